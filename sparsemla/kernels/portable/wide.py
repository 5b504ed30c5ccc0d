"""Portable sparse MLA attention over rows of every format at 64 heads per program (wgmma on Hopper).

Each K tile is converted once, in natural dim order, to bf16 -- e4m3, and e2m1 times its e4m3 block scale, are
exact in bf16; fp8_ds_mla's fp32 tile scale is applied in the conversion (one bf16 rounding) -- and both dots read
it from shared memory: QK^T as one 512-deep dot plus the rope dot, P V into one ``[HB, 512]`` accumulator.  Fewer,
larger dots than the per-format few-heads kernels (Triton waits after every dot of a chain), and q goes from its
load straight into shared memory.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (NEG_BIG, bf16_operand, e2m1x4_to_f16, e4m3_to_bf16, e4m3x2_to_f16, finish, nvfp4_lane_scales, program_coords, softmax_step, store_chunk, tile_rows)


KIND_BF16 = tl.constexpr(0)
KIND_FP8 = tl.constexpr(1)
KIND_DS = tl.constexpr(2)
KIND_NVFP4 = tl.constexpr(3)
KIND_OF = {"bf16": 0, "fp8": 1, "staged": 1, "fp8_ds_mla": 2, "nvfp4_ds_mla": 3}  # row kind -> KIND


@triton.jit
def _wide_tile(base, vmask, KIND: tl.constexpr, SCALE_OFF: tl.constexpr, BN: tl.constexpr, INTERP: tl.constexpr):
    """Rows at byte addresses base [BN] -> their first 512 dims as bf16 [BN, 512], scales applied."""
    d = tl.arange(0, 512)
    if KIND == KIND_BF16:
        return tl.load(base.to(tl.pointer_type(tl.bfloat16))[:, None] + d[None, :], mask=vmask, other=0.0)
    elif KIND == KIND_FP8:
        return e4m3_to_bf16(tl.load(base[:, None] + d[None, :], mask=vmask, other=0))
    elif KIND == KIND_DS:
        k8 = tl.load(base[:, None] + d[None, :], mask=vmask, other=0).to(tl.float8e4nv, bitcast=True)
        sc4 = tl.load((base + SCALE_OFF).to(tl.pointer_type(tl.float32))[:, None] + tl.arange(0, 4)[None, :], mask=vmask,
                      other=0.0)
        scl = tl.reshape(tl.broadcast_to(sc4[:, :, None], [BN, 4, 128]), [BN, 512])
        return (k8.to(tl.float32) * scl).to(tl.bfloat16)
    else:
        # int16 lane c = dims 4c..4c+3
        lanes = tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, 128)[None, :], mask=vmask, other=0)
        sf = nvfp4_lane_scales(base, vmask, SCALE_OFF, BN)
        v0, v1, v2, v3 = e2m1x4_to_f16(lanes, INTERP)
        # join(join(v0, v2), join(v1, v3))[c, i, j] = v_{2i + j}: dims 4c..4c+3 in order
        kf = tl.reshape(tl.join(tl.join(v0 * sf, v2 * sf), tl.join(v1 * sf, v3 * sf)), [BN, 512])
        return kf.to(tl.bfloat16)


@triton.jit
def _wide_rope(base, vmask, KIND: tl.constexpr, ROPE_OFF: tl.constexpr, INTERP: tl.constexpr):
    """The 64 rope dims of the rows as bf16 [BN, 64] (bf16 in bf16 and fp8_ds_mla rows, e4m3 otherwise)."""
    if KIND == KIND_BF16:
        return tl.load(base.to(tl.pointer_type(tl.bfloat16))[:, None] + 512 + tl.arange(0, 64)[None, :], mask=vmask,
                       other=0.0)
    elif KIND == KIND_DS:
        return tl.load((base + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :], mask=vmask,
                       other=0.0)
    else:
        # e4m3 pairs as int16 lanes through the packed conversion: a uint8 tile here made ptxas spill.
        lo, hi = e4m3x2_to_f16(tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + ROPE_OFF // 2 + tl.arange(0, 32)[None, :],
                                        mask=vmask, other=0), INTERP)
        return tl.reshape(tl.join(lo, hi), [lo.shape[0], 64]).to(tl.bfloat16)


@triton.jit
def wide_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                     o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                     sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                     BPT: tl.constexpr, KIND: tl.constexpr, STAGED: tl.constexpr, ROPE: tl.constexpr,
                SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr,
                     HB: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                     HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 512)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    qe_row = qr_ptr + t.to(tl.int64) * stride_rt + heads[:, None] * stride_rh  # the rope part (ROPE)
    q = bf16_operand(tl.load(q_row + d[None, :], mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        qpe = bf16_operand(tl.load(qe_row + tl.arange(0, 64)[None, :], mask=hm[:, None], other=0.0), INTERP)
    score_scale = sm_scale_log2
    if KIND == KIND_FP8:
        score_scale = score_scale * k_scale  # plain fp8 rows hold value / k_scale
    m_i = tl.full([HB], NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, 512], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, STAGED)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)  # 16-byte rows (see fp8_few_kernel)
        vmask = valid[:, None]
        if ROPE:
            # rope first: converted before the main tile, it does not add to the tile's register peak
            sc = tl.dot(qpe, tl.trans(bf16_operand(_wide_rope(base, vmask, KIND, ROPE_OFF, INTERP), INTERP)))
        kk = bf16_operand(_wide_tile(base, vmask, KIND, SCALE_OFF, BN, INTERP), INTERP)
        if ROPE:
            sc = tl.dot(q, tl.trans(kk), sc)
        else:
            sc = tl.dot(q, tl.trans(kk))
        sc = tl.where(valid[None, :], sc * score_scale, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(sc, m_i, l_i)
        acc = tl.dot(bf16_operand(p.to(tl.bfloat16), INTERP), kk, acc * alpha[:, None])
    inv_l, lse = finish(l_i, m_i)
    if KIND == KIND_FP8:
        inv_l = inv_l * k_scale
    store_chunk(o_ptr, t, s, heads, hm, d, acc * inv_l[:, None], stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)

