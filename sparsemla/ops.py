"""The public operations as PyTorch custom ops (namespace ``sparsemla``), for ``torch.compile`` and CUDA graphs.

``torch.compile`` cannot look inside a Triton launch wrapped in Python checks and a backend registry;
registered as custom ops with fake (meta) implementations, the operations appear in a traced graph as
single nodes whose output shapes the compiler knows, so a model that calls them compiles with
``fullgraph=True`` (no graph break), and the compiled graph can be captured in a CUDA graph.

Ops (tensors only in their schemas; a cache is passed as its row view plus its format and geometry):

    sparsemla::cache_write(rows!, kv_c, k_pe?, slot_mapping, fmt, block_size, block_stride_rows, k_scale) -> ()
    sparsemla::convert_indices(topk_local, req_id_per_token, block_table, block_size, block_stride_rows)
        -> (rows int32 [T, K], valid_counts int32 [T])
    sparsemla::sparse_mla_decode(q, kv_rows, fmt, block_size, block_stride_rows, indices, sm_scale,
        valid_counts?, k_scale, backend) -> (out [T, H, 512], lse [T, H])
    sparsemla::sparse_mla_prefill(q, kv, fmt, block_size, block_stride_rows, indices, sm_scale,
        valid_counts?, k_scale, backend) -> (out, lse)      # kv: cache rows (uint8) or a bf16 workspace

The Python helpers below (:func:`cache_write`, :func:`convert_indices`, :func:`sparse_mla_decode`,
:func:`sparse_mla_prefill`) take a :class:`PagedKVCache` and call the ops.  Inside an op the value
checks that read device memory are off (a compiled or captured graph cannot sync); call the functional
API (``sparsemla.sparse_mla_decode``) eagerly to get them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .attention import sparse_mla_decode as _decode, sparse_mla_prefill as _prefill
from .cache import PagedKVCache
from .indices import convert_indices as _convert
from .kernels.attention import per_call_partials

V_DIM = 512
_WORKSPACE = ""  # the fmt argument that marks a bf16 workspace (prefill)


def _cache_view(rows: Tensor, fmt: str, block_size: int, block_stride_rows: int) -> PagedKVCache:
    """A PagedKVCache over an existing row view (no copy)."""
    return PagedKVCache.from_rows(fmt, rows, block_size, block_stride_rows)


# --------------------------------------------------------------------------------------------------------
# cache write
# --------------------------------------------------------------------------------------------------------
@torch.library.custom_op("sparsemla::cache_write", mutates_args=("rows",))
def _cache_write_op(rows: Tensor, kv_c: Tensor, k_pe: Optional[Tensor], slot_mapping: Tensor, fmt: str,
                    block_size: int, block_stride_rows: int, k_scale: float) -> None:
    _cache_view(rows, fmt, block_size, block_stride_rows).write(kv_c, k_pe, slot_mapping, k_scale, check=False)


@_cache_write_op.register_fake
def _(rows, kv_c, k_pe, slot_mapping, fmt, block_size, block_stride_rows, k_scale):
    return None


def cache_write(cache: PagedKVCache, kv_c: Tensor, k_pe: Optional[Tensor], slot_mapping: Tensor,
                k_scale: float = 1.0) -> None:
    """``cache.write`` as a custom op (quantize and scatter; slot -1 = skip).  Slots are not range-checked."""
    torch.ops.sparsemla.cache_write(cache.rows, kv_c, k_pe, slot_mapping, cache.fmt.id, cache.block_size,
                                    cache.block_stride_rows, float(k_scale))


# --------------------------------------------------------------------------------------------------------
# index conversion
# --------------------------------------------------------------------------------------------------------
@torch.library.custom_op("sparsemla::convert_indices", mutates_args=())
def _convert_op(topk_local: Tensor, req_id_per_token: Tensor, block_table: Tensor, block_size: int,
                block_stride_rows: int) -> Tuple[Tensor, Tensor]:
    rows, counts = _convert(topk_local, req_id_per_token, block_table, block_size, block_stride_rows,
                            return_valid_counts=True, check=False)
    return rows, counts


@_convert_op.register_fake
def _(topk_local, req_id_per_token, block_table, block_size, block_stride_rows):
    t, k = topk_local.shape
    return (topk_local.new_empty((t, k), dtype=torch.int32), topk_local.new_empty((t,), dtype=torch.int32))


def convert_indices(topk_local: Tensor, req_id_per_token: Tensor, block_table: Tensor, block_size: int = 64,
                    block_stride_rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``sparsemla.convert_indices(..., return_valid_counts=True)`` as a custom op: (rows, valid counts)."""
    return torch.ops.sparsemla.convert_indices(topk_local, req_id_per_token, block_table, block_size,
                                               block_size if block_stride_rows is None else block_stride_rows)


# --------------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------------
def _fake_attention(q: Tensor):
    t, h = q.shape[0], q.shape[1]
    return q.new_empty((t, h, V_DIM)), q.new_empty((t, h), dtype=torch.float32)


@torch.library.custom_op("sparsemla::sparse_mla_decode", mutates_args=())
def _decode_op(q: Tensor, kv_rows: Tensor, fmt: str, block_size: int, block_stride_rows: int, indices: Tensor,
               sm_scale: float, valid_counts: Optional[Tensor], k_scale: float, backend: str) -> Tuple[Tensor, Tensor]:
    cache = _cache_view(kv_rows, fmt, block_size, block_stride_rows)
    with per_call_partials():
        return _decode(q, cache, indices, sm_scale, valid_counts, k_scale, backend, check=False)


@_decode_op.register_fake
def _(q, kv_rows, fmt, block_size, block_stride_rows, indices, sm_scale, valid_counts, k_scale, backend):
    return _fake_attention(q)


@torch.library.custom_op("sparsemla::sparse_mla_prefill", mutates_args=())
def _prefill_op(q: Tensor, kv: Tensor, fmt: str, block_size: int, block_stride_rows: int, indices: Tensor,
                sm_scale: float, valid_counts: Optional[Tensor], k_scale: float, backend: str) -> Tuple[Tensor, Tensor]:
    src = kv if fmt == _WORKSPACE else _cache_view(kv, fmt, block_size, block_stride_rows)
    with per_call_partials():
        return _prefill(q, src, indices, sm_scale, valid_counts, k_scale, backend, check=False)


@_prefill_op.register_fake
def _(q, kv, fmt, block_size, block_stride_rows, indices, sm_scale, valid_counts, k_scale, backend):
    return _fake_attention(q)


def _backend_name(backend) -> str:
    if not isinstance(backend, str):
        name = getattr(backend, "name", None)
        if not isinstance(name, str):
            raise TypeError(f"backend: expected a backend name (str), got {type(backend).__name__}")
        return name
    return backend


def sparse_mla_decode(q: Tensor, cache: PagedKVCache, indices: Tensor, sm_scale: float,
                      valid_counts: Optional[Tensor] = None, k_scale: float = 1.0,
                      backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """:func:`sparsemla.sparse_mla_decode` as a custom op (same arguments; no ``out``; indices not range-checked)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    return torch.ops.sparsemla.sparse_mla_decode(q, cache.rows, cache.fmt.id, cache.block_size,
                                                 cache.block_stride_rows, indices, float(sm_scale), valid_counts,
                                                 float(k_scale), _backend_name(backend))


def sparse_mla_prefill(q: Tensor, kv, indices: Tensor, sm_scale: float, valid_counts: Optional[Tensor] = None,
                       k_scale: float = 1.0, backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """:func:`sparsemla.sparse_mla_prefill` as a custom op (kv: a PagedKVCache or a bf16 workspace)."""
    if isinstance(kv, PagedKVCache):
        args = (kv.rows, kv.fmt.id, kv.block_size, kv.block_stride_rows)
    elif isinstance(kv, Tensor):
        args = (kv, _WORKSPACE, 1, 1)
    else:
        raise TypeError(f"kv: expected a PagedKVCache or a bf16 [rows, head_dim] tensor, got {type(kv).__name__}")
    return torch.ops.sparsemla.sparse_mla_prefill(q, *args, indices, float(sm_scale), valid_counts,
                                                  float(k_scale), _backend_name(backend))


__all__ = ["cache_write", "convert_indices", "sparse_mla_decode", "sparse_mla_prefill"]
