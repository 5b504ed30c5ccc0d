"""``DSAAttention``: one DeepSeek-Sparse-Attention layer (MLA + lightning indexer) over paged caches.

The layer shows how an engine wires the library's parts.  For ``T`` tokens ``x [T, hidden]``:

    qr      = RMSNorm(W_qa x)                                   [T, q_lora_rank]
    q       = W_qb qr  -> q_nope [T, H, d_nope], q_pe [T, H, d_rope] (RoPE applied)
    kv_c    = RMSNorm((W_kva x)[:512]),  k_pe = RoPE((W_kva x)[512:])      one latent KV head
    cache  <- (kv_c, k_pe) at meta.slot_mapping   (PagedKVCache.write: quantizes to the cache's format)
    topk    = LightningIndexer(x, qr)               request-local positions, -1 padded
    rows    = convert_indices(topk, ...)            rows of the paged cache
    q_abs   = q_nope @ W_UK   (weight absorption: W_UK [H, d_nope, 512] is the key half of W_kvb,
              folded into the query so attention runs on the 512-dim latent directly)
    o, lse  = sparse_mla([q_abs, q_pe] (576 or 512 dims, bf16), cache, rows, sm_scale)      [T, H, 512]
    out     = W_o (o @ W_UV^T)    (W_UV [H, d_v, 512], the value half of W_kvb, applied after attention)

``sm_scale`` is ``(d_nope + d_rope) ** -0.5`` (the non-absorbed head dim) unless configured.
Decode (``meta.decode``) calls ``sparse_mla_decode``, prefill ``sparse_mla_prefill``; both read the
cache.  The decode path has no host synchronisation, so a step can be captured in a CUDA graph
(given metadata tensors that stay in place between replays: ``DSAMetadata.copy_from``).

``reference_forward`` computes the same layer in float64 with unquantized keys (the truth the
accuracy report measures against).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from .._validate import check_positive_int, check_tensor
from ..attention import sparse_mla_decode, sparse_mla_prefill
from ..cache import PagedKVCache
from ..formats import KV_LORA_RANK
from ..indices import convert_indices
from ..reference import sparse_mla
from .indexer import IndexKeyCache, LightningIndexer
from .rope import RMSNorm, apply_rope, rms_norm

_INT = (torch.int32, torch.int64)


@dataclass
class DSAConfig:
    """Geometry of one DSA layer; the defaults are DeepSeek-V3.2's."""

    hidden_size: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = KV_LORA_RANK
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # 0 = NoPE (GLM-5.3-Flash style): 512-dim keys
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 1
    index_rope_dim: Optional[int] = None  # default: 64 if the layer has RoPE, else 0
    index_hadamard: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    softmax_scale: Optional[float] = None  # default (qk_nope + qk_rope) ** -0.5

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "index_n_heads", "index_topk", "index_kpool"):
            check_positive_int(name, getattr(self, name))
        if self.kv_lora_rank != KV_LORA_RANK:
            raise ValueError(f"kv_lora_rank: the KV formats store {KV_LORA_RANK} latent dims, got {self.kv_lora_rank}")
        if self.qk_rope_head_dim not in (64, 0):
            raise ValueError(f"qk_rope_head_dim: expected 64 or 0 (NoPE), got {self.qk_rope_head_dim}")
        if self.num_heads > 128:
            raise ValueError(f"num_heads: the attention kernels serve at most 128 heads, got {self.num_heads}")
        if self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk: expected a multiple of index_kpool ({self.index_kpool}), "
                             f"got {self.index_topk}")
        if self.index_rope_dim is None:
            self.index_rope_dim = 64 if self.qk_rope_head_dim else 0

    @property
    def head_dim(self) -> int:
        """Width of the absorbed query and of a cache row: 576, or 512 for NoPE."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        if self.softmax_scale is not None:
            return float(self.softmax_scale)
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    @classmethod
    def tiny(cls, rope: bool = True, **kw) -> "DSAConfig":
        """A small geometry for CPU tests (still 512 latent dims and 128-dim index keys)."""
        base = dict(hidden_size=128, num_heads=4, q_lora_rank=64, qk_nope_head_dim=32,
                    qk_rope_head_dim=64 if rope else 0, v_head_dim=32, index_n_heads=4, index_topk=16)
        base.update(kw)
        return cls(**base)


@dataclass
class DSAMetadata:
    """Where each query token is, what it sees, and where its K/V go.  All tensors on one device.

    positions: int64 ``[T]`` request-local position of each token (RoPE position).
    req_id: int32 ``[T]`` request of each token (row of ``block_table``).
    context_lens: int32 ``[T]`` tokens visible to each token: ``positions + 1`` (causal).
    slot_mapping: int64 ``[T]`` cache slot ``block * block_size + offset`` of each token's K/V (-1 = skip).
    block_table: int32 ``[R, max_blocks]`` physical blocks of each request (shared by the KV cache and
        the index-key cache of every layer).
    block_size: tokens per block; max_context: static bound on ``context_lens`` (score-matrix width).
    decode: use the decode attention path (one or a few tokens per request).
    """

    positions: torch.Tensor
    req_id: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    max_context: int
    decode: bool = False

    @classmethod
    def from_positions(cls, positions: torch.Tensor, req_id: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, *, max_context: Optional[int] = None, decode: bool = False) -> "DSAMetadata":
        """Derive context lengths and slots on the device (no host sync).  ``max_context`` defaults to
        the block table's capacity ``max_blocks * block_size``."""
        check_tensor("positions", positions, dtypes=_INT, ndim=1)
        t = positions.shape[0]
        check_tensor("req_id", req_id, dtypes=_INT, shape=(t,), device=positions.device)
        check_tensor("block_table", block_table, dtypes=_INT, ndim=2, device=positions.device)
        check_positive_int("block_size", block_size)
        if max_context is None:
            max_context = block_table.shape[1] * block_size
        check_positive_int("max_context", max_context)
        pos = positions.to(torch.int64)
        req = req_id.to(torch.int64)
        phys = block_table.to(torch.int64)[req, pos // block_size]
        slots = phys * block_size + pos % block_size
        return cls(pos, req_id.to(torch.int32), (pos + 1).to(torch.int32), slots,
                   block_table.to(torch.int32), block_size, max_context, decode)

    @classmethod
    def from_lists(cls, query_lens: Sequence[int], start_positions: Sequence[int], block_table: torch.Tensor,
                   block_size: int, *, max_context: Optional[int] = None,
                   decode: Optional[bool] = None) -> "DSAMetadata":
        """Request ``r`` contributes ``query_lens[r]`` tokens at positions ``start_positions[r] + i``.
        ``decode`` defaults to "every request has one token"."""
        if len(query_lens) != len(start_positions) or len(query_lens) > block_table.shape[0]:
            raise ValueError(f"query_lens / start_positions: expected one entry per request "
                             f"(<= {block_table.shape[0]}), got {len(query_lens)} and {len(start_positions)}")
        dev = block_table.device
        pos, req = [], []
        for r, (n, s) in enumerate(zip(query_lens, start_positions)):
            if n < 0 or s < 0:
                raise ValueError(f"query_lens / start_positions: expected non-negative, got {n} and {s} (request {r})")
            if s + n > block_table.shape[1] * block_size:
                raise ValueError(f"start_positions: request {r} reaches position {s + n - 1}, past its block table "
                                 f"({block_table.shape[1]} blocks of {block_size})")
            pos += range(s, s + n)
            req += [r] * n
        if decode is None:
            decode = all(n == 1 for n in query_lens)
        return cls.from_positions(torch.tensor(pos, dtype=torch.int64, device=dev),
                                  torch.tensor(req, dtype=torch.int32, device=dev), block_table, block_size,
                                  max_context=max_context, decode=decode)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def copy_from(self, other: "DSAMetadata") -> None:
        """Copy another step's values into these tensors in place (same shapes): for CUDA-graph replay."""
        for name in ("positions", "req_id", "context_lens", "slot_mapping", "block_table"):
            getattr(self, name).copy_(getattr(other, name))


def sparse_attention(q: torch.Tensor, cache: PagedKVCache, indices: torch.Tensor, sm_scale: float,
                     valid_counts: Optional[torch.Tensor], k_scale: float, *, decode: bool, backend="auto"):
    """The attention call of the layer: ``sparsemla.attention`` (decode or prefill; no host sync), or the float64
    reference itself (``backend="reference-direct"``)."""
    if backend == "reference-direct":
        return sparse_mla(q, cache, indices, sm_scale, valid_counts, k_scale)
    fn = sparse_mla_decode if decode else sparse_mla_prefill
    return fn(q, cache, indices, sm_scale, valid_counts, k_scale, backend=backend)


def _cache_rows(topk: torch.Tensor, meta: DSAMetadata, cache: PagedKVCache):
    """Request-local top-k -> (int32 rows of ``cache.rows``, int32 valid counts), without a host sync."""
    return convert_indices(topk, meta.req_id, meta.block_table, cache.block_size, cache.block_stride_rows,
                           return_valid_counts=True, check=False)


class DSAAttention(nn.Module):
    """One DSA attention layer (see the module docstring).

    Args:
        config: a :class:`DSAConfig` (DeepSeek-V3.2 geometry by default).
        dtype, device: of the weights (bf16 on GPU; the attention query is always bf16).
        attn_backend: backend of the sparse attention call (``"auto"``, ``"triton"``, ``"reference"``, ...).
    """

    def __init__(self, config: Optional[DSAConfig] = None, *, dtype=torch.bfloat16, device=None,
                 attn_backend="auto"):
        super().__init__()
        c = self.config = config if config is not None else DSAConfig()
        kw = dict(dtype=dtype, device=device)
        h = c.num_heads
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, **kw)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps, **kw)
        self.wq_b = nn.Linear(c.q_lora_rank, h * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False, **kw)
        self.wkv_a = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False, **kw)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps, **kw)
        self.wkv_b = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.wo = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=False, **kw)
        self.indexer = LightningIndexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                                        c.index_rope_dim, c.index_topk, c.index_kpool, c.rope_theta, c.norm_eps,
                                        c.index_hadamard, **kw)
        self.attn_backend = attn_backend

    # --- weight views ------------------------------------------------------------------------------
    def w_uk_uv(self, dtype=None):
        """``(W_UK [H, d_nope, 512], W_UV [H, d_v, 512])``: the two halves of ``wkv_b`` per head."""
        c = self.config
        w = self.wkv_b.weight if dtype is None else self.wkv_b.weight.to(dtype)
        w = w.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    # --- pieces --------------------------------------------------------------------------------------
    def _kv(self, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        kv = self.wkv_a(x)
        kv_c = self.kv_norm(kv[:, : c.kv_lora_rank])
        k_pe = None
        if c.qk_rope_head_dim:
            k_pe = apply_rope(kv[:, c.kv_lora_rank:], positions, c.rope_theta, interleaved=True)
        return kv_c, k_pe

    def write_cache(self, x: torch.Tensor, meta: DSAMetadata, kv_cache: PagedKVCache, index_cache: IndexKeyCache,
                    *, k_scale: float = 1.0) -> None:
        """Project ``x [T, hidden]`` to its latent K/V and index keys and store them (no attention):
        fills a context cheaply, e.g. before measuring the last tokens of a long prompt."""
        kv_c, k_pe = self._kv(x, meta.positions)
        kv_cache.write(kv_c, k_pe, meta.slot_mapping, k_scale, check=False)
        self.indexer.write_keys(x, meta.positions, meta.slot_mapping, index_cache)

    def forward(self, x: torch.Tensor, meta: DSAMetadata, kv_cache: PagedKVCache, index_cache: IndexKeyCache,
                *, k_scale: float = 1.0, return_indices: bool = False):
        """Attention output ``[T, hidden]`` (x's dtype) for tokens ``x [T, hidden]``.

        The tokens' K/V and index keys are written first, so a token attends to itself and to every
        earlier token of its request (causal through ``meta.context_lens``).  With ``return_indices``
        also returns the indexer's int32 ``[T, width]`` request-local top-k.
        """
        c = self.config
        check_tensor("x", x, ndim=2)
        t = x.shape[0]
        if x.shape[1] != c.hidden_size:
            raise ValueError(f"x: expected shape [T, {c.hidden_size}], got {tuple(x.shape)}")
        if meta.num_tokens != t:
            raise ValueError(f"meta: describes {meta.num_tokens} tokens, x has {t}")
        if kv_cache.fmt.head_dim != c.head_dim:
            raise ValueError(f"kv_cache: format {kv_cache.fmt.id} has head_dim {kv_cache.fmt.head_dim}, "
                             f"the layer needs {c.head_dim}")
        if kv_cache.block_size != meta.block_size or index_cache.block_size != meta.block_size:
            raise ValueError(f"kv_cache / index_cache: block sizes {kv_cache.block_size} / {index_cache.block_size} "
                             f"differ from meta.block_size {meta.block_size}")
        h = c.num_heads
        # Queries.
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(t, h, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope = q[..., : c.qk_nope_head_dim]
        # Keys/values of these tokens into the caches, then the indexer picks the context.
        kv_c, k_pe = self._kv(x, meta.positions)
        kv_cache.write(kv_c, k_pe, meta.slot_mapping, k_scale, check=False)
        topk = self.indexer(x, qr, meta, index_cache)
        rows, counts = _cache_rows(topk, meta, kv_cache)
        # Weight absorption: q_abs[t, h] = q_nope[t, h] @ W_UK[h]  ([d_nope] x [d_nope, 512] -> [512]).
        w_uk, w_uv = self.w_uk_uv()
        q_abs = torch.einsum("thd,hdc->thc", q_nope, w_uk)
        parts = [q_abs]
        if c.qk_rope_head_dim:
            parts.append(apply_rope(q[..., c.qk_nope_head_dim:], meta.positions, c.rope_theta, interleaved=True))
        q_attn = torch.cat(parts, dim=-1).to(torch.bfloat16).contiguous()
        o, _ = sparse_attention(q_attn, kv_cache, rows, c.sm_scale, counts, k_scale, decode=meta.decode,
                                backend=self.attn_backend)
        # W_UV after attention: [T, H, 512] x [H, d_v, 512] -> [T, H, d_v], then the output projection.
        o = torch.einsum("thc,hvc->thv", o.to(w_uv.dtype), w_uv)
        out = self.wo(o.reshape(t, h * c.v_head_dim))
        return (out, topk) if return_indices else out

    # --- float64 reference ---------------------------------------------------------------------------
    @torch.no_grad()
    def reference_forward(self, x_seq: torch.Tensor, query_positions: torch.Tensor,
                          topk: Optional[torch.Tensor] = None, *, absorbed: bool = True):
        """The layer in float64 for query tokens of ONE sequence, keys and values unquantized.

        Args:
            x_seq: ``[S, hidden]`` the sequence's inputs (positions ``0..S-1``).
            query_positions: int ``[Q]`` positions whose outputs are wanted (each sees ``[0, pos]``).
            topk: optional int ``[Q, width]`` request-local positions to attend to (e.g. the fast
                indexer's, to isolate the attention error); default the float64 indexer's own.
            absorbed: compute attention on the 512-dim latent with W_UK folded into q (the layer's
                method) or, with False, per head on decompressed keys/values (plain MLA; small shapes).

        Returns ``(out float64 [Q, hidden], topk int32 [Q, width])``.
        """
        c = self.config
        check_tensor("x_seq", x_seq, ndim=2)
        check_tensor("query_positions", query_positions, dtypes=_INT, ndim=1, device=x_seq.device)
        f = torch.float64
        qpos = query_positions.to(torch.int64)
        nq, h = qpos.shape[0], c.num_heads
        x = x_seq.to(f)
        s = x.shape[0]
        xq = x[qpos]
        qr = rms_norm(xq @ self.wq_a.weight.to(f).T, self.q_norm.weight, c.norm_eps)
        q = (qr @ self.wq_b.weight.to(f).T).view(nq, h, -1)
        q_nope = q[..., : c.qk_nope_head_dim]
        q_pe = apply_rope(q[..., c.qk_nope_head_dim:], qpos, c.rope_theta, interleaved=True) \
            if c.qk_rope_head_dim else None
        kv = x @ self.wkv_a.weight.to(f).T
        kv_c = rms_norm(kv[:, : c.kv_lora_rank], self.kv_norm.weight, c.norm_eps)
        k_pe = apply_rope(kv[:, c.kv_lora_rank:], torch.arange(s, device=x.device), c.rope_theta, interleaved=True) \
            if c.qk_rope_head_dim else None
        if topk is None:
            topk, _ = self.indexer.reference_topk(x, qr, qpos)
        check_tensor("topk", topk, dtypes=_INT, ndim=2, device=x.device)
        if topk.shape[0] != nq:
            raise ValueError(f"topk: expected {nq} rows (one per query position), got shape {tuple(topk.shape)}")
        w_uk, w_uv = self.w_uk_uv(f)
        if absorbed:
            q_abs = torch.einsum("thd,hdc->thc", q_nope, w_uk)
            q_full = torch.cat([q_abs] + ([q_pe] if q_pe is not None else []), dim=-1)
            workspace = torch.cat([kv_c] + ([k_pe] if k_pe is not None else []), dim=-1)  # row = position
            o, _ = sparse_mla(q_full, workspace, topk, c.sm_scale)
            o = torch.einsum("thc,hvc->thv", o, w_uv)
        else:
            o = torch.zeros((nq, h, c.v_head_dim), dtype=f, device=x.device)
            for i in range(nq):
                sel = topk[i][topk[i] >= 0].to(torch.int64)
                k_nope = torch.einsum("sc,hdc->shd", kv_c[sel], w_uk)
                v = torch.einsum("sc,hvc->shv", kv_c[sel], w_uv)
                logits = torch.einsum("hd,shd->hs", q_nope[i], k_nope)
                if q_pe is not None:
                    logits = logits + torch.einsum("hr,sr->hs", q_pe[i], k_pe[sel])
                p = torch.softmax(logits * c.sm_scale, dim=-1)
                o[i] = torch.einsum("hs,shv->hv", p, v)
        out = o.reshape(nq, h * c.v_head_dim) @ self.wo.weight.to(f).T
        return out, topk.to(torch.int32)


# --- realistic random weights and activations ----------------------------------------------------

def _normal(shape, std, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def student_t(shape, df: int, gen: torch.Generator) -> torch.Tensor:
    """Student-t samples with integer ``df`` (heavy tails): ``z / sqrt(chi2_df / df)``, on ``gen``'s device."""
    check_positive_int("df", df)
    dev = gen.device
    z = torch.randn(shape, generator=gen, device=dev)
    chi2 = torch.zeros(shape, device=dev)
    for _ in range(df):
        chi2 += torch.randn(shape, generator=gen, device=dev) ** 2
    return z / torch.sqrt(chi2 / df)


def channel_gains(n: int, gen, *, sigma: float = 0.3, outlier_frac: float = 0.01, outlier_gain=(8.0, 24.0)):
    """Per-channel gains: log-normal with median 1, and ``outlier_frac`` of the channels 8-24x larger
    (like the outlier channels of real LLM activations; they set the quantization scales)."""
    g = torch.exp(torch.randn(n, generator=gen) * sigma)
    n_out = int(round(outlier_frac * n))
    if n_out:
        idx = torch.randperm(n, generator=gen)[:n_out]
        lo, hi = outlier_gain
        g[idx] *= lo + (hi - lo) * torch.rand(n_out, generator=gen)
    # Normalize the typical channel (the median) to 1, so the outliers stand out of an O(1) background.
    return g / g.median()


def realistic_hidden(num_tokens: int, hidden_size: int, gen: torch.Generator, *, df: int = 4,
                     gains: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """Float32 ``[T, hidden]`` stand-ins for normalized hidden states: Student-t entries (heavy tails),
    rows scaled to RMS 1, times per-channel gains with outlier channels; token 0 is an "attention sink"
    with 4x the norm.  The gains come from ``gen`` (CPU); the bulk is drawn on ``device`` (default CPU)
    from a generator seeded by ``gen``, so large inputs are cheap on a GPU and still reproducible."""
    if gains is None:
        gains = channel_gains(hidden_size, gen)
    bulk = gen
    if device is not None and torch.device(device).type != "cpu":
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
        bulk = torch.Generator(device=device).manual_seed(seed)
    x = student_t((num_tokens, hidden_size), df, bulk)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    x = x * gains.to(x.device)
    if num_tokens:
        x[0] *= 4.0
    return x


@torch.no_grad()
def init_dsa_weights_(layer: DSAAttention, gen: torch.Generator, *, q_gain: float = 0.7) -> DSAAttention:
    """Fill a layer with random weights that give realistic activations: Gaussian projections scaled by
    ``fan_in**-0.5``, norm weights with outlier channels (so ``kv_c`` has outlier latent dims, which is
    what the per-tile / per-block cache scales must cope with), a larger RoPE key part, and ``q_gain``
    setting the attention sharpness (0.7 gives logits with a standard deviation of about 2.5 at
    DeepSeek's head dims: a mix of peaked and broad heads).  Drawn on the CPU
    from ``gen``, so the weights are the same on any device."""
    c = layer.config

    def fill(lin: nn.Linear, gain: float = 1.0):
        lin.weight.copy_(_normal(lin.weight.shape, gain / math.sqrt(lin.in_features), gen))

    fill(layer.wq_a)
    fill(layer.wq_b, q_gain)
    fill(layer.wkv_a)
    if c.qk_rope_head_dim:
        layer.wkv_a.weight[c.kv_lora_rank:] *= 2.0
    fill(layer.wkv_b)
    fill(layer.wo)
    layer.q_norm.weight.copy_(channel_gains(c.q_lora_rank, gen, sigma=0.2))
    layer.kv_norm.weight.copy_(channel_gains(c.kv_lora_rank, gen, sigma=0.3, outlier_frac=0.02))
    ix = layer.indexer
    fill(ix.wq_b)
    fill(ix.wk)
    fill(ix.weights_proj)
    ix.k_norm.weight.copy_(channel_gains(ix.head_dim, gen, sigma=0.2))
    ix.k_norm.bias.copy_(_normal((ix.head_dim,), 0.1, gen))
    return layer


__all__ = ["DSAConfig", "DSAMetadata", "DSAAttention", "sparse_attention", "init_dsa_weights_", "realistic_hidden",
           "channel_gains", "student_t"]
