import triton
import triton.language as tl
from asmconv import e4m3_to_f16_asm
from sparsemla.kernels.sparse_attention import _program_coords, _tile_rows, _pow2_fp16_scale, _finish, _NEG_BIG, _softmax_step, _store_chunk

@triton.jit
def _fwd_fp8ds_e_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                      o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                      sm_scale_log2, H, K, rows_per_split,
                      BPT: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, NUM_SPLITS, NG, HB, HAS_VC)
    d = tl.arange(0, 128)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q0 = tl.load(q_row, mask=hm[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(q_row + 128, mask=hm[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_row + 256, mask=hm[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(q_row + 384, mask=hm[:, None], other=0.0).to(tl.float32)
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
        qpe = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + 512 + r[None, :],
                      mask=hm[:, None], other=0.0)
        if INTERP:
            qpe = qpe.to(tl.float32)

    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc0 = tl.zeros([HB, 128], tl.float32)
    acc1 = tl.zeros([HB, 128], tl.float32)
    acc2 = tl.zeros([HB, 128], tl.float32)
    acc3 = tl.zeros([HB, 128], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        # Rows are 16-byte multiples and the cache is 16-byte aligned; Triton cannot see that through a
        # gathered index, and without the hint every load is one byte wide.
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        kp = base[:, None] + d[None, :]
        k_0 = e4m3_to_f16_asm(tl.load(kp, mask=vmask, other=0))
        k_1 = e4m3_to_f16_asm(tl.load(kp + 128, mask=vmask, other=0))
        k_2 = e4m3_to_f16_asm(tl.load(kp + 256, mask=vmask, other=0))
        k_3 = e4m3_to_f16_asm(tl.load(kp + 384, mask=vmask, other=0))
        sp = (base + 512).to(tl.pointer_type(tl.float32))
        sc0 = tl.load(sp, mask=valid, other=0.0)
        sc1 = tl.load(sp + 1, mask=valid, other=0.0)
        sc2 = tl.load(sp + 2, mask=valid, other=0.0)
        sc3 = tl.load(sp + 3, mask=valid, other=0.0)
        sc = (tl.dot(q0, tl.trans(k_0)) * sc0[None, :] + tl.dot(q1, tl.trans(k_1)) * sc1[None, :]
              + tl.dot(q2, tl.trans(k_2)) * sc2[None, :] + tl.dot(q3, tl.trans(k_3)) * sc3[None, :]) * nope_scale
        if ROPE:
            kpe = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=vmask, other=0.0)
            if INTERP:
                kpe = kpe.to(tl.float32)
            sc += tl.dot(qpe, tl.trans(kpe)) * sm_scale_log2
        sc = tl.where(valid[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        # Per-column value scales go into P as ratios <= 1 (fp16-safe); the tile max multiplies the dot.
        mx0 = tl.maximum(tl.max(sc0), 1e-30)
        mx1 = tl.maximum(tl.max(sc1), 1e-30)
        mx2 = tl.maximum(tl.max(sc2), 1e-30)
        mx3 = tl.maximum(tl.max(sc3), 1e-30)
        acc0 = acc0 * alpha[:, None] + tl.dot((p * (sc0 / mx0)[None, :]).to(tl.float16), k_0) * mx0
        acc1 = acc1 * alpha[:, None] + tl.dot((p * (sc1 / mx1)[None, :]).to(tl.float16), k_1) * mx1
        acc2 = acc2 * alpha[:, None] + tl.dot((p * (sc2 / mx2)[None, :]).to(tl.float16), k_2) * mx2
        acc3 = acc3 * alpha[:, None] + tl.dot((p * (sc3 / mx3)[None, :]).to(tl.float16), k_3) * mx3

    inv_l, lse = _finish(l_i, m_i)
    _store_chunk(o_ptr, t, s, heads, hm, d, acc0 * inv_l[:, None], stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, d + 128, acc1 * inv_l[:, None], stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, d + 256, acc2 * inv_l[:, None], stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, d + 384, acc3 * inv_l[:, None], stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)


