"""``reference``: the float64 reference (``sparsemla.reference.sparse_mla``) behind the backend interface.

Serves everything on any device; slow, allocates, and reads index ranges on the host, so it is never
captured in a CUDA graph.  The default on CPU, and the last resort elsewhere.
"""
from __future__ import annotations

from ..reference import sparse_mla
from .registry import Backend


class Reference(Backend):
    name = "reference"
    description = "float64 reference over decoded rows (any device; slow)"
    device_types = ("cuda", "cpu")
    graph_safe = False
    device_valid_counts = True
    mixed_batches = True

    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        o, l = sparse_mla(q, kv, indices, sm_scale, valid_counts=valid_counts, k_scale=k_scale)
        if out is None:
            out = o
        else:
            out.copy_(o)
        if lse is None:
            lse = l
        else:
            lse.copy_(l)
        return out, lse

