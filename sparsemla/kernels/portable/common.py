"""Pieces every portable (Triton) attention kernel shares: program coordinates, the gathered tile's rows,
the online softmax, stores, and the exact conversions of packed e4m3 / e2m1 codes.

The conversions run on int16 lanes (two e4m3 codes or four e2m1 codes each): Triton moves such lanes through
shared memory like any 16-bit dot operand (asynchronous copies, ldmatrix, the transposed operand of P @ V), and
the conversion then runs on the operand registers; 8-bit operands have no ldmatrix path for the transposed
operand.  The conversions are inline PTX; the interpreter cannot run PTX, so ``INTERP`` selects plain Triton bit
manipulation with the same results.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
V_DIM = 512
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max, so exp2(m_old - m_new) never sees inf - inf


@triton.jit
def program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG: tl.constexpr,
                    HB: tl.constexpr, HAS_VC: tl.constexpr):
    """Program id -> (token, split, head offsets, head mask, first and end position of this split).

    Head groups vary fastest so the programs that read the same rows run next to each other (L2 reuse)."""
    pid = tl.program_id(0)
    g = pid % NG
    ts = pid // NG
    s = ts % num_splits
    t = ts // num_splits
    n = K
    if HAS_VC:
        # A 1-element vector load + reduce, not a scalar load: the interpreter returns scalar loads as
        # shape-(1,) arrays, which `range` cannot take.
        n = tl.minimum(tl.maximum(tl.max(tl.load(vc_ptr + t + tl.arange(0, 1)), 0), 0), K)
    k_begin = s * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, n)
    heads = g * HB + tl.arange(0, HB)
    return t, s, heads, heads < H, k_begin, k_end


@triton.jit
def tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN: tl.constexpr, STAGED: tl.constexpr):
    """Rows of the tile starting at position k0: (row int64 [BN] (0 where invalid), valid bool [BN])."""
    offs = k0 + tl.arange(0, BN)
    idx = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs, mask=offs < k_end, other=-1)
    valid = idx >= 0
    if STAGED:
        # Staged rows are stored per (token, position): row = t * K + position.
        row = t.to(tl.int64) * K + offs
    else:
        row = idx.to(tl.int64)
    row = tl.where(valid, row, 0)
    return row, valid


@triton.jit
def softmax_step(s, m_i, l_i):
    """Online softmax in base 2: returns (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def pow2_fp16_scale(amax):
    """A power of two c with amax * c in [2^13, 2^15) (inside fp16 range; 1 when amax == 0)."""
    e = tl.floor(tl.log2(tl.maximum(amax, 1e-30)))
    c = tl.exp2(13.0 - e)
    return tl.where(amax > 0, c, 1.0)


@triton.jit
def store_chunk(o_ptr, t, s, heads, hm, cols, val, stride_ot, stride_os, stride_oh):
    ptr = o_ptr + t.to(tl.int64) * stride_ot + s * stride_os + heads[:, None] * stride_oh + cols[None, :]
    tl.store(ptr, val.to(o_ptr.dtype.element_ty), mask=hm[:, None])


@triton.jit
def finish(l_i, m_i):
    """(1/l with 0 for empty rows, natural-log lse with -inf for empty rows).  l is >= 0, or NaN where a selected
    row held a NaN: ``!= 0``, not ``> 0``, so that the NaN reaches out and lse instead of emptying the row."""
    has = l_i != 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return inv_l, lse



@triton.jit
def e4m3x2_to_f16(x, INTERP: tl.constexpr):
    """int16 lane of two e4m3 codes -> (low-byte value, high-byte value) as fp16, exactly."""
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
            constraints="=h,=h,h", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def e2m1_to_fp16(code):
    """4-bit e2m1 codes (int32) -> fp16, exactly.  Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: code c >= 2 is the
    fp16 pattern (c << 9) + 0x3800 (exponent and mantissa bit line up, bias moved), c = 1 is 0.5 = 0x3800."""
    mag = code & 7
    bits = tl.where(mag < 2, mag * 0x3800, (mag << 9) + 0x3800) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e2m1x4_to_f16(x, INTERP: tl.constexpr):
    """int16 lane of four e2m1 codes (bits 0-3, 4-7, 8-11, 12-15) -> four fp16 values, exactly.

    PTX, two codes per 32-bit word: the 3 magnitude bits of code ``c`` placed at fp16 bits 9-11 make the
    fp16 ``m * 2^-14`` (exponent field = c >> 1, top mantissa bit = c & 1; c = 1 lands on the subnormal
    2^-15), so one ``mul.f16x2`` by 2^14 gives the e2m1 value exactly; the sign bit moves to bit 15.  With
    ``t = w | w << 12`` the second code of a pair sits 16 bits above the first, so both halves are built
    with the same shifts and masks (~4 instructions per value instead of a table lookup's ~6)."""
    if INTERP:
        xi = x.to(tl.int32)
        return (e2m1_to_fp16(xi & 15), e2m1_to_fp16((xi >> 4) & 15),
                e2m1_to_fp16((xi >> 8) & 15), e2m1_to_fp16((xi >> 12) & 15))
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 w, v, t, a, b, r0, r1, k;
            mov.b32 k, 0x74007400;
            cvt.u32.u16 w, $4;
            shl.b32 t, w, 12;
            or.b32 t, t, w;
            shl.b32 a, t, 9;
            and.b32 a, a, 0x0E000E00;
            shl.b32 b, t, 12;
            and.b32 b, b, 0x80008000;
            or.b32 r0, a, b;
            mul.rn.f16x2 r0, r0, k;
            shr.b32 v, w, 8;
            shl.b32 t, v, 12;
            or.b32 t, t, v;
            shl.b32 a, t, 9;
            and.b32 a, a, 0x0E000E00;
            shl.b32 b, t, 12;
            and.b32 b, b, 0x80008000;
            or.b32 r1, a, b;
            mul.rn.f16x2 r1, r1, k;
            mov.b32 {$0, $1}, r0;
            mov.b32 {$2, $3}, r1;
            }""",
            constraints="=h,=h,=h,=h,h", args=[x], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)


@triton.jit
def load_q_f16(q_row, hm, off: tl.constexpr, cols, c):
    return (tl.load(q_row + off + cols[None, :], mask=hm[:, None], other=0.0).to(tl.float32) * c).to(tl.float16)


@triton.jit
def amax_strided(q_row, hm, cols, off: tl.constexpr, step: tl.constexpr):
    return tl.max(tl.abs(tl.load(q_row + off + step * cols[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))



@triton.jit
def nvfp4_lane_scales(base, vmask, SCALE_OFF: tl.constexpr, BN: tl.constexpr):
    """The 32 e4m3 block scales of the rows at byte addresses ``base`` [BN] as fp16, expanded to the 128
    int16 lanes ([BN, 128]; lane c = dims 4c..4c+3 lies in block c // 4).  Block b's scale sits at byte
    ``SCALE_OFF + 8 * (b % 4) + b // 4`` (kv-formats.md).  One 32-byte load per row, expanded in registers,
    instead of a gather of one scale byte per lane (the rejected alternative: CHANGELOG.md)."""
    blk = tl.arange(0, 32)
    sf = tl.load((base[:, None] + (SCALE_OFF + 8 * (blk % 4) + blk // 4)[None, :]).to(tl.pointer_type(tl.float8e4nv)),
                 mask=vmask, other=0.0).to(tl.float16)
    return tl.reshape(tl.broadcast_to(sf[:, :, None], [BN, 32, 4]), [BN, 128])



@triton.jit
def bf16_operand(x, INTERP: tl.constexpr):
    # The interpreter multiplies the raw bits of bf16 dot operands; widen to fp32 there.
    if INTERP:
        return x.to(tl.float32)
    else:
        return x



@triton.jit
def e4m3_to_bf16(x8):
    """uint8 e4m3 codes -> bf16 (exact)."""
    return x8.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)

