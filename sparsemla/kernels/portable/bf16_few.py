"""Portable sparse MLA attention over bf16 rows (a bf16 cache, or the prefill workspace) at up to 32 heads per
program (mma.sync): bf16 operands straight from memory, four 128-deep dots for QK and four [HB, 128]
accumulators for PV."""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (NEG_BIG, bf16_operand, finish, program_coords, softmax_step, store_chunk, tile_rows)


@triton.jit
def bf16_few_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                     o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                     sm_scale_log2, H, K, rows_per_split, num_splits,
                     ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                     NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    D: tl.constexpr = 512 + ROPE
    t, s, heads, hm, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 128)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q0 = bf16_operand(tl.load(q_row, mask=hm[:, None], other=0.0), INTERP)
    q1 = bf16_operand(tl.load(q_row + 128, mask=hm[:, None], other=0.0), INTERP)
    q2 = bf16_operand(tl.load(q_row + 256, mask=hm[:, None], other=0.0), INTERP)
    q3 = bf16_operand(tl.load(q_row + 384, mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        r = tl.arange(0, 64)
        qpe = bf16_operand(tl.load(qr_ptr + t.to(tl.int64) * stride_rt + heads[:, None] * stride_rh + r[None, :],
                                    mask=hm[:, None], other=0.0), INTERP)
    m_i = tl.full([HB], NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc0 = tl.zeros([HB, 128], tl.float32)
    acc1 = tl.zeros([HB, 128], tl.float32)
    acc2 = tl.zeros([HB, 128], tl.float32)
    acc3 = tl.zeros([HB, 128], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        vmask = valid[:, None]
        # 16-byte aligned rows (see fp8_few_kernel); the hint gives 16-byte loads.
        rp = tl.multiple_of(kv_ptr.to(tl.pointer_type(tl.bfloat16)) + row * D, 16)
        kp = rp[:, None] + d[None, :]
        k_0 = bf16_operand(tl.load(kp, mask=vmask, other=0.0), INTERP)
        k_1 = bf16_operand(tl.load(kp + 128, mask=vmask, other=0.0), INTERP)
        k_2 = bf16_operand(tl.load(kp + 256, mask=vmask, other=0.0), INTERP)
        k_3 = bf16_operand(tl.load(kp + 384, mask=vmask, other=0.0), INTERP)
        sc = tl.dot(q0, tl.trans(k_0)) + tl.dot(q1, tl.trans(k_1)) + tl.dot(q2, tl.trans(k_2)) \
            + tl.dot(q3, tl.trans(k_3))
        if ROPE:
            kpe = bf16_operand(tl.load(rp[:, None] + 512 + r[None, :], mask=vmask, other=0.0), INTERP)
            sc += tl.dot(qpe, tl.trans(kpe))
        sc = tl.where(valid[None, :], sc * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(sc, m_i, l_i)
        pc = bf16_operand(p.to(tl.bfloat16), INTERP)
        al = alpha[:, None]
        acc0 = tl.dot(pc, k_0, acc0 * al)
        acc1 = tl.dot(pc, k_1, acc1 * al)
        acc2 = tl.dot(pc, k_2, acc2 * al)
        acc3 = tl.dot(pc, k_3, acc3 * al)

    inv_l, lse = finish(l_i, m_i)
    il = inv_l[:, None]
    store_chunk(o_ptr, t, s, heads, hm, d, acc0 * il, stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, d + 128, acc1 * il, stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, d + 256, acc2 * il, stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, d + 384, acc3 * il, stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)

