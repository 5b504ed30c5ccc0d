"""Realistic batches for benchmarks, the demo and ``check``.

What "realistic" means here (``docs/benchmarking.md``):

* ``b`` requests, each with its own context (32768 tokens in the standard configurations), stored
  in pages of 64 tokens whose physical order is shuffled, as after hours of serving;
* every token of every context written through ``PagedKVCache.write`` from heavy-tailed data with
  outlier channels (never zeros or constants: compressible or cached data flatters a kernel);
* per query token, distinct random positions inside its request's visible context (causal: a
  query at position p sees [0, p]), -1 padded when the context is shorter than top-k, converted to
  cache rows with the index-conversion rule;
* bf16 queries, also heavy-tailed.

Data are a deterministic function of the seed, so every format's cache holds the same values, and
every backend and format sees the same queries and indices.  The same functions build tiny
batches on the CPU (``BenchConfig.scaled_down``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..cache import PagedKVCache
from ..formats import get_format
from ..indices import convert_indices_torch
from .configs import BLOCK_SIZE, BenchConfig
from .progress import NullBar

KV_DIM = 576          # 512 latent + 64 RoPE; NoPE formats use the first 512
SM_SCALE = 192 ** -0.5  # DeepSeek-V3.x softmax scale before the YaRN factor (qk_head_dim 192)
# Query scale: with it the softmax over 2048 selected keys ranges from nearly one-hot to broad
# (median ~450 effective keys, measured on this data), so errors are tested on both regimes.
Q_GAIN = 0.2
CHUNK_TOKENS = 1 << 16  # tokens generated and written at a time (the data depend on it: keep it fixed)


# --- random data ------------------------------------------------------------------------------------

def _generator(device, seed: int) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def outlier_channels(dim: int, seed: int, fraction: float = 1 / 64) -> torch.Tensor:
    """A fixed set of channel indices (int64, CPU) that carry outliers, as real activations have."""
    g = _generator("cpu", seed)
    n = max(1, int(dim * fraction))
    return torch.randperm(dim, generator=g)[:n]


def channel_means(dim: int, seed: int, std: float = 0.5) -> torch.Tensor:
    """Fixed per-channel offsets (float32, CPU): real activations are not centred channel by channel."""
    return std * torch.randn(dim, generator=_generator("cpu", seed + 101))


def heavy_tailed(shape: Sequence[int], *, generator: torch.Generator, device, dtype=torch.bfloat16,
                 channels: Optional[torch.Tensor] = None, channel_gain: float = 8.0,
                 scale: float = 1.0, means: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Normal values times a log-normal per-element scale (a heavy tail), with outlier channels.

    Args:
        shape: output shape; the last dim is the channel dim.
        generator: a ``torch.Generator`` on ``device``.
        channels: channel indices multiplied by ``channel_gain`` (None = no outlier channels).
        scale: overall factor.
        means: optional per-channel offsets added before the gains (``[shape[-1]]``).
    """
    x = torch.randn(*shape, generator=generator, device=device)
    x *= torch.exp(0.7 * torch.randn(*shape, generator=generator, device=device))
    if means is not None:
        x += means.to(x.device)
    if channels is not None and len(channels):
        x[..., channels.to(x.device)] *= channel_gain
    if scale != 1.0:
        x *= scale
    return x.to(dtype)


def kv_tokens(seed: int, start: int, n: int, device) -> torch.Tensor:
    """bf16 ``[n, 576]`` values of tokens ``[start, start + n)`` of a batch (deterministic in seed, start)."""
    g = _generator(device, seed * 1_000_003 + start)
    # Per-channel offsets matter for accuracy figures: with zero-mean i.i.d. values, attention averages
    # them towards 0 and any error looks large relative to the small output.
    return heavy_tailed((n, KV_DIM), generator=g, device=device, channels=outlier_channels(KV_DIM, seed),
                        means=channel_means(KV_DIM, seed))


# --- paged layout ------------------------------------------------------------------------------------

@dataclass
class PagedLayout:
    """Where each request's tokens live.

    context_lens: int32 ``[b]``; block_table: int32 ``[b, max_blocks]`` physical blocks (shuffled),
    -1 past a request's last block; num_blocks: blocks in the cache (all requests' plus ``extra``).
    """

    context_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    num_blocks: int

    @property
    def batch(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.context_lens.sum())

    def token_slots(self) -> torch.Tensor:
        """int64 ``[sum(context_lens)]``: the cache slot of every context token, request by request."""
        ctx = self.context_lens.to(torch.int64)
        dev = self.block_table.device
        req = torch.repeat_interleave(torch.arange(self.batch, device=dev), ctx.to(dev))
        starts = torch.cumsum(ctx, 0) - ctx
        pos = torch.arange(req.numel(), device=dev) - starts.to(dev)[req]
        blk = self.block_table.to(torch.int64)[req, pos // self.block_size]
        return blk * self.block_size + pos % self.block_size


def make_layout(context_lens, *, block_size: int = BLOCK_SIZE, device="cpu", seed: int = 0,
                extra_blocks: int = 0) -> PagedLayout:
    """Give each request ``ceil(ctx / block_size)`` blocks drawn from a shuffled pool.

    ``context_lens`` is a list or int tensor ``[b]`` of positive lengths; ``extra_blocks`` unused
    blocks are added to the pool (so some block ids belong to nobody).
    """
    ctx = torch.as_tensor(context_lens, dtype=torch.int64).reshape(-1).cpu()
    if ctx.numel() == 0 or int(ctx.min()) < 1:
        raise ValueError(f"context_lens: expected one or more positive lengths, got {ctx.tolist()}")
    nblk = (ctx + block_size - 1) // block_size
    used = int(nblk.sum())
    total = used + int(extra_blocks)
    perm = torch.randperm(total, generator=_generator("cpu", seed + 17))
    table = torch.full((ctx.numel(), int(nblk.max())), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(nblk.tolist()):
        table[r, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return PagedLayout(ctx.to(torch.int32).to(device), table.to(device), block_size, total)


def build_cache(fmt, layout: PagedLayout, *, device, seed: int = 0, chunk_tokens: int = CHUNK_TOKENS,
                bar=None) -> PagedKVCache:
    """Allocate a cache of ``fmt`` for ``layout`` and write every context token into it.

    Tokens are generated and written ``chunk_tokens`` at a time (bounded memory) through
    ``PagedKVCache.write`` — the library's own write path.  ``bar`` gets ``update(tokens)``.
    """
    fmt = get_format(fmt)
    cache = PagedKVCache(fmt, layout.num_blocks, layout.block_size, device=device)
    slots = layout.token_slots().to(device)
    bar = bar if bar is not None else NullBar()
    n_all = slots.numel()
    for start in range(0, n_all, chunk_tokens):
        n = min(chunk_tokens, n_all - start)
        kv = kv_tokens(seed, start, n, device)
        k_pe = kv[:, 512:512 + fmt.rope_dim] if fmt.rope_dim else None
        cache.write(kv[:, :512], k_pe, slots[start:start + n], check=False)
        bar.update(n)
    return cache


def source_tokens(layout: PagedLayout, *, device, seed: int = 0, max_tokens: Optional[int] = None):
    """(bf16 ``[n, 576]`` values that :func:`build_cache` wrote for the first ``n`` tokens, their slots).

    ``n = min(max_tokens, layout.num_tokens)``; slots are int64 ``[n]`` (``cache.slot_to_row`` gives rows).
    """
    n = layout.num_tokens if max_tokens is None else min(int(max_tokens), layout.num_tokens)
    parts = [kv_tokens(seed, s, min(CHUNK_TOKENS, layout.num_tokens - s), device)
             for s in range(0, n, CHUNK_TOKENS)]
    kv = torch.cat(parts)[:n] if parts else torch.empty((0, KV_DIM), dtype=torch.bfloat16, device=device)
    return kv, layout.token_slots()[:n].to(device)


# --- queries and indices ------------------------------------------------------------------------------

def random_topk_positions(visible: torch.Tensor, topk: int, *, generator: torch.Generator,
                          max_elems: int = 1 << 25) -> torch.Tensor:
    """int32 ``[T, topk]``: per row, ``min(visible[t], topk)`` distinct random positions in
    ``[0, visible[t])`` (in random order), then -1.

    Done by drawing a random key per visible position and keeping the ``topk`` largest, in chunks
    of rows so that ``rows * max(visible)`` stays under ``max_elems``.
    """
    t = visible.shape[0]
    dev = visible.device
    out = torch.full((t, topk), -1, dtype=torch.int32, device=dev)
    if t == 0:
        return out
    vmax = int(visible.max())
    rows_per_chunk = max(1, max_elems // max(vmax, 1))
    col = torch.arange(vmax, device=dev)
    for r0 in range(0, t, rows_per_chunk):
        r1 = min(t, r0 + rows_per_chunk)
        keys = torch.rand((r1 - r0, vmax), generator=generator, device=dev)
        keys.masked_fill_(col[None, :] >= visible[r0:r1, None], -1.0)  # invisible: below every real key
        k = min(topk, vmax)
        vals, idx = keys.topk(k, dim=1)
        out[r0:r1, :k] = torch.where(vals >= 0, idx, torch.full_like(idx, -1)).to(torch.int32)
    return out


@dataclass
class Workload:
    """One attention call's inputs.

    q: bf16 ``[T, H, head_dim]``; topk_local: int32 ``[T, K]`` request-local positions (-1 padded);
    req_id: int32 ``[T]``; query_pos: int64 ``[T]`` position of each query in its request;
    indices: int32 ``[T, K]`` rows of ``cache.rows``; valid_counts: int32 ``[T]``.
    """

    config: BenchConfig
    fmt: object
    layout: PagedLayout
    cache: PagedKVCache
    q: torch.Tensor
    topk_local: torch.Tensor
    req_id: torch.Tensor
    query_pos: torch.Tensor
    indices: torch.Tensor
    valid_counts: torch.Tensor
    sm_scale: float = SM_SCALE
    k_scale: float = 1.0


def config_seed(config: BenchConfig, seed: int) -> int:
    """A seed that depends on the configuration's name (stable across runs and processes)."""
    return zlib.crc32(config.name.encode()) + 7919 * int(seed)


def build_queries(config: BenchConfig, cache: PagedKVCache, layout: PagedLayout, *, seed: int = 0) -> Workload:
    """Queries, top-k positions and rows for ``config`` over an already written ``cache``.

    Query token ``t`` belongs to request ``t // s_q`` and sits at position ``ctx - s_q + t % s_q``
    (the newest tokens: decode, draft tokens, or a prefill chunk at the end of the context).
    """
    if config.kind not in ("decode", "prefill"):
        raise ValueError(f"config: expected a decode or prefill configuration, got kind {config.kind!r}")
    if config.batch != layout.batch:
        raise ValueError(f"layout: built for {layout.batch} requests, config {config.name} has {config.batch}")
    fmt = cache.fmt
    dev = cache.device
    s = config_seed(config, seed)
    g = _generator(dev, s)
    b, s_q = config.batch, config.s_q
    ctx = layout.context_lens.to(device=dev, dtype=torch.int64)
    if int(ctx.min()) < s_q:
        raise ValueError(f"context_lens: every context must hold the {s_q} query tokens, got {ctx.tolist()}")
    req = torch.arange(b, device=dev).repeat_interleave(s_q)
    pos = ctx[req] - s_q + torch.arange(s_q, device=dev).repeat(b)
    topk_local = random_topk_positions(pos + 1, config.topk, generator=g)
    indices, counts = convert_indices_torch(topk_local, req.to(torch.int32), layout.block_table.to(dev),
                                            layout.block_size, cache.block_stride_rows, return_valid_counts=True)
    q = heavy_tailed((b * s_q, config.num_heads, KV_DIM), generator=g, device=dev,
                     channels=outlier_channels(KV_DIM, s + 1), channel_gain=4.0, scale=Q_GAIN)
    q = q[..., :fmt.head_dim].contiguous()
    return Workload(config, fmt, layout, cache, q, topk_local, req.to(torch.int32), pos, indices, counts)


def build_workload(config: BenchConfig, fmt, *, device="cpu", seed: int = 0, context_lens=None,
                   bar=None) -> Workload:
    """Layout + cache + queries for one configuration (``context_lens`` overrides ``config.context``)."""
    if context_lens is None:
        context_lens = [config.context] * config.batch
    layout = make_layout(context_lens, device=device, seed=seed)
    cache = build_cache(fmt, layout, device=device, seed=seed, bar=bar)
    return build_queries(config, cache, layout, seed=seed)


# --- cache write (config W) ----------------------------------------------------------------------------

@dataclass
class WriteWorkload:
    """Inputs of one ``cache.write`` call: kv_c bf16 ``[N, 512]``, k_pe bf16 ``[N, rope]`` or None,
    slots int64 ``[N]`` into shuffled blocks of ``cache``."""

    config: BenchConfig
    cache: PagedKVCache
    kv_c: torch.Tensor
    k_pe: Optional[torch.Tensor]
    slots: torch.Tensor

    def run(self) -> None:
        self.cache.write(self.kv_c, self.k_pe, self.slots, check=False)


def build_write_workload(config: BenchConfig, fmt, *, device="cpu", seed: int = 0) -> WriteWorkload:
    fmt = get_format(fmt)
    n = config.tokens
    layout = make_layout([n], device=device, seed=seed)
    cache = PagedKVCache(fmt, layout.num_blocks, layout.block_size, device=device)
    slots = layout.token_slots().to(device)
    kv = kv_tokens(seed, 0, n, device)
    k_pe = kv[:, 512:512 + fmt.rope_dim].contiguous() if fmt.rope_dim else None
    return WriteWorkload(config, cache, kv[:, :512].contiguous(), k_pe, slots)


__all__ = ["KV_DIM", "SM_SCALE", "heavy_tailed", "outlier_channels", "kv_tokens", "PagedLayout", "make_layout",
           "build_cache", "source_tokens", "CHUNK_TOKENS", "random_topk_positions", "Workload", "build_queries", "build_workload", "config_seed",
           "WriteWorkload", "build_write_workload", "channel_means"]
