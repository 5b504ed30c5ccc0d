"""Public functional API: sparse MLA decode and prefill over a paged, quantized KV cache.

Both functions check every argument (raising ``TypeError``/``ValueError`` that name the argument and say
what was expected), then dispatch through the backend registry (``sparsemla.backends``): ``backend="auto"``
picks the best backend for the GPU generation and the KV format; a named backend is forced and raises
``ValueError`` with its reason when it cannot serve the call.

Index rules (``kv-formats.md`` §7): ``indices[t]`` are rows of the cache's flat row view
(``PagedKVCache.rows``; see ``sparsemla.convert_indices``), -1 = no token; entries at or past
``valid_counts[t]`` are ignored whatever they hold.  A query with no valid entry gives out 0, lse -inf.
Outputs (§8): ``out`` bf16 ``[T, H, 512]``, ``lse`` fp32 ``[T, H]`` (natural log, sm_scale included).

For a step that is captured in a CUDA graph, use the runner (:class:`sparsemla.SparseMLA`), which owns its
buffers; these functions are for eager use (during capture they skip the value checks that read device
memory back to the host).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._validate import check_k_scale, check_sm_scale, check_tensor, same_device
from .backends import registry
from .cache import PagedKVCache

V_DIM = 512
MAX_HEADS = registry.MAX_HEADS


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_q(q: torch.Tensor, head_dim: int, *, min_heads: int = 1) -> Tuple[int, int]:
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    t, h, d = q.shape
    if d != head_dim:
        raise ValueError(f"q: expected shape [T, H, {head_dim}] (the cache's head_dim), got {tuple(q.shape)}")
    if not min_heads <= h <= MAX_HEADS:
        raise ValueError(f"q: expected {min_heads}..{MAX_HEADS} heads, got {h} (shape {tuple(q.shape)})")
    if q.stride(2) != 1:
        raise ValueError(f"q: the last dim must be contiguous (strides {q.stride()})")
    return t, h


def _check_indices(indices, valid_counts, q: torch.Tensor, num_rows: int, check: bool) -> None:
    t = q.shape[0]
    check_tensor("indices", indices, dtype=torch.int32, ndim=2, device=q.device)
    if indices.shape[0] != t:
        raise ValueError(f"indices: expected shape [{t}, K] (one row per query token), got {tuple(indices.shape)}")
    if indices.shape[1] < 1:
        raise ValueError(f"indices: expected at least one column, got shape {tuple(indices.shape)}")
    if indices.stride(1) != 1:
        raise ValueError(f"indices: rows must be contiguous (strides {indices.stride()})")
    if valid_counts is not None:
        check_tensor("valid_counts", valid_counts, dtype=torch.int32, shape=(t,), device=q.device,
                     contiguous=True)
    if check and indices.numel() and not _capturing(q.device):
        # One reduction each (a device sync on GPU): pass check=False on a hot path.
        mask = indices >= 0
        if valid_counts is not None:
            k = torch.arange(indices.shape[1], device=indices.device, dtype=torch.int32)
            mask &= k[None, :] < valid_counts[:, None]
            vmin = int(valid_counts.min()) if t else 0
            if vmin < 0:
                raise ValueError(f"valid_counts: entries must be >= 0, found {vmin}")
        lo = int(indices.min())
        if lo < -1:
            # Below -1 is malformed even past the valid count: it is never a token and never padding.
            raise ValueError(f"indices: entries must be -1 (no token) or a row >= 0, found {lo}")
        if mask.any():
            hi = int(indices[mask].max())
            if hi >= num_rows:
                raise ValueError(f"indices: entries must be < {num_rows} (the number of cache rows), found {hi}")


def _check_outputs(out, lse, t: int, h: int, device) -> None:
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(t, h, V_DIM), device=device)
        if out.stride(2) != 1:
            raise ValueError(f"out: the last dim must be contiguous (strides {out.stride()})")
    if lse is not None:
        check_tensor("lse", lse, dtype=torch.float32, shape=(t, h), device=device)


def _k_scale(k_scale, device) -> float:
    if isinstance(k_scale, torch.Tensor) and _capturing(device):
        raise TypeError("k_scale: pass a Python float during CUDA-graph capture (reading a tensor syncs)")
    return check_k_scale(k_scale)


def _empty(q, out, lse):
    t, h = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((t, h, V_DIM), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    return out, lse


def sparse_mla_decode(q: torch.Tensor, cache: PagedKVCache, indices: torch.Tensor, sm_scale: float,
                      valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0, backend="auto",
                      out: Optional[torch.Tensor] = None, *, lse: Optional[torch.Tensor] = None,
                      check: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: each query token attends to its own top-k rows of a paged cache.

    Args:
        q: bf16 ``[T, H, head_dim]`` (head_dim = ``cache.fmt.head_dim``: 576, or 512 for NoPE), H in 1..128;
            the last dim contiguous.  Several tokens of one request (speculative decoding) are just rows.
        cache: a :class:`PagedKVCache` on q's device, any format.
        indices: int32 ``[T, K]`` rows of ``cache.rows`` (contiguous rows), -1 = no token.
        sm_scale: softmax scale (positive, finite).
        valid_counts: optional int32 ``[T]``: entries at or past ``valid_counts[t]`` are ignored.
        k_scale: the plain ``fp8`` format's per-tensor scale (positive, finite; other formats ignore it).
        backend: ``"auto"``, a backend name (``"triton"``, ``"triton-staged"``, ``"reference"``, ``"flashmla"``,
            ``"flashinfer"``) or a :class:`~sparsemla.backends.Backend`.
        out: optional bf16 ``[T, H, 512]`` output (last dim contiguous).  lse: optional fp32 ``[T, H]``.
        check: validate index values (one device sync); skipped automatically during CUDA-graph capture.

    Returns:
        ``(out, lse)``: bf16 ``[T, H, 512]`` and fp32 ``[T, H]`` (natural log, sm_scale included).
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    return _dispatch("decode", q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check)


def sparse_mla_prefill(q: torch.Tensor, kv, indices: torch.Tensor, sm_scale: float,
                       valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0, backend="auto",
                       out: Optional[torch.Tensor] = None, *, lse: Optional[torch.Tensor] = None,
                       check: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill: many query tokens (up to 65,536) per call, each with its own top-k rows.

    Args:
        q: bf16 ``[T, H, head_dim]``, H in 1..128.
        kv: a :class:`PagedKVCache` (indices are rows of ``kv.rows``) or a bf16 workspace ``[rows, head_dim]``
            (contiguous; e.g. the context upconverted from a quantized cache; indices are its rows).
        indices, sm_scale, valid_counts, k_scale, backend, out, lse, check: as in :func:`sparse_mla_decode`
            (k_scale applies to an ``fp8`` cache; a bf16 workspace ignores it).

    Returns ``(out, lse)`` as :func:`sparse_mla_decode`.
    """
    if not isinstance(kv, (PagedKVCache, torch.Tensor)):
        raise TypeError(f"kv: expected a PagedKVCache or a bf16 [rows, head_dim] tensor, got {type(kv).__name__}")
    return _dispatch("prefill", q, kv, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check)


def _dispatch(mode, q, kv, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check):
    sm_scale = check_sm_scale(sm_scale)
    if isinstance(kv, PagedKVCache):
        head_dim, num_rows, kv_device = kv.fmt.head_dim, kv.num_rows, kv.device
        name = "cache"
    else:
        check_tensor("kv", kv, dtype=torch.bfloat16, ndim=2, contiguous=True)
        if kv.shape[1] not in (576, 512):
            raise ValueError(f"kv: expected a bf16 workspace [rows, 576 or 512], got shape {tuple(kv.shape)}")
        head_dim, num_rows, kv_device = kv.shape[1], kv.shape[0], kv.device
        name = "kv"
    t, h = _check_q(q, head_dim)
    if not same_device(kv_device, q.device):
        raise ValueError(f"{name}: expected it on q's device {q.device}, got {kv_device}")
    k_scale = _k_scale(k_scale, q.device)
    _check_indices(indices, valid_counts, q, num_rows, check)
    _check_outputs(out, lse, t, h, q.device)
    config = registry.make_config(mode, q, kv, indices)
    chosen = registry.select(config, backend)
    if t == 0:
        return _empty(q, out, lse)
    return chosen.forward(mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse)


__all__ = ["sparse_mla_decode", "sparse_mla_prefill"]
