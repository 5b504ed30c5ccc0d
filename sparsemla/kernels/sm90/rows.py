"""Code the sm_90 kernels share beyond ``common.py``: the producer partition that gathers raw rows into shared
memory (``few.py``, ``wide.py``), q staging and row-copy helpers, the e2m1 decoder (``few.py``, ``conv.py``) and
the register layouts that turn raw e4m3 bytes into wgmma A operands.

Row formats (byte offsets are constexprs from the format's layout; values always start at byte 0):

- ``fp8``: 512 e4m3 values, then (ROPE = 64) 64 e4m3 rope values at ROPE_OFF; per-tensor ``k_scale``.
- ``fp8_ds_mla``: 512 e4m3 values, four fp32 scales (one per 128-dim group) at SCALE_OFF, then (ROPE = 64)
  64 bf16 rope values at ROPE_OFF.
- ``nvfp4_ds_mla``: 256 bytes of packed e2m1 pairs, (ROPE = 64) 64 e4m3 rope values at ROPE_OFF, 32 e4m3
  block scales (one per 16 dims) at SCALE_OFF.

With ROPE = 0 no rope byte is read, so a NoPE row may or may not keep a (zero) rope slot: only BPT and
SCALE_OFF tell the layouts apart.  Every offset and BPT is a multiple of 16 (the cp.async width).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from . import compat
from .common import program_coords

# bf16 rows [64, N] gathered by 16-byte copies covering 128 contiguous bytes of 4 rows a warp instruction
# (FlashInfer's gather width; the kernels' other bf16 layouts cover 64 bytes of 8 rows)
L_ROWS128 = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

# Raw e4m3 bytes of a 64-byte piece for QK, [64 rows, 64 bytes]: thread (warp w, lane 4g + t) holds rows
# 16w + g and 16w + g + 8, bytes 16t .. 16t + 15 (register order = byte order: 128-bit loads); byte
# 16 t + 4 s + 2 p + e is the wgmma A fragment's k = 16 s + 8 p + 2 t + e (relabel64)
L_QK64 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 64]))

# Raw e4m3 bytes for PV, [16 rows, 128 dims] (one k-step of one group): thread (w, 4g + t) holds rows
# 2t, 2t + 1, 2t + 8, 2t + 9 and dims 32w + 4g .. 32w + 4g + 3 (32-bit loads).  Dim 32 w + 4 g + 2 i + h is
# the fragment's M row 64 i + 16 w + 8 h + g (see pv_rows and acc_dim).
L_V = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]], warp_bases=[[0, 32], [0, 64]], block_bases=[],
    shape=[16, 128]))

# Two rows' four e4m3 bytes ($4: row r, $5: row r + 1; dims d0..d3) -> fp16 pairs (d0 r, d0 r+1), (d1 r,
# d1 r+1), (d2 ..), (d3 ..) in $0..$3: the byte pairing is two prmt before the converts instead of four
# after them
# Interleave the bytes of two 32-bit words A, B into dim-order pairs (A0 B0, A1 B1, A2 B2, A3 B3) and convert
# each pair of e4m3 codes to f16x2 in $0..$3 (the common tail of the two conversions below).
_PAIR_CVT = """prmt.b32 p0, {a}, {b}, 0x5140;
prmt.b32 p1, {a}, {b}, 0x7362;
mov.b32 {{h0, h1}}, p0;
mov.b32 {{h2, h3}}, p1;
cvt.rn.f16x2.e4m3x2 $0, h0;
cvt.rn.f16x2.e4m3x2 $1, h1;
cvt.rn.f16x2.e4m3x2 $2, h2;
cvt.rn.f16x2.e4m3x2 $3, h3;
"""
_E4M3_ROWS_ASM = gl.constexpr("""{
.reg .b32 p0, p1;
.reg .b16 h0, h1, h2, h3;
""" + _PAIR_CVT.format(a="$4", b="$5") + "}")

# e2m1 nibbles -> fp16, four bytes (eight values) at a time: each nibble becomes an e4m3 code worth its value
# x 2^-6 (sign to bit 7, the three magnitude bits to bits 2-4: exact for the subnormal code 0.5 too), the
# codes are paired in dim order (byte 0's low and high nibble = dims 0, 1, ...: what a 16-byte store of the
# row wants), cvt.f16x2.e4m3x2 converts them and one multiply by the block scale x 2^6 (<= 448 x 64, exact)
# gives the exact dequantized values (<= 6 x 448, >= 2^-10: normal fp16).  $0 $1 = dims 0-3, $2 $3 = dims
# 4-7; $4: the four bytes; $5: the block scale x 2^6 as f16x2 (both halves equal).  ``fp4_values`` packs four
# fp16 elements per call ($5 $6, $6 unused), ``fp4_words_f16`` one int32 word holding the f16x2.
_FP4_CODES = """shl.b32 t, {x}, 4;
shl.b32 u, {x}, 2;
and.b32 t, t, 0x80808080;
and.b32 u, u, 0x1C1C1C1C;
or.b32 e, t, u;
shr.b32 u, {x}, 2;
and.b32 t, {x}, 0x80808080;
and.b32 u, u, 0x1C1C1C1C;
or.b32 o, t, u;
"""
_FP4N_ASM = gl.constexpr("""{
.reg .b32 e, o, t, u, p0, p1;
.reg .b16 h0, h1, h2, h3;
""" + _FP4_CODES.format(x="$4") + _PAIR_CVT.format(a="e", b="o") + """mul.f16x2 $0, $0, $5;
mul.f16x2 $1, $1, $5;
mul.f16x2 $2, $2, $5;
mul.f16x2 $3, $3, $5;
}""")

# One 32-bit word of four e4m3 values ($2, dim order) -> fp16 pairs $0 (dims 0-1), $1 (dims 2-3), exact
_E4M3W_ASM = gl.constexpr("""{
.reg .b16 l, h;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 $0, l;
cvt.rn.f16x2.e4m3x2 $1, h;
}""")

# ... and to bf16 pairs, each value times the fp32 scale $3 (rounded once, to bf16)
_E4M3WS_ASM = gl.constexpr("""{
.reg .b16 l, h, g0, g1, g2, g3;
.reg .b32 a, b;
.reg .f32 f0, f1, f2, f3;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
mov.b32 {g0, g1}, a;
mov.b32 {g2, g3}, b;
cvt.f32.f16 f0, g0;
cvt.f32.f16 f1, g1;
cvt.f32.f16 f2, g2;
cvt.f32.f16 f3, g3;
""" + "".join(f"mul.f32 f{k}, f{k}, $3;\n" for k in range(4)) + """cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")

# fp8_ds_mla tile scales [64 rows, 4 groups] with the rows of S^T (all four in each thread's registers)
SC_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4]))


@gluon.jit
def block_indices(idx_row, p0, k_end, rows_l: gl.constexpr):
    """The cache rows at positions p0 .. p0 + 63 (-1 past the split's end)."""
    offs = p0 + gl.arange(0, 64, layout=rows_l)
    return gl.load(idx_row + offs, mask=offs < k_end, other=-1)


@gluon.jit
def fp4_values(x, sc):
    """Packed e2m1 bytes ``x`` [R rows, B blocks, 8 bytes] (each thread holding whole blocks, in byte order) and
    each block's e4m3 scale byte ``sc`` (broadcast to x's shape) -> the dequantized values, fp16 [R, B, 16] in
    dim order (exact; see _FP4N_ASM)."""
    f = (sc.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 64.0).to(gl.float16)
    a, b = gl.inline_asm_elementwise(_FP4N_ASM, "=r,=r,=r,=r,r,r,r", [x, f], (gl.float16, gl.float16), True, 4)
    # a[4p + k] = dim 8p + k, b[4p + k] = dim 8p + 4 + k (p: which four bytes): a relabelling of registers
    r: gl.constexpr = x.shape[0]
    nb: gl.constexpr = x.shape[1]
    return gl.join(a, b).reshape([r, nb, 2, 4, 2]).permute(0, 1, 2, 4, 3).reshape([r, nb, 16])


@gluon.jit
def fp4_words_f16(x, sc):
    """Packed e2m1 words ``x`` [R, B blocks, 2] int32 (a 16-dim block = two words, each thread holding whole
    blocks) and each block's e4m3 scale byte ``sc`` [R, B] (x's layout sliced on dim 2) -> the dequantized
    values as fp16 pairs, int32 [R, 8 B] (pair j = dims 2j, 2j + 1; exact, see _FP4N_ASM)."""
    f = (sc.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 64.0).to(gl.float16)
    fw = f.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    fw = gl.broadcast((fw | (fw << 16))[:, :, None], x)[0]
    o0, o1, o2, o3 = gl.inline_asm_elementwise(_FP4N_ASM, "=r,=r,=r,=r,r,r", [x, fw],
                                               (gl.int32, gl.int32, gl.int32, gl.int32), True, 1)
    r: gl.constexpr = x.shape[0]
    nb: gl.constexpr = x.shape[1]
    # [R, B, word, pair]: o_k is pair k of each word (join(join(o0, o1), join(o2, o3)) puts it at [.., k % 2,
    # k // 2])
    return gl.join(gl.join(o0, o1), gl.join(o2, o3)).permute(0, 1, 2, 4, 3).reshape([r, nb * 8])


@gluon.jit
def e4m3_words_f16(w):
    """Words of four e4m3 values ``w`` [R, C] int32 (dim order) -> fp16 pairs [R, 2C] int32 (pair j = dims 2j,
    2j + 1; exact)."""
    a, b = gl.inline_asm_elementwise(_E4M3W_ASM, "=r,=r,r", [w], (gl.int32, gl.int32), True, 1)
    return gl.join(a, b).reshape([w.shape[0], 2 * w.shape[1]])


@gluon.jit
def e4m3_words_bf16(w, s):
    """Words of four e4m3 values ``w`` [R, C] int32 (dim order) times ``s`` (fp32, w's shape) -> bf16 pairs
    [R, 2C] int32 (pair j = dims 2j, 2j + 1), rounded once."""
    a, b = gl.inline_asm_elementwise(_E4M3WS_ASM, "=r,=r,r,f", [w, s], (gl.int32, gl.int32), True, 1)
    return gl.join(a, b).reshape([w.shape[0], 2 * w.shape[1]])


@gluon.jit
def copy_rows(dst, row_ptr, col0: gl.constexpr, NCOL: gl.constexpr, valid, lay: gl.constexpr):
    """cp.async of columns col0 .. col0 + NCOL (elements of row_ptr's type) of the rows ``row_ptr`` [R] (in
    SliceLayout(1, lay)) into dst [R, NCOL]; rows where ``valid`` is False are zero-filled, not read."""
    c = gl.arange(0, NCOL, layout=gl.SliceLayout(0, lay))
    compat.async_load(dst, row_ptr[:, None] + col0 + c[None, :], mask=valid[:, None])


@gluon.jit
def _gather(dst, kv_ptr, idx, BPT: gl.constexpr, off: gl.constexpr, cols, ty: gl.constexpr):
    """cp.async of the columns ``cols`` (elements of ``ty``) at byte ``off`` of each row; -1 rows zero-filled."""
    valid = idx >= 0
    base = gl.multiple_of(kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * BPT, 16)
    if off != 0:
        base = gl.multiple_of(base + off, 16).to(gl.pointer_type(ty))
    compat.async_load(dst, base[:, None] + cols[None, :], mask=valid[:, None])


@gluon.jit
def producer(args, BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
             DS: gl.constexpr, FP4: gl.constexpr, FP8_QK: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """The producer partition (one warpgroup): gathers each 64-row block's raw bytes into stage b % n_st of the
    ring with cp.async, each thread arriving on the stage's ``ready`` mbarrier when its copies land, after
    waiting for the stage's ``free`` mbarrier.  fp8 rows: the e4m3 values and rope; fp8_ds_mla: the e4m3
    values, the four scales and the bf16 rope; nvfp4: the packed nibbles, the e4m3 rope and the 32 scale
    bytes.  The next block's indices are loaded before the wait for a free stage, so their latency is off the
    producer's path.  FP8_QK: the values go to four [64, 128] pieces per stage (``raw.index(4 st + G)``, in
    wgmma's swizzled layout: the QK MMAs read them as the A operand).

    ``args``: (kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, raw, scl, rope, ready,
    free)."""
    kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, raw, scl, rope, ready, free = args
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    n_st: gl.constexpr = raw.shape[0] // (4 if FP8_QK else 1)
    lv: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])   # [64, 512, 256 or 128] u8, 16 B each
    ls: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [4, 1], [1, 0])   # [64, 4] f32, 8 B each
    lr: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])    # [64, 64] bf16, 16 B each
    lq: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # [64, 64 or 32] u8, 16 B each
    cv = gl.arange(0, raw.shape[2], layout=gl.SliceLayout(0, lv))
    cs = gl.arange(0, 4, layout=gl.SliceLayout(0, ls))
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, lr))
    cq = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
    c4 = gl.arange(0, 32, layout=gl.SliceLayout(0, lq))
    iv = block_indices(idx_row, k_begin, k_end, gl.SliceLayout(1, lv))
    i_s = block_indices(idx_row, k_begin, k_end, gl.SliceLayout(1, ls))
    ir = block_indices(idx_row, k_begin, k_end, gl.SliceLayout(1, lr))
    iq = block_indices(idx_row, k_begin, k_end, gl.SliceLayout(1, lq))
    for b in range(n_blocks):
        st = b % n_st
        p1 = k_begin + (b + 1) * 64
        nv = block_indices(idx_row, p1, k_end, gl.SliceLayout(1, lv))
        if DS:
            ns = block_indices(idx_row, p1, k_end, gl.SliceLayout(1, ls))
            if ROPE:
                nr = block_indices(idx_row, p1, k_end, gl.SliceLayout(1, lr))
            else:
                nr = ir
            nq = iq
        else:
            ns = i_s
            nr = ir
            if ROPE or FP4:
                nq = block_indices(idx_row, p1, k_end, gl.SliceLayout(1, lq))
            else:
                nq = iq
        mbarrier.wait(free.index(st), ((b // n_st) & 1) ^ 1)  # fresh barriers pass phase 1 at once
        if FP8_QK:
            for G in gl.static_range(4):
                _gather(raw.index(4 * st + G), kv_ptr, iv, BPT, 128 * G, cv, gl.uint8)
        else:
            _gather(raw.index(st), kv_ptr, iv, BPT, 0, cv, gl.uint8)
        if DS:
            _gather(scl.index(st), kv_ptr, i_s, BPT, SCALE_OFF, cs, gl.float32)
            if ROPE:
                _gather(rope.index(st), kv_ptr, ir, BPT, ROPE_OFF, cr, gl.bfloat16)
        elif FP4:
            if ROPE:
                _gather(rope.index(st), kv_ptr, iq, BPT, ROPE_OFF, cq, gl.uint8)
            _gather(scl.index(st), kv_ptr, iq, BPT, SCALE_OFF, c4, gl.uint8)
        elif ROPE:
            _gather(rope.index(st), kv_ptr, iq, BPT, ROPE_OFF, cq, gl.uint8)
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        iv = nv
        i_s = ns
        ir = nr
        iq = nq


@gluon.jit
def load_q_group(q_row, hm, off: gl.constexpr, lay: gl.constexpr):
    """q[:, off : off + 128] of the rows ``q_row`` (masked by ``hm``) as fp32 (contiguous 16-byte loads)."""
    k = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    return gl.load(q_row + off + k[None, :], mask=hm, other=0.0).to(gl.float32)


@gluon.jit
def load_q_rope(qr_ptr, stride_rt, stride_rh, t, heads, H, hm, lay: gl.constexpr):
    """The query's 64 RoPE dims of token ``t`` and the rows ``heads`` ([R] in SliceLayout(1, lay)) as fp32 [R, 64],
    read through their own pointer and strides (``q[..., 512:]`` or an engine's separate ``q_pe``); zeros where
    ``hm`` ([R, 1]) is False."""
    k = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
    row = qr_ptr + t.to(gl.int64) * stride_rt + gl.where(heads < H, heads, 0).to(gl.int64)[:, None] * stride_rh
    return gl.load(row + k[None, :], mask=hm, other=0.0).to(gl.float32)


@gluon.jit
def pow2_scale(amax):
    """c = 2^(7 - floor(log2 amax)) (amax c in [128, 256)) and 1 / c, exact, from amax's exponent bits (1 for
    amax == 0); amax is floored at 2^-100 (normal: its exponent field is floor(log2 amax) + 127).  Integer
    arithmetic instead of log2 / exp2 / a division (per head: in the wide kernel each thread holds 16 heads'
    values)."""
    a = gl.maximum(amax, 7.888609052210118e-31)
    e = ((a.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
    c = ((134 - e) << 23).to(gl.float32, bitcast=True)
    inv_c = ((120 + e) << 23).to(gl.float32, bitcast=True)
    has = amax > 0
    return gl.where(has, c, 1.0), gl.where(has, inv_c, 1.0)


@gluon.jit
def store_e4m3_terms(dst_hi, dst_lo, y, LO: gl.constexpr):
    """y = q c (fp32, exact in fp16: bf16 q times a power of two within fp16's range) -> its two e4m3 terms,
    hi = e4m3(y) into ``dst_hi`` and lo = e4m3((y - hi) LO) into ``dst_lo``, the remainder formed in fp16, where
    it is exact (at most 4 significant bits): half the conversions of going through fp32.  ``LO``: a power of
    two, 1 where both terms go into one accumulator; ``LO_SHIFT`` where the caller folds the lo products
    itself (the remainder then stays above e4m3's subnormals for 5 more binades).  hi is stored before lo is
    formed, so that the two are never live together."""
    yh = y.to(gl.float16)
    hi = yh.to(gl.float8e4nv)
    dst_hi.store(hi)
    dst_lo.store(((yh - hi.to(gl.float16)) * LO).to(gl.float8e4nv))  # LO = 1: the multiply folds away


# The lo term's factor where it has its own accumulator: with amax c in [128, 256), |y - hi| <= 8 (half of
# e4m3's spacing in [128, 256)), so (y - hi) 32 <= 256 fits e4m3 (448)
LO_SHIFT = gl.constexpr(32.0)


@gluon.jit
def relabel64(x):
    """[R, 64] indexed by byte -> indexed by fragment column (byte 16t + 4s + 2p + e is column 16s + 8p + 2t + e,
    see L_QK64): a relabelling of the registers, no data movement."""
    return x.reshape([x.shape[0], 4, 4, 2, 2]).permute(0, 2, 3, 1, 4).reshape([x.shape[0], 64])


@gluon.jit
def e4m3_view(buf, i):
    """FP8_QK: ring piece i (e4m3 bytes in wgmma's swizzled layout) as an fp8 view, the A operand of QK."""
    return compat.reinterpret(buf.index(i), gl.float8e4nv, [buf.shape[1], buf.shape[2]], buf.layout)


@gluon.jit
def pv_values(raw, ks: gl.constexpr, G: gl.constexpr):
    """Rows 16 ks .. 16 ks + 15, group G of a stage's e4m3 bytes ([64, 512]) -> fp16 V^T [128 dims (permuted,
    acc_dim), 16 rows], before the (free) conversion to the kernel's A operand layout."""
    return pv_rows(raw.slice(16 * ks, 16, dim=0).slice(128 * G, 128, dim=1).load(L_V))


@gluon.jit
def pv_rows(v):
    """Raw e4m3 bytes [16 rows, 128 dims] in L_V -> fp16 V^T [128 dims (permuted, acc_dim), 16 rows]."""
    # e4m3 -> fp16 with the values of rows 2t and 2t + 1 paired (what the A fragment holds in one register):
    # _E4M3_ROWS_ASM puts the value of (dim d, row r) of each 4 dims x 2 rows where the tensor has (dim
    # 2 (d & 1) + r, row d >> 1); the permute below puts the labels back (register bits only: no data movement)
    t = gl.inline_asm_elementwise(_E4M3_ROWS_ASM, "=r,=r,=r,=r,r,r", [v], gl.float16, True, 8)
    v = t.reshape([2, 2, 2, 2, 32, 2, 2]).permute(0, 1, 2, 6, 4, 3, 5).reshape([16, 128])
    return v.permute(1, 0).reshape([4, 8, 2, 2, 16]).permute(2, 0, 3, 1, 4).reshape([128, 16])


@gluon.jit
def acc_dim(m):
    """PV accumulator row m (0..127) of a 128-dim group -> the output dim within the group (see L_V): the
    kernels permute V's dims so that each thread loads 4 contiguous bytes of 4 rows, and un-permute on output."""
    return 32 * ((m >> 4) & 3) + 4 * (m & 7) + 2 * (m >> 6) + ((m >> 3) & 1)
