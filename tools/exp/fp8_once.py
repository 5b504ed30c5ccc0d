"""Experiment: the fp8-family decode kernel with each K tile converted ONCE.

The library kernel splits each 128-dim group into even/odd fp16 tiles straight from the packed cvt; Triton
then keeps the int16 lanes in shared memory and converts after each of the two operand loads (QK and PV).
Here the two halves are joined back into natural order (``tl.join`` + ``tl.reshape``) right after the
conversion: join/reshape are not elementwise, so the operand-layout conversion cannot be hoisted above the
cvt, and the fp16 tile itself goes through shared memory (converted once, read twice)."""
import triton
import triton.language as tl

from sparsemla.kernels.sparse_attention import (_NEG_BIG, _finish, _load_q_f16, _pow2_fp16_scale,
                                                _program_coords, _softmax_step, _store_chunk, _tile_rows)


@triton.jit
def _e4m3x2_to_f16(x, INTERP: tl.constexpr):
    """As the library's, but NOT pure: Triton may not clone it per use (rematerialization), so the tile is
    converted once."""
    if INTERP:
        lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = ((x >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, hi
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 r;
            cvt.rn.f16x2.e4m3x2 r, $2;
            mov.b32 {$0, $1}, r;
            }""",
            constraints="=h,=h,h", args=[x], dtype=(tl.float16, tl.float16), is_pure=PURE, pack=1)


PURE = tl.constexpr(False)


@triton.jit
def _group_nat(kp, vmask, g: tl.constexpr, BN: tl.constexpr, INTERP: tl.constexpr):
    lo, hi = _e4m3x2_to_f16(tl.load(kp + 64 * g, mask=vmask, other=0), INTERP)
    return tl.reshape(tl.join(lo, hi), [BN, 128])


@triton.jit
def _v_fp8_once(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                BPT: tl.constexpr, DS: tl.constexpr, STAGED: tl.constexpr, ROPE: tl.constexpr,
                HB: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    c64 = tl.arange(0, 64)
    c128 = tl.arange(0, 128)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    amax = tl.max(tl.abs(tl.load(q_row + tl.arange(0, 512)[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))
    if ROPE:
        if DS:
            qpe = tl.load(q_row + 512 + c64[None, :], mask=hm[:, None], other=0.0)
            if INTERP:
                qpe = qpe.to(tl.float32)
        else:
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(q_row + 512 + c64[None, :], mask=hm[:, None],
                                                          other=0.0).to(tl.float32))))
    c = _pow2_fp16_scale(amax)
    q0 = _load_q_f16(q_row, hm, 0, c128, c)
    q1 = _load_q_f16(q_row, hm, 128, c128, c)
    q2 = _load_q_f16(q_row, hm, 256, c128, c)
    q3 = _load_q_f16(q_row, hm, 384, c128, c)
    if ROPE and not DS:
        qpe8 = _load_q_f16(q_row, hm, 512, c64, c)
    score_scale = sm_scale_log2 / c
    if not DS:
        score_scale = score_scale * k_scale

    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    a0 = tl.zeros([HB, 128], tl.float32)
    a1 = tl.zeros([HB, 128], tl.float32)
    a2 = tl.zeros([HB, 128], tl.float32)
    a3 = tl.zeros([HB, 128], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, STAGED)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        kp = base.to(tl.pointer_type(tl.int16))[:, None] + c64[None, :]
        k_0 = _group_nat(kp, vmask, 0, BN, INTERP)
        k_1 = _group_nat(kp, vmask, 1, BN, INTERP)
        k_2 = _group_nat(kp, vmask, 2, BN, INTERP)
        k_3 = _group_nat(kp, vmask, 3, BN, INTERP)
        d0 = tl.dot(q0, tl.trans(k_0))
        d1 = tl.dot(q1, tl.trans(k_1))
        d2 = tl.dot(q2, tl.trans(k_2))
        d3 = tl.dot(q3, tl.trans(k_3))
        if DS:
            sp = (base + 512).to(tl.pointer_type(tl.float32))
            sc0 = tl.load(sp, mask=valid, other=0.0)
            sc1 = tl.load(sp + 1, mask=valid, other=0.0)
            sc2 = tl.load(sp + 2, mask=valid, other=0.0)
            sc3 = tl.load(sp + 3, mask=valid, other=0.0)
            sc = (d0 * sc0[None, :] + d1 * sc1[None, :] + d2 * sc2[None, :] + d3 * sc3[None, :]) * score_scale
            if ROPE:
                kpe = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + c64[None, :],
                              mask=vmask, other=0.0)
                if INTERP:
                    kpe = kpe.to(tl.float32)
                sc += tl.dot(qpe, tl.trans(kpe)) * sm_scale_log2
        else:
            sc = d0 + d1 + d2 + d3
            if ROPE:
                lo, hi = _e4m3x2_to_f16(tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + 256
                                                + tl.arange(0, 32)[None, :], mask=vmask, other=0), INTERP)
                sc += tl.dot(qpe8, tl.trans(tl.reshape(tl.join(lo, hi), [BN, 64])))
            sc = sc * score_scale
        sc = tl.where(valid[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        al = alpha[:, None]
        if DS:
            mx0 = tl.maximum(tl.max(sc0), 1e-30)
            mx1 = tl.maximum(tl.max(sc1), 1e-30)
            mx2 = tl.maximum(tl.max(sc2), 1e-30)
            mx3 = tl.maximum(tl.max(sc3), 1e-30)
            a0 = a0 * al + tl.dot((p * (sc0 / mx0)[None, :]).to(tl.float16), k_0) * mx0
            a1 = a1 * al + tl.dot((p * (sc1 / mx1)[None, :]).to(tl.float16), k_1) * mx1
            a2 = a2 * al + tl.dot((p * (sc2 / mx2)[None, :]).to(tl.float16), k_2) * mx2
            a3 = a3 * al + tl.dot((p * (sc3 / mx3)[None, :]).to(tl.float16), k_3) * mx3
        else:
            p16 = p.to(tl.float16)
            a0 = tl.dot(p16, k_0, a0 * al)
            a1 = tl.dot(p16, k_1, a1 * al)
            a2 = tl.dot(p16, k_2, a2 * al)
            a3 = tl.dot(p16, k_3, a3 * al)

    inv_l, lse = _finish(l_i, m_i)
    if not DS:
        inv_l = inv_l * k_scale
    il = inv_l[:, None]
    _store_chunk(o_ptr, t, s, heads, hm, c128, a0 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, c128 + 128, a1 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, c128 + 256, a2 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, c128 + 384, a3 * il, stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)
