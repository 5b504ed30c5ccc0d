"""Step packing kernel: one engine step's batch metadata into a runner's buffers, with each token's valid count.

What ``SparseMLA.plan`` needs on the device for a batch whose tensors are already there, in one launch (instead of
a dozen copies, fills and element-wise ops, each a launch):

- ``block_table[:R]``: the step's block table, -1 past its ``width`` columns up to the buffer's ``B``;
- ``query_start_loc[:R + 1]`` and ``seq_lens[:R]``: copies;
- ``req_id[:max_tokens]`` and ``valid_counts[:max_tokens]``: for the step's tokens ``i < T`` their request and
  valid count, 0 for every token slot past them (a padded or captured larger run reads nothing there).

Valid count of token ``i`` of request ``r`` (kv-formats.md §7): it sees ``ctx = seq_lens[r] - (query_start_loc[r
+ 1] - 1 - i)`` context tokens; its top-k row holds ``min(ctx, index_topk)`` entries, or ``index_topk + ctx %
kpool`` past ``index_topk`` when the indexer pools ``kpool`` tokens, clamped to ``[0, topk]``.  A token whose
request id is not in ``[0, R)`` gets request 0 and count 0 (nothing is read outside the tensors).

One program per block-table row and per ``BLOCK`` token slots (``max(R, ceil(max_tokens / BLOCK))`` programs).
No host synchronization; capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch

BLOCK = 256


@triton.jit
def _step_pack_kernel(qsl_ptr, seq_ptr, bt_ptr, stride_br, stride_bb, req_ptr,  # the step's int32 metadata
                      d_qsl_ptr, d_seq_ptr, d_bt_ptr, d_req_ptr, d_vc_ptr,       # the runner's int32 buffers
                      R, T, width, B, max_tokens, index_topk, kpool, topk,
                      BLOCK: tl.constexpr):
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if p < R:
        row = p.to(tl.int64)
        for c0 in range(0, B, BLOCK):
            c = c0 + offs
            v = tl.load(bt_ptr + row * stride_br + c * stride_bb, mask=c < width, other=-1)
            tl.store(d_bt_ptr + row * B + c, v, mask=c < B)
        tl.store(d_seq_ptr + p, tl.load(seq_ptr + p))
        tl.store(d_qsl_ptr + p, tl.load(qsl_ptr + p))
        if p == R - 1:
            tl.store(d_qsl_ptr + R, tl.load(qsl_ptr + R))
    i = p * BLOCK + offs
    live = i < T
    req = tl.load(req_ptr + i, mask=live, other=0)
    live = live & (req >= 0) & (req < R)
    req = tl.where(live, req, 0)
    seq = tl.load(seq_ptr + req, mask=live, other=0)
    end = tl.load(qsl_ptr + req + 1, mask=live, other=0)
    ctx = seq - (end - 1 - i)
    cnt = tl.where(ctx <= index_topk, ctx, index_topk + ctx % kpool)
    cnt = tl.where(live, tl.minimum(tl.maximum(cnt, 0), topk), 0)
    in_buf = i < max_tokens
    tl.store(d_req_ptr + i, req, mask=in_buf)
    tl.store(d_vc_ptr + i, cnt, mask=in_buf)


_LAUNCH = None


def step_pack(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              req_id_per_token: torch.Tensor, num_tokens: int, *, out_query_start_loc: torch.Tensor,
              out_seq_lens: torch.Tensor, out_block_table: torch.Tensor, out_req_id: torch.Tensor,
              out_valid_counts: torch.Tensor, index_topk: int, kpool: int, topk: int) -> None:
    """Pack one step (arguments are not checked: the runner validated them).

    Args:
        query_start_loc: int32 ``[R + 1]``; seq_lens: int32 ``[R]``; block_table: int32 ``[R, width]`` (any
            strides); req_id_per_token: int32 ``[>= num_tokens]`` contiguous; num_tokens: T.
        out_*: the runner's contiguous int32 buffers: ``[>= R + 1]``, ``[>= R]``, ``[>= R, B]`` (row stride B),
            ``[max_tokens]``, ``[max_tokens]``.
        index_topk, kpool, topk: the valid-count rule (module docstring).
    """
    global _LAUNCH
    r, width = block_table.shape
    max_tokens = out_req_id.shape[0]
    if _LAUNCH is None:
        _LAUNCH = Launch(_step_pack_kernel, dict(BLOCK=BLOCK), dict(num_warps=4))
    bs = block_table.stride()
    grid = (max(r, -(-max_tokens // BLOCK)),)
    _LAUNCH(grid, (query_start_loc, seq_lens, block_table, bs[0], bs[1], req_id_per_token, out_query_start_loc,
                   out_seq_lens, out_block_table, out_req_id, out_valid_counts, r, num_tokens, width,
                   out_block_table.shape[1], max_tokens, index_topk, kpool, topk))


__all__ = ["step_pack"]
