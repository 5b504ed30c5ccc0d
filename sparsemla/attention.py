"""Public functional API: sparse MLA decode and prefill over a paged, quantized KV cache.

Both functions check their arguments once, on the host, from what the host knows (types, dtypes, shapes, strides,
devices; ``TypeError`` / ``ValueError`` naming the argument and what was expected), choose a backend
(``backend="auto"``: the best for the GPU generation and the KV format; a named backend is forced and raises
``ValueError`` with its reason when it cannot serve the call), allocate the outputs the caller did not pass, and
launch.  A default call never synchronizes with the device.  ``check=True`` is a debug option that also checks
the index values against the cache (a device-to-host read, so a sync); it is skipped during CUDA-graph capture.

Index rules (``kv-formats.md`` §7): ``indices[t]`` are rows of the cache's flat row view
(``PagedKVCache.rows``; see ``sparsemla.convert_indices``), -1 = no token; entries at or past
``valid_counts[t]`` are ignored whatever they hold.  A query with no valid entry gives out 0, lse -inf.
Outputs (§8): ``out`` bf16 ``[T, H, 512]``, ``lse`` fp32 ``[T, H]`` (natural log, sm_scale included).

A step captured in a CUDA graph is best run through :class:`sparsemla.SparseMLA`, which owns its buffers.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import host_entry
from ._device import current_cuda_index, stream_capturing as _capturing
from ._validate import SCALE_MAX, SCALE_MIN, check_current_device, check_k_scale, check_sm_scale, check_tensor
from .backends import registry
from .backends.triton_native import launches_only
from .cache import PagedKVCache
from .formats import get_format

V_DIM = 512
MAX_HEADS = registry.MAX_HEADS
_BF16, _I32, _F32 = torch.bfloat16, torch.int32, torch.float32


def sparse_mla_decode(q: torch.Tensor, cache: PagedKVCache, indices: torch.Tensor, sm_scale: float,
                      valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0, backend="auto",
                      out: Optional[torch.Tensor] = None, *, lse: Optional[torch.Tensor] = None,
                      check: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: each query token attends to its own top-k rows of a paged cache.

    Args:
        q: bf16 ``[T, H, head_dim]`` (head_dim = ``cache.fmt.head_dim``: 576, or 512 for NoPE), H in 1..128;
            the last dim contiguous; a CUDA q on the current CUDA device (the kernels run there).  Several tokens
            of one request (speculative decoding) are just rows.
        cache: a :class:`PagedKVCache` on q's device, any format.
        indices: int32 ``[T, K]`` rows of ``cache.rows`` (contiguous rows), -1 = no token.
        sm_scale: softmax scale (positive, finite).
        valid_counts: optional int32 ``[T]``: entries at or past ``valid_counts[t]`` are ignored.
        k_scale: the plain ``fp8`` format's per-tensor scale (positive, finite; other formats ignore it).
        backend: ``"auto"``, a backend name (``"triton"``, ``"triton-portable"``, ``"triton-staged"``,
            ``"reference"``, ``"flashmla"``, ``"flashinfer"``, ``"triton-fp8qk"``) or a
            :class:`~sparsemla.backends.Backend`.
        out: optional bf16 ``[T, H, 512]`` output (last dim contiguous).  lse: optional fp32 ``[T, H]``.
        check: debug option: also check the index values against the cache (one device sync; skipped during
            CUDA-graph capture).

    Returns:
        ``(out, lse)``: bf16 ``[T, H, 512]`` and fp32 ``[T, H]`` (natural log, sm_scale included).
    """
    # a configuration served before: replayed by the compiled host entry (sparsemla.host_entry), same checks
    r = host_entry.call(0, q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check)
    if r.__class__ is tuple:
        return r
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    return _call("decode", q, cache, cache.fmt, cache.rows, "cache", indices, sm_scale, valid_counts, k_scale,
                 backend, out, lse, check, r)


def sparse_mla_prefill(q: torch.Tensor, kv, indices: torch.Tensor, sm_scale: float,
                       valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0, backend="auto",
                       out: Optional[torch.Tensor] = None, *, lse: Optional[torch.Tensor] = None,
                       check: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill: many query tokens (up to 65,536) per call, each with its own top-k rows.

    Args:
        q: bf16 ``[T, H, head_dim]``, H in 1..128.
        kv: a :class:`PagedKVCache` (indices are rows of ``kv.rows``) or a bf16 workspace ``[rows, head_dim]``
            (contiguous; e.g. the context upconverted from a quantized cache; indices are its rows).
        indices, sm_scale, valid_counts, k_scale, backend, out, lse, check: as in :func:`sparse_mla_decode`
            (k_scale applies to an ``fp8`` cache; a bf16 workspace ignores it).

    Returns ``(out, lse)`` as :func:`sparse_mla_decode`.
    """
    r = host_entry.call(1, q, kv, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check)
    if r.__class__ is tuple:
        return r
    if isinstance(kv, PagedKVCache):
        return _call("prefill", q, kv, kv.fmt, kv.rows, "cache", indices, sm_scale, valid_counts, k_scale,
                     backend, out, lse, check, r)
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a PagedKVCache or a bf16 [rows, head_dim] tensor, got {type(kv).__name__}")
    check_tensor("kv", kv, dtype=_BF16, ndim=2, contiguous=True)
    if kv.shape[1] not in (576, 512):
        raise ValueError(f"kv: expected a bf16 workspace [rows, 576 or 512], got shape {tuple(kv.shape)}")
    fmt = get_format("bf16", kv.shape[1] - V_DIM)
    return _call("prefill", q, kv, fmt, kv, "workspace", indices, sm_scale, valid_counts, k_scale,
                 backend, out, lse, check)


def _call(mode, q, kv, fmt, rows, source, indices, sm_scale, valid_counts, k_scale, backend, out, lse,
          check, entry_key=None):
    """``entry_key``: the compiled host entry's key for this call's configuration, when it may be recorded."""
    # --- what the host knows, checked once (the fast tests first; the named helpers build the messages) ---------
    if type(sm_scale) is not float or not SCALE_MIN <= sm_scale <= SCALE_MAX:
        sm_scale = check_sm_scale(sm_scale)
    if type(k_scale) is not float or not SCALE_MIN <= k_scale <= SCALE_MAX:
        k_scale = _k_scale(k_scale, q)
    head_dim = fmt.head_dim
    qshape = q.shape if isinstance(q, torch.Tensor) else None
    if not (qshape is not None and q.dtype is _BF16 and len(qshape) == 3 and qshape[2] == head_dim
            and 1 <= qshape[1] <= MAX_HEADS and q.stride()[2] == 1):
        _explain_q(q, head_dim)
    t, h = qshape[0], qshape[1]
    dev = q.device
    if rows.device != dev:
        name = "cache" if source == "cache" else "kv"
        raise ValueError(f"{name}: expected it on q's device {dev}, got {rows.device}")
    ishape = indices.shape if isinstance(indices, torch.Tensor) else None
    if not (ishape is not None and indices.dtype is _I32 and len(ishape) == 2 and ishape[0] == t and ishape[1] >= 1
            and indices.stride()[1] == 1 and indices.device == dev):
        _explain_indices(indices, t, dev)
    if valid_counts is not None and not (isinstance(valid_counts, torch.Tensor) and valid_counts.dtype is _I32
                                         and valid_counts.shape == (t,) and valid_counts.is_contiguous()
                                         and valid_counts.device == dev):
        check_tensor("valid_counts", valid_counts, dtype=_I32, shape=(t,), device=dev, contiguous=True)
    if out is not None and not (isinstance(out, torch.Tensor) and out.dtype is _BF16 and out.shape == (t, h, V_DIM)
                                and out.stride(2) == 1 and out.device == dev):
        check_tensor("out", out, dtype=_BF16, shape=(t, h, V_DIM), device=dev)
        raise ValueError(f"out: the last dim must be contiguous (strides {out.stride()})")
    if lse is not None and not (isinstance(lse, torch.Tensor) and lse.dtype is _F32 and lse.shape == (t, h)
                                and lse.device == dev):
        check_tensor("lse", lse, dtype=_F32, shape=(t, h), device=dev)
    capturing = False
    if q.is_cuda:  # (q.is_cuda: no device string built)
        if q.get_device() != current_cuda_index():
            check_current_device("q", q)
        capturing = _capturing()
    if capturing and isinstance(k_scale, torch.Tensor):
        raise TypeError("k_scale: pass a Python float during CUDA-graph capture (reading a tensor syncs)")
    chosen = registry.select_call(mode, fmt, h, ishape[1], dev, source, capturing, backend)
    if check and not capturing:
        _check_index_values(indices, valid_counts, t, rows.shape[0])  # (rows: the cache's or the workspace's)
    # --- allocate what the caller did not pass, once; launch --------------------------------------------------
    # new_empty takes q's device and (for out) dtype without parsing them (less host time than torch.empty)
    if out is None:
        out = q.new_empty((t, h, V_DIM))
    if lse is None:
        lse = q.new_empty((t, h), dtype=_F32)
    if t == 0:
        return out, lse
    if entry_key is not None and launches_only(chosen):
        rec = host_entry.begin(entry_key)  # the launcher records the call's launches
        try:
            result = chosen.forward(mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse)
            rec.keep.append(backend)  # (the key holds its identity)
            host_entry.commit(rec)
            return result
        finally:
            host_entry.end()
    return chosen.forward(mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse)


def _k_scale(k_scale, q) -> float:
    if isinstance(k_scale, torch.Tensor) and q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise TypeError("k_scale: pass a Python float during CUDA-graph capture (reading a tensor syncs)")
    return check_k_scale(k_scale)


def _explain_q(q, head_dim: int):
    check_tensor("q", q, dtype=_BF16, ndim=3)
    if q.shape[2] != head_dim:
        raise ValueError(f"q: expected shape [T, H, {head_dim}] (the cache's head_dim), got {tuple(q.shape)}")
    if not 1 <= q.shape[1] <= MAX_HEADS:
        raise ValueError(f"q: expected 1..{MAX_HEADS} heads, got {q.shape[1]} (shape {tuple(q.shape)})")
    raise ValueError(f"q: the last dim must be contiguous (strides {q.stride()})")


def _explain_indices(indices, t: int, dev):
    check_tensor("indices", indices, dtype=_I32, ndim=2, device=dev)
    if indices.shape[0] != t:
        raise ValueError(f"indices: expected shape [{t}, K] (one row per query token), got {tuple(indices.shape)}")
    if indices.shape[1] < 1:
        raise ValueError(f"indices: expected at least one column, got shape {tuple(indices.shape)}")
    raise ValueError(f"indices: rows must be contiguous (strides {indices.stride()})")


def _check_index_values(indices, valid_counts, t: int, num_rows: int) -> None:
    """The debug check: every entry before a query's valid count is -1 or a row of the cache (syncs)."""
    if not indices.numel():
        return
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


__all__ = ["sparse_mla_decode", "sparse_mla_prefill"]
