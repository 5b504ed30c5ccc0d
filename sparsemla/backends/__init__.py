"""Backends behind one interface, and the choice between them.

Built in, registered here in this order: ``triton`` (the library's kernels, every KV format read natively),
``triton-portable`` (the portable Triton kernels only), ``triton-staged`` (top-k FP8 staging gather, then an FP8
kernel), ``reference`` (float64, any device), two optional peers used where installed -- ``flashmla`` (FlashMLA's
Hopper kernels, package ``sgl-flash-mla``) and ``flashinfer`` (FlashInfer's fa3 MLA kernel with page size 1) --
and ``triton-fp8qk`` (the opt-in FP8-QK mode).  See :mod:`.registry` for the selection rules.
"""
from .peers.flashinfer import FlashInferPeer
from .peers.flashmla import FlashMLAPeer
from .reference import Reference
from .registry import (FORMAT_PRIORITY, PRIORITY, AttentionConfig, Backend, HostPlan, RunnerSpec,
                       clear_selection_cache, get_backend, list_backends, make_config, register, select,
                       select_call)
from .triton_native import TritonFP8QK, TritonNative, TritonPortable
from .triton_staged import TritonStaged

for _backend in (TritonNative(), TritonPortable(), TritonStaged(), Reference(), FlashMLAPeer(), FlashInferPeer(),
                 TritonFP8QK()):
    register(_backend)

select_backend = select

__all__ = ["AttentionConfig", "Backend", "HostPlan", "RunnerSpec", "PRIORITY", "FORMAT_PRIORITY",
           "clear_selection_cache", "get_backend", "list_backends", "make_config", "register", "select",
           "select_backend", "select_call"]
