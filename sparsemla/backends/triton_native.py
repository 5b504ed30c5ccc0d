"""``triton``: the native kernels, which read every KV format straight from the paged cache.

Calls ``sparsemla.kernels.sparse_attention.sparse_mla_fwd``.  In a runner the split-KV partial buffers
are preallocated once (:class:`SplitBuffers`), so a call launches kernels only and can be captured.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels._runtime import interpreting
from ._common import ensure_outputs, kv_rows
from .registry import AttentionConfig, Backend, RunnerSpec, register

# Formats whose rows hold e4m3 bytes: Triton converts e4m3 only on compute capability >= 8.9.
_E4M3_FORMATS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")


def _kernels():
    from ..kernels import sparse_attention
    return sparse_attention


def probe_native(names) -> Optional[str]:
    try:
        mod = _kernels()
    except Exception as exc:  # ImportError, or a Triton error at import
        return f"the native kernel module sparsemla.kernels.sparse_attention does not import ({type(exc).__name__}: {exc})"
    missing = [n for n in names if not callable(getattr(mod, n, None))]
    if missing:
        return f"sparsemla.kernels.sparse_attention has no {', '.join(missing)}"
    return None


def device_why_not(c: AttentionConfig) -> Optional[str]:
    """Rules shared by both Triton backends."""
    if c.device_type == "cpu" and not interpreting():
        return "it runs on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1)"
    if c.device_type == "cuda" and c.capability is not None and tuple(c.capability) < (8, 9) \
            and c.fmt.name in _E4M3_FORMATS:
        return f"reading {c.fmt.id} rows needs e4m3 conversions, which Triton has only on compute capability >= 8.9"
    return None


class SplitBuffers:
    """Preallocated fp32 split-KV partials for every token count up to ``max_tokens``.

    The split factor is a pure function of (tokens, heads, top-k), so the largest partial size over all
    token counts is known at construction; a call takes views of the front of two flat buffers."""

    def __init__(self, spec: RunnerSpec, kind: str = None):
        k = _kernels()
        self._plan = k.plan_splits
        self.kind = kind or spec.fmt.name  # the kernel kind the split plan is for ("staged" for staged rows)
        self._shapes = k.split_buffer_shapes
        self.num_heads, self.topk, self.device = spec.num_heads, spec.topk, spec.device
        cap_o = cap_l = 0
        for t in _token_counts(spec.max_tokens):
            s = self._plan(t, self.num_heads, self.topk, self.device, kind=self.kind)
            if s > 1:
                o, l = self._shapes(t, self.num_heads, s)
                cap_o, cap_l = max(cap_o, _numel(o)), max(cap_l, _numel(l))
        self.o_flat = torch.empty(cap_o, dtype=torch.float32, device=self.device)
        self.l_flat = torch.empty(cap_l, dtype=torch.float32, device=self.device)

    def for_tokens(self, t: int):
        """(num_splits, (o_part, lse_part) or None) for a call on ``t`` tokens."""
        s = self._plan(t, self.num_heads, self.topk, self.device, kind=self.kind)
        while s > 1:
            o, l = self._shapes(t, self.num_heads, s)
            if _numel(o) <= self.o_flat.numel() and _numel(l) <= self.l_flat.numel():
                return s, (self.o_flat[:_numel(o)].view(o), self.l_flat[:_numel(l)].view(l))
            s -= 1  # only when t was not among the sampled counts and needs more room: fewer splits fit
        return 1, None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _token_counts(max_tokens: int):
    """Every count up to 4096, then powers of two, then max_tokens (the split factor is 1 long before)."""
    seen = set(range(1, min(max_tokens, 4096) + 1))
    p = 4096
    while p < max_tokens:
        p *= 2
        seen.add(min(p, max_tokens))
    seen.add(max_tokens)
    return sorted(seen)


class TritonNative(Backend):
    name = "triton"
    description = "native Triton kernels: every KV format dequantized in registers, split-KV, any H 1..128"
    device_types = ("cuda", "cpu")
    min_capability = (8, 0)
    max_topk = 32768
    graph_safe = True
    device_valid_counts = True
    fp8_arith = False  # the opt-in FP8-arithmetic mode (the ``triton-fp8`` subclass)

    def _extra_why_not(self, c):
        return device_why_not(c)

    def _probe(self, config):
        return probe_native(("sparse_mla_fwd", "plan_splits", "split_buffer_shapes"))

    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        rows, fmt = kv_rows(kv)
        out, lse = ensure_outputs(q, out, lse)
        num_splits, bufs = (None, None) if workspace is None else workspace.for_tokens(q.shape[0])
        return _kernels().sparse_mla_fwd(q, rows, fmt, indices, sm_scale, valid_counts=valid_counts,
                                         k_scale=k_scale, out=out, lse=lse, num_splits=num_splits,
                                         split_buffers=bufs, fp8_arith=self.fp8_arith)

    def make_workspace(self, spec):
        return SplitBuffers(spec)


register(TritonNative())
