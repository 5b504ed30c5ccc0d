"""Index conversion kernel: request-local top-k positions -> rows of a paged cache.

Semantics are those of ``indices.convert_indices_torch`` (the reference), entry by entry:
    row = block_table[req, pos // block_size] * block_stride_rows + pos % block_size
-1 stays -1; a position whose block lies outside the request's table (``pos // block_size >=
max_blocks``) or whose table entry is negative becomes -1, and so does every entry of a token whose
request id is not a row of the table (the kernel never reads outside its tensors); with ``workspace_start`` a request ``r``
with ``workspace_start[r] >= 0`` maps position ``pos`` to ``workspace_start[r] + pos`` instead.
Valid count of a row = the length of the shortest prefix holding all its valid entries; ``compact``
moves the valid entries to a prefix, order kept, -1 after them.

Tiling: one program per query token; it walks the token's K entries in chunks of ``BLOCK`` (a
power of two up to 1024, so K = 2051 -> 2112-wide rows cost three chunks).  Compacting needs each
valid entry's rank among the valid entries of its row: a first pass counts the valid entries, the
second writes entry ``k`` to ``carry + (inclusive prefix count within the chunk) - 1`` and -1 to every
position at or past the total.  The two sets of destinations never overlap, so no ordering between
threads is needed.  The entries are recomputed in the second pass (block-table reads hit L1/L2)
instead of being read back from the output, which another thread may be rewriting.

No host synchronisation, and no allocation when the outputs are given (``out=``, ``counts_out=``):
capturable in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import host_entry
from .launch import Launch, direct_context

CONVERT_MAX_BLOCK = 1024
CONVERT_NUM_WARPS = 4


@triton.jit
def _rows_of_chunk(topk_row, stride_tk, k, K, bt_row, stride_bb, max_blocks, req_ok, ws, block_stride_rows,
                   BLOCK_SIZE: tl.constexpr, HAS_WS: tl.constexpr):
    """Rows (int64, -1 = none) of the entries ``k`` (a chunk of column indices) of one token, whose
    top-k row starts at ``topk_row`` and whose block-table row starts at ``bt_row`` (``req_ok``: the
    token's request is a row of the table; otherwise every entry reads as -1)."""
    in_k = k < K
    pos = tl.load(topk_row + k * stride_tk, mask=in_k, other=-1).to(tl.int64)
    # (a tensor compare instead of ``& req_ok``: some interpreters mishandle tensor & scalar masks)
    pos = tl.where(pos < tl.where(req_ok, 1 << 62, 0), pos, -1)
    blk = pos // BLOCK_SIZE
    in_table = (pos >= 0) & (blk < max_blocks)
    phys = tl.load(bt_row + blk * stride_bb, mask=in_table, other=-1).to(tl.int64)
    ok = in_table & (phys >= 0)
    rows = tl.where(ok, phys * block_stride_rows + pos % BLOCK_SIZE, -1)
    if HAS_WS:
        # A request staged contiguously in a prefill workspace: its positions index the workspace.
        rows = tl.where(ws >= 0, tl.where(pos >= 0, ws + pos, -1), rows)
    return rows


@triton.jit
def _convert_indices_kernel(
    topk_ptr, stride_tt, stride_tk,        # [T, K] int32/int64 request-local positions
    req_ptr,                               # [T] request of each token
    bt_ptr, stride_br, stride_bb,          # [R, max_blocks] block table
    ws_ptr,                                # [R] workspace starts (unused unless HAS_WS)
    out_ptr, stride_ot,                    # [T, K] int32 rows, unit column stride
    cnt_ptr,                               # [T] int32 valid counts (unused unless COUNTS)
    K, R, max_blocks, block_stride_rows,
    BLOCK_SIZE: tl.constexpr, HAS_WS: tl.constexpr, COMPACT: tl.constexpr, COUNTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    req_ok = (req >= 0) & (req < R)            # a request id outside the table: every entry -1
    bt_row = bt_ptr + tl.where(req_ok, req, 0) * stride_br
    ws = 0
    if HAS_WS:
        ws = tl.load(ws_ptr + tl.where(req_ok, req, 0)).to(tl.int64)
        ws = tl.where(req_ok, ws, -1)
    topk_row = topk_ptr + t * stride_tt
    out_row = out_ptr + t * stride_ot
    offs = tl.arange(0, BLOCK)
    if COMPACT:
        total = 0
        for k0 in range(0, K, BLOCK):
            rows = _rows_of_chunk(topk_row, stride_tk, k0 + offs, K, bt_row, stride_bb, max_blocks, req_ok, ws,
                                  block_stride_rows, BLOCK_SIZE, HAS_WS)
            total += tl.sum((rows >= 0).to(tl.int32), axis=0)
        carry = 0
        for k0 in range(0, K, BLOCK):
            k = k0 + offs
            rows = _rows_of_chunk(topk_row, stride_tk, k, K, bt_row, stride_bb, max_blocks, req_ok, ws,
                                  block_stride_rows, BLOCK_SIZE, HAS_WS)
            valid = rows >= 0
            rank = carry + tl.cumsum(valid.to(tl.int32), axis=0) - 1
            tl.store(out_row + rank, rows.to(tl.int32), mask=valid)
            tl.store(out_row + k, tl.full([BLOCK], -1, tl.int32), mask=(k >= total) & (k < K))
            carry += tl.sum(valid.to(tl.int32), axis=0)
        count = total
    else:
        count = 0
        for k0 in range(0, K, BLOCK):
            k = k0 + offs
            rows = _rows_of_chunk(topk_row, stride_tk, k, K, bt_row, stride_bb, max_blocks, req_ok, ws,
                                  block_stride_rows, BLOCK_SIZE, HAS_WS)
            tl.store(out_row + k, rows.to(tl.int32), mask=k < K)
            count = tl.maximum(count, tl.max(tl.where(rows >= 0, k + 1, 0), axis=0))
    if COUNTS:
        tl.store(cnt_ptr + t, count.to(tl.int32))


def convert_indices_triton(topk_local: torch.Tensor, req_id_per_token: torch.Tensor, block_table: torch.Tensor,
                           block_size: int = 64, block_stride_rows: Optional[int] = None,
                           return_valid_counts: bool = False, compact: bool = False,
                           workspace_start: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                           counts_out: Optional[torch.Tensor] = None):
    """The Triton launcher of ``indices.convert_indices``, without argument checks: callers validate once
    (``convert_indices`` does on every call; a runner does at construction and plan time).

    Args:
        topk_local: int32/int64 ``[T, K]`` request-local positions, -1 padded (any strides).
        req_id_per_token: int32/int64 ``[T]`` row of ``block_table`` of each token.
        block_table: int32/int64 ``[R, max_blocks]`` physical block ids (negative = none; any strides).
        block_size, block_stride_rows: cache geometry.
        return_valid_counts: also return int32 ``[T]`` valid counts.
        compact: valid entries to a prefix, order kept.
        workspace_start: optional int ``[R]``; see the module docstring.
        out: optional int32 ``[T, K]`` with unit column stride, written in place.
        counts_out: optional int32 ``[T]`` contiguous, the valid counts written in place.

    Returns int32 ``[T, K]`` rows (and int32 ``[T]`` valid counts).  One launch, no host sync.
    """
    if block_stride_rows is None:
        block_stride_rows = block_size
    t, k = topk_local.shape
    dev = topk_local.device
    if out is None:
        out = torch.empty((t, k), dtype=torch.int32, device=dev)
    counts = None
    if return_valid_counts:
        counts = counts_out if counts_out is not None else torch.empty((t,), dtype=torch.int32, device=dev)
    if t and k:
        req = req_id_per_token if req_id_per_token.stride()[0] == 1 else req_id_per_token.contiguous()
        has_ws = workspace_start is not None
        ws = (workspace_start if workspace_start.stride()[0] == 1 else workspace_start.contiguous()) if has_ws else req
        meta = (block_size, has_ws, compact, return_valid_counts, k)
        launch = _LAUNCHES.get(meta)
        if launch is None:
            block = min(triton.next_power_of_2(k), CONVERT_MAX_BLOCK)
            launch = _LAUNCHES[meta] = Launch(
                _convert_indices_kernel, dict(BLOCK_SIZE=block_size, HAS_WS=has_ws, COMPACT=bool(compact),
                                              COUNTS=bool(return_valid_counts), BLOCK=block),
                dict(num_warps=CONVERT_NUM_WARPS))
        ts, bs, bshape = topk_local.stride(), block_table.stride(), block_table.shape
        cnt = out if counts is None else counts
        ints = (ts[0], ts[1], bs[0], bs[1], out.stride()[0], k, bshape[0], bshape[1], block_stride_rows)
        # the launcher takes tensors as addresses; read once, they also give the alignment check: every pointer
        # 16-byte aligned, the integers (and the index dtypes) decide Triton's specialization
        pt, pr, pb, pw, po, pc = (topk_local.data_ptr(), req.data_ptr(), block_table.data_ptr(), ws.data_ptr(),
                                  out.data_ptr(), cnt.data_ptr())
        key = None if (pt | pr | pb | pw | po | pc) & 15 else (topk_local.dtype, req.dtype, block_table.dtype,
                                                               ws.dtype, ints)
        tail = (k, bshape[0], bshape[1], block_stride_rows)
        addrs = (pt, ts[0], ts[1], pr, pb, bs[0], bs[1], pw, po, ints[4], pc, *tail)
        direct = launch((t,), (topk_local, ts[0], ts[1], req, block_table, bs[0], bs[1], ws, out, ints[4], cnt, *tail),
                        key, addrs)
        rec = host_entry.active()
        if rec is not None:  # a runner's call the compiled host entry records: topk_local is its per-call tensor
            if direct:
                ctx = direct_context()
                rec.add(launch.compiled(ctx, key), (t, 1, 1), ctx[1], addrs, {0: "topk"}, {"topk": pt})
            else:
                rec.ok = False
    elif counts is not None:
        counts.zero_()
    if return_valid_counts:
        return out, counts
    return out


_LAUNCHES: dict = {}

__all__ = ["convert_indices_triton"]
