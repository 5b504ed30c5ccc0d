import triton
import triton.language as tl
from asmconv import e4m3x2_to_f16_pair
from sparsemla.kernels.sparse_attention import _program_coords, _tile_rows, _pow2_fp16_scale, _finish, _NEG_BIG, _softmax_step, _store_chunk


@triton.jit
def _qk_pv_group(qe, qo, base, dcol, vmask):
    pass


@triton.jit
def _fwd_fp8ds_w_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                        o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                        sm_scale_log2, H, K, rows_per_split,
                        BPT: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, NUM_SPLITS, NG, HB, HAS_VC)
    c64 = tl.arange(0, 64)  # int16 column = dim pair
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + 2 * c64[None, :]
    qe0 = tl.load(q_row, mask=hm[:, None], other=0.0).to(tl.float32)
    qo0 = tl.load(q_row + 1, mask=hm[:, None], other=0.0).to(tl.float32)
    qe1 = tl.load(q_row + 128, mask=hm[:, None], other=0.0).to(tl.float32)
    qo1 = tl.load(q_row + 129, mask=hm[:, None], other=0.0).to(tl.float32)
    qe2 = tl.load(q_row + 256, mask=hm[:, None], other=0.0).to(tl.float32)
    qo2 = tl.load(q_row + 257, mask=hm[:, None], other=0.0).to(tl.float32)
    qe3 = tl.load(q_row + 384, mask=hm[:, None], other=0.0).to(tl.float32)
    qo3 = tl.load(q_row + 385, mask=hm[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.abs(qe0)), tl.max(tl.abs(qo0))),
                                 tl.maximum(tl.max(tl.abs(qe1)), tl.max(tl.abs(qo1)))),
                      tl.maximum(tl.maximum(tl.max(tl.abs(qe2)), tl.max(tl.abs(qo2))),
                                 tl.maximum(tl.max(tl.abs(qe3)), tl.max(tl.abs(qo3)))))
    c = _pow2_fp16_scale(amax)
    qe0 = (qe0 * c).to(tl.float16)
    qo0 = (qo0 * c).to(tl.float16)
    qe1 = (qe1 * c).to(tl.float16)
    qo1 = (qo1 * c).to(tl.float16)
    qe2 = (qe2 * c).to(tl.float16)
    qo2 = (qo2 * c).to(tl.float16)
    qe3 = (qe3 * c).to(tl.float16)
    qo3 = (qo3 * c).to(tl.float16)
    nope_scale = sm_scale_log2 / c
    if ROPE:
        r = tl.arange(0, 64)
        qpe = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + 512 + r[None, :],
                      mask=hm[:, None], other=0.0)
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    ae0 = tl.zeros([HB, 64], tl.float32)
    ao0 = tl.zeros([HB, 64], tl.float32)
    ae1 = tl.zeros([HB, 64], tl.float32)
    ao1 = tl.zeros([HB, 64], tl.float32)
    ae2 = tl.zeros([HB, 64], tl.float32)
    ao2 = tl.zeros([HB, 64], tl.float32)
    ae3 = tl.zeros([HB, 64], tl.float32)
    ao3 = tl.zeros([HB, 64], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        kp = base.to(tl.pointer_type(tl.int16))[:, None] + c64[None, :]
        ke0, ko0 = e4m3x2_to_f16_pair(tl.load(kp, mask=vmask, other=0))
        ke1, ko1 = e4m3x2_to_f16_pair(tl.load(kp + 64, mask=vmask, other=0))
        ke2, ko2 = e4m3x2_to_f16_pair(tl.load(kp + 128, mask=vmask, other=0))
        ke3, ko3 = e4m3x2_to_f16_pair(tl.load(kp + 192, mask=vmask, other=0))
        sp = (base + 512).to(tl.pointer_type(tl.float32))
        sc0 = tl.load(sp, mask=valid, other=0.0)
        sc1 = tl.load(sp + 1, mask=valid, other=0.0)
        sc2 = tl.load(sp + 2, mask=valid, other=0.0)
        sc3 = tl.load(sp + 3, mask=valid, other=0.0)
        sc = ((tl.dot(qe0, tl.trans(ke0)) + tl.dot(qo0, tl.trans(ko0))) * sc0[None, :]
              + (tl.dot(qe1, tl.trans(ke1)) + tl.dot(qo1, tl.trans(ko1))) * sc1[None, :]
              + (tl.dot(qe2, tl.trans(ke2)) + tl.dot(qo2, tl.trans(ko2))) * sc2[None, :]
              + (tl.dot(qe3, tl.trans(ke3)) + tl.dot(qo3, tl.trans(ko3))) * sc3[None, :]) * nope_scale
        if ROPE:
            kpe = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=vmask, other=0.0)
            sc += tl.dot(qpe, tl.trans(kpe)) * sm_scale_log2
        sc = tl.where(valid[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        mx0 = tl.maximum(tl.max(sc0), 1e-30)
        mx1 = tl.maximum(tl.max(sc1), 1e-30)
        mx2 = tl.maximum(tl.max(sc2), 1e-30)
        mx3 = tl.maximum(tl.max(sc3), 1e-30)
        p0 = (p * (sc0 / mx0)[None, :]).to(tl.float16)
        p1 = (p * (sc1 / mx1)[None, :]).to(tl.float16)
        p2 = (p * (sc2 / mx2)[None, :]).to(tl.float16)
        p3 = (p * (sc3 / mx3)[None, :]).to(tl.float16)
        a2 = alpha[:, None]
        ae0 = ae0 * a2 + tl.dot(p0, ke0) * mx0
        ao0 = ao0 * a2 + tl.dot(p0, ko0) * mx0
        ae1 = ae1 * a2 + tl.dot(p1, ke1) * mx1
        ao1 = ao1 * a2 + tl.dot(p1, ko1) * mx1
        ae2 = ae2 * a2 + tl.dot(p2, ke2) * mx2
        ao2 = ao2 * a2 + tl.dot(p2, ko2) * mx2
        ae3 = ae3 * a2 + tl.dot(p3, ke3) * mx3
        ao3 = ao3 * a2 + tl.dot(p3, ko3) * mx3
    inv_l, lse = _finish(l_i, m_i)
    il = inv_l[:, None]
    e = 2 * c64
    _store_chunk(o_ptr, t, s, heads, hm, e, ae0 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 1, ao0 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 128, ae1 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 129, ao1 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 256, ae2 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 257, ao2 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 384, ae3 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 385, ao3 * il, stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)
