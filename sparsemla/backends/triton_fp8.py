"""``triton-fp8``: the opt-in FP8-arithmetic mode of the native kernels (never chosen automatically).

Calls ``sparse_mla_fwd(..., fp8_arith=True)``: for fp8 / fp8_ds_mla rows on Hopper, the warp-specialized
kernels (``kernels/ws_few.py`` and ``kernels/ws_wide.py``, F8 variants) split q into two e4m3 terms (a power of
two per head; together exact for bf16 q in all but q's smallest elements) and run QK on e4m3 tensor cores
straight from the gathered bytes, so the QK half of the row conversions is gone.  Its error is that of the
e4m3 tensor cores' accumulation (about 14 significant bits): outputs as close to the float64 reference as the
default path's, lse off by ~1e-3 of |lse| (BENCHMARKS.md sections 12-13).
"""
from __future__ import annotations

from typing import Optional

from .registry import register
from .triton_native import TritonNative, _kernels, probe_native


class TritonFP8(TritonNative):
    """The native backend with ``fp8_arith=True``: its forward and split buffers, narrower declared rules."""
    name = "triton-fp8"
    description = ("opt-in FP8 arithmetic (fp8 / fp8_ds_mla rows, Hopper): q as two e4m3 terms, QK on e4m3 tensor "
                   "cores; lse ~1e-3 x |lse| from the reference")
    device_types = ("cuda",)
    min_capability = (9, 0)
    max_capability = (9, 0)
    formats = ("fp8", "fp8-nope", "fp8_ds_mla", "fp8_ds_mla-nope")
    kv_sources = ("cache",)
    fp8_arith = True

    def _probe(self, config) -> Optional[str]:
        # the format, device and capability are declared above; this checks that the Gluon kernel can run here
        return probe_native(("sparse_mla_fwd", "fp8_arith_why_not")) or _kernels().fp8_arith_why_not("fp8")

    def tolerance(self, fmt):
        """(out relative error, lse error) for the benchmark harness: the outputs meet the exact paths' bound;
        the lse moves with |lse| (~1e-3 of it, e4m3 tensor-core accumulation), so it is reported, not bounded."""
        return (1e-2, float("inf"))


register(TritonFP8())
