"""sparsemla: sparse MLA (DeepSeek Sparse Attention) over paged, quantized KV caches, in Triton.

Public API (imported lazily, so that ``TRITON_INTERPRET`` can still be set before any kernel module
is loaded — Triton decides at decoration time whether a kernel is compiled or interpreted):

    get_format, all_formats, FORMAT_NAMES          KV formats (sparsemla.formats)
    PagedKVCache                                   paged cache (sparsemla.cache)
    convert_indices, expand_pooled_topk, ...       index conversion (sparsemla.indices)
    sparse_mla_decode, sparse_mla_prefill          attention (sparsemla.attention)
    SparseMLA, BatchMetadata                       CUDA-graph-safe runner (sparsemla.runner)
    select_backend, list_backends                  backend registry (sparsemla.backends)
    reference                                      float64 references (sparsemla.reference)
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "get_format": "formats", "all_formats": "formats", "FORMAT_NAMES": "formats", "KVFormat": "formats",
    "PagedKVCache": "cache",
    "convert_indices": "indices", "expand_pooled_topk": "indices", "pooled_valid_counts": "indices",
    "pooled_width": "indices",
    "sparse_mla_decode": "attention", "sparse_mla_prefill": "attention",
    "SparseMLA": "runner", "BatchMetadata": "runner",
    "select_backend": "backends", "list_backends": "backends",
}

__all__ = sorted(_EXPORTS) + ["reference", "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        mod = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = globals()[name] = getattr(mod, name)  # later lookups skip this function
        return value
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'sparsemla' has no attribute {name!r}")


def __dir__():
    return __all__
