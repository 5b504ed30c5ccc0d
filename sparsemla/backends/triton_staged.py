"""``triton-staged``: the compatibility path.  Gather each query's top-k rows into FP8 (``e4m3(x / k_scale)``,
what a plain ``fp8`` cache would hold), then run the kernel that reads staged FP8 rows.

The staging buffer is ``[tokens, K, head_dim]`` bytes; tokens go through it in chunks so it stays under
``STAGING_BUDGET`` bytes (a runner allocates it once; the functional path per call).
"""
from __future__ import annotations

import torch

from ._common import ensure_outputs, kv_rows
from .registry import Backend, register
from .triton_native import SplitBuffers, device_why_not, probe_native

STAGING_BUDGET = 256 * 2 ** 20  # bytes of staged rows at once


def _chunk_tokens(topk: int, head_dim: int, num_tokens: int) -> int:
    return max(1, min(num_tokens, STAGING_BUDGET // max(1, topk * head_dim)))


class _StagedWorkspace:
    def __init__(self, spec):
        self.splits = SplitBuffers(spec, kind="staged")
        self.chunk = _chunk_tokens(spec.topk, spec.fmt.head_dim, spec.max_tokens)
        self.staged = torch.empty((self.chunk, spec.topk, spec.fmt.head_dim), dtype=torch.float8_e4m3fn,
                                  device=spec.device)


class TritonStaged(Backend):
    name = "triton-staged"
    description = "top-k FP8 staging gather, then a Triton kernel over FP8 rows (the compatibility path)"
    device_types = ("cuda", "cpu")
    min_capability = (8, 9)  # the staged rows are e4m3 whatever the cache format
    max_topk = 32768
    graph_safe = True
    device_valid_counts = True

    def _extra_why_not(self, c):
        return device_why_not(c)

    def _probe(self, config):
        reason = probe_native(("sparse_mla_fwd_staged", "plan_splits", "split_buffer_shapes"))
        if reason is not None:
            return reason
        try:
            from ..kernels import staging
        except Exception as exc:
            return f"the staging kernel module sparsemla.kernels.staging does not import ({type(exc).__name__}: {exc})"
        if not callable(getattr(staging, "gather_topk_fp8", None)):
            return "sparsemla.kernels.staging has no gather_topk_fp8"
        return None

    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        from ..kernels.sparse_attention import sparse_mla_fwd_staged
        from ..kernels.staging import gather_topk_fp8

        rows, fmt = kv_rows(kv)
        out, lse = ensure_outputs(q, out, lse)
        t, k = q.shape[0], indices.shape[1]
        chunk = workspace.chunk if workspace is not None else _chunk_tokens(k, fmt.head_dim, t)
        for t0 in range(0, t, chunk):
            t1 = min(t, t0 + chunk)
            vc = None if valid_counts is None else valid_counts[t0:t1]
            buf = None if workspace is None else workspace.staged[: t1 - t0]
            staged = gather_topk_fp8(rows, fmt, indices[t0:t1], vc, k_scale, out=buf)
            ns, bufs = (None, None) if workspace is None else workspace.splits.for_tokens(t1 - t0)
            sparse_mla_fwd_staged(q[t0:t1], staged, indices[t0:t1], sm_scale, valid_counts=vc, k_scale=k_scale,
                                  out=out[t0:t1], lse=lse[t0:t1], num_splits=ns, split_buffers=bufs)
        return out, lse

    def make_workspace(self, spec):
        return _StagedWorkspace(spec)


register(TritonStaged())
