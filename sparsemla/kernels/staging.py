"""Staging gathers: cache rows of any format -> FP8 rows for the top-k of each query token, and each
request's context -> a contiguous bf16 workspace for prefill.

(a) ``gather_topk_fp8``: ``out[t, k] = e4m3_RNE_sat(dequant(row indices[t, k]) / k_scale)`` for all
    ``head_dim`` dims (``docs/kv-formats.md``, "Staging to FP8"): what a plain ``fp8`` cache written
    with that ``k_scale`` would hold, so any FP8 kernel reads it with the ``fp8`` bmm scales.  For
    the ``fp8`` format itself this is a byte copy (``e4m3(e * k / k) == e``); for nvfp4 with
    k_scale 1 the e4m3 rope is copied bit-exactly.  Entries that are -1, at/after ``valid_counts[t]``
    or outside ``[0, num_rows)`` become zero rows (their cache row is never read).
(b) ``upconvert_context``: request ``r``'s rows for positions ``0 .. seq_lens[r]-1`` (through its block
    table), dequantized (``fmt.decode``) and rounded to bf16, at workspace rows
    ``workspace_start[r] + pos``.  A block id outside the cache (or negative) gives zero rows; a
    workspace row outside ``out`` is not written.

Every layout of a format is read through ``fmt.layout``'s offsets (constexprs): vLLM's NoPE rows
(656 / 352 B, the zero RoPE slot skipped) and the compact ones alike.  NaN values (a group
written from non-finite input, ``formats/base.py``) stage as the e4m3 NaN 0x7F and upconvert to bf16 NaN.  A default call (given
outputs) reads nothing on the host: no synchronization, capturable in a CUDA graph; ``check=True`` is
a debug option that validates index values on the host first.

Tiling: (a) one program = ``BK`` (16) consecutive top-k entries of one query token, 4 warps; (b) one
program = ``BP`` (16; 32 for nvfp4) consecutive positions of one request, 4 warps; both on a flat 1-D grid.  A
program moves whole rows: a ``[rows, 512]`` load of the latent part (plus the scale bytes and the
rope), the dequantization in registers, and ``[rows, 512]`` / ``[rows, rope]`` stores, all at int64
byte offsets.  nvfp4 rows are never de-interleaved: each packed byte (dims 2k, 2k+1) is decoded into
one fp16x2 word and stored as one 16-bit (e4m3 pair) or 32-bit (bf16 pair) element.

Why this should run near copy bandwidth: (a) at b 128 x top-k 2048 moves 243..453 MB (row read + 576 B
written per entry), 57..107 us at ~4.2 TB/s; (b) for 4 x 32K tokens 197..302 MB, 46..71 us.  The
sm_90 SASS bodies are ~2 (fp8 byte copy), ~5 (bf16), ~6 (fp8_ds_mla) and ~7 (nvfp4, k_scale 1: the
e2m1 x scale products and the e4m3 conversion in fp16x2) instructions per element for (a), 5..10
for (b): 10..35 us of issue time, under the memory time, with 32..56 registers (8+ programs, ~100 KB
of loads in flight per SM).  Both use the conversion paths of ``cache_write.py`` (cvt instructions on
the GPU, exact bit arithmetic under the interpreter).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._validate import check_block_geometry, check_cache_rows, check_index_range, check_k_scale, check_tensor
from ..formats import get_format
from .cache_write import (FMT_BF16, FMT_FP8, FMT_FP8_DS_MLA, FMT_NVFP4_DS_MLA, KS_ONE, apply_inv_k_scale, bf16_bits,
                          check_config, e4m3_codes, f32_from_e4m3, format_id, k_scale_mode, use_emulation)

_INT = (torch.int32, torch.int64)

# Defaults: rows per program and warps.  16 rows x 512 dims with 4 warps is 64 values per thread:
# enough bytes in flight per program (5-18 KB) at a register count that still allows several
# programs per SM.  The movement benchmark's sweep tries others.
GATHER_ROWS_PER_PROGRAM = 16
GATHER_NUM_WARPS = 4
UPCONVERT_ROWS_PER_PROGRAM = 16
UPCONVERT_NUM_WARPS = 4
# nvfp4 rows (352 / 288 B) are short: 32 rows per program keep as many bytes in flight as 16 rows of
# the other formats (picked by the movement benchmark's sweep on the H200).
UPCONVERT_TUNED = {"nvfp4_ds_mla": {"BP": 32, "num_warps": 4}}


# --------------------------------------------------------------------------------------------------
# dequantization of whole rows (shared by both kernels)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _f32_from_bf16_bits(u):
    """uint16 bf16 bits -> fp32 (exact: the bits are the top half of the fp32)."""
    return (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_words(p):
    """Packed nvfp4 bytes (int32 0..255, any shape) -> uint32 fp16x2 words: low half = the low
    nibble's e2m1 value times 2^-14, high half = the high nibble's, exact.

    An e2m1 code's bits, put at the same places of an fp16 (``sign<<15 | code<<9``), read as the
    e2m1 value times 2^-14 (code 1 becomes the fp16 subnormal 2^-15 = 0.5 * 2^-14).  Copying the
    byte to bit 12 as well (``p * 0x1001``, no overlap) puts the high nibble where the same two
    mask-and-shift steps move it into the high half."""
    y = p.to(tl.uint32) * 0x1001
    return ((y & 0x00080008) << 12) | ((y & 0x00070007) << 9)


@triton.jit
def _f32x2_from_f16x2(w, EMULATE: tl.constexpr):
    """uint32 fp16x2 words -> (low half, high half) as fp32 (exact)."""
    if EMULATE:
        lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _e4m3x2(lo, hi, EMULATE: tl.constexpr):
    """Two fp32 tensors -> uint16 ``e4m3(lo) | e4m3(hi) << 8`` (RNE, saturating; one instruction)."""
    if EMULATE:
        return e4m3_codes(lo, EMULATE).to(tl.uint16) | (e4m3_codes(hi, EMULATE).to(tl.uint16) << 8)
    else:
        # cvt.*x2 puts its first source in the upper half.
        return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [lo, hi],
                                         dtype=tl.uint16, is_pure=True, pack=1)


@triton.jit
def _bf16x2(lo, hi, EMULATE: tl.constexpr):
    """Two fp32 tensors -> uint32 ``bf16(lo) | bf16(hi) << 16`` (RNE; one instruction)."""
    if EMULATE:
        return bf16_bits(lo, EMULATE).to(tl.uint32) | (bf16_bits(hi, EMULATE).to(tl.uint32) << 16)
    else:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                         dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _load_latent(rows_ptr, base, m2, R: tl.constexpr, FMT: tl.constexpr, SCALE_OFF: tl.constexpr,
                 EMULATE: tl.constexpr):
    """The 512 latent values of ``R`` rows (byte offsets ``base`` [R] int64, rows masked by ``m2``
    [R, 1]; masked rows read as zeros) -> fp32 [R, 512], exactly ``fmt.decode`` without k_scale
    (the fp8 format's k_scale is applied by the caller).  bf16, fp8 and fp8_ds_mla; nvfp4 rows go
    through ``_load_latent_nvfp4``."""
    D: tl.constexpr = 512
    col = tl.arange(0, D)
    if FMT == FMT_BF16:
        p16 = rows_ptr.to(tl.pointer_type(tl.uint16))
        u = tl.load(p16 + (base // 2)[:, None] + col[None, :], mask=m2, other=0)
        x = _f32_from_bf16_bits(u)
    elif FMT == FMT_FP8:
        q = tl.load(rows_ptr + base[:, None] + col[None, :], mask=m2, other=0)
        x = f32_from_e4m3(q, EMULATE)
    elif FMT == FMT_FP8_DS_MLA:
        q = tl.load(rows_ptr + base[:, None] + col[None, :], mask=m2, other=0)
        pf = rows_ptr.to(tl.pointer_type(tl.float32))
        s = tl.load(pf + ((base + SCALE_OFF) // 4)[:, None] + tl.arange(0, 4)[None, :], mask=m2, other=0.0)
        x = tl.reshape(tl.reshape(f32_from_e4m3(q, EMULATE), [R, 4, 128]) * s[:, :, None], [R, D])
    return x


@triton.jit
def _load_latent_nvfp4(rows_ptr, base, m2, R: tl.constexpr, SCALE_OFF: tl.constexpr, EMULATE: tl.constexpr):
    """nvfp4 rows -> (fp16x2 words ``[R, 32, 8]`` uint32 from ``_e2m1_words``: block, byte within the
    block; the block scales ``[R, 32]`` fp32).  Value of dim ``16 s + 2 j (+1)`` = low (high) half of
    word ``[s, j]`` times ``2^14 * sf[s]``.  The (even, odd) pairs stay together: the callers store
    each pair as one wider element, which needs no interleaving."""
    bc = tl.arange(0, 256)
    p = tl.load(rows_ptr + base[:, None] + bc[None, :], mask=m2, other=0).to(tl.int32)
    blk = tl.arange(0, 32)
    perm = 8 * (blk % 4) + blk // 4                                   # block s -> its scale byte
    sfc = tl.load(rows_ptr + (base + SCALE_OFF)[:, None] + perm[None, :], mask=m2, other=0)
    return _e2m1_words(tl.reshape(p, [R, 32, 8])), f32_from_e4m3(sfc, EMULATE)


@triton.jit
def _nvfp4_f32_pairs(w, sf, EMULATE: tl.constexpr):
    """(words, scales) of ``_load_latent_nvfp4`` -> (even dims, odd dims) fp32 ``[R, 32, 8]``, exact
    (e2m1 times an e4m3 scale has at most 6 significant bits)."""
    lo, hi = _f32x2_from_f16x2(w, EMULATE)
    s = (sf * 16384.0)[:, :, None]
    return lo * s, hi * s


@triton.jit
def _nvfp4_e4m3x2(w, sf):
    """GPU fast path for staging nvfp4 with k_scale 1: (words, scales) -> uint16 e4m3 pairs, all in
    fp16x2.  ``(v 2^-14) * (sf 2^7)`` is exact in fp16 (at most 6 significant bits, magnitude in
    [2^-17, 21], where even the fp16 subnormals have enough resolution), times 2^7 is ``v sf`` exact
    (<= 2688), and the e4m3 conversion rounds it exactly like the fp32 path: three instructions per
    pair instead of seven."""
    s16 = (sf * 128.0).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    s2 = (s16 | (s16 << 16))[:, :, None]
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, k; mov.b32 k, 0x58005800; mul.rn.f16x2 t, $1, $2; mul.rn.f16x2 t, t, k; "
        "cvt.rn.satfinite.e4m3x2.f16x2 $0, t; }",
        "=h,r,r", [w, tl.broadcast_to(s2, w.shape)], dtype=tl.uint16, is_pure=True, pack=1)


@triton.jit
def _load_rope(rows_ptr, base, m2, R: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr,
               ROPE_OFF: tl.constexpr, EMULATE: tl.constexpr):
    """The rope part of ``R`` rows -> fp32 [R, ROPE] (bf16 or e4m3 in the row, unscaled)."""
    rc = tl.arange(0, ROPE)
    if FMT == FMT_BF16 or FMT == FMT_FP8_DS_MLA:
        p16 = rows_ptr.to(tl.pointer_type(tl.uint16))
        u = tl.load(p16 + ((base + ROPE_OFF) // 2)[:, None] + rc[None, :], mask=m2, other=0)
        r = _f32_from_bf16_bits(u)
    else:
        q = tl.load(rows_ptr + (base + ROPE_OFF)[:, None] + rc[None, :], mask=m2, other=0)
        r = f32_from_e4m3(q, EMULATE)
    return r


# --------------------------------------------------------------------------------------------------
# (a) top-k gather to FP8
# --------------------------------------------------------------------------------------------------
@triton.jit
def _gather_topk_fp8_kernel(
    rows_ptr,                       # uint8 [num_rows, BPT]
    idx_ptr, stride_it, stride_ik,  # [T, K] int32/int64 rows, -1 = none
    vc_ptr,                         # [T] int32 valid counts (unused unless HAS_VC)
    out_ptr,                        # uint8 [T, K, HEAD_DIM] (e4m3 codes), contiguous
    K, num_rows, k_scale, inv_k_scale,
    FMT: tl.constexpr, ROPE: tl.constexpr, BPT: tl.constexpr, ROPE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, KS_MODE: tl.constexpr, EMULATE: tl.constexpr, HAS_VC: tl.constexpr,
    BK: tl.constexpr,
):
    D: tl.constexpr = 512
    HEAD_DIM: tl.constexpr = D + ROPE
    # One flat grid (no 65535 limit on the token count): consecutive programs = consecutive chunks
    # of one token's top-k list.
    pid = tl.program_id(0)
    chunks = tl.cdiv(K, BK)
    t = (pid // chunks).to(tl.int64)
    k = (pid % chunks) * BK + tl.arange(0, BK)
    in_k = k < K
    idx = tl.load(idx_ptr + t * stride_it + k * stride_ik, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (idx >= 0) & (idx < num_rows)
    if HAS_VC:
        valid = valid & (k < tl.load(vc_ptr + t))
    base = tl.where(valid, idx, 0) * BPT
    obase = (t * K + k) * HEAD_DIM                        # int64 byte offset of each output row
    m2 = valid[:, None]
    mo = in_k[:, None]
    col = tl.arange(0, D)
    if FMT == FMT_FP8:
        # e4m3(e * k_scale / k_scale) == e: the staged row is the cached row.
        q = tl.load(rows_ptr + base[:, None] + col[None, :], mask=m2, other=0)
        tl.store(out_ptr + obase[:, None] + col[None, :], q, mask=mo)
        if ROPE > 0:
            rc = tl.arange(0, ROPE)
            qr = tl.load(rows_ptr + (base + ROPE_OFF)[:, None] + rc[None, :], mask=m2, other=0)
            tl.store(out_ptr + (obase + D)[:, None] + rc[None, :], qr, mask=mo)
    else:
        if FMT == FMT_NVFP4_DS_MLA:
            w, sf = _load_latent_nvfp4(rows_ptr, base, m2, BK, SCALE_OFF, EMULATE)
            if KS_MODE == KS_ONE and not EMULATE:
                q2 = _nvfp4_e4m3x2(w, sf)
            else:
                lo, hi = _nvfp4_f32_pairs(w, sf, EMULATE)
                q2 = _e4m3x2(apply_inv_k_scale(lo, k_scale, inv_k_scale, KS_MODE),
                             apply_inv_k_scale(hi, k_scale, inv_k_scale, KS_MODE), EMULATE)
            o16 = out_ptr.to(tl.pointer_type(tl.uint16))
            c2 = tl.arange(0, D // 2)
            tl.store(o16 + (obase // 2)[:, None] + c2[None, :], tl.reshape(q2, [BK, D // 2]), mask=mo)
        else:
            x = _load_latent(rows_ptr, base, m2, BK, FMT, SCALE_OFF, EMULATE)
            q = e4m3_codes(apply_inv_k_scale(x, k_scale, inv_k_scale, KS_MODE), EMULATE)
            tl.store(out_ptr + obase[:, None] + col[None, :], q, mask=mo)
        if ROPE > 0:
            rc = tl.arange(0, ROPE)
            if FMT == FMT_NVFP4_DS_MLA and KS_MODE == KS_ONE:
                # e4m3 rope and k_scale 1: a bit-exact copy
                qr = tl.load(rows_ptr + (base + ROPE_OFF)[:, None] + rc[None, :], mask=m2, other=0)
            else:
                r = _load_rope(rows_ptr, base, m2, BK, ROPE, FMT, ROPE_OFF, EMULATE)
                qr = e4m3_codes(apply_inv_k_scale(r, k_scale, inv_k_scale, KS_MODE), EMULATE)
            tl.store(out_ptr + (obase + D)[:, None] + rc[None, :], qr, mask=mo)


def gather_topk_fp8(rows: torch.Tensor, fmt, indices: torch.Tensor, valid_counts: Optional[torch.Tensor] = None,
                    k_scale: float = 1.0, out: Optional[torch.Tensor] = None, *, check: bool = False,
                    _config: Optional[dict] = None, _emulate: Optional[bool] = None) -> torch.Tensor:
    """Stage the top-k rows of every query token as FP8 (e4m3) rows.

    Args:
        rows: uint8 ``[num_rows, bytes_per_token]`` contiguous, the flat cache (``PagedKVCache.rows``).
        fmt: the cache's :class:`KVFormat` (or name).
        indices: int32/int64 ``[T, K]`` rows of ``rows``, -1 = no token (``convert_indices`` output).
        valid_counts: optional int32 ``[T]``; entries at ``k >= valid_counts[t]`` are treated as -1.
        k_scale: the per-tensor scale of the staged rows (a kernel reading them uses the ``fp8``
            bmm scales with this k_scale); for the ``fp8`` format it must be the cache's k_scale.
        out: optional float8_e4m3fn ``[T, K, head_dim]`` contiguous, written in place (else allocated).
        check: debug option: raise if an index within the valid counts lies outside ``[-1, num_rows)``
            (reads the indices on the host: one device sync).  Default False: such an entry stages as a
            zero row, and nothing is read outside ``rows``.
        _config: tiling override for benchmarks (``{"BK": rows per program, "num_warps": w}``).
        _emulate: force / forbid the bit-arithmetic conversions (tests on the GPU).

    Returns:
        float8_e4m3fn ``[T, K, head_dim]``: ``e4m3_RNE_sat(dequant(row) / k_scale)``, zero rows for
        entries that are -1, past the valid count or outside the cache.  One launch, no host sync by default.
    """
    fmt = get_format(fmt)
    k_scale = check_k_scale(k_scale)
    dev = check_cache_rows(rows, fmt)
    check_tensor("indices", indices, dtypes=_INT, ndim=2, device=dev)
    t, k = indices.shape
    if valid_counts is not None:
        check_tensor("valid_counts", valid_counts, dtype=torch.int32, shape=(t,), device=dev, contiguous=True)
    shape = (t, k, fmt.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev)
    else:
        check_tensor("out", out, dtype=torch.float8_e4m3fn, shape=shape, device=dev, contiguous=True)
    if check:
        # Entries past a token's valid count are never read, so they may hold anything.
        live = indices
        if valid_counts is not None:
            keep = torch.arange(k, device=dev)[None, :] < valid_counts[:, None]
            live = torch.where(keep, indices, torch.full_like(indices, -1))
        check_index_range("indices", live, rows.shape[0])
    if t == 0 or k == 0:
        return out
    mode, ks, inv = k_scale_mode(k_scale)
    cfg = {"BK": GATHER_ROWS_PER_PROGRAM, "num_warps": GATHER_NUM_WARPS}
    cfg.update(check_config(_config, ("BK", "num_warps")))
    lay = fmt.layout
    grid = (-(-k // cfg["BK"]) * t,)
    _gather_topk_fp8_kernel[grid](
        rows, indices, indices.stride(0), indices.stride(1),
        valid_counts if valid_counts is not None else indices, out.view(torch.uint8),
        k, rows.shape[0], ks, inv,
        FMT=format_id(fmt), ROPE=fmt.rope_dim, BPT=fmt.bytes_per_token, ROPE_OFF=max(lay.rope_offset, 0),
        SCALE_OFF=max(lay.scale_offset, 0), KS_MODE=mode, EMULATE=use_emulation(_emulate),
        HAS_VC=valid_counts is not None, BK=cfg["BK"], num_warps=cfg["num_warps"],
    )
    return out


# --------------------------------------------------------------------------------------------------
# (b) context upconvert to a bf16 workspace
# --------------------------------------------------------------------------------------------------
@triton.jit
def _upconvert_kernel(
    rows_ptr,                       # uint8 [num_rows, BPT]
    bt_ptr, stride_br, stride_bb,   # [R, max_blocks] block table
    seq_ptr,                        # [R] context lengths
    ws_ptr,                         # [R] workspace row of each request's position 0 (< 0: skip)
    out_ptr,                        # bf16 [W, HEAD_DIM] contiguous
    max_blocks, num_blocks, block_stride_rows, W, k_scale,
    BLOCK_SIZE: tl.constexpr, FMT: tl.constexpr, ROPE: tl.constexpr, BPT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, EMULATE: tl.constexpr, BP: tl.constexpr,
):
    D: tl.constexpr = 512
    HEAD_DIM: tl.constexpr = D + ROPE
    pid = tl.program_id(0)
    tiles = tl.cdiv(max_blocks * BLOCK_SIZE, BP)
    r = (pid // tiles).to(tl.int64)
    pos = (pid % tiles) * BP + tl.arange(0, BP)
    seq = tl.load(seq_ptr + r).to(tl.int64)
    ws = tl.load(ws_ptr + r).to(tl.int64)
    blk = pos // BLOCK_SIZE
    wpos = ws + pos                            # workspace row of each position
    # (wpos >= pos is ws >= 0 as a tensor compare: some interpreters mishandle tensor & scalar masks)
    live = (pos < seq) & (blk < max_blocks) & (wpos >= pos) & (wpos < W)
    phys = tl.load(bt_ptr + r * stride_br + blk * stride_bb, mask=live, other=-1).to(tl.int64)
    ok = live & (phys >= 0) & (phys < num_blocks)   # a missing block or one outside the cache: zero rows
    base = tl.where(ok, phys * block_stride_rows + pos % BLOCK_SIZE, 0) * BPT
    o16 = out_ptr.to(tl.pointer_type(tl.uint16))
    obase = wpos * HEAD_DIM                    # int64 element offset of each workspace row
    m2 = ok[:, None]
    mo = live[:, None]
    col = tl.arange(0, D)
    if FMT == FMT_BF16:
        # bf16 rows: a copy of the 16-bit values.
        p16 = rows_ptr.to(tl.pointer_type(tl.uint16))
        u = tl.load(p16 + (base // 2)[:, None] + col[None, :], mask=m2, other=0)
        tl.store(o16 + obase[:, None] + col[None, :], u, mask=mo)
        if ROPE > 0:
            rc = tl.arange(0, ROPE)
            ur = tl.load(p16 + ((base + ROPE_OFF) // 2)[:, None] + rc[None, :], mask=m2, other=0)
            tl.store(o16 + (obase + D)[:, None] + rc[None, :], ur, mask=mo)
    else:
        if FMT == FMT_NVFP4_DS_MLA:
            w, sf = _load_latent_nvfp4(rows_ptr, base, m2, BP, SCALE_OFF, EMULATE)
            lo, hi = _nvfp4_f32_pairs(w, sf, EMULATE)
            w = _bf16x2(lo, hi, EMULATE)
            o32 = out_ptr.to(tl.pointer_type(tl.uint32))
            c2 = tl.arange(0, D // 2)
            tl.store(o32 + (obase // 2)[:, None] + c2[None, :], tl.reshape(w, [BP, D // 2]), mask=mo)
        else:
            x = _load_latent(rows_ptr, base, m2, BP, FMT, SCALE_OFF, EMULATE)
            if FMT == FMT_FP8:
                x = x * k_scale                # the fp8 format's decode: float(e4m3) * k_scale
            tl.store(o16 + obase[:, None] + col[None, :], bf16_bits(x, EMULATE), mask=mo)
        if ROPE > 0:
            rc = tl.arange(0, ROPE)
            rr = _load_rope(rows_ptr, base, m2, BP, ROPE, FMT, ROPE_OFF, EMULATE)
            if FMT == FMT_FP8:
                rr = rr * k_scale
            tl.store(o16 + (obase + D)[:, None] + rc[None, :], bf16_bits(rr, EMULATE), mask=mo)


def upconvert_context(rows: torch.Tensor, fmt, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      block_size: int, block_stride_rows: Optional[int] = None, k_scale: float = 1.0,
                      out: Optional[torch.Tensor] = None, workspace_start: Optional[torch.Tensor] = None,
                      *, check: bool = False, _config: Optional[dict] = None,
                      _emulate: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dequantize each request's context into a contiguous bf16 workspace (the prefill input).

    Args:
        rows: uint8 ``[num_rows, bytes_per_token]`` contiguous, the flat cache.
        fmt: the cache's format.
        block_table: int32/int64 ``[R, max_blocks]`` physical block ids per request (a negative entry =
            no block: its positions get zero rows, as do those of a block id past the cache's blocks).
        seq_lens: int32/int64 ``[R]`` context length of each request (positions ``0 .. seq_len-1``).
        block_size, block_stride_rows: cache geometry (stride defaults to block_size).
        k_scale: the cache's per-tensor scale (changes only the ``fp8`` format's values).
        out: optional bf16 ``[W, head_dim]`` contiguous workspace, written in place (rows that no
            request maps to are left as they are; positions that would land past row ``W`` are not
            written).  Without it one is allocated, which reads ``sum(seq_lens)`` on the host (a sync).
        workspace_start: optional int32/int64 ``[R]``: request ``r``'s position ``p`` goes to workspace row
            ``workspace_start[r] + p``; a negative start skips the request.  Default: the exclusive
            cumulative sum of ``seq_lens`` (requests back to back, in order; computed on the device).
        check: debug option: raise for a negative or too long seq_len, a used block id outside the
            cache, or a request that does not fit in ``out`` (reads them on the host: one sync).
        _config: tiling override for benchmarks (``{"BP": positions per program, "num_warps": w}``).
        _emulate: force / forbid the bit-arithmetic conversions (tests on the GPU).

    Returns:
        ``(out, workspace_start)``: bf16 ``[W, head_dim]`` (``W = sum(seq_lens)`` when allocated here)
        and the int32 ``[R]`` starts used (feed them to ``convert_indices(..., workspace_start=...)``).
        One launch; no host sync when ``out`` is given and ``check`` is False.
    """
    fmt = get_format(fmt)
    k_scale = check_k_scale(k_scale)
    dev = check_cache_rows(rows, fmt)
    check_tensor("block_table", block_table, dtypes=_INT, ndim=2, device=dev)
    n_req, max_blocks = block_table.shape
    check_tensor("seq_lens", seq_lens, dtypes=_INT, shape=(n_req,), device=dev, contiguous=True)
    block_stride_rows = check_block_geometry(block_size, block_stride_rows)
    if workspace_start is None:
        workspace_start = (torch.cumsum(seq_lens, 0) - seq_lens).to(torch.int32)
    else:
        check_tensor("workspace_start", workspace_start, dtypes=_INT, shape=(n_req,), device=dev, contiguous=True)
    if out is None:
        total = int(seq_lens.sum()) if n_req else 0
        out = torch.empty((total, fmt.head_dim), dtype=torch.bfloat16, device=dev)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(None, fmt.head_dim), device=dev, contiguous=True)
    if check and n_req:
        _check_upconvert(rows, block_table, seq_lens, block_size, block_stride_rows, workspace_start, out)
    if n_req == 0 or max_blocks == 0:
        return out, workspace_start
    cfg = {"BP": UPCONVERT_ROWS_PER_PROGRAM, "num_warps": UPCONVERT_NUM_WARPS}
    cfg.update(UPCONVERT_TUNED.get(fmt.name, {}))
    cfg.update(check_config(_config, ("BP", "num_warps")))
    lay = fmt.layout
    num_blocks = (rows.shape[0] - block_size) // block_stride_rows + 1 if rows.shape[0] >= block_size else 0
    grid = (-(-(max_blocks * block_size) // cfg["BP"]) * n_req,)
    _upconvert_kernel[grid](
        rows, block_table, block_table.stride(0), block_table.stride(1), seq_lens, workspace_start, out,
        max_blocks, num_blocks, block_stride_rows, out.shape[0], k_scale_mode(k_scale)[1],
        BLOCK_SIZE=block_size, FMT=format_id(fmt), ROPE=fmt.rope_dim, BPT=fmt.bytes_per_token,
        ROPE_OFF=max(lay.rope_offset, 0), SCALE_OFF=max(lay.scale_offset, 0), EMULATE=use_emulation(_emulate),
        BP=cfg["BP"], num_warps=cfg["num_warps"],
    )
    return out, workspace_start


def _check_upconvert(rows, block_table, seq_lens, block_size, block_stride_rows, workspace_start, out):
    """Host-side validation (one sync): the blocks of the used positions lie inside the cache (a
    negative entry = no block: its positions become zero rows, as convert_indices treats them as no
    token), and every staged request fits in ``out``."""
    seq = seq_lens.to(torch.int64)
    n_req, max_blocks = block_table.shape
    lo, hi = int(seq.min()), int(seq.max())
    if lo < 0:
        raise ValueError(f"seq_lens: expected entries >= 0, found {lo}")
    if hi > max_blocks * block_size:
        raise ValueError(f"seq_lens: a context of {hi} tokens needs more than the {max_blocks} blocks of "
                         f"{block_size} tokens in block_table")
    staged = workspace_start.to(torch.int64) >= 0
    needed = (seq + block_size - 1) // block_size                             # blocks used per request
    used = (torch.arange(max_blocks, device=seq.device)[None, :] < needed[:, None]) & staged[:, None]
    if bool(used.any()):
        ids = block_table.to(torch.int64)[used]
        num_blocks_in_rows = (rows.shape[0] - block_size) // block_stride_rows + 1 if rows.shape[0] >= block_size else 0
        if int(ids.max()) >= num_blocks_in_rows:
            raise ValueError(f"block_table: block ids of the used positions must be < {num_blocks_in_rows} (blocks "
                             f"in rows), found {int(ids.max())}")
    ends = torch.where(staged, workspace_start.to(torch.int64) + seq, torch.zeros_like(seq))
    if int(ends.max()) > out.shape[0]:
        raise ValueError(f"out: a request ends at workspace row {int(ends.max())}, but out has {out.shape[0]} rows")


__all__ = ["gather_topk_fp8", "upconvert_context"]
