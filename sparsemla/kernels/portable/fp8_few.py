"""Portable sparse MLA attention over e4m3 rows at up to 32 heads per program (mma.sync): plain ``fp8`` rows
(per-tensor ``k_scale``), FP8 rows staged per query (``[T, K, D]``) and ``fp8_ds_mla`` rows (four fp32 tile
scales, bf16 RoPE).

Each 128-dim group g of a row is an int16 ``[BN, 64]`` tile, converted to an even-dim and an odd-dim fp16 tile
(e4m3 -> fp16 is exact).  q is brought into fp16 range by a per-token power of two ``c`` (exact), divided back
out of the scores.  fp8_ds_mla's tile scales multiply the scores per column, never the elements; for PV, P is
multiplied per column by ``scale / tile_max`` (a ratio <= 1, a power of two for the pow2 writer) and each group's
accumulator is kept divided by the previous tile's ``tile_max``, so the rescale stays one multiply and the dot
accumulates in place.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (NEG_BIG, amax_strided, e4m3x2_to_f16, finish, load_q_f16, pow2_fp16_scale, program_coords, softmax_step, store_chunk, tile_rows)


@triton.jit
def _fp8_group(kp, vmask, g: tl.constexpr, INTERP: tl.constexpr):
    return e4m3x2_to_f16(tl.load(kp + 64 * g, mask=vmask, other=0), INTERP)


@triton.jit
def _split4(x):
    """[..., 4] -> its four columns [...]."""
    a02, a13 = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))  # (col 0, col 2), (col 1, col 3)
    c0, c2 = tl.split(a02)
    c1, c3 = tl.split(a13)
    return c0, c1, c2, c3


@triton.jit
def _join4(c0, c1, c2, c3):
    """Four scalars -> a [4] vector (inverse of ``_split4``)."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [4])


@triton.jit
def fp8_few_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                    o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                    sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                    BPT: tl.constexpr, DS: tl.constexpr, STAGED: tl.constexpr, ROPE: tl.constexpr,
                   SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr,
                    HB: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                    HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    c64 = tl.arange(0, 64)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    qe_row = qr_ptr + t.to(tl.int64) * stride_rt + heads[:, None] * stride_rh  # the rope part (ROPE)
    amax = tl.max(tl.abs(tl.load(q_row + tl.arange(0, 512)[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))
    if ROPE:
        r = tl.arange(0, 32)
        if DS:
            qpe = tl.load(qe_row + tl.arange(0, 64)[None, :], mask=hm[:, None], other=0.0)
            if INTERP:
                qpe = qpe.to(tl.float32)
        else:
            amax = tl.maximum(amax, amax_strided(qe_row, hm, tl.arange(0, 64), 0, 1))
    c = pow2_fp16_scale(amax)
    e = 2 * c64
    qe0 = load_q_f16(q_row, hm, 0, e, c)
    qo0 = load_q_f16(q_row, hm, 1, e, c)
    qe1 = load_q_f16(q_row, hm, 128, e, c)
    qo1 = load_q_f16(q_row, hm, 129, e, c)
    qe2 = load_q_f16(q_row, hm, 256, e, c)
    qo2 = load_q_f16(q_row, hm, 257, e, c)
    qe3 = load_q_f16(q_row, hm, 384, e, c)
    qo3 = load_q_f16(q_row, hm, 385, e, c)
    if ROPE and not DS:
        qpe_e = load_q_f16(qe_row, hm, 0, 2 * r, c)
        qpe_o = load_q_f16(qe_row, hm, 1, 2 * r, c)
    score_scale = sm_scale_log2 / c
    if not DS:
        score_scale = score_scale * k_scale

    m_i = tl.full([HB], NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    ae0 = tl.zeros([HB, 64], tl.float32)
    ao0 = tl.zeros([HB, 64], tl.float32)
    ae1 = tl.zeros([HB, 64], tl.float32)
    ao1 = tl.zeros([HB, 64], tl.float32)
    ae2 = tl.zeros([HB, 64], tl.float32)
    ao2 = tl.zeros([HB, 64], tl.float32)
    ae3 = tl.zeros([HB, 64], tl.float32)
    ao3 = tl.zeros([HB, 64], tl.float32)
    # fp8_ds_mla: the factors f_g the PV accumulators of group g are held divided by (see below)
    f0 = sm_scale_log2 * 0.0 + 1.0
    f1 = f0
    f2 = f0
    f3 = f0
    for k0 in range(k_begin, k_end, BN):
        row, valid = tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, STAGED)
        # Rows are 16-byte multiples and the cache is 16-byte aligned; Triton cannot see that through a
        # gathered index, and without the hint every load is one byte wide.
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        kp = base.to(tl.pointer_type(tl.int16))[:, None] + c64[None, :]
        ke0, ko0 = _fp8_group(kp, vmask, 0, INTERP)
        ke1, ko1 = _fp8_group(kp, vmask, 1, INTERP)
        ke2, ko2 = _fp8_group(kp, vmask, 2, INTERP)
        ke3, ko3 = _fp8_group(kp, vmask, 3, INTERP)
        d0 = tl.dot(qe0, tl.trans(ke0)) + tl.dot(qo0, tl.trans(ko0))
        d1 = tl.dot(qe1, tl.trans(ke1)) + tl.dot(qo1, tl.trans(ko1))
        d2 = tl.dot(qe2, tl.trans(ke2)) + tl.dot(qo2, tl.trans(ko2))
        d3 = tl.dot(qe3, tl.trans(ke3)) + tl.dot(qo3, tl.trans(ko3))
        if DS:
            # fp8_ds_mla: the tile scales multiply the scores per column, never the elements.
            # the four tile scales of each row: one 16-byte load, split into [BN] columns
            sc4 = tl.load((base + SCALE_OFF).to(tl.pointer_type(tl.float32))[:, None] + tl.arange(0, 4)[None, :],
                          mask=vmask, other=0.0)
            sc0, sc1, sc2, sc3 = _split4(sc4)
            sc = (d0 * sc0[None, :] + d1 * sc1[None, :] + d2 * sc2[None, :] + d3 * sc3[None, :]) * score_scale
            if ROPE:
                kpe = tl.load((base + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :],
                              mask=vmask, other=0.0)
                if INTERP:
                    kpe = kpe.to(tl.float32)
                sc += tl.dot(qpe, tl.trans(kpe)) * sm_scale_log2
        else:
            sc = d0 + d1 + d2 + d3
            if ROPE:
                kpe_e, kpe_o = e4m3x2_to_f16(
                    tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + ROPE_OFF // 2 + r[None, :], mask=vmask, other=0),
                    INTERP)
                sc += tl.dot(qpe_e, tl.trans(kpe_e)) + tl.dot(qpe_o, tl.trans(kpe_o))
            sc = sc * score_scale
        sc = tl.where(valid[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(sc, m_i, l_i)
        a2 = alpha[:, None]
        if DS:
            # Value scales go into P as ratios <= 1 to the tile's largest scale mx (fp16-safe; exact for
            # the pow2 writer).  Group g's accumulator holds its value divided by f_g, the previous
            # tile's mx, so the rescale is one multiply by alpha * f_g / mx_g and the dot accumulates in
            # place (no separate multiply-add of each dot by mx).  A tile without a positive scale
            # (no valid row) keeps f_g.  One [4] reduction gives all four maxima.
            mxr = tl.max(sc4, 0)
            mx0, mx1, mx2, mx3 = _split4(tl.where(mxr > 0, mxr, _join4(f0, f1, f2, f3)))
            p0 = (p * (sc0 / mx0)[None, :]).to(tl.float16)
            p1 = (p * (sc1 / mx1)[None, :]).to(tl.float16)
            p2 = (p * (sc2 / mx2)[None, :]).to(tl.float16)
            p3 = (p * (sc3 / mx3)[None, :]).to(tl.float16)
            r0 = a2 * (f0 / mx0)
            r1 = a2 * (f1 / mx1)
            r2 = a2 * (f2 / mx2)
            r3 = a2 * (f3 / mx3)
            ae0 = tl.dot(p0, ke0, ae0 * r0)
            ao0 = tl.dot(p0, ko0, ao0 * r0)
            ae1 = tl.dot(p1, ke1, ae1 * r1)
            ao1 = tl.dot(p1, ko1, ao1 * r1)
            ae2 = tl.dot(p2, ke2, ae2 * r2)
            ao2 = tl.dot(p2, ko2, ao2 * r2)
            ae3 = tl.dot(p3, ke3, ae3 * r3)
            ao3 = tl.dot(p3, ko3, ao3 * r3)
            f0 = mx0
            f1 = mx1
            f2 = mx2
            f3 = mx3
        else:
            p16 = p.to(tl.float16)
            ae0 = tl.dot(p16, ke0, ae0 * a2)
            ao0 = tl.dot(p16, ko0, ao0 * a2)
            ae1 = tl.dot(p16, ke1, ae1 * a2)
            ao1 = tl.dot(p16, ko1, ao1 * a2)
            ae2 = tl.dot(p16, ke2, ae2 * a2)
            ao2 = tl.dot(p16, ko2, ao2 * a2)
            ae3 = tl.dot(p16, ke3, ae3 * a2)
            ao3 = tl.dot(p16, ko3, ao3 * a2)

    inv_l, lse = finish(l_i, m_i)
    if not DS:
        inv_l = inv_l * k_scale  # values were stored divided by k_scale
    il = inv_l[:, None]
    store_chunk(o_ptr, t, s, heads, hm, e, ae0 * (il * f0), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 1, ao0 * (il * f0), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 128, ae1 * (il * f1), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 129, ao1 * (il * f1), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 256, ae2 * (il * f2), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 257, ao2 * (il * f2), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 384, ae3 * (il * f3), stride_ot, stride_os, stride_oh)
    store_chunk(o_ptr, t, s, heads, hm, e + 385, ao3 * (il * f3), stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)
