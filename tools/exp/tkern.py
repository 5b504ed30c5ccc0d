"""Experiment: tokens-as-M orientation (S^T = K Q^T, O^T = V^T P^T) for the fp8_ds_mla kernel."""
import triton
import triton.language as tl
from sparsemla.kernels.sparse_attention import _program_coords, _tile_rows, _pow2_fp16_scale, _finish, _NEG_BIG


@triton.jit
def _fwd_fp8ds_t_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                        o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                        sm_scale_log2, H, K, rows_per_split,
                        BPT: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, NUM_SPLITS, NG, HB, HAS_VC)
    d = tl.arange(0, 128)
    # q^T chunks [128, HB]
    q_col = q_ptr + t.to(tl.int64) * stride_qt + heads[None, :] * stride_qh + d[:, None]
    q0 = tl.load(q_col, mask=hm[None, :], other=0.0).to(tl.float32)
    q1 = tl.load(q_col + 128, mask=hm[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(q_col + 256, mask=hm[None, :], other=0.0).to(tl.float32)
    q3 = tl.load(q_col + 384, mask=hm[None, :], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0)), tl.max(tl.abs(q1))),
                      tl.maximum(tl.max(tl.abs(q2)), tl.max(tl.abs(q3))))
    c = _pow2_fp16_scale(amax)
    q0 = (q0 * c).to(tl.float16)
    q1 = (q1 * c).to(tl.float16)
    q2 = (q2 * c).to(tl.float16)
    q3 = (q3 * c).to(tl.float16)
    nope_scale = sm_scale_log2 / c
    if ROPE:
        r = tl.arange(0, 64)
        qpe = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[None, :] * stride_qh + 512 + r[:, None],
                      mask=hm[None, :], other=0.0)
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc0 = tl.zeros([128, HB], tl.float32)
    acc1 = tl.zeros([128, HB], tl.float32)
    acc2 = tl.zeros([128, HB], tl.float32)
    acc3 = tl.zeros([128, HB], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        kp = (base[:, None] + d[None, :]).to(tl.pointer_type(tl.float8e4nv))
        k_0 = tl.load(kp, mask=vmask, other=0.0).to(tl.float16)
        k_1 = tl.load(kp + 128, mask=vmask, other=0.0).to(tl.float16)
        k_2 = tl.load(kp + 256, mask=vmask, other=0.0).to(tl.float16)
        k_3 = tl.load(kp + 384, mask=vmask, other=0.0).to(tl.float16)
        sp = (base + 512).to(tl.pointer_type(tl.float32))
        sc0 = tl.load(sp, mask=valid, other=0.0)
        sc1 = tl.load(sp + 1, mask=valid, other=0.0)
        sc2 = tl.load(sp + 2, mask=valid, other=0.0)
        sc3 = tl.load(sp + 3, mask=valid, other=0.0)
        st = (tl.dot(k_0, q0) * sc0[:, None] + tl.dot(k_1, q1) * sc1[:, None]
              + tl.dot(k_2, q2) * sc2[:, None] + tl.dot(k_3, q3) * sc3[:, None]) * nope_scale
        if ROPE:
            kpe = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=vmask, other=0.0)
            if INTERP:
                st += tl.dot(kpe.to(tl.float32), qpe.to(tl.float32)) * sm_scale_log2
            else:
                st += tl.dot(kpe, qpe) * sm_scale_log2
        st = tl.where(valid[:, None], st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        mx0 = tl.maximum(tl.max(sc0), 1e-30)
        mx1 = tl.maximum(tl.max(sc1), 1e-30)
        mx2 = tl.maximum(tl.max(sc2), 1e-30)
        mx3 = tl.maximum(tl.max(sc3), 1e-30)
        acc0 = acc0 * alpha[None, :] + tl.dot(tl.trans(k_0), (p * (sc0 / mx0)[:, None]).to(tl.float16)) * mx0
        acc1 = acc1 * alpha[None, :] + tl.dot(tl.trans(k_1), (p * (sc1 / mx1)[:, None]).to(tl.float16)) * mx1
        acc2 = acc2 * alpha[None, :] + tl.dot(tl.trans(k_2), (p * (sc2 / mx2)[:, None]).to(tl.float16)) * mx2
        acc3 = acc3 * alpha[None, :] + tl.dot(tl.trans(k_3), (p * (sc3 / mx3)[:, None]).to(tl.float16)) * mx3
    inv_l, lse = _finish(l_i, m_i)
    o = o_ptr + t.to(tl.int64) * stride_ot + s * stride_os + heads[None, :] * stride_oh + d[:, None]
    tl.store(o, (acc0 * inv_l[None, :]).to(o_ptr.dtype.element_ty), mask=hm[None, :])
    tl.store(o + 128, (acc1 * inv_l[None, :]).to(o_ptr.dtype.element_ty), mask=hm[None, :])
    tl.store(o + 256, (acc2 * inv_l[None, :]).to(o_ptr.dtype.element_ty), mask=hm[None, :])
    tl.store(o + 384, (acc3 * inv_l[None, :]).to(o_ptr.dtype.element_ty), mask=hm[None, :])
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)
