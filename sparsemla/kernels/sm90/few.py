"""sm_90 sparse MLA decode for quantized rows at few heads: ``fp8``, ``fp8_ds_mla`` and ``nvfp4_ds_mla`` rows
(RoPE or NoPE), 16 heads per program, warp-specialized (Gluon).

Schedule.  The cache rows are the MMA's M dimension: ``S^T = K q^T`` and ``O^T += V^T P^T`` on wgmma m64n16
with the 16 heads as N, so q and P live in shared memory as the B operand and the K / V tiles are the A
operand from registers, converted there straight from the raw e4m3 bytes (never written back).  A producer
warpgroup (``rows.producer``) gathers raw rows with cp.async into a ring of 64-row stages; two consumer
warpgroups take every other 64-row block, each with its own online softmax, and merge once at the end
through shared memory.  12 warps at launch (12 x 32 x 168 registers fill the register file); setmaxnreg
then gives the consumers 232 and the producer 40.

Operand layout.  A thread of the wgmma A fragment holds k (columns) 2t, 2t+1, 2t+8, 2t+9 of each 16-wide
step.  A dot product does not care about the order of k, so the kernel permutes k: a thread loads 16
contiguous bytes of a row (one 128-bit shared load) and those bytes are its fragment, in the order the
fragment wants them; q is written to shared memory once with the same permutation of its columns.  For PV
the output dims are permuted the same way (each thread loads 4 contiguous bytes of 4 rows per 128-dim
group, ``rows.L_V``) and un-permuted when the output is stored (``rows.acc_dim``).  The relabellings are
reshapes / permutes of register tensors (no data movement).

Numbers.  e4m3 is exact in fp16, so the MMAs run in fp16 with q brought into fp16 range by a per-token power
of two.  fp8_ds_mla's per-row, per-128-dim-group fp32 scales: QK runs one accumulator per group (A = the
raw values) and S^T = sum_g scale_g x S_g^T after (32 multiply-adds a block instead of 128 fp16 multiplies
of the A registers); for PV, P is multiplied by ``scale_g / u_g`` per group (u_g = the largest scale of
group g so far, so the factor is <= 1) and each group's accumulator is held in units of u_g.  The rope part
of fp8_ds_mla is bf16 and multiplies in bf16 (A from shared memory, its own accumulator); plain fp8 rows are
e4m3 throughout, the per-tensor ``k_scale`` applied to the scores and the output.

nvfp4_ds_mla rows (``_consumer_fp4``): converting e2m1 costs about four instructions per pair of values
(against one for e4m3) and the consumers are instruction-bound, so each block is dequantized once, into the
consumer warpgroup's own fp16 tile in shared memory, and both MMAs read the tile (S^T: A = the tile; O^T:
A = the tile transposed).  Two 64 KB tiles leave room for three 22 KB stages.

FP8_QK (fp8 / fp8_ds_mla rows): q as two e4m3 terms with a power of two per head and 128-dim group
(``_stage_q8``), QK on e4m3 wgmma with both operands in shared memory, so the gathered bytes feed the MMA as
they are and the QK half of the conversions is gone.  Each group (and the e4m3 rope) has its own accumulator,
added in fp32: the e4m3 MMAs accumulate with less than fp32's precision, so no chain runs past 128 dims.  PV
is unchanged (wgmma takes an fp8 A operand only K-major, and V^T would need a byte transpose costing as much
as the conversion it replaces).  The ring then holds each stage as four
[64, 128] pieces in wgmma's swizzled layout.

Gluon kernels do not run under the Triton interpreter: ``tests/test_sm90_compile.py`` compiles every
variant for sm_90 on the CPU; the GPU suite checks the numbers against the float64 reference.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import compat
from .common import (NEG_BIG, PUBLISH, absmax, combine_in_kernel, fused_meta, normalizer, program_coords, publish,
                     rcp)
from .rows import (L_QK64, L_V, LO_SHIFT, SC_L, acc_dim, block_indices, e4m3_view, fp4_values, load_q_group,
                   load_q_rope,
                   pow2_scale, producer, pv_rows, pv_values, relabel64, store_e4m3_terms)

NS = gl.constexpr(4)  # ring stages of 64 rows (fp8 / fp8_ds_mla rows; nvfp4 rows have 3, see the kernel)

# S^T [64 rows, 16 heads] and O^T [128 dims, 16 heads] (one per 128-dim group) on wgmma m64n16
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))

# FP8_QK's QK accumulator: e4m3 MMAs (k = 32 per instruction) with q's two terms side by side as N = 32
# (hi: heads 0-15, lo: 16-31), folded into S_L by _fold
S8_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 32]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_L.value, k_width=2))
ROW = gl.constexpr(gl.SliceLayout(1, S_L.value))   # one value per cache row (or output dim)
HEAD = gl.constexpr(gl.SliceLayout(0, S_L.value))  # one value per head

# Raw e4m3 bytes for QK, [64 rows, 128 bytes] (one 128-dim group): thread (warp w, lane 4g + t) holds rows
# 16w + g and 16w + g + 8, bytes 32t .. 32t + 31.  Register order = byte order (128-bit loads).  Byte
# 32t + 16 j + 4 s + 2 p + e is the fragment's k = 64 j + 16 s + 8 p + 2 t + e (see _qk_operand).
L_QK = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 128]))

# nvfp4_ds_mla: one 64-dim chunk's packed nibbles [64 rows, 4 blocks, 8 bytes]: thread (w, 4g + t) holds rows
# 16w + g and 16w + g + 8, block t of the chunk (bytes 8t .. 8t + 7 = dims 16t .. 16t + 15, one e4m3 scale,
# two 128-bit stores of fp16 into the tile)
L_Q4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[[16, 0, 0], [32, 0, 0]],
    block_bases=[], shape=[64, 4, 8]))

L_Q4B = gl.constexpr(gl.DistributedLinearLayout(  # the same bytes as a [64, 32] tensor (64-bit loads)
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 32]))

L_Q4S = gl.constexpr(gl.DistributedLinearLayout(  # the chunk's scale bytes [64 rows, 4 blocks, 1]
    reg_bases=[[8, 0, 0]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[[16, 0, 0], [32, 0, 0]],
    block_bases=[], shape=[64, 4, 1]))

@gluon.jit
def _fp4_chunk(raw, scl, C: gl.constexpr):
    """nvfp4: 64-dim chunk C of the stage's rows -> fp16 [64 rows, 64 dims] in natural order (each thread: two
    rows x one 16-dim block)."""
    x = gl.convert_layout(raw.slice(32 * C, 32, dim=1).load(L_Q4B).reshape([64, 4, 8]), L_Q4)
    # block 4C + t of a row: its scale is at byte 8 t + C
    sc = scl.reshape([64, 4, 8]).slice(C, 1, dim=2).load(L_Q4S).reshape([64, 4])
    sc = gl.convert_layout(sc, gl.SliceLayout(2, L_Q4))[:, :, None]
    return fp4_values(x, gl.broadcast(sc, x)[0]).reshape([64, 64])


@gluon.jit
def _qk_operand(raw, G: gl.constexpr):
    """Group G's e4m3 bytes of the stage -> the fp16 A operand [64 rows, 128 k] (k permuted, _relabel128)."""
    a = raw.slice(128 * G, 128, dim=1).load(L_QK).to(gl.float8e4nv, bitcast=True).to(gl.float16)
    return gl.convert_layout(_relabel128(a), A_OP)


@gluon.jit
def _rope_operand(rope):
    """Plain fp8 rows: the 64 e4m3 rope bytes -> fp16 A operand [64 rows, 64 k] (k permuted like L_QK64)."""
    a = rope.load(L_QK64).to(gl.float8e4nv, bitcast=True).to(gl.float16)
    return gl.convert_layout(relabel64(a), A_OP)


@gluon.jit
def _pv_operand(raw, ks: gl.constexpr, G: gl.constexpr):
    """Rows 16 ks .. 16 ks + 15, group G -> the fp16 A operand V^T [128 dims (permuted, acc_dim), 16 rows]."""
    return gl.convert_layout(pv_values(raw, ks, G), A_OP)


@gluon.jit
def _pv_operands8(raw, st, ks: gl.constexpr):
    """FP8_QK: the same from the stage's four [64, 128] pieces (raw.index(4 st + G))."""
    return (gl.convert_layout(pv_rows(raw.index(4 * st + 0).slice(16 * ks, 16, dim=0).load(L_V)), A_OP),
            gl.convert_layout(pv_rows(raw.index(4 * st + 1).slice(16 * ks, 16, dim=0).load(L_V)), A_OP),
            gl.convert_layout(pv_rows(raw.index(4 * st + 2).slice(16 * ks, 16, dim=0).load(L_V)), A_OP),
            gl.convert_layout(pv_rows(raw.index(4 * st + 3).slice(16 * ks, 16, dim=0).load(L_V)), A_OP))


@gluon.jit
def _qk_groups8(raw, st, qn, z):
    """FP8_QK, fp8_ds_mla: S^T per 128-dim group on fp8 MMAs, A = the rows' e4m3 bytes in shared memory (nothing
    converted), B = (q c_h)^T in e4m3; four accumulators (S8_L, unfolded), issued asynchronously."""
    s_zero = gl.zeros([64, 32], gl.float32, S8_L)
    g0 = _qk8(e4m3_view(raw, 4 * st + 0), qn, 0 + z, s_zero, False)
    g1 = _qk8(e4m3_view(raw, 4 * st + 1), qn, 1 + z, s_zero, False)
    g2 = _qk8(e4m3_view(raw, 4 * st + 2), qn, 2 + z, s_zero, False)
    g3 = _qk8(e4m3_view(raw, 4 * st + 3), qn, 3 + z, s_zero, False)
    return g0, g1, g2, g3


@gluon.jit
def _qk8(a, qb, i, acc, use_acc: gl.constexpr):
    """acc [64, 32] (+)= a [q hi; q lo]^T: one e4m3 MMA with q's two terms as 32 columns (_store_hi_lo)."""
    return warpgroup_mma(a, qb.index(i).permute((1, 0)), acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _fold(acc, inv_c):
    """[64, 32] S8_L (hi columns, then lo) -> (hi + lo / LO_SHIFT) / c_h, [64, 16] in S_L (each thread holds
    both halves of its heads: in-register arithmetic); ``inv_c``: 1 / c_h of the part ([16], HEAD)."""
    hi, lo = acc.reshape([64, 2, 16]).permute(0, 2, 1).split()
    return gl.convert_layout(hi + lo * (1.0 / LO_SHIFT), S_L) * inv_c[None, :]


@gluon.jit
def _qk_plain8(raw, rope, st, qn, qr, z, inv_c, ROPE: gl.constexpr):
    """FP8_QK, plain fp8: S^T = K q^T on fp8 MMAs from shared memory, one accumulator per 128-dim group and
    one for the e4m3 rope, added in fp32 (the e4m3 MMAs' own accumulation is kept to 128 dims)."""
    g0, g1, g2, g3 = _qk_groups8(raw, st, qn, z)
    if ROPE:
        gr = _qk8(e4m3_view(rope, st), qr, z, gl.zeros([64, 32], gl.float32, S8_L), False)
        g0, g1, g2, g3, gr = warpgroup_mma_wait(0, deps=(g0, g1, g2, g3, gr))
        x = _fold(gr, inv_c[4]) + _fold(g0, inv_c[0])
    else:
        g0, g1, g2, g3 = warpgroup_mma_wait(0, deps=(g0, g1, g2, g3))
        x = _fold(g0, inv_c[0])
    return x + _fold(g1, inv_c[1]) + _fold(g2, inv_c[2]) + _fold(g3, inv_c[3])


@gluon.jit
def _pv_ops(raw, rs, st, ks: gl.constexpr, FP8_QK: gl.constexpr):
    """The PV operands of rows 16 ks .. 16 ks + 15 from stage rs ([64, 512]) or (FP8_QK) its four pieces."""
    if FP8_QK:
        return _pv_operands8(raw, st, ks)
    else:
        return _pv_operands(rs, ks)


@gluon.jit
def _pv_operands(raw, ks: gl.constexpr):
    """Rows 16 ks .. 16 ks + 15 of the stage -> the four groups' V^T A operands."""
    return _pv_operand(raw, ks, 0), _pv_operand(raw, ks, 1), _pv_operand(raw, ks, 2), _pv_operand(raw, ks, 3)


@gluon.jit
def _stage_q(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, DS: gl.constexpr,
             ROPE: gl.constexpr, CHUNKS: gl.constexpr):
    """q * c into shared memory as the QK B operand, once per program; returns c, the per-token power of two
    that brings q into fp16 range (amax * c in [2^13, 2^15); over the latent dims, and the rope dims too
    when they are fp16 operands (plain fp8)).  Groups are fp16 [4, 16, 128] with columns permuted like the
    A fragments (the same register relabelling as _qk_operand, applied to q loaded in natural order); the
    rope part is bf16 in natural order (fp8_ds_mla) or fp16 permuted (fp8, nvfp4).  nvfp4: eight 64-dim
    chunks [8, 16, 64] in natural order (CHUNKS: the A operands are in shared memory), otherwise the four
    128-dim groups permuted like _relabel128."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, lay))
    hm = (heads < H)[:, None]
    q_row = q_ptr + t.to(gl.int64) * stride_qt + gl.where(heads < H, heads, 0).to(gl.int64)[:, None] * stride_qh
    x0 = load_q_group(q_row, hm, 0, lay)
    x1 = load_q_group(q_row, hm, 128, lay)
    x2 = load_q_group(q_row, hm, 256, lay)
    x3 = load_q_group(q_row, hm, 384, lay)
    amax = gl.maximum(gl.maximum(absmax(x0), absmax(x1)), gl.maximum(absmax(x2), absmax(x3)))
    if ROPE:
        xr = load_q_rope(qr_ptr, stride_rt, stride_rh, t, heads, H, hm, lay)
        if not DS:
            amax = gl.maximum(amax, absmax(xr))
    e = gl.floor(gl.log2(gl.maximum(amax, 1e-30)))
    c = gl.where(amax > 0, gl.exp2(13.0 - e), 1.0)
    if CHUNKS:
        _store_chunks(qn, 0, x0 * c)
        _store_chunks(qn, 2, x1 * c)
        _store_chunks(qn, 4, x2 * c)
        _store_chunks(qn, 6, x3 * c)
    else:
        qn.index(0).store(_relabel128(x0 * c).to(gl.float16))
        qn.index(1).store(_relabel128(x1 * c).to(gl.float16))
        qn.index(2).store(_relabel128(x2 * c).to(gl.float16))
        qn.index(3).store(_relabel128(x3 * c).to(gl.float16))
    if ROPE:
        if DS:
            qr.index(0).store((xr * c).to(gl.bfloat16))
        else:
            qr.index(0).store(relabel64(xr * c).to(gl.float16))
    return c


@gluon.jit
def _stage_q8(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, DS: gl.constexpr,
              ROPE: gl.constexpr):
    """FP8_QK's q: each 128-dim group G of each head as two e4m3 terms of y = q c_hG, hi = e4m3(y) and
    lo = e4m3((y - hi) LO_SHIFT), [4 groups, 32, 128] (rows 0-15 hi, 16-31 lo: one MMA takes both as N = 32,
    each in its own accumulator columns; natural order: the QK MMAs read the rows' e4m3 bytes straight from
    shared memory, so nothing is permuted); c_hG is a power of two per head and group with amax_hG c_hG in
    [128, 256) (e4m3's largest value is 448).  bf16 q has 8 significant bits, each term 4: hi + lo is exact
    but for elements below ~2^-14 of their group's largest (lo under e4m3's subnormals).  One scale per head
    would lose every element below 2^-9 of the head's largest, which a large key value in that dim then
    multiplies.  The rope part the same way for plain fp8 rows ([1, 32, 64], its own scale), bf16 as it is
    for fp8_ds_mla (its own bf16 MMA).  Returns the five 1 / c ([16], HEAD each; the rope's 1 for fp8_ds_mla)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, lay))
    hm = (heads < H)[:, None]
    q_row = q_ptr + t.to(gl.int64) * stride_qt + gl.where(heads < H, heads, 0).to(gl.int64)[:, None] * stride_qh
    x0 = load_q_group(q_row, hm, 0, lay)
    x1 = load_q_group(q_row, hm, 128, lay)
    x2 = load_q_group(q_row, hm, 256, lay)
    x3 = load_q_group(q_row, hm, 384, lay)
    i0 = _store_hi_lo(qn, 0, x0)
    i1 = _store_hi_lo(qn, 1, x1)
    i2 = _store_hi_lo(qn, 2, x2)
    i3 = _store_hi_lo(qn, 3, x3)
    ir = gl.full([16], 1.0, gl.float32, HEAD)
    if ROPE:
        xr = load_q_rope(qr_ptr, stride_rt, stride_rh, t, heads, H, hm, lay)
        if DS:
            qr.index(0).store(xr.to(gl.bfloat16))
        else:
            ir = _store_hi_lo(qr, 0, xr)
    return i0, i1, i2, i3, ir


@gluon.jit
def _store_hi_lo(buf, i: gl.constexpr, x):
    """x [16 heads, n] (fp32) times c_h (pow2_scale of each head's largest) as its two e4m3 terms
    (store_e4m3_terms, lo times LO_SHIFT): hi into rows 0-15 of buf[i], lo into rows 16-31.  Returns 1 / c_h
    ([16], HEAD)."""
    c, inv_c = pow2_scale(gl.max(gl.abs(x), 1))
    b = buf.index(i)
    store_e4m3_terms(b.slice(0, 16, dim=0), b.slice(16, 16, dim=0), x * c[:, None], LO_SHIFT)
    return gl.convert_layout(inv_c, HEAD)


@gluon.jit
def _store_chunks(qn, C: gl.constexpr, x):
    """x [16, 128] -> 64-dim chunks C and C + 1 of qn (natural order: the A operands are in shared memory)."""
    lo, hi = x.reshape([16, 2, 64]).permute(0, 2, 1).split()
    qn.index(C).store(lo.to(gl.float16))
    qn.index(C + 1).store(hi.to(gl.float16))


@gluon.jit
def _relabel128(x):
    """[R, 128] indexed by byte -> indexed by fragment column (byte 32t + 16j + 4s + 2p + e is column
    64j + 16s + 8p + 2t + e): a relabelling of the registers, no data movement."""
    return x.reshape([x.shape[0], 4, 2, 4, 2, 2]).permute(0, 2, 3, 4, 1, 5).reshape([x.shape[0], 128])


@gluon.jit
def _cols(x):
    """The four columns of a [64, 4] tensor in SC_L, each as a per-row vector of S^T (a register relabelling)."""
    a, b = x.reshape([64, 2, 2]).split()  # columns 0, 2 and 1, 3
    c0, c2 = a.split()
    c1, c3 = b.split()
    return (gl.convert_layout(c0, ROW), gl.convert_layout(c1, ROW), gl.convert_layout(c2, ROW),
            gl.convert_layout(c3, ROW))


@gluon.jit
def _qk_groups(rs, qn, z, s_zero):
    """fp8_ds_mla: S^T per 128-dim group, four accumulators (A = the raw e4m3 values, B = q^T), issued
    asynchronously; the caller weighs them with the rows' group scales."""
    a0 = _qk_operand(rs, 0)
    g0 = warpgroup_mma(a0, qn.index(0 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    a1 = _qk_operand(rs, 1)
    g1 = warpgroup_mma(a1, qn.index(1 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    warpgroup_mma_wait(1, deps=(a0, ))
    a2 = _qk_operand(rs, 2)
    g2 = warpgroup_mma(a2, qn.index(2 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    warpgroup_mma_wait(1, deps=(a1, ))
    a3 = _qk_operand(rs, 3)
    g3 = warpgroup_mma(a3, qn.index(3 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return g0, g1, g2, g3


@gluon.jit
def _pick(v, G: gl.constexpr):
    """Element G of a [4] vector in SliceLayout(0, SC_L), as a scalar (held in every thread)."""
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
    return gl.sum(gl.where(c == G, v, 0.0), 0)


@gluon.jit
def _pv_issue(v0, v1, v2, v3, pb, P0, ks: gl.constexpr, a0, a1, a2, a3, DS: gl.constexpr):
    """Issue O^T_G += V^T_G P_G^T over rows 16 ks .. 16 ks + 15 for the four groups (asynchronous)."""
    if DS:
        b0 = pb[0].index(P0).slice(16 * ks, 16, dim=0)
        b1 = pb[1].index(P0).slice(16 * ks, 16, dim=0)
        b2 = pb[2].index(P0).slice(16 * ks, 16, dim=0)
        b3 = pb[3].index(P0).slice(16 * ks, 16, dim=0)
    else:
        b0 = pb[0].index(P0).slice(16 * ks, 16, dim=0)
        b1 = b0
        b2 = b0
        b3 = b0
    a0 = warpgroup_mma(v0, b0, a0, is_async=True)
    a1 = warpgroup_mma(v1, b1, a1, is_async=True)
    a2 = warpgroup_mma(v2, b2, a2, is_async=True)
    a3 = warpgroup_mma(v3, b3, a3, is_async=True)
    return a0, a1, a2, a3


@gluon.jit
def _qk_chain(rs, qn, z, s_zero):
    """Plain fp8: issue S^T = K q^T over the four 128-dim groups as one chain of MMAs (A = the converted bytes,
    B = q^T); returns the pending accumulator (and the third group's operand, for a wait that names it).  One
    wait per group keeps two groups' A registers alive at most; it names no accumulator (waiting on the
    chain's pending accumulator would make ptxas serialize the MMAs)."""
    a0 = _qk_operand(rs, 0)
    acc = warpgroup_mma(a0, qn.index(0 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    a1 = _qk_operand(rs, 1)
    acc = warpgroup_mma(a1, qn.index(1 + z).permute((1, 0)), acc, is_async=True)
    warpgroup_mma_wait(1, deps=(a0, ))
    a2 = _qk_operand(rs, 2)
    acc = warpgroup_mma(a2, qn.index(2 + z).permute((1, 0)), acc, is_async=True)
    warpgroup_mma_wait(1, deps=(a1, ))
    a3 = _qk_operand(rs, 3)
    acc = warpgroup_mma(a3, qn.index(3 + z).permute((1, 0)), acc, is_async=True)
    return acc, a2


@gluon.jit
def _softmax_step(x, valid, m_i, l_acc):
    """Online softmax over one block's scaled scores x [64 rows, 16 heads] (log2 units), -inf for rows without
    a token: returns P, the factor alpha of the earlier blocks, the new running max and per-element sums."""
    x = gl.where(valid[:, None], x, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(x, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(x - m_new[None, :])
    return p, alpha, m_new, l_acc * alpha[None, :] + p


@gluon.jit
def _consumer_fp4(args, WG: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """nvfp4 consumer warpgroup WG (0 or 1): blocks WG, WG + 2, ...  Each block is dequantized once, into this
    warpgroup's fp16 tile in shared memory [8 chunks, 64 rows, 64 dims], and both MMAs read it from there:
    S^T = K q^T (A = the tile), O^T += V^T P^T (A = the tile transposed), eight 64-dim accumulators.  The
    raw stage is released as soon as it is converted.  Warpgroup 0 then merges and stores."""
    (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot,
     stride_os, stride_oh, lse_ptr,
     stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, smem,
     bars) = args
    raw, scl, rope, qn, qr, pb, kt, vec = smem  # kt: the two warpgroups' tiles, [2 x 8 chunks, 64, 64] fp16
    q_bar, ready, free, done_bar = bars
    n_st: gl.constexpr = raw.shape[0]
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    c = _q_ready(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, vec, q_bar, WG, False,
                 ROPE, True, False)
    score_scale = sm_scale_log2 / c
    s_zero = gl.zeros([64, 16], gl.float32, S_L)
    o0 = s_zero
    o1 = s_zero
    o2 = s_zero
    o3 = s_zero
    o4 = s_zero
    o5 = s_zero
    o6 = s_zero
    o7 = s_zero
    l_acc = s_zero
    m_i = gl.full([16], NEG_BIG, gl.float32, HEAD)
    n_mine = (n_blocks + 1 - WG) // 2
    for j in range(n_mine):
        b = 2 * j + WG
        z = j // (n_mine + 1)  # == 0 (see _consumer)
        st = b % n_st
        p0 = k_begin + b * 64
        valid = block_indices(idx_row, p0, k_end, ROW) >= 0
        mbarrier.wait(ready.index(st), (b // n_st) & 1)
        kw = 8 * (WG + z)  # this warpgroup's tile: chunks kw .. kw + 7 of kt
        rs = raw.index(st)
        sc_st = scl.index(st)
        for C in gl.static_range(8):
            kt.index(kw + C).store(_fp4_chunk(rs, sc_st, C))
        if ROPE:
            ra = _rope_operand(rope.index(st))  # e4m3 rope: a register operand
        fence_async_shared()  # the tile's stores -> the wgmma (async proxy) reads
        compat.barrier()   # every warp's part of the tile is written; the raw stage is read
        mbarrier.arrive(free.index(st), count=1)
        x = warpgroup_mma(kt.index(kw), qn.index(0 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        for C in gl.static_range(1, 8):
            x = warpgroup_mma(kt.index(kw + C), qn.index(C + z).permute((1, 0)), x, is_async=True)
        if ROPE:
            x = warpgroup_mma(ra, qr.index(z).permute((1, 0)), x, is_async=True)
        x = warpgroup_mma_wait(0, deps=(x, ))
        p, alpha, m_i, l_acc = _softmax_step(x * score_scale, valid, m_i, l_acc)
        pb[0].index(WG).store(p.to(gl.float16))
        o0 = o0 * alpha[None, :]
        o1 = o1 * alpha[None, :]
        o2 = o2 * alpha[None, :]
        o3 = o3 * alpha[None, :]
        o4 = o4 * alpha[None, :]
        o5 = o5 * alpha[None, :]
        o6 = o6 * alpha[None, :]
        o7 = o7 * alpha[None, :]
        fence_async_shared()
        compat.barrier()  # every warp's part of P is in shared memory before the MMAs read it
        pv = pb[0].index(WG + z)
        o0 = warpgroup_mma(kt.index(kw + 0).permute((1, 0)), pv, o0, is_async=True)
        o1 = warpgroup_mma(kt.index(kw + 1).permute((1, 0)), pv, o1, is_async=True)
        o2 = warpgroup_mma(kt.index(kw + 2).permute((1, 0)), pv, o2, is_async=True)
        o3 = warpgroup_mma(kt.index(kw + 3).permute((1, 0)), pv, o3, is_async=True)
        o4 = warpgroup_mma(kt.index(kw + 4).permute((1, 0)), pv, o4, is_async=True)
        o5 = warpgroup_mma(kt.index(kw + 5).permute((1, 0)), pv, o5, is_async=True)
        o6 = warpgroup_mma(kt.index(kw + 6).permute((1, 0)), pv, o6, is_async=True)
        o7 = warpgroup_mma(kt.index(kw + 7).permute((1, 0)), pv, o7, is_async=True)
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
    l_i = gl.sum(l_acc, 0)
    # warpgroup 1's accumulators go over its own tile (free once its last MMAs are done)
    mrg = compat.reinterpret(kt, gl.float32, [32, 64, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # 16 + i: tile 1
    if WG == 1:
        mrg.index(16).store(o0)
        mrg.index(17).store(o1)
        mrg.index(18).store(o2)
        mrg.index(19).store(o3)
        mrg.index(20).store(o4)
        mrg.index(21).store(o5)
        mrg.index(22).store(o6)
        mrg.index(23).store(o7)
        _publish(m_i, l_i, vec, done_bar)
    else:
        a0, a1, lse, heads, hm, obase = _merge_start(m_i, l_i, vec, done_bar, o_ptr, stride_ot, stride_os, stride_oh,
                                                     t, s, g, H)
        d = gl.arange(0, 64, layout=ROW)[:, None]
        ty = o_ptr.dtype.element_ty
        gl.store(obase + d, (o0 * a0 + mrg.index(16).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 64 + d, (o1 * a0 + mrg.index(17).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 128 + d, (o2 * a0 + mrg.index(18).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 192 + d, (o3 * a0 + mrg.index(19).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 256 + d, (o4 * a0 + mrg.index(20).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 320 + d, (o5 * a0 + mrg.index(21).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 384 + d, (o6 * a0 + mrg.index(22).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + 448 + d, (o7 * a0 + mrg.index(23).load(S_L) * a1).to(ty), mask=hm)
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=heads < H)


@gluon.jit
def _q_ready(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, vec, q_bar, WG: gl.constexpr,
             DS: gl.constexpr,
             ROPE: gl.constexpr, CHUNKS: gl.constexpr, FP8_QK: gl.constexpr):
    """Warpgroup 0 stages q (_stage_q, or _stage_q8 for FP8_QK) and publishes c; warpgroup 1 waits for it.  Returns
    c: a scalar, or (FP8_QK) the five 1 / c of _stage_q8 (one power of two per head each, [16] in HEAD)."""
    if WG == 0:
        if FP8_QK:
            c = _stage_q8(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, DS, ROPE)
            vec.index(0).store(c[0])
            vec.index(1).store(c[1])
            vec.index(2).store(c[2])
            vec.index(3).store(c[3])
            vec.index(4).store(c[4])
        else:
            c = _stage_q(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, DS, ROPE, CHUNKS)
            vec.index(0).store(gl.full([16], 1.0, gl.float32, HEAD) * c)  # c for warpgroup 1
        fence_async_shared()
        publish(q_bar)
    else:
        mbarrier.wait(q_bar, 0)
        fence_async_shared()
        if FP8_QK:
            c = (vec.index(0).load(HEAD), vec.index(1).load(HEAD), vec.index(2).load(HEAD), vec.index(3).load(HEAD),
                 vec.index(4).load(HEAD))
        else:
            c = gl.max(vec.index(0).load(HEAD), 0)
    return c


@gluon.jit
def _publish(m_i, l_i, vec, done_bar):
    """Warpgroup 1, its accumulators stored for the merge: its running max and sum to warpgroup 0."""
    vec.index(0).store(m_i)
    vec.index(1).store(l_i)
    publish(done_bar)


@gluon.jit
def _merge_start(m_i, l_i, vec, done_bar, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H):
    """Warpgroup 0, once warpgroup 1 has published: the two warpgroups' weights (each [1, 16]) in the merged,
    normalized output, the natural-log lse, and the program's heads, head mask and output row pointers."""
    mbarrier.wait(done_bar, 0)
    m1 = vec.index(0).load(HEAD)
    l1 = vec.index(1).load(HEAD)
    m = gl.maximum(m_i, m1)
    w0 = gl.exp2(m_i - m)
    w1 = gl.exp2(m1 - m)
    inv_l, lse = normalizer(m, l_i * w0 + l1 * w1)
    heads = g * 16 + gl.arange(0, 16, layout=HEAD)
    hm = (heads < H)[None, :]
    obase = o_ptr + t.to(gl.int64) * stride_ot + s * stride_os + heads[None, :] * stride_oh
    return (w0 * inv_l)[None, :], (w1 * inv_l)[None, :], lse, heads, hm, obase


@gluon.jit
def _consumer(args, WG: gl.constexpr, DS: gl.constexpr, ROPE: gl.constexpr, FP8_QK: gl.constexpr,
              NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Consumer warpgroup WG (0 or 1): blocks WG, WG + 2, ...; warpgroup 0 then merges and stores.  FP8_QK: QK on
    e4m3 MMAs straight from shared memory (see the module docstring)."""
    (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot,
     stride_os, stride_oh, lse_ptr,
     stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, smem,
     bars) = args
    raw, scl, rope, qn, qr, pb, mrg, vec = smem
    q_bar, ready, free, done_bar = bars
    n_st: gl.constexpr = raw.shape[0] // (4 if FP8_QK else 1)
    MB: gl.constexpr = 4 if FP8_QK else 0  # warpgroup 1's accumulators: mrg.index(MB + G) (stage 1's bytes)
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    c = _q_ready(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, vec, q_bar, WG, DS, ROPE,
                 False, FP8_QK)
    if FP8_QK:
        score_scale = sm_scale_log2  # the scores are in true units (_fold divides by c)
    else:
        score_scale = sm_scale_log2 / c
    s_zero = gl.zeros([64, 16], gl.float32, S_L)
    o0 = gl.zeros([128, 16], gl.float32, S_L)
    o1 = o0
    o2 = o0
    o3 = o0
    l_acc = s_zero
    m_i = gl.full([16], NEG_BIG, gl.float32, HEAD)
    u = gl.full([4], 1.0, gl.float32, gl.SliceLayout(0, SC_L))  # fp8_ds_mla: each group's accumulator unit
    n_mine = (n_blocks + 1 - WG) // 2
    for j in range(n_mine):
        b = 2 * j + WG
        # z == 0, but the compiler cannot know it: shared-memory views indexed with it are recomputed in the
        # loop instead of their wgmma descriptors being hoisted out of it and spilled
        z = j // (n_mine + 1)
        st = b % n_st
        p0 = k_begin + b * 64
        valid = block_indices(idx_row, p0, k_end, ROW) >= 0
        mbarrier.wait(ready.index(st), (b // n_st) & 1)
        fence_async_shared()  # cp.async data -> the wgmma (async proxy) reads of the rope part
        rs = raw.index(st)
        if DS:
            sv = scl.index(st).load(SC_L)  # 0 for a -1 row or one past the end (cp.async zero-fills them)
        # S^T = K q^T (A = the converted bytes, B = q^T): plain fp8 as one chain of MMAs; fp8_ds_mla as one
        # accumulator per 128-dim group, weighed with the rows' group scales after (32 multiply-adds a
        # block instead of 128 fp16 multiplies of the A registers)
        if DS:
            if FP8_QK:
                g0, g1, g2, g3 = _qk_groups8(raw, st, qn, z)
            else:
                g0, g1, g2, g3 = _qk_groups(rs, qn, z, s_zero)
            c0, c1, c2, c3 = _cols(sv)
            if ROPE:  # bf16 rope (A from shared memory), not scaled: its own accumulator
                tr = warpgroup_mma(rope.index(st), qr.index(z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                g0, g1, g2, g3, tr = warpgroup_mma_wait(0, deps=(g0, g1, g2, g3, tr))
            else:
                g0, g1, g2, g3 = warpgroup_mma_wait(0, deps=(g0, g1, g2, g3))
            if FP8_QK:  # q's two terms added, in true units
                g0 = _fold(g0, c[0])
                g1 = _fold(g1, c[1])
                g2 = _fold(g2, c[2])
                g3 = _fold(g3, c[3])
            if ROPE:
                x = tr + g0 * c0[:, None]
            else:
                x = g0 * c0[:, None]
            x = x + g1 * c1[:, None] + g2 * c2[:, None] + g3 * c3[:, None]
        elif FP8_QK:
            x = _qk_plain8(raw, rope, st, qn, qr, z, c, ROPE) * k_scale
        else:
            x, a2 = _qk_chain(rs, qn, z, s_zero)
            if ROPE:  # e4m3 rope, in the same chain
                warpgroup_mma_wait(1, deps=(a2, ))
                x = warpgroup_mma(_rope_operand(rope.index(st)), qr.index(z).permute((1, 0)), x, is_async=True)
            x = warpgroup_mma_wait(0, deps=(x, ))
            x = x * k_scale
        p, alpha, m_i, l_acc = _softmax_step(x * score_scale, valid, m_i, l_acc)
        if DS:
            # group units: the block's largest scale (a group without a positive scale keeps its unit)
            mx = gl.max(sv, 0)
            u_new = gl.where(mx > 0, mx, u)
            inv = rcp(u_new)
            f = u * inv
            pb[0].index(WG).store((p * (c0 * _pick(inv, 0))[:, None]).to(gl.float16))
            pb[1].index(WG).store((p * (c1 * _pick(inv, 1))[:, None]).to(gl.float16))
            pb[2].index(WG).store((p * (c2 * _pick(inv, 2))[:, None]).to(gl.float16))
            pb[3].index(WG).store((p * (c3 * _pick(inv, 3))[:, None]).to(gl.float16))
            o0 = o0 * (alpha * _pick(f, 0))[None, :]
            o1 = o1 * (alpha * _pick(f, 1))[None, :]
            o2 = o2 * (alpha * _pick(f, 2))[None, :]
            o3 = o3 * (alpha * _pick(f, 3))[None, :]
            u = u_new
        else:
            pb[0].index(WG).store(p.to(gl.float16))
            o0 = o0 * alpha[None, :]
            o1 = o1 * alpha[None, :]
            o2 = o2 * alpha[None, :]
            o3 = o3 * alpha[None, :]
        fence_async_shared()
        compat.barrier()  # every warp's part of P is in shared memory before the MMAs read it
        # PV, one 16-row step at a time: the next step's operands are converted while this step's MMAs
        # run; each wait retires all four (waiting on an accumulator still in flight makes ptxas
        # serialize every wgmma: it then reads those registers)
        v0, v1, v2, v3 = _pv_ops(raw, rs, st, 0, FP8_QK)
        o0, o1, o2, o3 = _pv_issue(v0, v1, v2, v3, pb, WG + z, 0, o0, o1, o2, o3, DS)
        v0, v1, v2, v3 = _pv_ops(raw, rs, st, 1, FP8_QK)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        o0, o1, o2, o3 = _pv_issue(v0, v1, v2, v3, pb, WG + z, 1, o0, o1, o2, o3, DS)
        v0, v1, v2, v3 = _pv_ops(raw, rs, st, 2, FP8_QK)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        o0, o1, o2, o3 = _pv_issue(v0, v1, v2, v3, pb, WG + z, 2, o0, o1, o2, o3, DS)
        v0, v1, v2, v3 = _pv_ops(raw, rs, st, 3, FP8_QK)
        compat.barrier()  # all of this warpgroup's reads of the stage are done (the MMAs read registers)
        mbarrier.arrive(free.index(st), count=1)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        o0, o1, o2, o3 = _pv_issue(v0, v1, v2, v3, pb, WG + z, 3, o0, o1, o2, o3, DS)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
    l_i = gl.sum(l_acc, 0)
    if DS:
        o0 = o0 * _pick(u, 0)
        o1 = o1 * _pick(u, 1)
        o2 = o2 * _pick(u, 2)
        o3 = o3 * _pick(u, 3)
    else:
        o0 = o0 * k_scale
        o1 = o1 * k_scale
        o2 = o2 * k_scale
        o3 = o3 * k_scale
    if WG == 1:
        mrg.index(MB + 0).store(o0)
        mrg.index(MB + 1).store(o1)
        mrg.index(MB + 2).store(o2)
        mrg.index(MB + 3).store(o3)
        _publish(m_i, l_i, vec, done_bar)
    else:
        a0, a1, lse, heads, hm, obase = _merge_start(m_i, l_i, vec, done_bar, o_ptr, stride_ot, stride_os, stride_oh,
                                                     t, s, g, H)
        d0 = acc_dim(gl.arange(0, 128, layout=ROW))[:, None]
        d1 = d0 + 128
        d2 = d0 + 256
        d3 = d0 + 384
        ty = o_ptr.dtype.element_ty
        gl.store(obase + d0, (o0 * a0 + mrg.index(MB + 0).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + d1, (o1 * a0 + mrg.index(MB + 1).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + d2, (o2 * a0 + mrg.index(MB + 2).load(S_L) * a1).to(ty), mask=hm)
        gl.store(obase + d3, (o3 * a0 + mrg.index(MB + 3).load(S_L) * a1).to(ty), mask=hm)
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=heads < H)


@gluon.jit
def few_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
               o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
               sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
               fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh,
               BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
               NG: gl.constexpr, HAS_VC: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr, FP8_QK: gl.constexpr,
               FUSED: gl.constexpr = False):
    """One program = one query token x 16 heads (head group g of NG) x one split; launch with num_warps=4 (the
    default partition, consumer warpgroup 0) and maxnreg=168 (see the module docstring and ``launch``)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 16], gl.float16)
    p0 = gl.allocate_shared_memory(gl.float16, [2, 64, 16], pl)
    if FP4:
        # nvfp4: three 22 KB stages (nibbles, scale bytes, e4m3 rope); each consumer warpgroup's fp16 tile
        # [8 chunks, 64 rows, 64 dims] (kt, 2 x 64 KB); q in 64-dim chunks; one P
        raw = gl.allocate_shared_memory(gl.uint8, [3, 64, 256], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
        scl = gl.allocate_shared_memory(gl.uint8, [3, 64, 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.uint8, [3, 64, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
        qr = gl.allocate_shared_memory(gl.float16, [1, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16))
        qn = gl.allocate_shared_memory(gl.float16, [8, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16))
        pb = (p0, p0, p0, p0)
        kt = gl.allocate_shared_memory(gl.float16, [16, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16))
    elif FP8_QK:
        raw = gl.allocate_shared_memory(gl.uint8, [4 * NS, 64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv))
        qn = gl.allocate_shared_memory(gl.float8e4nv, [4, 32, 128], gl.NVMMASharedLayout.get_default_for([32, 128], gl.float8e4nv))
        # warpgroup 1's accumulators for the final merge: indices 4 .. 7 of this view, stage 1's bytes (only
        # warpgroup 1 reads stage 1; the consumer's MB)
        kt = compat.reinterpret(raw, gl.float32, [4 * NS, 128, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:
        raw = gl.allocate_shared_memory(gl.uint8, [NS, 64, 512], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
        qn = gl.allocate_shared_memory(gl.float16, [4, 16, 128], gl.NVMMASharedLayout.get_default_for([16, 128], gl.float16))
        # warpgroup 1's accumulators for the final merge go over stage 1's bytes (only warpgroup 1 reads stage 1)
        kt = compat.reinterpret(raw.index(1), gl.float32, [4, 128, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if DS:
        scl = gl.allocate_shared_memory(gl.float32, [NS, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.bfloat16, [NS, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
        qr = gl.allocate_shared_memory(gl.bfloat16, [1, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16))
        # P (times each group's scale ratio) per group, [warpgroup, 64 rows, 16 heads]: one allocation per
        # group so that the four stores need no barrier between them (the barrier analysis works per allocation)
        pb = (p0, gl.allocate_shared_memory(gl.float16, [2, 64, 16], pl), gl.allocate_shared_memory(gl.float16, [2, 64, 16], pl),
              gl.allocate_shared_memory(gl.float16, [2, 64, 16], pl))
    elif FP8_QK:
        scl = gl.allocate_shared_memory(gl.float32, [1, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv))
        qr = gl.allocate_shared_memory(gl.float8e4nv, [1, 32, 64], gl.NVMMASharedLayout.get_default_for([32, 64], gl.float8e4nv))
        pb = (p0, p0, p0, p0)
    elif not FP4:
        scl = gl.allocate_shared_memory(gl.float32, [1, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
        qr = gl.allocate_shared_memory(gl.float16, [1, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16))
        pb = (p0, p0, p0, p0)  # fp8: one P for the four groups
    if FP8_QK:  # the five 1 / c of q's parts, later the merge's max and sum
        vec = gl.allocate_shared_memory(gl.float32, [5, 16], plain)
    else:
        vec = gl.allocate_shared_memory(gl.float32, [2, 16], plain)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    n_st: gl.constexpr = raw.shape[0] // (4 if FP8_QK else 1)
    ready = gl.allocate_shared_memory(gl.int64, [n_st, 1], bl)
    free = gl.allocate_shared_memory(gl.int64, [n_st, 1], bl)
    done_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    mbarrier.init(q_bar, count=PUBLISH)  # warpgroup 0's publish() of q
    mbarrier.init(done_bar, count=PUBLISH)  # warpgroup 1's publish() of its accumulators, max and sum
    for i in gl.static_range(n_st):
        mbarrier.init(ready.index(i), count=128)  # one cp.async arrival per producer thread
        mbarrier.init(free.index(i), count=1)     # the consuming warpgroup
    # kt: nvfp4's fp16 tiles; fp8 / fp8_ds_mla: warpgroup 1's accumulators for the final merge
    smem = (raw, scl, rope, qn, qr, pb, kt, vec)
    bars = (q_bar, ready, free, done_bar)
    # (constexprs reach a partition as constexprs only when written into warp_specialize's argument tuples
    # there: a tuple assigned to a name first holds them as tensors)
    ca = (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot,
          stride_os, stride_oh,
          lse_ptr, stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
          smem, bars)
    pa = (kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, raw, scl, rope, ready, free)
    if FP4:
        gl.warp_specialize([(_consumer_fp4, (ca, 0, ROPE, NG, HAS_VC)), (_consumer_fp4, (ca, 1, ROPE, NG, HAS_VC)),
                            (producer, (pa, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, FP4, FP8_QK, NG, HAS_VC))],
                           [4, 4], [232, 40])
    else:
        gl.warp_specialize([(_consumer, (ca, 0, DS, ROPE, FP8_QK, NG, HAS_VC)),
                            (_consumer, (ca, 1, DS, ROPE, FP8_QK, NG, HAS_VC)),
                            (producer, (pa, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, FP4, FP8_QK, NG, HAS_VC))],
                           [4, 4], [232, 40])
    if FUSED:  # the splits' partials merged by this grid's programs (common.combine_in_kernel)
        combine_in_kernel(o_ptr, lse_ptr, fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh, H, num_splits,
                          NG)

KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")  # the row formats this kernel reads


# How sparsemla.kernels.attention launches it (one cached launch per plan, compile-time arguments from
# meta()):
# ``grid``: ``(tokens x splits x num_groups,)``; program p serves head group p % num_groups of split
# (p // num_groups) % splits of token p // (num_groups x splits).  12 warps (two consumer warpgroups and
# the producer), 168 registers each at launch.
# ``args`` (positional, in this order): q [tokens, heads, 512 or more] bf16 and its strides (token, head); the
# query's RoPE part [tokens, heads, 64] bf16 (q[..., 512:] or a tensor of its own; q again for NoPE rows, unread)
# and its strides (token, head); the cache rows (uint8, row r at byte r x bytes_per_row, 16-byte aligned);
# indices [tokens, top-k] int32
# (-1: no row) and its token stride; valid counts [tokens] int32 (any tensor when has_valid_counts is
# False); out (bf16 [tokens, heads, 512], or the fp32 split partials) and its strides (token, split, head);
# lse (fp32) and its strides (token, split, head); sm_scale x log2(e); k_scale (fp8 rows; 1.0 otherwise);
# heads; top-k; rows per split (a multiple of 64); splits; the final out (bf16) and lse with their token and head
# strides (read by the FUSED variant only, which merges the split partials into them).

def meta(*, kind: str, bytes_per_row: int, rope_dim: int, rope_offset: int, scale_offset: int, num_groups: int,
         has_valid_counts: bool, fp8_qk: bool = False, fused: bool = False) -> dict:
    """``few_kernel``'s constexprs and launch options for one variant.  ``kind``: one of ``KINDS``;
    ``bytes_per_row``: the row stride in bytes; ``rope_dim`` 64 or 0 (NoPE: no rope byte is read);
    ``rope_offset`` / ``scale_offset``: byte offsets of the rope part / the scales in a row (the format's
    layout; ignored where absent); ``num_groups``: ceil(heads / 16); ``fp8_qk``: the FP8-QK mode (fp8 /
    fp8_ds_mla rows); ``fused``: the splits' partials merged by the kernel's own programs after a grid barrier
    (a cooperative launch; ``common.combine_in_kernel``) instead of by the combine kernel."""
    ds, fp4 = kind == "fp8_ds_mla", kind == "nvfp4_ds_mla"
    if kind not in KINDS or (fp8_qk and fp4):
        raise ValueError(f"kind: expected one of {KINDS} (fp8_qk: not nvfp4_ds_mla), got {kind!r}, fp8_qk={fp8_qk}")
    return dict(BPT=bytes_per_row, ROPE=rope_dim, SCALE_OFF=scale_offset if ds or fp4 else 0,
                ROPE_OFF=rope_offset if rope_dim else 0, NG=num_groups, HAS_VC=bool(has_valid_counts), DS=ds,
                FP4=fp4, FP8_QK=bool(fp8_qk), num_warps=4, maxnreg=168, enable_fp_fusion=True,
                **fused_meta(fused))
