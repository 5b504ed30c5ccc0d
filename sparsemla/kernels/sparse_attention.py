"""Sparse MLA attention forward (decode and prefill) reading every KV format natively.

Math, per query token ``t`` and head ``h`` over the valid entries ``r`` of ``indices[t]``::

    s_r = sm_scale * q[t, h, :D] . K[r, :D]      lse = log sum_r exp(s_r)      out = sum_r exp(s_r - lse) V[r]

with ``V[r] = K[r, :512]`` (one KV head; absorbed MLA).  Rows are read straight out of the paged cache
(``PagedKVCache.rows``, uint8 ``[num_rows, bytes_per_token]``) and dequantized in registers: no staging copy.

Tiling: one program = one query token x one block of ``HB`` heads x one split of its top-k list.  It walks
its split in tiles of ``BN`` gathered rows; per tile it does ``S = Q K^T`` and ``O += P V`` with tensor-core
dots and an online softmax (base 2, ``sm_scale * log2(e)`` folded in).  Splits (split-KV) let a small batch
fill all SMs; their normalized partial outputs and lse are merged by ``_combine_kernel``.

Two kernel shapes, chosen by head count (``kernel_config``):
- up to 32 heads (memory-bound decode): one kernel per format family (``_fwd_bf16_kernel``,
  ``_fwd_fp8_kernel``, ``_fwd_nvfp4_kernel``), 16-32 heads per program on mma.sync, FP8/FP4 rows read as int16
  lanes and converted on the operand registers (below) -- except fp8, fp8_ds_mla and nvfp4_ds_mla rows on
  sm_90, which go to the warp-specialized Gluon kernel of ``ws_few`` (rows as the wgmma's M, K / V converted
  from raw bytes in registers; 1.5-2.4x faster on the H200, with its own split plan: one program per SM);
- more than 32 heads (compute-bound): ``_fwd_wide_kernel`` for every format, 64 heads per program on wgmma,
  each K tile converted once to bf16 in natural dim order and read from shared memory by both dots --
  except bf16 rows on sm_90, which go to the warp-specialized Gluon kernels of ``ws_attention`` (a
  producer warpgroup gathering rows with cp.async, two consumer warpgroups; 1.5-2x faster on the H200), and
  quantized rows on sm_90: ``ws_few`` in 16-head groups while its programs fit in one wave (four for nvfp4;
  ``ws_attention.FEW_WAVES``: small batches), else fp8 / fp8_ds_mla go to ``ws_wide`` (the few-heads
  kernel's register operands with the bf16 kernel's pair schedule; 1.3-1.8x).

Number formats on the tensor cores (few-heads kernels), and why:
- e4m3 -> fp16 is exact and is one packed ``cvt.rn.f16x2.e4m3x2`` per two values (e4m3 -> bf16 costs two more
  conversions), so every FP8 and FP4 format multiplies in fp16.  The query is brought into fp16 range by a
  per-token power of two (exact), which is divided back out of the scores.
- fp8_ds_mla: the four per-128-dim fp32 tile scales are never applied per element.  QK is four 128-deep dots,
  each scaled per column (per row of the cache); for PV, P is multiplied per column by ``scale / tile_max``
  (a ratio <= 1, exactly a power of two for the pow2 writer), and each group's accumulator is kept divided
  by the previous tile's ``tile_max``, so the rescale stays one multiply and the dot accumulates in place.
- nvfp4_ds_mla: an e2m1 value times its e4m3 block scale has at most 5 significant bits and lies in
  [2^-13, 2688], so the product is exact in fp16.  Byte k holds dims 2k (low nibble) and 2k+1 (high nibble):
  rather than interleaving them, the 512 dims are handled as an "even" and an "odd" half, each a 256-deep dot,
  with q and the output split the same way (once per program, not per tile).
- bf16 rows multiply in bf16.
Under the Triton interpreter ``tl.dot`` on bf16 operands is wrong (it multiplies the raw bits), so with
``INTERP`` the bf16 operands are widened to fp32 first (fp16 and fp8 are fine there).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_wait

from ..formats import KVFormat, get_format
from ._runtime import capability as _capability
from ._runtime import interpreting
from ._runtime import num_sms as _num_sms

try:  # the warp-specialized bf16 kernel needs Gluon (Triton >= 3.5); without it the Triton kernels serve
    from . import ws_attention as _ws
except ImportError:  # pragma: no cover
    _ws = None

LOG2E = 1.4426950408889634
V_DIM = 512
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max, so exp2(m_old - m_new) never sees inf - inf


# --------------------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG: tl.constexpr,
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
def _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN: tl.constexpr, STAGED: tl.constexpr):
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
def _softmax_step(s, m_i, l_i):
    """Online softmax in base 2: returns (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _pow2_fp16_scale(amax):
    """A power of two c with amax * c in [2^13, 2^15) (inside fp16 range; 1 when amax == 0)."""
    e = tl.floor(tl.log2(tl.maximum(amax, 1e-30)))
    c = tl.exp2(13.0 - e)
    return tl.where(amax > 0, c, 1.0)


@triton.jit
def _store_chunk(o_ptr, t, s, heads, hm, cols, val, stride_ot, stride_os, stride_oh):
    ptr = o_ptr + t.to(tl.int64) * stride_ot + s * stride_os + heads[:, None] * stride_oh + cols[None, :]
    tl.store(ptr, val.to(o_ptr.dtype.element_ty), mask=hm[:, None])


@triton.jit
def _finish(l_i, m_i):
    """(1/l with 0 for empty rows, natural-log lse with -inf for empty rows)."""
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return inv_l, lse


# --------------------------------------------------------------------------------------------------------
# Packed-code conversions.  The FP8 and FP4 rows are read as int16 lanes (2 e4m3 codes or 4 e2m1 codes each):
# Triton then moves them through shared memory exactly like a 16-bit dot operand (async copies, ldmatrix,
# transposed for P @ V), and the conversion runs on the operand registers.  Read as 8-bit data instead, the
# transposed (P @ V) operand has no ldmatrix path and the kernel ran 1.5-3x slower on the H200.
# The conversions are inline PTX (one packed cvt per e4m3 pair; a byte permute from an 8-entry table per
# e2m1 pair); the interpreter cannot run PTX, so INTERP selects plain Triton bit manipulation instead.
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _e4m3x2_to_f16(x, INTERP: tl.constexpr):
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
def _e2m1_to_fp16(code):
    """4-bit e2m1 codes (int32) -> fp16, exactly.  Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: code c >= 2 is the
    fp16 pattern (c << 9) + 0x3800 (exponent and mantissa bit line up, bias moved), c = 1 is 0.5 = 0x3800."""
    mag = code & 7
    bits = tl.where(mag < 2, mag * 0x3800, (mag << 9) + 0x3800) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1x4_to_f16(x, INTERP: tl.constexpr):
    """int16 lane of four e2m1 codes (bits 0-3, 4-7, 8-11, 12-15) -> four fp16 values, exactly.

    PTX, two codes per 32-bit word: the 3 magnitude bits of code ``c`` placed at fp16 bits 9-11 make the
    fp16 ``m * 2^-14`` (exponent field = c >> 1, top mantissa bit = c & 1; c = 1 lands on the subnormal
    2^-15), so one ``mul.f16x2`` by 2^14 gives the e2m1 value exactly; the sign bit moves to bit 15.  With
    ``t = w | w << 12`` the second code of a pair sits 16 bits above the first, so both halves are built
    with the same shifts and masks (~4 instructions per value instead of a table lookup's ~6)."""
    if INTERP:
        xi = x.to(tl.int32)
        return (_e2m1_to_fp16(xi & 15), _e2m1_to_fp16((xi >> 4) & 15),
                _e2m1_to_fp16((xi >> 8) & 15), _e2m1_to_fp16((xi >> 12) & 15))
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
def _load_q_f16(q_row, hm, off: tl.constexpr, cols, c):
    return (tl.load(q_row + off + cols[None, :], mask=hm[:, None], other=0.0).to(tl.float32) * c).to(tl.float16)


@triton.jit
def _amax_strided(q_row, hm, cols, off: tl.constexpr, step: tl.constexpr):
    return tl.max(tl.abs(tl.load(q_row + off + step * cols[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))


# --------------------------------------------------------------------------------------------------------
# fp8 family: plain fp8 rows (per-tensor k_scale), staged fp8 rows [T, K, D], fp8_ds_mla rows (4 fp32 tile
# scales + bf16 rope).  Each 128-dim group g is an int16 [BN, 64] tile -> even-dim and odd-dim fp16 tiles.
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _fp8_group(kp, vmask, g: tl.constexpr, INTERP: tl.constexpr):
    return _e4m3x2_to_f16(tl.load(kp + 64 * g, mask=vmask, other=0), INTERP)


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
def _fwd_fp8_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                    o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                    sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                    BPT: tl.constexpr, DS: tl.constexpr, STAGED: tl.constexpr, ROPE: tl.constexpr,
                    HB: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                    HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    c64 = tl.arange(0, 64)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    amax = tl.max(tl.abs(tl.load(q_row + tl.arange(0, 512)[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))
    if ROPE:
        r = tl.arange(0, 32)
        if DS:
            qpe = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=hm[:, None], other=0.0)
            if INTERP:
                qpe = qpe.to(tl.float32)
        else:
            amax = tl.maximum(amax, _amax_strided(q_row, hm, tl.arange(0, 64), 512, 1))
    c = _pow2_fp16_scale(amax)
    e = 2 * c64
    qe0 = _load_q_f16(q_row, hm, 0, e, c)
    qo0 = _load_q_f16(q_row, hm, 1, e, c)
    qe1 = _load_q_f16(q_row, hm, 128, e, c)
    qo1 = _load_q_f16(q_row, hm, 129, e, c)
    qe2 = _load_q_f16(q_row, hm, 256, e, c)
    qo2 = _load_q_f16(q_row, hm, 257, e, c)
    qe3 = _load_q_f16(q_row, hm, 384, e, c)
    qo3 = _load_q_f16(q_row, hm, 385, e, c)
    if ROPE and not DS:
        qpe_e = _load_q_f16(q_row, hm, 512, 2 * r, c)
        qpe_o = _load_q_f16(q_row, hm, 513, 2 * r, c)
    score_scale = sm_scale_log2 / c
    if not DS:
        score_scale = score_scale * k_scale

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
    # fp8_ds_mla: the factors f_g the PV accumulators of group g are held divided by (see below)
    f0 = sm_scale_log2 * 0.0 + 1.0
    f1 = f0
    f2 = f0
    f3 = f0
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, STAGED)
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
            sc4 = tl.load((base + 512).to(tl.pointer_type(tl.float32))[:, None] + tl.arange(0, 4)[None, :],
                          mask=vmask, other=0.0)
            sc0, sc1, sc2, sc3 = _split4(sc4)
            sc = (d0 * sc0[None, :] + d1 * sc1[None, :] + d2 * sc2[None, :] + d3 * sc3[None, :]) * score_scale
            if ROPE:
                kpe = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :],
                              mask=vmask, other=0.0)
                if INTERP:
                    kpe = kpe.to(tl.float32)
                sc += tl.dot(qpe, tl.trans(kpe)) * sm_scale_log2
        else:
            sc = d0 + d1 + d2 + d3
            if ROPE:
                kpe_e, kpe_o = _e4m3x2_to_f16(
                    tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + 256 + r[None, :], mask=vmask, other=0),
                    INTERP)
                sc += tl.dot(qpe_e, tl.trans(kpe_e)) + tl.dot(qpe_o, tl.trans(kpe_o))
            sc = sc * score_scale
        sc = tl.where(valid[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
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

    inv_l, lse = _finish(l_i, m_i)
    if not DS:
        inv_l = inv_l * k_scale  # values were stored divided by k_scale
    il = inv_l[:, None]
    _store_chunk(o_ptr, t, s, heads, hm, e, ae0 * (il * f0), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 1, ao0 * (il * f0), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 128, ae1 * (il * f1), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 129, ao1 * (il * f1), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 256, ae2 * (il * f2), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 257, ao2 * (il * f2), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 384, ae3 * (il * f3), stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, e + 385, ao3 * (il * f3), stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)


# --------------------------------------------------------------------------------------------------------
# nvfp4_ds_mla: 256 B of packed e2m1 (+ 64 e4m3 rope) + 32 permuted e4m3 block scales.  An int16 lane c
# holds dims 4c..4c+3, so the 512 dims are four fp16 [BN, 128] tiles of "dim = 4c + j" (no interleaving:
# q and the output are split the same way once per program).  e2m1 x e4m3 scale is exact in fp16.
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _nvfp4_lane_scales(base, vmask, SCALE_OFF: tl.constexpr, BN: tl.constexpr):
    """The 32 e4m3 block scales of the rows at byte addresses ``base`` [BN] as fp16, expanded to the 128
    int16 lanes ([BN, 128]; lane c = dims 4c..4c+3 lies in block c // 4).  Block b's scale sits at byte
    ``SCALE_OFF + 8 * (b % 4) + b // 4`` (kv-formats.md).  32 bytes per row expanded in registers were
    faster on the H200 than gathering one scale byte per lane (251 vs 288 us at D-h16)."""
    blk = tl.arange(0, 32)
    sf = tl.load((base[:, None] + (SCALE_OFF + 8 * (blk % 4) + blk // 4)[None, :]).to(tl.pointer_type(tl.float8e4nv)),
                 mask=vmask, other=0.0).to(tl.float16)
    return tl.reshape(tl.broadcast_to(sf[:, :, None], [BN, 32, 4]), [BN, 128])


@triton.jit
def _fwd_nvfp4_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                      o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                      sm_scale_log2, H, K, rows_per_split, num_splits,
                      BPT: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                      NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    SCALE_OFF: tl.constexpr = 320 if ROPE else 256
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    c128 = tl.arange(0, 128)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    amax = tl.max(tl.abs(tl.load(q_row + tl.arange(0, 512)[None, :], mask=hm[:, None], other=0.0).to(tl.float32)))
    if ROPE:
        r = tl.arange(0, 32)
        amax = tl.maximum(amax, _amax_strided(q_row, hm, tl.arange(0, 64), 512, 1))
    c = _pow2_fp16_scale(amax)
    f = 4 * c128
    q0 = _load_q_f16(q_row, hm, 0, f, c)
    q1 = _load_q_f16(q_row, hm, 1, f, c)
    q2 = _load_q_f16(q_row, hm, 2, f, c)
    q3 = _load_q_f16(q_row, hm, 3, f, c)
    if ROPE:
        qpe_e = _load_q_f16(q_row, hm, 512, 2 * r, c)
        qpe_o = _load_q_f16(q_row, hm, 513, 2 * r, c)
    score_scale = sm_scale_log2 / c

    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    a0 = tl.zeros([HB, 128], tl.float32)
    a1 = tl.zeros([HB, 128], tl.float32)
    a2 = tl.zeros([HB, 128], tl.float32)
    a3 = tl.zeros([HB, 128], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        packed = tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + c128[None, :], mask=vmask, other=0)
        sf = _nvfp4_lane_scales(base, vmask, SCALE_OFF, BN)
        k0_, k1_, k2_, k3_ = _e2m1x4_to_f16(packed, INTERP)
        k0_ = k0_ * sf
        k1_ = k1_ * sf
        k2_ = k2_ * sf
        k3_ = k3_ * sf
        sc = tl.dot(q0, tl.trans(k0_)) + tl.dot(q1, tl.trans(k1_)) + tl.dot(q2, tl.trans(k2_)) \
            + tl.dot(q3, tl.trans(k3_))
        if ROPE:
            kpe_e, kpe_o = _e4m3x2_to_f16(tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + 128 + r[None, :],
                                                  mask=vmask, other=0), INTERP)
            sc += tl.dot(qpe_e, tl.trans(kpe_e)) + tl.dot(qpe_o, tl.trans(kpe_o))
        sc = tl.where(valid[None, :], sc * score_scale, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        p16 = p.to(tl.float16)
        al = alpha[:, None]
        a0 = tl.dot(p16, k0_, a0 * al)
        a1 = tl.dot(p16, k1_, a1 * al)
        a2 = tl.dot(p16, k2_, a2 * al)
        a3 = tl.dot(p16, k3_, a3 * al)

    inv_l, lse = _finish(l_i, m_i)
    il = inv_l[:, None]
    _store_chunk(o_ptr, t, s, heads, hm, f, a0 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, f + 1, a1 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, f + 2, a2 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, f + 3, a3 * il, stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)


# --------------------------------------------------------------------------------------------------------
# bf16 rows (the cache format, and the prefill workspace): bf16 operands straight from memory.
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _bf16_operand(x, INTERP: tl.constexpr):
    # The interpreter multiplies the raw bits of bf16 dot operands; widen to fp32 there.
    if INTERP:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _fwd_bf16_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                     o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                     sm_scale_log2, H, K, rows_per_split, num_splits,
                     ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                     NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    D: tl.constexpr = 512 + ROPE
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 128)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q0 = _bf16_operand(tl.load(q_row, mask=hm[:, None], other=0.0), INTERP)
    q1 = _bf16_operand(tl.load(q_row + 128, mask=hm[:, None], other=0.0), INTERP)
    q2 = _bf16_operand(tl.load(q_row + 256, mask=hm[:, None], other=0.0), INTERP)
    q3 = _bf16_operand(tl.load(q_row + 384, mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        r = tl.arange(0, 64)
        qpe = _bf16_operand(tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + 512 + r[None, :],
                                    mask=hm[:, None], other=0.0), INTERP)
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc0 = tl.zeros([HB, 128], tl.float32)
    acc1 = tl.zeros([HB, 128], tl.float32)
    acc2 = tl.zeros([HB, 128], tl.float32)
    acc3 = tl.zeros([HB, 128], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        vmask = valid[:, None]
        # 16-byte aligned rows (see _fwd_fp8_kernel); the hint gives 16-byte loads.
        rp = tl.multiple_of(kv_ptr.to(tl.pointer_type(tl.bfloat16)) + row * D, 16)
        kp = rp[:, None] + d[None, :]
        k_0 = _bf16_operand(tl.load(kp, mask=vmask, other=0.0), INTERP)
        k_1 = _bf16_operand(tl.load(kp + 128, mask=vmask, other=0.0), INTERP)
        k_2 = _bf16_operand(tl.load(kp + 256, mask=vmask, other=0.0), INTERP)
        k_3 = _bf16_operand(tl.load(kp + 384, mask=vmask, other=0.0), INTERP)
        sc = tl.dot(q0, tl.trans(k_0)) + tl.dot(q1, tl.trans(k_1)) + tl.dot(q2, tl.trans(k_2)) \
            + tl.dot(q3, tl.trans(k_3))
        if ROPE:
            kpe = _bf16_operand(tl.load(rp[:, None] + 512 + r[None, :], mask=vmask, other=0.0), INTERP)
            sc += tl.dot(qpe, tl.trans(kpe))
        sc = tl.where(valid[None, :], sc * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        pc = _bf16_operand(p.to(tl.bfloat16), INTERP)
        al = alpha[:, None]
        acc0 = tl.dot(pc, k_0, acc0 * al)
        acc1 = tl.dot(pc, k_1, acc1 * al)
        acc2 = tl.dot(pc, k_2, acc2 * al)
        acc3 = tl.dot(pc, k_3, acc3 * al)

    inv_l, lse = _finish(l_i, m_i)
    il = inv_l[:, None]
    _store_chunk(o_ptr, t, s, heads, hm, d, acc0 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, d + 128, acc1 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, d + 256, acc2 * il, stride_ot, stride_os, stride_oh)
    _store_chunk(o_ptr, t, s, heads, hm, d + 384, acc3 * il, stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)


# --------------------------------------------------------------------------------------------------------
# Many heads (64 per program, wgmma): every format through one kernel.  Each K tile is converted once, in
# natural dim order, to bf16 -- e4m3, and e2m1 times its e4m3 block scale, are exact in bf16; fp8_ds_mla's
# fp32 tile scale is applied in the conversion (one bf16 rounding) -- and then both dots read it from shared
# memory: QK^T as one 512-deep dot plus the rope dot, P V into one [HB, 512] accumulator.  On the H200
# (third session) this beat the per-format kernels at 64/128 heads by 15-50 % (fp8_ds_mla D-h128 729 ->
# 373 us): fewer, larger wgmma groups (Triton waits after every dot of a chain) and q straight from its
# load into shared memory instead of registers (the fp16 q of the few-heads kernels spilled).
# --------------------------------------------------------------------------------------------------------
KIND_BF16 = tl.constexpr(0)
KIND_FP8 = tl.constexpr(1)
KIND_DS = tl.constexpr(2)
KIND_NVFP4 = tl.constexpr(3)
_WIDE_KIND = {"bf16": 0, "fp8": 1, "staged": 1, "fp8_ds_mla": 2, "nvfp4_ds_mla": 3}


@triton.jit
def _e4m3_to_bf16(x8):
    """uint8 e4m3 codes -> bf16 (exact)."""
    return x8.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def _wide_tile(base, vmask, KIND: tl.constexpr, ROPE: tl.constexpr, BN: tl.constexpr, INTERP: tl.constexpr):
    """Rows at byte addresses base [BN] -> their first 512 dims as bf16 [BN, 512], scales applied."""
    d = tl.arange(0, 512)
    if KIND == KIND_BF16:
        return tl.load(base.to(tl.pointer_type(tl.bfloat16))[:, None] + d[None, :], mask=vmask, other=0.0)
    elif KIND == KIND_FP8:
        return _e4m3_to_bf16(tl.load(base[:, None] + d[None, :], mask=vmask, other=0))
    elif KIND == KIND_DS:
        k8 = tl.load(base[:, None] + d[None, :], mask=vmask, other=0).to(tl.float8e4nv, bitcast=True)
        sc4 = tl.load((base + 512).to(tl.pointer_type(tl.float32))[:, None] + tl.arange(0, 4)[None, :], mask=vmask,
                      other=0.0)
        scl = tl.reshape(tl.broadcast_to(sc4[:, :, None], [BN, 4, 128]), [BN, 512])
        return (k8.to(tl.float32) * scl).to(tl.bfloat16)
    else:
        # int16 lane c = dims 4c..4c+3
        SCALE_OFF: tl.constexpr = 320 if ROPE else 256
        lanes = tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, 128)[None, :], mask=vmask, other=0)
        sf = _nvfp4_lane_scales(base, vmask, SCALE_OFF, BN)
        v0, v1, v2, v3 = _e2m1x4_to_f16(lanes, INTERP)
        # join(join(v0, v2), join(v1, v3))[c, i, j] = v_{2i + j}: dims 4c..4c+3 in order
        kf = tl.reshape(tl.join(tl.join(v0 * sf, v2 * sf), tl.join(v1 * sf, v3 * sf)), [BN, 512])
        return kf.to(tl.bfloat16)


@triton.jit
def _wide_rope(base, vmask, KIND: tl.constexpr, INTERP: tl.constexpr):
    """The 64 rope dims of the rows as bf16 [BN, 64] (bf16 in bf16 and fp8_ds_mla rows, e4m3 otherwise)."""
    if KIND == KIND_BF16:
        return tl.load(base.to(tl.pointer_type(tl.bfloat16))[:, None] + 512 + tl.arange(0, 64)[None, :], mask=vmask,
                       other=0.0)
    elif KIND == KIND_DS:
        return tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :], mask=vmask,
                       other=0.0)
    else:
        # e4m3 pairs as int16 lanes through the packed conversion: a uint8 tile here made ptxas spill.
        off: tl.constexpr = 256 if KIND == KIND_FP8 else 128
        lo, hi = _e4m3x2_to_f16(tl.load(base.to(tl.pointer_type(tl.int16))[:, None] + off + tl.arange(0, 32)[None, :],
                                        mask=vmask, other=0), INTERP)
        return tl.reshape(tl.join(lo, hi), [lo.shape[0], 64]).to(tl.bfloat16)


@triton.jit
def _fwd_wide_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                     o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                     sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                     BPT: tl.constexpr, KIND: tl.constexpr, STAGED: tl.constexpr, ROPE: tl.constexpr,
                     HB: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                     HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 512)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = _bf16_operand(tl.load(q_row + d[None, :], mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        qpe = _bf16_operand(tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=hm[:, None], other=0.0), INTERP)
    score_scale = sm_scale_log2
    if KIND == KIND_FP8:
        score_scale = score_scale * k_scale  # plain fp8 rows hold value / k_scale
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, 512], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, STAGED)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)  # 16-byte rows (see _fwd_fp8_kernel)
        vmask = valid[:, None]
        if ROPE:
            # rope first: converted before the main tile, it does not add to the tile's register peak
            sc = tl.dot(qpe, tl.trans(_bf16_operand(_wide_rope(base, vmask, KIND, INTERP), INTERP)))
        kk = _bf16_operand(_wide_tile(base, vmask, KIND, ROPE, BN, INTERP), INTERP)
        if ROPE:
            sc = tl.dot(q, tl.trans(kk), sc)
        else:
            sc = tl.dot(q, tl.trans(kk))
        sc = tl.where(valid[None, :], sc * score_scale, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        acc = tl.dot(_bf16_operand(p.to(tl.bfloat16), INTERP), kk, acc * alpha[:, None])
    inv_l, lse = _finish(l_i, m_i)
    if KIND == KIND_FP8:
        inv_l = inv_l * k_scale
    _store_chunk(o_ptr, t, s, heads, hm, d, acc * inv_l[:, None], stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)


# --------------------------------------------------------------------------------------------------------
# combine split partials
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(op_ptr, lp_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, H, num_splits,
                    SP: tl.constexpr, PDL: tl.constexpr):
    """out[t, h] = sum_s exp(lse_s - lse) o_s,  lse = log sum_s exp(lse_s).  Partials: o [T, S, H, 512] fp32
    (normalized), lse [T, S, H] fp32 natural log (-inf for an empty split).

    One program = one (token, head, 128-column chunk): all splits of the chunk are one [SP, 128] load, so
    a small batch (few tokens, up to 32 splits) is not a chain of per-split loads in a handful of programs
    (that took ~130 us at b = 1 on the H200).

    PDL: launched with programmatic dependent launch (sm_90+), so that its launch overlaps the attention
    kernel's last programs; ``griddepcontrol.wait`` then holds it until that kernel has finished and its
    partials are visible."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    sp = tl.arange(0, SP)
    sm = sp < num_splits
    lp = tl.load(lp_ptr + (t.to(tl.int64) * num_splits + sp) * H + h, mask=sm, other=float("-inf"))  # [SP]
    mx = tl.max(lp, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lp - mx_safe)  # 0 for empty splits (their partial output is never read)
    tot = tl.sum(w, 0)
    has = tot > 0
    w = w * tl.where(has, 1.0 / tl.where(has, tot, 1.0), 0.0)
    d = c * 128 + tl.arange(0, 128)
    part = tl.load(op_ptr + ((t.to(tl.int64) * num_splits + sp[:, None]) * H + h) * 512 + d[None, :],
                   mask=(sm & (w > 0))[:, None], other=0.0)
    acc = tl.sum(part * w[:, None], 0)
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, acc.to(o_ptr.dtype.element_ty))
    if c == 0:
        lse = tl.where(has, mx_safe + tl.log(tl.where(has, tot, 1.0)), float("-inf"))
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h * stride_lh, lse)


# --------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------
# The combine step waits for the attention kernel through programmatic dependent launch on sm_90+ (see
# _combine_kernel); False launches it in plain stream order (the A/B of BENCHMARKS section 11).
COMBINE_PDL = True


def head_block(num_heads: int) -> int:
    """Heads per program: the next power of two >= H, at least 16 (the smallest tensor-core M), at most 64."""
    hb = 16
    while hb < num_heads and hb < 64:
        hb *= 2
    return hb


# (BLOCK_N, num_warps, num_stages) per format for few heads (<= 32: memory-bound decode, mma.sync kernels),
# chosen by benchmarks/decode_sweep.py on the H200 (BENCHMARKS.md has the sweeps).  More heads use the wide
# kernel with 64 heads per program, BLOCK_N 64, 8 warps, 2-3 stages (_WIDE_STAGES): deeper pipelines
# (BLOCK_N 32, 5-7 stages) were 5-30 % slower there (third-session sweep), the shared memory being taken by
# q (72 KB) and the tiles.
_TUNED = {
    "bf16": (64, 4, 3),
    "fp8": (32, 4, 3),
    "staged": (32, 4, 3),
    "fp8_ds_mla": (32, 4, 3),
    "nvfp4_ds_mla": (32, 4, 3),
}
_WIDE = (64, 64, 8, 2)
# 3 stages prefetch the indices two tiles ahead (all of their loads become asynchronous copies); on the H200
# that helped bf16 (D-h128 309 -> 295 us, P-2k 257 -> 271 TFLOP/s; D-h64 198 -> 202) and NVFP4 (2-3 %) but
# slowed fp8_ds_mla by 7 % (two repetitions, sweep plan `stages`, third session).
_WIDE_STAGES = {"bf16": 3, "nvfp4_ds_mla": 3}
# Fewest heads that take the wide kernel.  NVFP4 switches at 17: its Triton few-heads kernel at 32 heads (348 us
# at D-h32) was slower than the wide kernel at 64 (271 us, the same work as at 17-64 heads; H200, third
# session).  On sm_90 the warp-specialized few-heads kernel takes 17-32 heads first (133 us; _launch).
WIDE_MIN_HEADS = {"nvfp4_ds_mla": 17}


def kernel_config(kind: str, num_heads: int):
    """(heads per program, block_n, num_warps, num_stages, wide kernel?) for a format kind and head count."""
    if num_heads >= WIDE_MIN_HEADS.get(kind, 33):
        return _WIDE[:3] + (_WIDE_STAGES.get(kind, _WIDE[3]), True)
    return (head_block(num_heads),) + _TUNED[kind] + (False,)


def plan_splits(num_tokens: int, num_heads: int, topk: int, device=None, block_n: int = 64,
                head_block_size: int = None, kind: str = None) -> int:
    """Split-KV factor for ``num_tokens`` queries of ``num_heads`` heads over ``topk`` rows.

    Aim for about two programs per SM: the kernels hold ~200 registers per thread, so two 4-warp programs
    fit on an SM, and with one program per SM the H200 sat at 6 % occupancy and 30-60 % of DRAM bandwidth
    (Nsight Compute, D-h16).  At b = 128, h = 16 two splits took bf16 from 132 to 95 us.  Each split keeps
    at least two tiles of ``block_n`` rows (up to 32 splits); the partials cost 2 KB per split per token
    and head.  With one or two programs' worth of work (b = 1) a split may be one 32-row tile (up to 64
    splits; the launcher caps the count at one tile of its own BLOCK_N): on the H200 that took b = 1 from
    15-26 to 13-23 us at 16 heads and from 22-28 to 20-22 us at 128 heads, but made b = 4 slower (h 16:
    fp8 20 -> 29 us; h 128: 31-35 -> 43-45), the combine step then merging 2-4x more partials (fourth
    session, ``benchmarks/small_sweep.py``)."""
    sms = _num_sms(torch.device(device)) if device is not None else 132
    per_program = (_ws_planned(kind, num_tokens, num_heads, torch.device(device))
                   if kind is not None and device is not None else 0)
    if per_program:
        # the warp-specialized kernels for quantized rows hold a whole SM (190-220 KB of shared memory): at
        # most one program per SM, each split at least two 64-row blocks (one per consumer warpgroup).  On
        # the H200 at b 128, h 16 one split ran fp8_ds_mla in 70 us, two splits (two waves) in 113-147 us.
        programs = max(1, num_tokens * -(-num_heads // per_program))
        return max(1, min(sms // programs, max(1, topk // 128), 64))
    hb = head_block_size or head_block(num_heads)
    groups = -(-num_heads // hb)
    programs = max(1, num_tokens * groups)
    want = max(1, (2 * sms) // programs)
    if programs <= 2:
        return max(1, min(want, topk // 32, 64))
    return max(1, min(want, max(1, topk // (2 * block_n)), 32))


def split_buffer_shapes(num_tokens: int, num_heads: int, num_splits: int):
    """Shapes of the fp32 split partials: (o_part [T, S, H, 512], lse_part [T, S, H])."""
    return (num_tokens, num_splits, num_heads, V_DIM), (num_tokens, num_splits, num_heads)


def _check_common(q, indices, valid_counts, out, lse, head_dim):
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q: expected [T, H, {head_dim}], got {tuple(q.shape)}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q: expected dtype torch.bfloat16, got {q.dtype}")
    if q.stride(2) != 1:
        raise ValueError("q: the last dim must be contiguous")
    t = q.shape[0]
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != t or indices.stride(1) != 1:
        raise ValueError(f"indices: expected int32 [T={t}, K] with contiguous rows, got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if valid_counts is not None and (valid_counts.dtype != torch.int32 or valid_counts.shape != (t,)
                                     or not valid_counts.is_contiguous()):
        raise ValueError(f"valid_counts: expected contiguous int32 [{t}], got {valid_counts.dtype} "
                         f"{tuple(valid_counts.shape)}")
    if out is not None and (out.shape != (t, q.shape[1], V_DIM) or out.stride(2) != 1):
        raise ValueError(f"out: expected [{t}, {q.shape[1]}, 512] with a contiguous last dim, got {tuple(out.shape)}")
    if lse is not None and (lse.shape != (t, q.shape[1]) or lse.dtype != torch.float32):
        raise ValueError(f"lse: expected float32 [{t}, {q.shape[1]}], got {lse.dtype} {tuple(lse.shape)}")


def _gluon_off(ws_kernel=None) -> bool:
    """Whether the Gluon kernels are unavailable or switched off for this call: no Gluon, the interpreter,
    or ``SPARSEMLA_WS=0`` (unless ``ws_kernel`` asks for them)."""
    if _ws is None or interpreting():
        return True
    return ws_kernel is None and os.environ.get("SPARSEMLA_WS", "1") == "0"


def _ws_ok(q, kv, kind, num_heads, ws_kernel) -> bool:
    """Whether the warp-specialized Gluon kernel takes this wide-kernel call (bf16 rows on sm_90; never
    under the interpreter).  ``ws_kernel``: None = when supported (unless SPARSEMLA_WS=0 is set), False =
    never, True or a ``ws_attention.CONFIGS`` name = when supported."""
    return not _gluon_off(ws_kernel) and _ws.supported(q, kv, kind, num_heads)


def _ws_planned(kind, num_tokens, num_heads, device) -> int:
    """Heads per program of the warp-specialized kernel for quantized rows that a call of this kind and head
    count on ``device`` goes to by default (16: ws_few, 64: ws_wide), or 0 (the split plan depends on it; q
    and cache alignment are checked at launch)."""
    if _gluon_off() or device.type != "cuda" or _capability(device) != (9, 0):
        return 0
    if _ws.few_planned(kind, num_tokens, num_heads, _num_sms(device)):
        return 16
    if _ws.wide_q_planned(kind, num_tokens, num_heads, _num_sms(device)):
        return 64
    return 0


def _few_ok(q, kv, kind, num_heads, ws_kernel) -> bool:
    """Whether the warp-specialized few-heads kernel takes this call (fp8 / fp8_ds_mla / nvfp4 rows, <= 32 heads
    or a small batch, sm_90; same switches as ``_ws_ok``)."""
    return not _gluon_off(ws_kernel) and _ws.few_supported(q, kv, kind, num_heads)


def _wide_q_ok(q, kv, kind, num_heads, ws_kernel) -> bool:
    """Whether the warp-specialized wide kernel for quantized rows takes this call (fp8 / fp8_ds_mla rows, > 32
    heads, sm_90; same switches as ``_ws_ok``)."""
    return not _gluon_off(ws_kernel) and _ws.wide_q_supported(q, kv, kind, num_heads)


# formats the FP8-arithmetic mode reads (e4m3 rows: the QK MMAs take their bytes as they are)
FP8_ARITH_KINDS = ("fp8", "fp8_ds_mla")


def fp8_arith_why_not(kind: str, device=None) -> Optional[str]:
    """None when the FP8-arithmetic mode can serve ``kind`` rows on ``device`` (None: any Hopper GPU), else why
    not (one sentence)."""
    if kind not in FP8_ARITH_KINDS:
        return f"the FP8-arithmetic mode reads only {' or '.join(FP8_ARITH_KINDS)} rows, not {kind}"
    if _gluon_off(True):
        return "the FP8-arithmetic mode is a Gluon kernel: it needs triton.experimental.gluon and no interpreter"
    if device is not None and (torch.device(device).type != "cuda" or _capability(torch.device(device)) != (9, 0)):
        return "the FP8-arithmetic mode is built for Hopper (sm_90) wgmma"
    return None


def _check_fp8_arith(kind, q, kv, tuning):
    why = fp8_arith_why_not(kind, q.device)
    if why is None and tuning:
        why = "the FP8-arithmetic mode has no Triton tiling to tune (block_n / num_warps / num_stages / kernel)"
    if why is None and not _ws._quantized_ok(q, kv):
        why = "the FP8-arithmetic mode needs bf16 q and a 16-byte aligned cache"
    if why is not None:
        raise ValueError(f"fp8_arith: {why}")


def _launch(kind: str, q, kv, fmt: KVFormat, indices, sm_scale, valid_counts, k_scale, out, lse, num_splits,
            split_buffers, block_n, num_warps, num_stages, head_block_size=None, kernel=None, fp8_family=False,
            maxnreg=None, ws_kernel=None, fp8_arith=False):
    t, h, _ = q.shape
    k = indices.shape[1]
    dev = q.device
    if out is None:
        out = torch.empty((t, h, V_DIM), dtype=q.dtype, device=dev)
    if lse is None:
        lse = torch.empty((t, h), dtype=torch.float32, device=dev)
    if t == 0:
        return out, lse
    interp = interpreting()
    cfg_hb, cfg_bn, cfg_w, cfg_st, wide = kernel_config(kind, h)
    # fp8 / fp8_ds_mla / nvfp4_ds_mla on sm_90 at <= 32 heads, and above while a batch is small
    # (ws_attention.few_planned): the warp-specialized kernel (ws_few.py), 16 heads per program, 64-row blocks
    # (it also takes NVFP4's 17-32 heads from the Triton wide kernel); not when a Triton tiling -- head block,
    # BLOCK_N, warps, stages -- is asked for: that is a tuning run
    # fp8 / fp8_ds_mla at more than 32 heads on sm_90 otherwise: the warp-specialized wide kernel (ws_wide.py),
    # 64 heads per program, 64-row blocks
    tuning = not (kernel is None and head_block_size is None and block_n is None and num_warps is None
                  and num_stages is None and ws_kernel is not False)
    few = not tuning and _few_ok(q, kv, kind, h, ws_kernel)
    wide_q = not tuning and not few and _wide_q_ok(q, kv, kind, h, ws_kernel)
    if fp8_arith:  # opt-in: the FP8-arithmetic variants of the two warp-specialized kernels for e4m3 rows
        _check_fp8_arith(kind, q, kv, tuning)
        fp8_arith = few or wide_q
    wide = wide and not few and not wide_q and kernel is None and (head_block_size or cfg_hb) >= 64
    if few:
        head_block_size, block_n = 16, 64
    if wide_q:
        head_block_size, block_n = 64, 64
    hb = head_block_size or cfg_hb
    ng = -(-h // hb)
    if block_n is None:
        block_n = 16 if interp else cfg_bn
    if num_warps is None:
        num_warps = cfg_w
    if num_stages is None:
        num_stages = cfg_st
    if num_splits is None:
        num_splits = plan_splits(t, h, k, dev, block_n, hb, kind=kind if few or wide_q else None)
    num_splits = max(1, min(int(num_splits), max(1, -(-k // block_n))))
    rows_per_split = -(-(-(-k // num_splits)) // block_n) * block_n
    num_splits = max(1, -(-k // rows_per_split)) if k else 1
    if num_splits > 1:
        if split_buffers is None:
            o_shape, l_shape = split_buffer_shapes(t, h, num_splits)
            o_part = torch.empty(o_shape, dtype=torch.float32, device=dev)
            l_part = torch.empty(l_shape, dtype=torch.float32, device=dev)
        else:
            o_part, l_part = split_buffers
            if o_part.numel() < t * num_splits * h * V_DIM or l_part.numel() < t * num_splits * h:
                raise ValueError("split_buffers: too small for this call's tokens x splits x heads")
        o_dst, l_dst = o_part, l_part
        o_strides = (num_splits * h * V_DIM, h * V_DIM, V_DIM)
        l_strides = (num_splits * h, h, 1)
    else:
        o_dst, l_dst = out, lse
        o_strides = (out.stride(0), 0, out.stride(1))
        l_strides = (lse.stride(0), 0, lse.stride(1))
    vc = valid_counts if valid_counts is not None else indices  # dummy pointer when absent
    sm_scale_log2 = float(sm_scale) * LOG2E
    grid = (t * num_splits * ng,)
    common = dict(HB=hb, BN=block_n, NG=ng, HAS_VC=valid_counts is not None,
                  INTERP=interp, num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None and not interp:
        common["maxnreg"] = maxnreg  # cap registers so more programs fit per SM
    args = (q, q.stride(0), q.stride(1), kv, indices, indices.stride(0), vc,
            o_dst, *o_strides, l_dst, *l_strides, sm_scale_log2)
    rope = fmt.rope_dim
    if kernel is not None and fp8_family:  # experimental variants (tools/exp/variants.py)
        kernel[grid](*args, float(k_scale), h, k, rows_per_split, num_splits, BPT=fmt.bytes_per_token,
                     DS=kind == "fp8_ds_mla", STAGED=False, ROPE=rope, **common)
    elif kernel is not None:
        kernel[grid](*args, h, k, rows_per_split, num_splits, BPT=fmt.bytes_per_token, ROPE=rope, **common)
    elif wide_q:
        _ws.launch_wide_q(grid, args + (float(k_scale), h, k, rows_per_split, num_splits), fmt.bytes_per_token,
                          kind, rope, ng, valid_counts is not None, fp8_arith=fp8_arith)
    elif few:
        _ws.launch_few(grid, args + (float(k_scale), h, k, rows_per_split, num_splits), fmt.bytes_per_token,
                       kind, rope, ng, valid_counts is not None, fp8_arith=fp8_arith)
    elif wide and hb == 64 and ws_kernel is not False and _ws_ok(q, kv, kind, h, ws_kernel):
        _ws.launch(grid, args + (h, k, rows_per_split, num_splits), fmt.bytes_per_token, rope, ng,
                   valid_counts is not None, config=ws_kernel if isinstance(ws_kernel, str) else None)
    elif wide:
        _fwd_wide_kernel[grid](*args, float(k_scale), h, k, rows_per_split, num_splits, BPT=fmt.bytes_per_token,
                               KIND=_WIDE_KIND[kind], STAGED=kind == "staged", ROPE=rope, **common)
    elif kind == "bf16":
        _fwd_bf16_kernel[grid](*args, h, k, rows_per_split, num_splits, ROPE=rope, **common)
    elif kind == "nvfp4_ds_mla":
        _fwd_nvfp4_kernel[grid](*args, h, k, rows_per_split, num_splits, BPT=fmt.bytes_per_token, ROPE=rope, **common)
    else:  # fp8, staged fp8, fp8_ds_mla
        _fwd_fp8_kernel[grid](*args, float(k_scale), h, k, rows_per_split, num_splits, BPT=fmt.bytes_per_token,
                              DS=kind == "fp8_ds_mla", STAGED=kind == "staged", ROPE=rope, **common)
    if num_splits > 1:
        pdl = COMBINE_PDL and not interp and _capability(dev) >= (9, 0)
        _combine_kernel[(t, h, V_DIM // 128)](o_part, l_part, out, out.stride(0), out.stride(1), lse, lse.stride(0),
                                              lse.stride(1), h, num_splits, SP=triton.next_power_of_2(num_splits),
                                              PDL=pdl, num_warps=4 if num_splits > 8 else 2, launch_pdl=pdl)
    return out, lse


def sparse_mla_fwd(q: torch.Tensor, kv_rows: torch.Tensor, fmt, indices: torch.Tensor, sm_scale: float,
                   valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                   out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                   num_splits: Optional[int] = None, split_buffers=None, *, block_n: Optional[int] = None,
                   num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                   fp8_arith: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA forward over rows of any KV format, dequantized in registers.

    Args:
        q: bf16 ``[T, H, D]``, D = ``fmt.head_dim`` (576, or 512 for NoPE).
        kv_rows: uint8 ``[num_rows, fmt.bytes_per_token]`` (``PagedKVCache.rows``; a bf16 workspace
            ``ws [rows, D]`` is passed as ``ws.view(torch.uint8)`` with the ``bf16`` format).
        fmt: the rows' :class:`KVFormat` (or its name).
        indices: int32 ``[T, K]`` rows of ``kv_rows``, -1 = no token.  Entries at or past
            ``valid_counts[t]`` are never read.  Not range-checked here (the public API does that).
        sm_scale: softmax scale; k_scale: the ``fp8`` format's per-tensor scale (ignored by the others).
        out, lse: optional outputs (bf16 ``[T, H, 512]``, fp32 ``[T, H]``).
        num_splits: split-KV factor (default :func:`plan_splits`); split_buffers: preallocated
            ``(o_part, lse_part)`` of :func:`split_buffer_shapes` (needed for CUDA-graph capture).
        fp8_arith: opt-in FP8-arithmetic mode (fp8 / fp8_ds_mla rows, sm_90): q becomes two e4m3 terms (a
            power of two per head) and QK runs on e4m3 tensor cores, reading the rows' bytes unconverted; less
            accurate than the default (BENCHMARKS.md has its measured error and speed).  Both warp-specialized
            kernels for these rows have the variant (few heads / small batches: ``ws_few``; 64 heads per
            program: ``ws_wide``), so it applies to every call on sm_90 with bf16 q and a 16-byte aligned
            cache; ValueError elsewhere, with the reason (:func:`fp8_arith_why_not`).

    Returns ``(out, lse)``: lse is the natural log including sm_scale; an empty row gives 0 / -inf.
    """
    fmt = get_format(fmt)
    _check_common(q, indices, valid_counts, out, lse, fmt.head_dim)
    if kv_rows.dtype != torch.uint8 or kv_rows.dim() != 2 or kv_rows.shape[1] != fmt.bytes_per_token \
            or not kv_rows.is_contiguous():
        raise ValueError(f"kv_rows: expected contiguous uint8 [rows, {fmt.bytes_per_token}] for {fmt.id}, "
                         f"got {kv_rows.dtype} {tuple(kv_rows.shape)}")
    return _launch(fmt.name, q, kv_rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, num_splits,
                   split_buffers, block_n, num_warps, num_stages, fp8_arith=fp8_arith)


def sparse_mla_fwd_staged(q: torch.Tensor, staged: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                          valid_counts: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                          out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                          num_splits: Optional[int] = None, split_buffers=None, *, block_n: Optional[int] = None,
                          num_warps: Optional[int] = None, num_stages: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA forward over FP8 rows staged per query (``kernels.staging.gather_topk_fp8``).

    staged: float8_e4m3fn ``[T, K, D]`` holding ``e4m3(dequant / k_scale)``; entry ``[t, k]`` is read only
    where ``indices[t, k] >= 0`` and ``k < valid_counts[t]``.  Uses the ``fp8`` bmm scales (k_scale).
    """
    t = q.shape[0]
    d = q.shape[2]
    if staged.dtype != torch.float8_e4m3fn or staged.dim() != 3 or staged.shape[0] != t \
            or staged.shape[1] != indices.shape[1] or staged.shape[2] != d or not staged.is_contiguous():
        raise ValueError(f"staged: expected contiguous float8_e4m3fn [T, K, {d}] matching indices, "
                         f"got {staged.dtype} {tuple(staged.shape)}")
    fmt = get_format("fp8", d - V_DIM)
    _check_common(q, indices, valid_counts, out, lse, fmt.head_dim)
    return _launch("staged", q, staged.view(torch.uint8), fmt, indices, sm_scale, valid_counts, k_scale, out, lse,
                   num_splits, split_buffers, block_n, num_warps, num_stages)
