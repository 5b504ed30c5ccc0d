"""Random sparse-attention cases for the reliability tests, drawn from one space on the CPU and on the GPU.

A case is a :class:`Spec` (every choice that shapes it, plus a data seed) turned into tensors by
:func:`build_case`: a paged cache of the spec's format with its own block size and block stride, every
byte that no token owns poisoned with ``0xFF`` (which every format decodes to NaN), shuffled block
tables, heavy-tailed keys and queries with outliers, and an index row per query token with the spec's
valid-count, -1 and garbage patterns.  :func:`run_case` calls the public API on it (outputs poisoned
with NaN first); :func:`measure` compares the result with ``sparsemla.reference`` on the device without
a host sync, so that thousands of cases can run back to back.

Specs are drawn through a :class:`Source`: :class:`HypothesisSource` (the CPU suite: bounded examples,
shrinking) or :class:`RandomSource` (the GPU suite: a seeded stream, one seed per case, recorded).

Tolerances are the suite's: output relative error (Frobenius norm over the case) at most 1e-2; lse
within 1e-2 x max(1, max|lse| / 100) (one fp32 ulp of an lse near 1500 is 1.2e-4), for the FP8-QK mode
1e-2 x max(10, max|lse|) (e4m3 tensor-core accumulation).  The FP8-QK mode's outputs are held to the same
bounds where max|lse| <= FP8QK_OUT_LSE; above, scores of that size carry absolute errors of several units
after the e4m3 accumulation and a near tie between rows can swap, so only the lse, finiteness and empty rows
are checked there (the mode's documented domain).  A query with no valid entry must give exactly 0 and -inf.  A per-token bound (5e-2 of the token's output norm, floored at a tenth of the
case's typical norm) catches one wrong token hidden in a large case.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import sparsemla

V_DIM = 512
POISON = 0xFF  # bf16 0xFFFF, e4m3 0xFF and fp32 0xFFFFFFFF are NaN; nvfp4 rows have e4m3 scales: NaN too
O_TOL = 1e-2
TOKEN_TOL = 5e-2
LSE_TOL = 1e-2
# Largest |lse| (natural log) at which the FP8-QK mode's outputs are checked.  The H200 property run's FP8-QK
# output failures all had max|lse| of 1,993 to 305,345; attention in real models stays far below 1,000.
FP8QK_OUT_LSE = 1000.0


# --------------------------------------------------------------------------------------------------------
# sources of choices
# --------------------------------------------------------------------------------------------------------
class RandomSource:
    """Choices from a seeded ``random.Random`` (reproducible from the seed alone)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.r = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def choice(self, seq: Sequence):
        seq = list(seq)
        return seq[self.r.randrange(len(seq))]

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def log_uniform(self, lo: float, hi: float) -> float:
        return math.exp(self.r.uniform(math.log(lo), math.log(hi)))


class HypothesisSource:
    """Choices drawn from hypothesis (``st.data()``): every choice is a small integer, so failures shrink
    towards the first option of each choice, low integers and ``chance`` False."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.st = st
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, seq: Sequence):
        return self.data.draw(self.st.sampled_from(list(seq)))

    def chance(self, p: float) -> bool:
        return self.data.draw(self.st.integers(0, 999)) >= 1000 - int(round(p * 1000))

    def log_uniform(self, lo: float, hi: float) -> float:
        u = self.data.draw(self.st.integers(0, 1000)) / 1000
        return lo * (hi / lo) ** u


# --------------------------------------------------------------------------------------------------------
# the space of cases
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """Everything that shapes one case (the data itself comes from ``seed``).

    fmt: format id; backend: ``"auto"`` or a backend name; mode: ``decode``, ``prefill`` (over the cache)
    or ``workspace`` (prefill over a bf16 ``[rows, head_dim]`` tensor holding the decoded cache).
    heads, tokens, width (K); block_size and stride_extra (block stride = block_size + stride_extra rows);
    ctx: context length of each token's request; counts: ``none`` (no valid_counts), ``full``,
    ``random``, ``over`` (counts past K), ``mixed`` (0, K or random per token), ``pooled`` (the pooled
    indexer's rule with ``index_topk``/``kpool``); pad: ``prefix`` (valid entries first, then -1),
    ``holes`` (-1 scattered inside the valid range), ``empty`` (some tokens all -1); dup: positions may
    repeat; garbage past the valid count: ``poison`` (rows nobody wrote), ``minus1``, ``outside`` (rows
    past the cache; GPU only); kv: ``heavy``, ``wide`` (row magnitudes 2^-12..2^8), ``edge`` (zero,
    constant, single-spike, tiny and saturating rows); in_dtype: the cache write's input dtype;
    k_scale, sm_scale, q_scale (q magnitude); q_layout ``contiguous``/``padded``/``transposed``/``pair`` (the
    query as an engine's two tensors, read in place by the native kernels: :func:`run_case`);
    idx_layout ``contiguous``/``padded``; out ``none``/``poisoned``/``padded``; lse
    ``none``/``poisoned``/``transposed``; write: how the cache gets its rows, ``kernel`` (the library's cache
    write, as a user writes) or ``encoder`` (the format's PyTorch encoder: the same bytes, which the cache
    write's own tests check, without compiling a cache-write variant for the case's input dtype, k_scale mode,
    block size and sizes).
    """

    fmt: str
    backend: str
    mode: str
    heads: int
    tokens: int
    width: int
    block_size: int
    stride_extra: int
    ctx: Tuple[int, ...]
    counts: str
    pad: str
    dup: bool
    garbage: str
    kv: str
    in_dtype: str
    k_scale: float
    sm_scale: float
    q_scale: float
    q_layout: str
    idx_layout: str
    out: str
    lse: str
    seed: int
    index_topk: int = 0
    kpool: int = 1
    write: str = "kernel"

    def short(self) -> str:
        return (f"{self.fmt} {self.backend} {self.mode} H={self.heads} T={self.tokens} K={self.width} "
                f"bs={self.block_size}+{self.stride_extra} counts={self.counts} pad={self.pad} "
                f"garbage={self.garbage} kv={self.kv} ks={self.k_scale:.4g} seed={self.seed}")


@dataclass(frozen=True)
class Profile:
    """Ranges of a suite: the CPU interpreter needs small shapes, the H200 takes real ones."""

    name: str
    max_tokens: int
    max_width: int
    widths_aligned: Tuple[int, ...]
    pooled: Tuple[Tuple[int, int], ...]  # (index_topk, kpool)
    block_sizes: Tuple[int, ...]
    outside_garbage: bool


CPU = Profile("cpu", 4, 96, (16, 32, 48, 64), ((32, 4), (16, 2), (64, 4)), (1, 2, 3, 5, 16, 32, 64), False)
GPU = Profile("gpu", 96, 2112, (64, 128, 512, 1024, 2048), ((2048, 4), (512, 4), (1024, 2), (2048, 2)),
              (1, 16, 32, 64, 7, 128), True)


def format_ids() -> List[str]:
    """Every format id, the library's own compact NoPE layouts included."""
    try:
        fmts = sparsemla.all_formats(compact=True)
    except TypeError:
        fmts = sparsemla.all_formats()
    return [f.id for f in fmts]


def attention_backends(device_type: str) -> List[str]:
    """The library's own attention backends that can run here (not the float64 reference, not peers).

    On the CPU only the Triton kernels under the interpreter (``auto`` picks the reference there); on a GPU
    ``auto`` and every ``triton*`` backend."""
    ours = [n for n in sparsemla.list_backends() if n.startswith("triton")]
    if device_type == "cpu":
        return [n for n in ours if not is_fp8qk(n)]
    return ["auto"] + ours


def is_fp8qk(backend: str) -> bool:
    return backend.startswith("triton") and "fp8" in backend


def is_staged(backend: str) -> bool:
    return "staged" in backend


def backend_formats(backend: str, fmts: Sequence[str]) -> List[str]:
    """Formats a backend declares it serves (all for ``auto``; the FP8-QK mode reads e4m3 rows only)."""
    out = list(fmts)
    if backend != "auto":
        try:
            from sparsemla.backends import get_backend
            declared = get_backend(backend).formats
        except Exception:
            declared = None
        if declared is not None:
            out = [f for f in out if f in declared]
    if is_fp8qk(backend):
        out = [f for f in out if sparsemla.get_format(f).name in ("fp8", "fp8_ds_mla")]
    return out


def _heads(src, band: Optional[Tuple[int, int]]) -> int:
    if band is not None:
        return src.integer(*band)
    lo, hi = src.choice([(1, 4), (5, 32), (33, 128)])
    return src.integer(lo, hi)


def _width(src, profile: Profile, kind: Optional[str]) -> Tuple[int, int, int]:
    """(K, index_topk, kpool); kind: ``odd`` (not a multiple of 16), ``aligned``, ``pooled``, ``one``."""
    kind = kind or src.choice(["odd", "odd", "aligned", "pooled", "one"])
    if kind == "one":
        return 1, 0, 1
    if kind == "aligned":
        return src.choice(profile.widths_aligned), 0, 1
    if kind == "pooled":
        itk, kpool = src.choice(profile.pooled)
        itk = min(itk, profile.max_width - kpool + 1)
        itk -= itk % kpool
        return itk + kpool - 1, itk, kpool
    k = src.integer(2, profile.max_width)
    return (k + 1 if k % 16 == 0 else k), 0, 1


@dataclass(frozen=True)
class Config:
    """The part of a spec that decides which kernel variants compile (GPU suite): a case draws the rest.

    heads_band: inclusive range of H (one kernel variant: a 16-head band, or one multiple of 16);
    tokens_band likewise; width_kind as in :func:`_width`; counts None means no valid_counts."""

    fmt: str
    backend: str
    mode: str
    heads_band: Tuple[int, int]
    tokens_band: Tuple[int, int]
    width_kind: str
    has_counts: bool
    q_layout: str = "contiguous"
    out: str = "poisoned"
    lse: str = "poisoned"


def draw_config(src, fmt: str, backend: str, *, many_heads: Optional[bool] = None,
                many_tokens: Optional[bool] = None, band: Optional[int] = None, cache_rows: bool = False,
                tokens_band: Optional[Tuple[int, int]] = None) -> Config:
    """A configuration; ``band``: the 16-head band ``b`` (H in ``16b+1 .. 16b+16``), else drawn (0-1 for few
    heads, 2-7 for many); ``cache_rows``: decode or prefill over the cache (not a bf16 workspace, whose rows are
    bf16 whatever the format); ``tokens_band``: the token counts, else drawn (a band that starts past the
    profile's ``max_tokens`` is kept as it is)."""
    many_heads = src.chance(0.5) if many_heads is None else many_heads
    if band is None:
        band = src.integer(2, 7) if many_heads else src.integer(0, 1)
    if src.chance(0.3):
        heads_band = (16 * (band + 1),) * 2
    else:
        heads_band = (max(1, 16 * band + 1), 16 * band + 15)
    many_tokens = src.chance(0.3) if many_tokens is None else many_tokens
    tokens_band = tokens_band or (src.choice([(34, 64), (65, 96)]) if many_tokens
                                  else src.choice([(1, 4), (5, 16), (17, 33)]))
    mode = src.choice(["decode", "decode", "prefill", "workspace"]) if not is_staged(backend) else "decode"
    if (is_fp8qk(backend) or cache_rows) and mode == "workspace":
        mode = "decode"
    return Config(fmt, backend, mode, heads_band, tokens_band, src.choice(["odd", "odd", "aligned", "pooled"]),
                  src.chance(0.8), q_layout=src.choice(["contiguous"] * 4 + ["padded", "transposed"]
                                                       + (["pair"] if _pair_ok(fmt, backend) else [])),
                  out=src.choice(["poisoned", "poisoned", "padded", "none"]),
                  lse=src.choice(["poisoned", "poisoned", "transposed", "none"]))


NATIVE = ("triton", "triton-portable", "triton-fp8qk")  # backends that are the library's launcher (with "auto" on a GPU)


def _pair_ok(fmt: str, backend: str) -> bool:
    """Whether a case may give the query as two tensors: formats with RoPE dims, the launcher's backends."""
    return (backend == "auto" or backend in NATIVE) and sparsemla.get_format(fmt).rope_dim > 0


def draw_spec(src, profile: Profile, *, config: Optional[Config] = None, fmts: Optional[Sequence[str]] = None,
              backends: Optional[Sequence[str]] = None) -> Spec:
    """One case.  Without ``config`` every choice is free (the CPU suite); with one, the choices that
    decide kernel variants come from it and only data-like choices are drawn."""
    if config is None:
        backend = src.choice(backends)
        fmt = src.choice(backend_formats(backend, fmts or format_ids()))
        mode = src.choice(["decode", "decode", "prefill", "workspace"]) if not is_staged(backend) else "decode"
        heads = _heads(src, None)
        tokens = src.integer(1, profile.max_tokens)
        width, itk, kpool = _width(src, profile, None)
        has_counts = src.chance(0.8)
        q_layout = src.choice(["contiguous", "contiguous", "padded", "transposed"]
                              + (["pair"] if _pair_ok(fmt, backend) else []))
        out = src.choice(["poisoned", "padded", "none"])
        lse = src.choice(["poisoned", "transposed", "none"])
    else:
        backend, fmt, mode = config.backend, config.fmt, config.mode
        heads = src.integer(*config.heads_band)
        tokens = src.integer(*config.tokens_band)
        if config.tokens_band[0] <= profile.max_tokens:  # (a band past the profile's cap is asked for as it is)
            tokens = min(tokens, profile.max_tokens)
        width, itk, kpool = _width(src, profile, config.width_kind)
        has_counts = config.has_counts
        q_layout, out, lse = config.q_layout, config.out, config.lse
    f = sparsemla.get_format(fmt)
    block_size = src.choice(profile.block_sizes)
    stride_extra = min(src.choice([0, 0, 1, 3, 8]), block_size)  # at most doubles the cache
    # Contexts: mostly around K (so most positions are selected), some much shorter (ctx < K: -1 tails).
    ctx = []
    for _ in range(tokens):
        if src.chance(0.25):
            ctx.append(src.integer(1, max(1, width // 2)))
        else:
            ctx.append(src.integer(max(1, width - 4), width + width // 4 + 4))
    if itk:
        counts = "pooled" if has_counts else "none"
    elif has_counts:
        counts = src.choice(["full", "random", "random", "mixed", "over"])
    else:
        counts = "none"
    pad = src.choice(["prefix", "prefix", "holes", "empty"])
    garbage = src.choice(["poison", "poison", "minus1"] + (["outside"] if profile.outside_garbage else []))
    k_scale = 1.0
    if src.chance(0.6):
        k_scale = src.choice([0.5, 2.0, 0.125, 3.7, 0.013])
    spec = Spec(fmt=fmt, backend=backend, mode=mode, heads=heads, tokens=tokens, width=width,
                block_size=block_size, stride_extra=stride_extra, ctx=tuple(ctx), counts=counts, pad=pad,
                dup=src.chance(0.15), garbage=garbage, kv=src.choice(["heavy", "heavy", "wide", "edge"]),
                in_dtype=src.choice(["bfloat16", "bfloat16", "float16", "float32"]), k_scale=k_scale,
                sm_scale=src.log_uniform(0.02, 0.3), q_scale=src.choice([1.0, 1.0, 0.1, 4.0]),
                q_layout=q_layout, idx_layout=src.choice(["contiguous", "contiguous", "padded"]), out=out,
                lse=lse, seed=src.integer(0, 2 ** 31 - 1), index_topk=itk, kpool=kpool)
    # One case in eight writes through the cache-write kernel.  Its constexprs follow a case's input dtype, k_scale
    # mode and block size, so nearly every case that wrote through it compiled a variant (399 in 500 cases of one
    # H200 process), which bound the run by compile time; the write's own tests cover that variety.
    return dataclasses.replace(spec, write="kernel" if src.chance(0.125) else "encoder")


# --------------------------------------------------------------------------------------------------------
# building a case
# --------------------------------------------------------------------------------------------------------
def heavy(gen, *shape, device="cpu"):
    """Normal times a log-normal magnitude, with rare x30 spikes."""
    x = torch.randn(*shape, generator=gen, device=device) * torch.exp(
        0.6 * torch.randn(*shape, generator=gen, device=device))
    spikes = torch.rand(*shape, generator=gen, device=device) < 1e-3
    return torch.where(spikes, x * 30, x)


def kv_values(gen, n: int, d: int, kind: str, k_scale: float, device) -> torch.Tensor:
    """fp32 ``[n, d]`` key values of one kind (see :class:`Spec`)."""
    x = heavy(gen, n, d, device=device)
    if d > 3:
        x[:, 3] *= 25.0  # an outlier channel
    if kind == "wide":
        x = x * torch.exp2(torch.randint(-12, 9, (n, 1), generator=gen, device=device).float())
    elif kind == "edge" and n:
        cat = torch.randint(0, 6, (n, 1), generator=gen, device=device)
        spike = torch.zeros_like(x)
        spike[:, d // 2] = 1000.0
        sat = torch.sign(x) * 448.0 * k_scale * (0.9 + 0.2 * torch.rand(n, d, generator=gen, device=device))
        x = torch.where(cat == 0, torch.zeros_like(x), x)                     # all-zero rows (scale floors)
        x = torch.where(cat == 1, torch.full_like(x, -0.75), x)               # constant rows
        x = torch.where(cat == 2, spike + 1e-3 * x, x)                        # one huge value, the rest tiny
        x = torch.where(cat == 3, x * 1e-6, x)                                # subnormal e4m3 territory
        x = torch.where(cat == 4, sat, x)                                     # at and past fp8 saturation
    return x


def write_tokens(cache, kv_c, k_pe, slots, k_scale):
    """``cache.write`` without its host-side slot checks where it offers that switch (the slots are
    built distinct and in range here)."""
    params = inspect.signature(cache.write).parameters
    kw = {"check": False} if "check" in params else {}
    cache.write(kv_c, k_pe, slots, k_scale, **kw)


def make_cache(fmt, num_blocks: int, block_size: int, stride_rows: int, device, storage=None):
    """A poisoned paged cache over ``storage`` (uint8, at least ``num_blocks * stride_rows * bpt`` bytes)."""
    fmt = sparsemla.get_format(fmt)
    bpt = fmt.bytes_per_token
    nbytes = num_blocks * stride_rows * bpt
    if storage is None:
        storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat = storage[:nbytes]
    flat.fill_(POISON)
    data = flat.as_strided((num_blocks, block_size, bpt), (stride_rows * bpt, bpt, 1))
    return sparsemla.PagedKVCache.from_tensor(fmt, data)


def build_case(spec: Spec, device, storage: Optional[torch.Tensor] = None) -> Dict:
    """Tensors of a spec.  ``storage``: an optional reusable uint8 buffer for the cache bytes."""
    device = torch.device(device)
    fmt = sparsemla.get_format(spec.fmt)
    t, k, bs = spec.tokens, spec.width, spec.block_size
    stride = bs + spec.stride_extra
    host = torch.Generator().manual_seed(spec.seed)                    # structure: on the host
    gen = torch.Generator(device=device).manual_seed(spec.seed + 1)    # bulk data: on the device
    nblk = [-(-c // bs) for c in spec.ctx]
    spare = 2
    num_blocks = sum(nblk) + spare
    cache = make_cache(fmt, num_blocks, bs, stride, device, storage)
    perm = torch.randperm(num_blocks, generator=host)
    tables, used = [], 0
    for n in nblk:
        tables.append(perm[used:used + n])
        used += n
    spare_blocks = perm[used:]

    # --- keys: every position of every token's request, written through the library's cache write -------
    ctx = torch.tensor(spec.ctx, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(t), ctx)
    starts = torch.cumsum(ctx, 0) - ctx
    pos = torch.arange(int(ctx.sum())) - starts[req]
    table = torch.full((t, max(nblk)), -1, dtype=torch.int64)
    for i, tb in enumerate(tables):
        table[i, : len(tb)] = tb
    blk = table[req, pos // bs]
    slots = blk * bs + pos % bs
    n_rows = slots.numel()
    kv = kv_values(gen, n_rows, V_DIM, spec.kv, spec.k_scale, device)
    pe = kv_values(gen, n_rows, fmt.rope_dim, spec.kv, spec.k_scale, device) if fmt.rope_dim else None
    dt = getattr(torch, spec.in_dtype)
    # finite inputs: a wide row's spikes pass fp16's largest value, and the cast would make them infinities
    # (a non-finite write, which has its own tests)
    big = torch.finfo(dt).max
    kv = kv.clamp(-big, big)
    pe = None if pe is None else pe.clamp(-big, big)
    kv, pe = kv.to(dt), None if pe is None else pe.to(dt)
    if spec.write == "kernel":
        write_tokens(cache, kv, pe, slots.to(device), spec.k_scale)
    else:
        cache.rows[(blk * stride + pos % bs).to(device)] = fmt.encode(kv, pe, spec.k_scale)

    # --- index rows --------------------------------------------------------------------------------------
    counts = []
    for i in range(t):
        c = spec.ctx[i]
        if spec.counts in ("none", "full"):
            n = k
        elif spec.counts == "random":
            n = int(torch.randint(0, k + 1, (1,), generator=host))
        elif spec.counts == "over":
            n = k + int(torch.randint(1, 100, (1,), generator=host))
        elif spec.counts == "pooled":
            n = c if c <= spec.index_topk else spec.index_topk + c % spec.kpool
        else:  # mixed
            n = [0, k, int(torch.randint(0, k + 1, (1,), generator=host))][int(torch.randint(0, 3, (1,), generator=host))]
        counts.append(n)
    # rows nobody wrote: the gaps between blocks, the spare blocks, the tail of each request's last block
    poison_rows = [int(b) * stride + j for b in spare_blocks for j in range(bs)]
    poison_rows += list(itertools.islice((b * stride + j for b in range(num_blocks) for j in range(bs, stride)), 4096))
    poison_rows = torch.tensor(poison_rows, dtype=torch.int64)
    idx = torch.full((t, k), -1, dtype=torch.int64)
    for i in range(t):
        c, n = spec.ctx[i], min(counts[i], k)
        m = n if spec.dup else min(n, c)
        if spec.dup:
            p = torch.randint(0, c, (m,), generator=host)
        else:
            p = torch.randperm(c, generator=host)[:m]
        rows = table[i, p // bs] * stride + p % bs
        idx[i, :m] = rows
        if spec.pad == "holes" and n:
            hole = torch.rand(n, generator=host) < 0.3
            idx[i, :n] = torch.where(hole, torch.full_like(idx[i, :n], -1), idx[i, :n])
            idx[i, :n] = idx[i, :n][torch.randperm(n, generator=host)]
        elif spec.pad == "empty" and i % 3 == 1:
            idx[i, :n] = -1
        if n < k and spec.counts != "none":
            rest = k - n
            if spec.garbage == "poison":
                idx[i, n:] = poison_rows[torch.randint(0, poison_rows.numel(), (rest,), generator=host)]
            elif spec.garbage == "outside":
                idx[i, n:] = cache.num_rows + torch.randint(0, 2 ** 30, (rest,), generator=host)
    vc = None
    if spec.counts != "none":
        vc = torch.tensor(counts, dtype=torch.int32, device=device)
    idx32 = idx.to(torch.int32)
    if spec.idx_layout == "padded":
        big = torch.full((t, k + 7), -1, dtype=torch.int32, device=device)
        indices = big[:, :k]
        indices.copy_(idx32)
    else:
        indices = idx32.to(device)

    # --- queries -----------------------------------------------------------------------------------------
    d = fmt.head_dim
    qv = heavy(gen, t, spec.heads, d, device=device) * spec.q_scale
    if spec.heads > 1:
        qv[:, 0] *= 8.0  # one peaky head: lse far from the others
    if spec.q_layout == "padded":
        q = torch.empty((t, spec.heads, d + 16), dtype=torch.bfloat16, device=device)[..., :d]
    elif spec.q_layout == "transposed":
        q = torch.empty((spec.heads, t, d), dtype=torch.bfloat16, device=device).transpose(0, 1)
    else:
        q = torch.empty((t, spec.heads, d), dtype=torch.bfloat16, device=device)
    q.copy_(qv)
    pair = None
    if spec.q_layout == "pair" and fmt.rope_dim:
        # an engine's two parts: q_nope head-major, q_pe a strided view of a [T, H, 128 + R] projection
        proj = torch.empty((t, spec.heads, 128 + fmt.rope_dim), dtype=torch.bfloat16, device=device)
        q_pe = proj[..., 128:]
        q_pe.copy_(q[..., V_DIM:])
        q_nope = torch.empty((spec.heads, t, V_DIM), dtype=torch.bfloat16, device=device).transpose(0, 1)
        q_nope.copy_(q[..., :V_DIM])
        pair = (q_nope, q_pe)

    kvarg = cache
    if spec.mode == "workspace":
        # the decoded cache as a bf16 workspace (poisoned rows decode to NaN and stay NaN)
        kvarg = fmt.decode(cache.rows, spec.k_scale).to(torch.bfloat16).contiguous()
    return dict(spec=spec, fmt=fmt, cache=cache, kv=kvarg, q=q, indices=indices, valid_counts=vc,
                tables=tables, counts=counts, q_pair=pair)


def _outputs(spec: Spec, q):
    t, h = q.shape[0], q.shape[1]
    dev = q.device
    out = lse = None
    if spec.out == "poisoned":
        out = torch.full((t, h, V_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
    elif spec.out == "padded":
        out = torch.full((t, h + 3, V_DIM), float("nan"), dtype=torch.bfloat16, device=dev)[:, :h]
    if spec.lse == "poisoned":
        lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=dev)
    elif spec.lse == "transposed":
        lse = torch.full((h, t), float("nan"), dtype=torch.float32, device=dev).t()
    return out, lse


class Refused(Exception):
    """A forced backend declined the call (it says why); not a failure of the kernels."""


def run_case(case: Dict):
    """The public API on a case: ``(out, lse)``.  Raises :class:`Refused` when a forced backend cannot
    serve the call."""
    spec = case["spec"]
    out, lse = _outputs(spec, case["q"])
    if case.get("q_pair") is not None and (spec.backend in NATIVE or case["q"].is_cuda):
        o, l = _run_pair(case, out, lse)
    else:
        fn = sparsemla.sparse_mla_decode if spec.mode == "decode" else sparsemla.sparse_mla_prefill
        try:
            o, l = fn(case["q"], case["kv"], case["indices"], spec.sm_scale, case["valid_counts"], spec.k_scale,
                      spec.backend, out, lse=lse)
        except ValueError as e:
            if "cannot serve" in str(e):
                raise Refused(str(e)) from e
            raise
    if out is not None:
        assert o.data_ptr() == out.data_ptr(), "out= was not written in place"
    if lse is not None:
        assert l.data_ptr() == lse.data_ptr(), "lse= was not written in place"
    return o, l


def _run_pair(case: Dict, out, lse):
    """The launcher on the query's two parts (``kernels.attention.attention_fwd(..., q_pe=)``, what the vLLM
    contract calls), the plan as the case's backend asks for it."""
    from sparsemla.backends._common import kv_rows
    from sparsemla.kernels.attention import attention_fwd, plan_for
    spec = case["spec"]
    q_nope, q_pe = case["q_pair"]
    rows, fmt = kv_rows(case["kv"])  # the cache's rows, or a bf16 workspace's
    try:
        plan = plan_for(q_nope, rows, fmt, case["indices"].shape[1], portable=spec.backend == "triton-portable",
                        fp8_qk=is_fp8qk(spec.backend), q_pe=q_pe)
    except ValueError as e:  # the FP8-QK mode where it cannot apply
        raise Refused(str(e)) from e
    return attention_fwd(q_nope, rows, fmt, case["indices"], spec.sm_scale, plan=plan,
                         valid_counts=case["valid_counts"], k_scale=spec.k_scale, out=out, lse=lse, q_pe=q_pe)


def reference(case: Dict):
    """float64 ``(out, lse)`` of a case.  The staged backend computes over its staged e4m3 rows, so its
    reference is taken over those rows (what a plain fp8 cache with this k_scale would hold)."""
    spec = case["spec"]
    q = case["q"].double()
    if is_staged(spec.backend):
        from sparsemla.kernels.staging import gather_topk_fp8
        idx, vc = case["indices"].contiguous(), case["valid_counts"]
        staged = gather_topk_fp8(case["cache"].rows, case["fmt"], idx, vc, spec.k_scale)
        t, k, d = staged.shape
        ws = staged.to(torch.float64).reshape(t * k, d) * spec.k_scale
        rows = torch.arange(t * k, device=idx.device, dtype=torch.int64).view(t, k)
        sidx = torch.where(idx >= 0, rows, torch.full_like(rows, -1))
        return sparsemla.reference.sparse_mla(q, ws, sidx, spec.sm_scale, vc)
    return sparsemla.reference.sparse_mla(q, case["kv"], case["indices"], spec.sm_scale, case["valid_counts"],
                                          spec.k_scale)


def no_valid_entry(case: Dict) -> torch.Tensor:
    """bool ``[T]``: tokens with no valid entry (out must be 0, lse -inf)."""
    idx, vc = case["indices"], case["valid_counts"]
    mask = idx >= 0
    if vc is not None:
        kk = torch.arange(idx.shape[1], device=idx.device)
        mask &= kk[None, :] < vc.to(torch.int64)[:, None]
    return ~mask.any(dim=1)


METRICS = ("out_err/tol", "token_err/tol", "lse_err/tol", "exact_violations")


def measure(case: Dict, out: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor, ref_l: torch.Tensor) -> torch.Tensor:
    """float64 ``[4]`` on the device (no host sync): the METRICS; a case passes when the first three are
    <= 1 and the last is 0."""
    spec = case["spec"]
    o, r = out.double(), ref_o.double()
    t = o.shape[0]
    diff = (o - r).flatten(1).norm(dim=1)                                     # [T]
    rn = r.flatten(1).norm(dim=1)
    case_norm = rn.norm()
    o_err = torch.where(case_norm > 0, (o - r).norm() / case_norm.clamp_min(1e-300), (o - r).norm())
    typical = case_norm / math.sqrt(max(t, 1))
    tok_err = (diff / torch.maximum(rn, 0.1 * typical).clamp_min(1e-300)).amax() if t else o_err * 0
    tok_err = torch.where(case_norm > 0, tok_err, diff.amax() if t else tok_err)
    fin = torch.isfinite(ref_l)
    big = torch.where(fin, ref_l.double().abs(), torch.zeros_like(ref_l, dtype=torch.float64)).amax() if t else \
        torch.zeros((), dtype=torch.float64, device=out.device)
    if is_fp8qk(spec.backend):
        lse_tol = LSE_TOL * torch.clamp(big, min=10.0)
        inside = big <= FP8QK_OUT_LSE  # the mode's output domain (module docstring)
        o_err = torch.where(inside, o_err, torch.zeros_like(o_err))
        tok_err = torch.where(inside, tok_err, torch.zeros_like(tok_err))
    else:
        lse_tol = LSE_TOL * torch.clamp(big / 100.0, min=1.0)
    ldiff = torch.where(fin, (lse.double() - ref_l.double()).abs(), torch.zeros_like(ref_l, dtype=torch.float64))
    ldiff = torch.nan_to_num(ldiff, nan=float("inf"))
    l_err = ldiff.amax() if t else ldiff.sum()
    empty = no_valid_entry(case)
    bad = (~torch.isfinite(o)).flatten(1).any(dim=1) & ~empty                 # non-finite output where there was data
    bad |= (torch.isfinite(lse) != fin).any(dim=1)                            # -inf exactly where the reference is
    bad |= empty & ((o != 0).flatten(1).any(dim=1) | ~torch.isneginf(lse).all(dim=1))
    return torch.stack([o_err / O_TOL, tok_err / TOKEN_TOL, l_err / lse_tol, bad.sum().double()])


def passed(m: Sequence[float]) -> bool:
    return m[0] <= 1 and m[1] <= 1 and m[2] <= 1 and m[3] == 0


def describe_failure(spec: Spec, m: Sequence[float]) -> str:
    vals = ", ".join(f"{k}={v:.3g}" for k, v in zip(METRICS, m))
    return f"{spec.short()}: {vals}\n  spec={dataclasses.asdict(spec)}"


# --------------------------------------------------------------------------------------------------------
# NaN rows
# --------------------------------------------------------------------------------------------------------
def plant_nan_row(cache, row: int) -> None:
    """Overwrite one row of a cache with bytes that decode to NaN in every dimension."""
    cache.rows[row].fill_(POISON)
    dec = cache.fmt.decode(cache.rows[row:row + 1])
    assert torch.isnan(dec).all(), f"{cache.fmt.id}: an all-0xFF row must decode to NaN"


def selects(indices: torch.Tensor, valid_counts: Optional[torch.Tensor], row: int) -> torch.Tensor:
    """bool ``[T]``: tokens that select ``row`` inside their valid count."""
    mask = indices == row
    if valid_counts is not None:
        kk = torch.arange(indices.shape[1], device=indices.device)
        mask &= kk[None, :] < valid_counts.to(torch.int64)[:, None]
    return mask.any(dim=1)


def nan_isolation_case(fmt, heads: int, tokens: int, width: int, device, seed: int, block_size: int = 16,
                       victim_row0: bool = False):
    """One request's cache shared by ``tokens`` queries (as speculative tokens of one request are), with
    a victim row that some tokens select, some hold past their valid count, and others select the rows
    next to.  ``victim_row0``: the victim is row 0 of the cache (where kernels point masked entries).
    Returns dict(cache, q, indices, valid_counts, victim, fmt)."""
    fmt = sparsemla.get_format(fmt)
    host = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    ctx = max(3 * width, 4 * block_size)
    nblk = -(-ctx // block_size)
    stride = block_size + 2
    cache = make_cache(fmt, nblk + 1, block_size, stride, device)
    table = torch.randperm(nblk + 1, generator=host)[:nblk]
    if victim_row0 and not bool((table == 0).any()):
        table[nblk // 2] = 0
    pos = torch.arange(ctx)
    slots = table[pos // block_size] * block_size + pos % block_size
    kv = kv_values(gen, ctx, V_DIM, "heavy", 1.0, device)
    pe = kv_values(gen, ctx, fmt.rope_dim, "heavy", 1.0, device) if fmt.rope_dim else None
    rows_of = table[pos // block_size] * stride + pos % block_size
    kv16, pe16 = kv.to(torch.bfloat16), None if pe is None else pe.to(torch.bfloat16)
    if torch.device(device).type == "cpu":  # the encoder's bytes: the interpreted write kernel is slow
        cache.rows[rows_of.to(device)] = fmt.encode(kv16, pe16)
    else:
        write_tokens(cache, kv16, pe16, slots.to(device), 1.0)
    victim_pos = int((rows_of == 0).nonzero()[0, 0]) if victim_row0 else ctx // 2
    victim = int(rows_of[victim_pos])
    neighbours = [p for p in (victim_pos - 1, victim_pos + 1) if 0 <= p < ctx]
    others = [p for p in range(ctx) if p != victim_pos]
    idx = torch.full((tokens, width), -1, dtype=torch.int64)
    counts = []
    for i in range(tokens):
        role = i % 4  # 0: selects the victim; 1: victim past its count; 2: neighbours; 3: -1 and others
        pick = torch.tensor(others)[torch.randperm(len(others), generator=host)[:width]]
        n = width
        if role == 0:
            pick[int(torch.randint(0, width, (1,), generator=host))] = victim_pos
        elif role == 1:
            n = max(1, width // 2)
            pick[n:] = victim_pos if width > n else pick[n:]
        elif role == 2:
            for j, p in enumerate(neighbours[:width]):
                pick[j] = p
        idx[i] = rows_of[pick]
        if role == 3:
            idx[i, ::3] = -1
        counts.append(n)
    q = (heavy(gen, tokens, heads, fmt.head_dim, device=device)).to(torch.bfloat16)
    return dict(cache=cache, q=q, indices=idx.to(torch.int32).to(device),
                valid_counts=torch.tensor(counts, dtype=torch.int32, device=device), victim=victim,
                victim_slot=int(slots[victim_pos]), fmt=fmt)


# --------------------------------------------------------------------------------------------------------
# kernel coverage
# --------------------------------------------------------------------------------------------------------
def compiled_kernels() -> Dict[str, int]:
    """``module.kernel -> compiled variants`` for every Triton/Gluon kernel of the library that ran in this
    process (kernels launched on any device; device helpers inlined into kernels never appear)."""
    import sys
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # pragma: no cover
        return {}
    found: Dict[str, int] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("sparsemla.kernels") or mod is None:
            continue
        for attr, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and getattr(fn, "module", name) == name:
                n = sum(len(v[0]) for v in dict(fn.device_caches).values())
                if n:
                    found[f"{name.rsplit('.', 1)[-1]}.{attr}"] = n
    return found


def _plant_by_write(c: Dict) -> bool:
    """Write a token with one NaN latent value into the victim's slot through ``PagedKVCache.write``.
    Returns False when the write rejects it (then it must raise ValueError naming kv_c and leave the row
    as it was)."""
    cache, fmt = c["cache"], c["fmt"]
    dev = cache.device
    kv = torch.randn(1, V_DIM, device=dev)
    kv[0, 100] = float("nan")
    pe = torch.randn(1, fmt.rope_dim, device=dev) if fmt.rope_dim else None
    before = cache.rows[c["victim"]].clone()
    try:
        cache.write(kv, pe, torch.tensor([c["victim_slot"]], dtype=torch.int32, device=dev))
    except ValueError as e:
        assert str(e).startswith("kv_c"), f"a rejected non-finite write must name kv_c: {e}"
        assert torch.equal(cache.rows[c["victim"]], before), "a rejected write changed the cache"
        return False
    return True


def check_nan_isolation(c: Dict, backend: str, *, sm_scale: float = 0.1, mode: str = "decode",
                        plant: str = "bytes") -> Optional[Dict]:
    """Run a :func:`nan_isolation_case` clean, then with its victim row made non-finite (``plant``:
    ``bytes`` overwrites it with NaN bytes; ``write`` writes a token holding a NaN through the cache write,
    when the write policy stores it): the tokens that do not select the victim (within their valid count)
    must give bitwise the same out and lse as the clean run, and every token that selects it must change.
    The cache is restored afterwards.  Returns dict(hit, clean=(out, lse), dirty=(out, lse)), or None when
    the write rejected the non-finite token."""
    fn = sparsemla.sparse_mla_decode if mode == "decode" else sparsemla.sparse_mla_prefill
    q, cache = c["q"], c["cache"]

    def call():
        t, h = q.shape[:2]
        out = torch.full((t, h, V_DIM), float("nan"), dtype=torch.bfloat16, device=q.device)
        lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=q.device)
        return fn(q, cache, c["indices"], sm_scale, c["valid_counts"], 1.0, backend, out, lse=lse)

    o0, l0 = call()
    hit = selects(c["indices"], c["valid_counts"], c["victim"])
    assert bool(hit.any()) and bool((~hit).any()), "the case must have tokens on both sides"
    assert bool(torch.isfinite(o0.float()).all()), f"{c['fmt'].id} {backend}: the clean run is not finite"
    saved = cache.rows[c["victim"]].clone()
    try:
        if plant == "write":
            if not _plant_by_write(c):
                return None
        else:
            plant_nan_row(cache, c["victim"])
        o1, l1 = call()
    finally:
        cache.rows[c["victim"]].copy_(saved)
    same = ((o1.view(torch.int16) == o0.view(torch.int16)).flatten(1).all(dim=1)
            & (l1.view(torch.int32) == l0.view(torch.int32)).all(dim=1))
    leaked = (~hit & ~same).nonzero().flatten().tolist()
    assert not leaked, (f"{c['fmt'].id} {backend}: tokens {leaked} do not select the non-finite row "
                        f"{c['victim']} but their output changed")
    ignored = (hit & same).nonzero().flatten().tolist()
    assert not ignored, (f"{c['fmt'].id} {backend}: tokens {ignored} select the non-finite row {c['victim']} and "
                         f"their output did not change (a selected row was not read)")
    return dict(hit=hit, clean=(o0, l0), dirty=(o1, l1))


def planned_kernel(spec: Spec, capability=(9, 0), num_sms: int = 132) -> Optional[str]:
    """The kernel ``sparsemla.plan`` gives a spec's call on an H200 (``kernel``, ``+fp8qk``, ``+split`` when the
    rows are split over programs), or None when the plan module is not there or declines (a coverage count,
    not a check)."""
    try:
        from sparsemla import plan as P
        fmt = "bf16" if spec.mode == "workspace" else spec.fmt
        if spec.mode == "workspace":
            fmt = sparsemla.get_format("bf16", sparsemla.get_format(spec.fmt).rope_dim)
        p = P.plan_attention(fmt, spec.tokens, spec.heads, spec.width, capability=capability, num_sms=num_sms,
                             fp8_qk=is_fp8qk(spec.backend), portable="portable" in spec.backend,
                             staged=is_staged(spec.backend))
    except Exception:
        return None
    return p.kernel + ("+fp8qk" if p.fp8_qk else "") + ("+split" if p.num_splits > 1 else "")


def plan_kernel_names() -> List[str]:
    try:
        from sparsemla import plan as P
        # the kernels the plan chooses by itself when every kernel builds, within the API's head counts
        return [k for k in P.KERNELS if k not in P.FORCED_ONLY + P.BACKUP_ONLY]
    except Exception:
        return []
