"""Float64 reference of sparse MLA attention over decoded rows.

For query token ``t`` and head ``h`` with selected rows ``r_1..r_n`` (valid entries of ``indices[t]``):

    s_k  = sm_scale * q[t, h, :D] . K[r_k, :D]        (D = head_dim, 576 or 512)
    lse  = log sum_k exp(s_k)                          (natural log, sm_scale included)
    out  = sum_k exp(s_k - lse) * K[r_k, :512]         (values are the first 512 latent dims)

A query with no valid entry gives ``out = 0`` and ``lse = -inf``.  Rows are read with ``fmt.decode``, so
every layout of a format is covered (a NoPE row's RoPE slot is not read).  A selected row that decodes to
NaN anywhere (a group written from non-finite input, ``formats/base.py``) makes that query's ``out`` and ``lse``
NaN for every head; no other query is affected (entries that are not selected are never mixed in).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._validate import check_k_scale, check_sm_scale, check_tensor
from ..cache import PagedKVCache

V_DIM = 512


def _rows_source(kv):
    """(num_rows, head_dim, function rows(int64 [n]) -> float64 [n, head_dim])."""
    if isinstance(kv, PagedKVCache):
        fmt = kv.fmt
        return kv.num_rows, fmt.head_dim, lambda r, ks: fmt.decode(kv.rows[r], ks).to(torch.float64)
    if isinstance(kv, torch.Tensor):
        check_tensor("kv", kv, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64), ndim=2)
        if kv.shape[1] not in (576, 512):
            raise ValueError(f"kv: expected a workspace [rows, 576 or 512], got {tuple(kv.shape)}")
        return kv.shape[0], kv.shape[1], lambda r, ks: kv[r].to(torch.float64)
    raise TypeError(f"kv: expected a PagedKVCache or a [rows, head_dim] tensor, got {type(kv).__name__}")


def valid_mask(indices: torch.Tensor, valid_counts: Optional[torch.Tensor]) -> torch.Tensor:
    """bool ``[T, K]``: entry is a token (not -1 and inside the valid count)."""
    mask = indices >= 0
    if valid_counts is not None:
        k = torch.arange(indices.shape[1], device=indices.device)
        mask &= k[None, :] < valid_counts.to(indices.device)[:, None]
    return mask


def sparse_mla(q: torch.Tensor, cache: Union[PagedKVCache, torch.Tensor], indices: torch.Tensor, sm_scale: float,
               valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0, *, chunk_tokens: int = 8):
    """Reference sparse MLA.

    Args:
        q: ``[T, H, head_dim]`` (any float dtype).
        cache: a :class:`PagedKVCache` (rows decoded with its format) or a ``[rows, head_dim]`` workspace.
        indices: int ``[T, K]`` rows of ``cache.rows`` (or of the workspace), -1 = no token.
        sm_scale: softmax scale.
        valid_counts: optional int ``[T]``; entries at or past it are ignored whatever they hold.
        k_scale: the per-tensor scale of the plain ``fp8`` format (other formats ignore it).
        chunk_tokens: tokens per float64 chunk (bounds memory).

    Returns:
        out ``[T, H, 512]`` in q's dtype, lse float32 ``[T, H]``.
    """
    sm_scale = check_sm_scale(sm_scale)
    k_scale = check_k_scale(k_scale)
    num_rows, head_dim, fetch = _rows_source(cache)
    check_tensor("q", q, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64), ndim=3)
    t, h, d = q.shape
    if d != head_dim:
        raise ValueError(f"q: expected head_dim {head_dim} (the cache's), got shape {tuple(q.shape)}")
    check_tensor("indices", indices, dtypes=(torch.int32, torch.int64), ndim=2, device=q.device)
    if indices.shape[0] != t:
        raise ValueError(f"indices: expected {t} rows (one per query token), got shape {tuple(indices.shape)}")
    if valid_counts is not None:
        check_tensor("valid_counts", valid_counts, dtypes=(torch.int32, torch.int64), shape=(t,), device=q.device)
    mask = valid_mask(indices, valid_counts)
    if mask.any():
        sel = indices[mask]
        lo, hi = int(sel.min()), int(sel.max())
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"indices: valid entries must be in [0, {num_rows}) (rows of the cache), "
                             f"found range [{lo}, {hi}]")
    out = torch.zeros((t, h, V_DIM), dtype=torch.float64, device=q.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64, device=q.device)
    for t0 in range(0, t, chunk_tokens):
        t1 = min(t, t0 + chunk_tokens)
        idx = indices[t0:t1].to(torch.int64)
        m = mask[t0:t1]
        safe = torch.where(m, idx, torch.zeros_like(idx))
        kv = fetch(safe.reshape(-1), k_scale).reshape(t1 - t0, -1, head_dim)  # [t, K, D]
        # Masked entries fetched row 0 as a stand-in; zero them so that garbage there (NaN codes) cannot leak.
        kv = torch.where(m[..., None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
        s = torch.einsum("thd,tkd->thk", q[t0:t1].to(torch.float64), kv) * sm_scale
        s = s.masked_fill(~m[:, None, :], float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # -inf for empty rows
        p = torch.exp(s - torch.where(torch.isfinite(l), l, torch.zeros_like(l))[..., None])
        p = torch.where(m[:, None, :], p, torch.zeros_like(p))
        out[t0:t1] = torch.einsum("thk,tkd->thd", p, kv[..., :V_DIM])
        lse[t0:t1] = l
    return out.to(q.dtype), lse.to(torch.float32)
