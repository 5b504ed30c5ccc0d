"""``triton-staged``: the compatibility path.  Gather each query's top-k rows into FP8 (``e4m3(x / k_scale)``,
what a plain ``fp8`` cache would hold), then run the kernel that reads staged FP8 rows.

The staging buffer is ``[tokens, K, head_dim]`` bytes; tokens go through it in chunks so it stays under
``STAGING_BUDGET`` bytes (a runner allocates it once; the functional path per call).
"""
from __future__ import annotations

import torch

from ..formats import get_format
from ..kernels.attention import attention_fwd, plan_for
from ..kernels.staging import gather_topk_fp8
from ._common import ensure_outputs, kv_rows
from .registry import Backend
from .triton_native import SplitBuffers, device_why_not

STAGING_BUDGET = 256 * 2 ** 20  # bytes of staged rows at once


def _chunk_tokens(topk: int, head_dim: int, num_tokens: int) -> int:
    return max(1, min(num_tokens, STAGING_BUDGET // max(1, topk * head_dim)))


class _StagedWorkspace:
    def __init__(self, spec):
        self.splits = SplitBuffers(spec, staged=True)
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

    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        rows, fmt = kv_rows(kv)
        out, lse = ensure_outputs(q, out, lse)
        t, k = q.shape[0], indices.shape[1]
        chunk = workspace.chunk if workspace is not None else _chunk_tokens(k, fmt.head_dim, t)
        for t0 in range(0, t, chunk):
            t1 = min(t, t0 + chunk)
            vc = None if valid_counts is None else valid_counts[t0:t1]
            buf = None if workspace is None else workspace.staged[: t1 - t0]
            staged = gather_topk_fp8(rows, fmt, indices[t0:t1], vc, k_scale, out=buf)
            fp8 = get_format("fp8", fmt.rope_dim)
            rows8 = staged.view(torch.uint8).view(-1, fmt.head_dim)
            qt = q[t0:t1]
            plan = plan_for(qt, rows8, fp8, k, staged=True)
            attention_fwd(qt, rows8, fp8, indices[t0:t1], sm_scale, plan=plan, valid_counts=vc, k_scale=k_scale,
                          out=out[t0:t1], lse=lse[t0:t1], staged=True,
                          split_buffers=None if workspace is None else workspace.splits.buffer)
        return out, lse

    def make_workspace(self, spec):
        return _StagedWorkspace(spec)

