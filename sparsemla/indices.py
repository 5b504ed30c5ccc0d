"""Index conversion: request-local top-k positions -> rows of a paged cache, and the pooled-indexer helpers.

Row rule (``kv-formats.md`` §7): ``row = block_table[req, pos // block_size] * block_stride_rows + pos % block_size``.
-1 stays -1; a position whose block lies outside the request's block table (``pos // block_size >=
block_table.shape[1]``, or a negative table entry) becomes -1.

``convert_indices`` runs one Triton kernel on CUDA tensors (``kernels/convert_indices.py``) and the
PyTorch code below elsewhere; both give identical results.  It runs every layer of every step, so a
default call checks only what the host knows (shapes, dtypes, devices: no sync), writes into the
caller's buffers when given (``out=``, ``counts_out=``: no allocation) and is capturable in a CUDA graph;
``check=True`` is a debug option that also checks index values (a device sync).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._validate import check_block_geometry, check_positive_int, check_tensor
from ._device import triton_runs_on
from .kernels.convert_indices import convert_indices_triton

_INT = (torch.int32, torch.int64)


def _check_convert_args(topk_local, req_id_per_token, block_table, block_size, block_stride_rows, workspace_start,
                        out, counts_out, return_valid_counts):
    check_tensor("topk_local", topk_local, dtypes=_INT, ndim=2)
    dev = topk_local.device
    t, k = topk_local.shape
    check_tensor("req_id_per_token", req_id_per_token, dtypes=_INT, shape=(t,), device=dev)
    check_tensor("block_table", block_table, dtypes=_INT, ndim=2, device=dev)
    block_stride_rows = check_block_geometry(block_size, block_stride_rows)
    if workspace_start is not None:
        check_tensor("workspace_start", workspace_start, dtypes=_INT, shape=(block_table.shape[0],), device=dev)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(t, k), device=dev)
        if k > 1 and out.stride(1) != 1:
            raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    if counts_out is not None:
        if not return_valid_counts:
            raise ValueError("counts_out: given without return_valid_counts=True")
        check_tensor("counts_out", counts_out, dtype=torch.int32, shape=(t,), device=dev, contiguous=True)
    return block_stride_rows


def convert_indices(topk_local: torch.Tensor, req_id_per_token: torch.Tensor, block_table: torch.Tensor,
                    block_size: int = 64, block_stride_rows: Optional[int] = None,
                    return_valid_counts: bool = False, *, compact: bool = False,
                    workspace_start: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                    counts_out: Optional[torch.Tensor] = None, check: bool = False):
    """Convert request-local top-k positions to cache rows.

    Args:
        topk_local: int32 / int64 ``[T, K]`` positions in ``[0, seq_len)`` of the token's request, -1 padded.
        req_id_per_token: int32 / int64 ``[T]`` request of each query token (row of ``block_table``).
        block_table: int32 / int64 ``[R, max_blocks]`` physical block ids per request (negative = none).
        block_size, block_stride_rows: cache geometry (``PagedKVCache.block_size`` / ``.block_stride_rows``).
        return_valid_counts: also return int32 ``[T]``, the length of the shortest prefix that holds
            every valid entry (0 for a row with none).  Without ``compact`` a -1 may sit inside it.
        compact: move the valid entries of each row to a prefix, keeping their order (-1 after).
        workspace_start: optional int ``[R]``; a request ``r`` with ``workspace_start[r] >= 0`` is staged
            contiguously in a prefill workspace and its tokens get ``workspace_start[r] + pos``.
        out: optional int32 ``[T, K]`` (unit column stride), the rows written in place.
        counts_out: optional int32 ``[T]`` contiguous, the valid counts written in place (with
            ``return_valid_counts``).
        check: debug option: raise for a position below -1 or a request id outside the block table
            (reads the tensors on the host: one device sync).  Default False: no sync; a request id
            outside the table is the caller's contract (the runner checks it on the host at plan time).

    Returns:
        int32 ``[T, K]`` rows (``out`` when given), and int32 ``[T]`` valid counts when asked.
    """
    block_stride_rows = _check_convert_args(topk_local, req_id_per_token, block_table, block_size,
                                            block_stride_rows, workspace_start, out, counts_out, return_valid_counts)
    if check:
        _check_values(topk_local, req_id_per_token, block_table)
    if triton_runs_on(topk_local.device):
        return convert_indices_triton(topk_local, req_id_per_token, block_table, block_size, block_stride_rows,
                                      return_valid_counts, compact, workspace_start, out, counts_out)
    res = convert_indices_torch(topk_local, req_id_per_token, block_table, block_size, block_stride_rows,
                                return_valid_counts, compact, workspace_start)
    rows, counts = res if return_valid_counts else (res, None)
    if out is not None:
        rows = out.copy_(rows)
    if counts_out is not None:
        counts = counts_out.copy_(counts)
    return (rows, counts) if return_valid_counts else rows


def _check_values(topk_local, req_id_per_token, block_table) -> None:
    if topk_local.numel():
        lo = int(topk_local.min())
        if lo < -1:
            raise ValueError(f"topk_local: entries must be -1 (padding) or >= 0, found {lo}")
    if req_id_per_token.numel():
        lo, hi = int(req_id_per_token.min()), int(req_id_per_token.max())
        if lo < 0 or hi >= block_table.shape[0]:
            raise ValueError(f"req_id_per_token: entries must be in [0, {block_table.shape[0]}) "
                             f"(rows of block_table), found range [{lo}, {hi}]")


def convert_indices_torch(topk_local, req_id_per_token, block_table, block_size=64, block_stride_rows=None,
                          return_valid_counts=False, compact=False, workspace_start=None):
    """The PyTorch implementation (the reference for the kernel).  Same arguments as ``convert_indices``
    (without the output buffers); a token whose request id is not a row of ``block_table`` gets -1 rows,
    as in the kernel."""
    if block_stride_rows is None:
        block_stride_rows = block_size
    pos = topk_local.to(torch.int64)
    n_req, max_blocks = block_table.shape
    req = req_id_per_token.to(torch.int64)
    req_ok = ((req >= 0) & (req < n_req))[:, None]
    req = torch.where(req_ok[:, 0], req, torch.zeros_like(req))
    blk_idx = torch.div(pos, block_size, rounding_mode="floor")
    in_table = (pos >= 0) & (blk_idx < max_blocks) & req_ok
    safe_blk_idx = torch.where(in_table, blk_idx, torch.zeros_like(blk_idx))
    if max_blocks and n_req:
        phys = block_table.to(torch.int64)[req[:, None], safe_blk_idx]
    else:
        phys = torch.full_like(pos, -1)
    ok = in_table & (phys >= 0)
    rows = phys * block_stride_rows + (pos % block_size)
    rows = torch.where(ok, rows, torch.full_like(rows, -1))
    if workspace_start is not None:
        ws = workspace_start.to(torch.int64)[req][:, None] if n_req else torch.full_like(pos[:, :1], -1)
        staged = (ws >= 0) & req_ok
        rows = torch.where(staged, torch.where(pos >= 0, ws + pos, torch.full_like(pos, -1)), rows)
    valid = rows >= 0
    if compact:
        # A stable sort of "invalid" flags moves valid entries to the front in their order.
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
        rows = torch.gather(rows, 1, order)
        valid = rows >= 0
    rows = rows.to(torch.int32)
    if not return_valid_counts:
        return rows
    k = rows.shape[1]
    ar = torch.arange(1, k + 1, device=rows.device, dtype=torch.int32)
    counts = torch.where(valid, ar, torch.zeros_like(ar)).amax(dim=1) if k else \
        torch.zeros(rows.shape[0], dtype=torch.int32, device=rows.device)
    return rows, counts.to(torch.int32)


# --- pooled indexers (kv-formats.md §7) -----------------------------------------------------------

def pooled_width(index_topk: int, kpool: int, tile: int = 64) -> int:
    """Width of a pooled top-k row: ``index_topk + kpool - 1`` rounded up to a multiple of ``tile``."""
    check_positive_int("index_topk", index_topk)
    check_positive_int("kpool", kpool)
    w = index_topk + kpool - 1
    return -(-w // tile) * tile


def pooled_valid_counts(context_lens: torch.Tensor, index_topk: int, kpool: int) -> torch.Tensor:
    """Valid count of each query: ``c`` when ``c <= index_topk``, else ``index_topk + c % kpool``.

    context_lens: int ``[T]`` context length (tokens visible) of each query token.  Returns int32 ``[T]``.
    """
    check_tensor("context_lens", context_lens, dtypes=_INT, ndim=1)
    check_positive_int("index_topk", index_topk)
    check_positive_int("kpool", kpool)
    if index_topk % kpool:
        raise ValueError(f"index_topk: expected a multiple of kpool ({kpool}), got {index_topk}")
    c = context_lens.to(torch.int64)
    return torch.where(c <= index_topk, c, index_topk + c % kpool).to(torch.int32)


def expand_pooled_topk(pool_topk: torch.Tensor, context_lens: torch.Tensor, kpool: int,
                       width: Optional[int] = None) -> torch.Tensor:
    """Expand chosen pools to token positions and append the unfinished tail pool.

    Args:
        pool_topk: int ``[T, P]`` chosen complete pools (pool ``p`` = positions ``[p*kpool, p*kpool+kpool)``),
            -1 padded, valid entries first.  ``P * kpool`` is the index top-k.
        context_lens: int ``[T]`` tokens visible to each query; only complete pools (``(p+1)*kpool <= c``)
            may be chosen, the tail ``[c - c % kpool, c)`` is appended after them.
        kpool: tokens per pool.
        width: output width; default ``pooled_width(P * kpool, kpool)``.

    Returns int32 ``[T, width]`` request-local positions, valid prefix then -1.  Runs on any device with
    no host synchronisation (usable inside a CUDA graph).
    """
    check_tensor("pool_topk", pool_topk, dtypes=_INT, ndim=2)
    t, p = pool_topk.shape
    check_tensor("context_lens", context_lens, dtypes=_INT, shape=(t,), device=pool_topk.device)
    check_positive_int("kpool", kpool)
    if width is None:
        width = pooled_width(max(p * kpool, 1), kpool)
    check_positive_int("width", width)
    if width < p * kpool + kpool - 1:
        raise ValueError(f"width: expected >= {p * kpool + kpool - 1} (P*kpool + kpool - 1), got {width}")
    dev = pool_topk.device
    pools = pool_topk.to(torch.int64)
    c = context_lens.to(torch.int64)
    j = torch.arange(kpool, device=dev, dtype=torch.int64)
    # Complete pools: each valid pool id -> kpool consecutive positions, in the pools' order.
    expanded = (pools[:, :, None] * kpool + j).reshape(t, p * kpool)
    pool_ok = (pools >= 0) & ((pools + 1) * kpool <= c[:, None])
    expanded = torch.where(pool_ok.repeat_interleave(kpool, dim=1), expanded, torch.full_like(expanded, -1))
    # Valid pools form a prefix, so the tail starts right after them.
    n_pool_pos = pool_ok.sum(dim=1) * kpool
    out = torch.full((t, width), -1, dtype=torch.int64, device=dev)
    out[:, : p * kpool] = expanded
    tail_len = c % kpool
    tail_start = c - tail_len
    jj = torch.arange(kpool - 1, device=dev, dtype=torch.int64) if kpool > 1 else torch.zeros(0, dtype=torch.int64, device=dev)
    if kpool > 1:
        tail_pos = tail_start[:, None] + jj
        tail_pos = torch.where(jj[None, :] < tail_len[:, None], tail_pos, torch.full_like(tail_pos, -1))
        # Scatter the tail right after the valid pools; invalid tail slots go to a dump column we then drop.
        cols = n_pool_pos[:, None] + jj
        cols = torch.where(tail_pos >= 0, cols, torch.full_like(cols, width))
        buf = torch.cat([out, torch.full((t, 1), -1, dtype=torch.int64, device=dev)], dim=1)
        buf.scatter_(1, cols, torch.where(tail_pos >= 0, tail_pos, torch.full_like(tail_pos, -1)))
        out = buf[:, :width]
    return out.to(torch.int32)


__all__ = ["convert_indices", "convert_indices_torch", "pooled_width", "pooled_valid_counts", "expand_pooled_topk"]
