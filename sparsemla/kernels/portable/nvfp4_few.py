"""Portable sparse MLA attention over ``nvfp4_ds_mla`` rows at up to 32 heads per program (mma.sync).

A row: 256 bytes of packed e2m1 (dim 2k in the low nibble of byte k), 64 e4m3 RoPE values (rope rows) and 32
permuted e4m3 block scales at byte ``SCALE_OFF``.  An int16 lane c holds dims 4c..4c+3, so the 512 dims are four
fp16 ``[BN, 128]`` tiles of "dim = 4c + j" (no interleaving: q and the output are split the same way once per
program).  An e2m1 value times its e4m3 block scale has at most 5 significant bits and lies in [2^-13, 2688]:
the product is exact in fp16.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (NEG_BIG, amax_strided, e2m1x4_to_f16, e4m3x2_to_f16, finish, load_q_f16, nvfp4_lane_scales, pow2_fp16_scale, program_coords, softmax_step, store_chunk, tile_rows)


@triton.jit
def nvfp4_few_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                      o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                      sm_scale_log2, H, K, rows_per_split, num_splits,
                      BPT: tl.constexpr, ROPE: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr,
                     HB: tl.constexpr, BN: tl.constexpr,
                      NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    c128 = tl.arange(0, 128)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    qe_row = qr_ptr + t.to(tl.int64) * stride_rt + heads[:, None] * stride_rh  # the rope part (ROPE)
    amax = tl.max(tl.abs(tl.load(q_row + tl.arange(0, 512)[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))
    if ROPE:
        r = tl.arange(0, 32)
        amax = tl.maximum(amax, amax_strided(qe_row, hm, tl.arange(0, 64), 0, 1))
    c = pow2_fp16_scale(amax)
    f = 4 * c128
    q0 = load_q_f16(q_row, hm, 0, f, c)
    q1 = load_q_f16(q_row, hm, 1, f, c)
    q2 = load_q_f16(q_row, hm, 2, f, c)
    q3 = load_q_f16(q_row, hm, 3, f, c)
    if ROPE:
        qpe_e = load_q_f16(qe_row, hm, 0, 2 * r, c)
        qpe_o = load_q_f16(qe_row, hm, 1, 2 * r, c)
    score_scale = sm_scale_log2 / c

    m_i = tl.full([HB], NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    a0 = tl.zeros([HB, 128], tl.float32)
    a1 = tl.zeros([HB, 128], tl.float32)
    a2 = tl.zeros([HB, 128], tl.float32)
    a3 = tl.zeros([HB, 128], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        packed = tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + c128[None, :], mask=vmask, other=0)
        sf = nvfp4_lane_scales(base, vmask, SCALE_OFF, BN)
        k0_, k1_, k2_, k3_ = e2m1x4_to_f16(packed, INTERP)
        k0_ = k0_ * sf
        k1_ = k1_ * sf
        k2_ = k2_ * sf
        k3_ = k3_ * sf
        sc = tl.dot(q0, tl.trans(k0_)) + tl.dot(q1, tl.trans(k1_)) + tl.dot(q2, tl.trans(k2_)) \
            + tl.dot(q3, tl.trans(k3_))
        if ROPE:
            kpe_e, kpe_o = e4m3x2_to_f16(tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + ROPE_OFF // 2 + r[None, :],
                                                  mask=vmask, other=0), INTERP)
            sc += tl.dot(qpe_e, tl.trans(kpe_e)) + tl.dot(qpe_o, tl.trans(kpe_o))
        sc = tl.where(valid[None, :], sc * score_scale, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(sc, m_i, l_i)
        p16 = p.to(tl.float16)
        al = alpha[:, None]
        a0 = tl.dot(p16, k0_, a0 * al)
        a1 = tl.dot(p16, k1_, a1 * al)
        a2 = tl.dot(p16, k2_, a2 * al)
        a3 = tl.dot(p16, k3_, a3 * al)

    inv_l, lse = finish(l_i, m_i)
    il = inv_l[:, None]
    store_chunk(o_ptr, t, s, heads, hm, f, a0 * il, stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, f + 1, a1 * il, stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, f + 2, a2 * il, stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, f + 3, a3 * il, stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)
