"""The library's own kernels behind the backend interface.

- ``triton``: every KV format read natively; on Hopper the Gluon kernels where the plan takes them, the portable
  Triton kernels elsewhere (and where a Gluon kernel did not build on the installed Triton).
- ``triton-portable``: the portable Triton kernels only (any CUDA GPU, the CPU interpreter); a cross-check of the
  Hopper kernels and the fallback a user can name.
- ``triton-fp8qk``: the FP8-QK mode, opt-in (never chosen by ``auto``): on Hopper, fp8 / fp8_ds_mla rows, q split
  into two e4m3 terms (a power of two per head, and per 128-dim group at few heads; together exact for bf16 q but
  for its smallest elements) and QK on e4m3 tensor cores straight from the gathered bytes.  Its error is that of
  e4m3 tensor-core accumulation (about 14 significant bits) and grows with the scores: lse within ~1e-3 of |lse|;
  outputs within the default path's bounds where max|lse| <= 1,000, beyond that not guaranteed (a near tie
  between rows can swap; docs/reliability.md).

In a runner the split-KV partials live in one preallocated buffer (:class:`SplitBuffers`), so a call launches
kernels only and can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._device import interpreting
from ..kernels.attention import launch_call, runner_split_elements
from ..plan import unavailable_kernels
from ._common import ensure_outputs, kv_rows
from .registry import AttentionConfig, Backend, RunnerSpec

# Formats whose rows hold e4m3 bytes: Triton converts e4m3 only on compute capability >= 8.9.
_E4M3_FORMATS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")


def device_why_not(c: AttentionConfig) -> Optional[str]:
    """Rules every Triton backend shares."""
    if c.device_type == "cpu" and not interpreting():
        return "it runs on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1)"
    if c.device_type == "cuda" and c.capability is not None and tuple(c.capability) < (8, 9) \
            and c.fmt.name in _E4M3_FORMATS:
        return f"reading {c.fmt.id} rows needs e4m3 conversions, which Triton has only on compute capability >= 8.9"
    return None


class SplitBuffers:
    """One preallocated fp32 buffer for the split-KV partials of every call a runner can make (the largest
    ``tokens x splits x heads x 513`` over its token counts, for the Hopper and the portable plans alike)."""

    def __init__(self, spec: RunnerSpec, *, fp8_qk: bool = False, portable: bool = False, staged: bool = False):
        n = runner_split_elements(spec.fmt, spec.max_tokens, spec.num_heads, spec.topk, spec.device,
                                  fp8_qk=fp8_qk, portable=portable, staged=staged)
        self.buffer = torch.empty(max(n, 1), dtype=torch.float32, device=spec.device)


class TritonNative(Backend):
    name = "triton"
    description = "the library's kernels: every KV format dequantized in the kernel, split-KV, any H 1..128"
    device_types = ("cuda", "cpu")
    min_capability = (8, 0)
    max_topk = 32768
    graph_safe = True
    device_valid_counts = True
    fp8_qk = False
    portable = False

    def _extra_why_not(self, c):
        return device_why_not(c)

    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        rows, fmt = kv_rows(kv)
        if out is None or lse is None:
            out, lse = ensure_outputs(q, out, lse)
        launch_call(q, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse,
                    None if workspace is None else workspace.buffer, fp8_qk=self.fp8_qk, portable=self.portable)
        return out, lse

    def make_workspace(self, spec):
        return SplitBuffers(spec, fp8_qk=self.fp8_qk, portable=self.portable)


def launches_only(backend) -> bool:
    """Whether a call to ``backend`` is the launcher's launches alone, nothing else (what the compiled host entry,
    :mod:`sparsemla.host_entry`, records and replays)."""
    return type(backend).forward is TritonNative.forward


class TritonPortable(TritonNative):
    name = "triton-portable"
    description = "the portable Triton kernels only (any CUDA GPU with Triton, the CPU interpreter)"
    portable = True


class TritonFP8QK(TritonNative):
    name = "triton-fp8qk"
    description = ("opt-in FP8-QK mode (fp8 / fp8_ds_mla rows, Hopper): q as two e4m3 terms, QK on e4m3 tensor "
                   "cores; lse within ~1e-3 x |lse| of the reference")
    device_types = ("cuda",)
    min_capability = (9, 0)
    max_capability = (9, 0)
    formats = ("fp8", "fp8-nope", "fp8_ds_mla", "fp8_ds_mla-nope")
    kv_sources = ("cache",)
    fp8_qk = True

    def _extra_why_not(self, c):
        broken = unavailable_kernels()
        if "sm90-few" in broken or "sm90-wide" in broken:
            return f"its Gluon kernels did not build on the installed Triton ({'; '.join(broken.values())})"
        return device_why_not(c)

    def tolerance(self, fmt):
        """(out relative error, lse error) for the benchmark harness: the outputs meet the exact paths' bound;
        the lse moves with |lse| (e4m3 tensor-core accumulation), so it is reported, not bounded."""
        return (1e-2, float("inf"))
