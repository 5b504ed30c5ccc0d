"""The lightning indexer (DeepSeek-V3.2): picks the top-k context tokens each query token attends to.

Per token ``t`` (``x`` its hidden state, ``qr`` the normalized query latent of the attention layer):

    q[t]  = rope(W_q qr[t])  reshaped to [n_heads, 128]        (RoPE on the first ``rope_dim`` dims)
    k[t]  = rope(LayerNorm(W_k x[t]))                           [128], one key shared by all heads
    w[t]  = W_w x[t] * n_heads**-0.5 * 128**-0.5                [n_heads]
    q, k <- q @ Hd, k @ Hd   (Hd = normalized 128x128 Hadamard; orthogonal, so q.k is unchanged, but it
                             spreads outlier channels before the fp8 rounding)
    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]),   s < context_len[t]

The keys go to a 132-byte/token fp8 cache (:class:`IndexKeyCache`); the queries are quantized to fp8
with one power-of-two scale per (token, head), folded into ``w``.  Scores are computed by
``sparsemla.kernels.indexer.index_scores`` and ranked with ``index_topk`` (pooled when ``kpool > 1``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .._device import triton_runs_on
from .._validate import check_positive_int, check_tensor
from ..indices import pooled_width
from ..kernels.indexer import (INDEX_BYTES_PER_TOKEN, INDEX_HEAD_DIM, index_cache_write, index_scores, index_topk,
                               quantize_index_q)
from ..reference import indexer as ref_indexer
from .rope import apply_rope

# Largest score matrix one scoring call materializes (fp32 elements); prefill is chunked to stay below.
MAX_SCORE_ELEMENTS = 1 << 28


def hadamard_matrix(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), scaled by ``n**-0.5`` (orthonormal)."""
    check_positive_int("n", n)
    if n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


class IndexKeyCache:
    """Paged fp8 index-key cache: uint8 ``[num_blocks, block_size, 132]`` (layout in
    ``sparsemla.reference.indexer``).  Shares its block table (and so its block size and block ids)
    with the KV cache of the same layer.

    Attributes: ``data`` (the uint8 tensor), ``block_size``, ``num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int = 64, device=None):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        self.data = torch.zeros((num_blocks, block_size, INDEX_BYTES_PER_TOKEN), dtype=torch.uint8, device=device)

    @classmethod
    def from_tensor(cls, data: torch.Tensor) -> "IndexKeyCache":
        """Wrap an engine's uint8 ``[num_blocks, block_size, 132]`` tensor (block stride may be larger)."""
        ref_indexer.check_index_cache(data, "data")
        obj = cls.__new__(cls)
        obj.num_blocks, obj.block_size = data.shape[0], data.shape[1]
        obj.data = data
        return obj

    @property
    def device(self) -> torch.device:
        return self.data.device

    def write(self, k: torch.Tensor, slot_mapping: torch.Tensor, *, check: bool = True) -> None:
        """Quantize and store keys ``[N, 128]`` at slots ``[N]`` (-1 = skip).  Triton on CUDA / under
        the interpreter, the PyTorch reference writer elsewhere (same bytes)."""
        if triton_runs_on(self.device):
            index_cache_write(self.data, k, slot_mapping, check=check)
        else:
            ref_indexer.write_index_cache(self.data, k, slot_mapping)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots ``[N]`` -> float64 dequantized keys ``[N, 128]``."""
        return ref_indexer.read_index_cache(self.data, slots)

    def __repr__(self) -> str:
        return f"IndexKeyCache(num_blocks={self.num_blocks}, block_size={self.block_size}, device={self.device})"


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer.

    Args:
        hidden_size: model width (input ``x``).
        q_lora_rank: width of the attention layer's query latent ``qr``.
        n_heads: index heads (64); head_dim: 128 (fixed by the cache layout).
        rope_dim: RoPE dims at the start of each index q / k (64; 0 = none).
        topk: index top-k (2048); kpool: tokens per pool (1 = token-level; 4 = GLM-5.3-Flash style).
        rope_theta, norm_eps: RoPE base, LayerNorm epsilon.
        hadamard: rotate q and k by a Hadamard matrix before quantizing (as DeepSeek-V3.2 does).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int = 64, head_dim: int = INDEX_HEAD_DIM,
                 rope_dim: int = 64, topk: int = 2048, kpool: int = 1, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6, hadamard: bool = True, dtype=None, device=None):
        super().__init__()
        if head_dim != INDEX_HEAD_DIM:
            raise ValueError(f"head_dim: the index-key cache stores {INDEX_HEAD_DIM}-dim keys, got {head_dim}")
        if rope_dim < 0 or rope_dim > head_dim or rope_dim % 2:
            raise ValueError(f"rope_dim: expected an even number in [0, {head_dim}], got {rope_dim}")
        check_positive_int("topk", topk)
        check_positive_int("kpool", kpool)
        if topk % kpool:
            raise ValueError(f"topk: expected a multiple of kpool ({kpool}), got {topk}")
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.topk, self.kpool, self.rope_theta = topk, kpool, rope_theta
        kw = dict(dtype=dtype, device=device)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, **kw)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(head_dim, eps=norm_eps, **kw)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False, **kw)
        self.use_hadamard = hadamard
        self.register_buffer("hadamard", hadamard_matrix(head_dim, torch.float32, device), persistent=False)
        # DeepSeek's weight scaling: n_heads**-0.5 (average over heads) * head_dim**-0.5 (softmax scale).
        self.weight_scale = n_heads ** -0.5 * head_dim ** -0.5

    @property
    def width(self) -> int:
        """Width of the top-k rows this indexer emits."""
        return self.topk if self.kpool == 1 else pooled_width(self.topk, self.kpool)

    # --- projections (float32 on the fast path, float64 with ``f64=True`` for the reference) -------
    def index_q(self, qr: torch.Tensor, positions: torch.Tensor, f64: bool = False) -> torch.Tensor:
        """Index queries ``[T, n_heads, 128]`` (float32, or float64 with ``f64``)."""
        t = qr.shape[0]
        if f64:
            q = qr.to(torch.float64) @ self.wq_b.weight.double().T
        else:
            q = self.wq_b(qr).float()
        return self._rotate(q.view(t, self.n_heads, self.head_dim), positions)

    def index_k(self, x: torch.Tensor, positions: torch.Tensor, f64: bool = False) -> torch.Tensor:
        """Index keys ``[T, 128]`` (float32, or float64 with ``f64``)."""
        if f64:
            kn = self.k_norm
            k = nn.functional.layer_norm(x.to(torch.float64) @ self.wk.weight.double().T, (self.head_dim,),
                                         kn.weight.double(), kn.bias.double(), kn.eps)
        else:
            k = self.k_norm(self.wk(x)).float()
        return self._rotate(k, positions)

    def index_weights(self, x: torch.Tensor, f64: bool = False) -> torch.Tensor:
        """Head weights ``[T, n_heads]`` (DeepSeek's scaling included; no query scale yet)."""
        if f64:
            return (x.to(torch.float64) @ self.weights_proj.weight.double().T) * self.weight_scale
        return self.weights_proj(x).float() * self.weight_scale

    def _rotate(self, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        if r:
            v = torch.cat([apply_rope(v[..., :r], positions, self.rope_theta, interleaved=False), v[..., r:]], -1)
        if self.use_hadamard:
            v = v @ self.hadamard.to(v.dtype)
        return v

    # --- the fast path ---------------------------------------------------------------------------
    def write_keys(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   cache: IndexKeyCache) -> None:
        """Project and store the index keys of ``x`` (no queries, no scores)."""
        cache.write(self.index_k(x, positions).contiguous(), slot_mapping, check=False)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, meta, cache: IndexKeyCache, *,
                write: bool = True) -> torch.Tensor:
        """Top-k request-local positions for each token of ``x``.

        Args:
            x: ``[T, hidden]``; qr: ``[T, q_lora_rank]`` (the normalized query latent).
            meta: a :class:`~sparsemla.layer.dsa.DSAMetadata` (positions, slots, req ids, context
                lengths, block table, ``max_context``).
            cache: this layer's :class:`IndexKeyCache`; the keys of ``x`` are written first (``write``).

        Returns int32 ``[T, width]`` positions, -1 padded (valid entries first).  No host sync on CUDA.
        """
        if write:
            self.write_keys(x, meta.positions, meta.slot_mapping, cache)
        q = self.index_q(qr, meta.positions)
        w = self.index_weights(x)
        q8, q_scale = quantize_index_q(q)
        wq = (w * q_scale).contiguous()
        t = x.shape[0]
        out = torch.empty((t, self.width), dtype=torch.int32, device=x.device)
        # Bound the fp32 score matrix; every bound here is a Python int, so no sync and graph-safe.
        chunk = max(1, MAX_SCORE_ELEMENTS // meta.max_context)
        for t0 in range(0, t, chunk):
            t1 = min(t, t0 + chunk)
            scores = self.scores(q8[t0:t1], wq[t0:t1], cache, meta.block_table, meta.req_id[t0:t1],
                                 meta.context_lens[t0:t1], meta.max_context)
            out[t0:t1] = index_topk(scores, self.topk, context_lens=meta.context_lens[t0:t1], kpool=self.kpool,
                                    width=self.width if self.kpool > 1 else None)
        return out

    @staticmethod
    def scores(q8, wq, cache: IndexKeyCache, block_table, req_id, context_lens, max_context: int) -> torch.Tensor:
        """fp32 ``[T, max_context]`` scores: the Triton kernel where it runs, else the float64
        reference on the same fp8 operands (CPU without the interpreter)."""
        if triton_runs_on(cache.device):
            return index_scores(q8, wq, cache.data, block_table, req_id.contiguous(), context_lens.contiguous(),
                                max_context, check=False)
        return ref_indexer.index_scores_paged(q8.to(torch.float64), wq, cache.data, block_table, req_id,
                                              context_lens, max_context).to(torch.float32)

    # --- the float64 reference --------------------------------------------------------------------
    @torch.no_grad()
    def reference_topk(self, x_seq: torch.Tensor, qr: torch.Tensor, query_positions: torch.Tensor):
        """Float64 top-k for queries of ONE sequence, keys unquantized.

        Args:
            x_seq: ``[S, hidden]`` the whole sequence (positions ``0..S-1``).
            qr: ``[Q, q_lora_rank]`` query latents of the query tokens, at ``query_positions`` (int ``[Q]``).

        Returns ``(topk int32 [Q, width], scores float64 [Q, S])``.
        """
        check_tensor("x_seq", x_seq, ndim=2)
        keys = self.index_k(x_seq, torch.arange(x_seq.shape[0], device=x_seq.device), f64=True)
        q = self.index_q(qr, query_positions, f64=True)
        w = self.index_weights(x_seq[query_positions], f64=True)
        ctx = (query_positions + 1).to(torch.int64)
        scores = ref_indexer.index_scores(q, w, keys, ctx)
        if self.kpool == 1:
            return ref_indexer.topk_positions(scores, self.topk), scores
        return ref_indexer.pooled_topk_positions(scores, ctx, self.topk, self.kpool, self.width), scores


__all__ = ["IndexKeyCache", "LightningIndexer", "hadamard_matrix"]
