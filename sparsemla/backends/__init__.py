"""Backends behind one interface, and the choice between them.

Built in: ``triton`` (native kernels reading every KV format in registers), ``triton-staged`` (top-k FP8
staging gather, then an FP8 kernel), ``reference`` (float64, any device), and two optional peers used
where installed: ``flashmla`` (FlashMLA's Hopper kernels, package ``sgl-flash-mla``) and ``flashinfer``
(FlashInfer's fa3 MLA kernel with page size 1).  See :mod:`.registry` for the selection rules.
"""
from .registry import (AttentionConfig, Backend, HostPlan, RunnerSpec, PRIORITY, FORMAT_PRIORITY, clear_selection_cache, get_backend,
                       list_backends, make_config, register, select)

select_backend = select

__all__ = ["AttentionConfig", "Backend", "HostPlan", "RunnerSpec", "PRIORITY", "FORMAT_PRIORITY", "clear_selection_cache", "get_backend",
           "list_backends", "make_config", "register", "select", "select_backend"]
