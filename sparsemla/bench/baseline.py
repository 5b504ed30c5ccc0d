"""The PyTorch floor of ``docs/benchmarking.md``: gather the selected rows, then two batched matmuls.

Always available, no custom kernel: the number any kernel must beat by far.  It reads a bf16
cache as it is (a bf16 row is 576 bf16 values); other formats would first need the format's
PyTorch decoder, which measures that decoder rather than attention, so the floor is timed on bf16
caches only (``why_not`` says so).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference.attention import valid_mask

V_DIM = 512


def why_not(problem) -> Optional[str]:
    """None when the floor applies to ``problem`` (a bench ``Problem``), else why not."""
    if problem.fmt.name != "bf16":
        return "the PyTorch floor is measured on bf16 caches only (other formats would time their decoder)"
    return None


def torch_gather_attention(q: torch.Tensor, cache, indices: torch.Tensor, sm_scale: float,
                           valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0):
    """q bf16 ``[T, H, D]``, a bf16 ``PagedKVCache``, indices int ``[T, K]`` -> (out bf16 ``[T, H, 512]``,
    lse fp32 ``[T, H]``).  Scores in fp32, probabilities rounded to q's dtype for the second matmul."""
    d = cache.fmt.head_dim
    table = cache.rows.view(torch.bfloat16).view(-1, d)          # [num_rows, D], no copy
    mask = valid_mask(indices, valid_counts)                       # [T, K]
    kv = table[torch.where(mask, indices, torch.zeros_like(indices)).long()]  # [T, K, D]
    s = torch.bmm(q.to(kv.dtype), kv.transpose(1, 2)).float() * sm_scale      # [T, H, K]
    s.masked_fill_(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # An empty row has lse -inf; subtracting 0 there keeps exp(-inf) = 0 instead of NaN.
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.bmm(p.to(kv.dtype), kv[..., :V_DIM])
    return out.to(q.dtype), lse


__all__ = ["torch_gather_attention", "why_not"]
