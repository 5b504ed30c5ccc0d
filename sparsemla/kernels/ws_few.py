"""Warp-specialized sparse MLA decode for FP8 rows at few heads (Hopper, Gluon): ``fp8`` and ``fp8_ds_mla``
(rope or NoPE), 16 heads per program.

Why a second kernel: the Triton few-heads kernels (``sparse_attention._fwd_fp8_kernel``) hold q as
mma.sync fragments in every warp (~144 registers), so two programs (8 warps) fit an SM; each tile then
runs load -> convert -> QK -> softmax -> PV in sequence and the kernel is latency-bound at 35 % of memory
speed-of-light (kernel-notes.md).  Here the work is transposed and split between warps:

- the cache rows are the MMA's M dimension: ``S^T = K q^T`` and ``O^T += V^T P^T`` on wgmma m64n16 with
  the 16 heads as N, so q and P live in shared memory as the B operand and the K / V tiles are the A
  operand **from registers**, converted there straight from the raw e4m3 bytes (never written back);
- a producer warpgroup gathers the raw rows (e4m3 values, scales, rope) with cp.async into a ring of
  four 64-row stages; two consumer warpgroups take every other 64-row block, each with its own online
  softmax, and merge once at the end (through shared memory).

Operand layout trick: a thread of the wgmma A fragment holds k (columns) 2t, 2t+1, 2t+8, 2t+9 of each
16-wide step.  A dot product does not care about the order of k, so the kernel permutes k: a thread loads
16 contiguous bytes of a row (one 128-bit shared load) and those bytes *are* its fragment, in the order
the fragment wants them; q is written to shared memory once with the same permutation of its columns.
For PV the output dims are permuted the same way (each thread loads 4 contiguous bytes of 4 rows per
128-dim group) and un-permuted when the output is stored.  The relabelling is a reshape / permute of the
register tensor (no data movement); ``tests/ws_compile_probe.py`` pins the SASS (128-bit shared loads, no
spills).

Numbers: e4m3 is exact in fp16, so the MMAs run in fp16 with q brought into fp16 range by a per-token
power of two (as the Triton kernels do).  fp8_ds_mla's per-row, per-128-dim-group fp32 scales: for QK each
row's values of group g are multiplied on the A registers by ``scale_g / (the row's largest scale)`` (a
ratio <= 1, exact for the power-of-two scales the writer makes) and S^T by the row's largest scale after,
so QK is one chain of MMAs; for PV, P is multiplied by ``scale_g / u_g`` per group (u_g = the block's
largest scale of group g, again <= 1) and each group's accumulator is held in units of u_g.  The rope part
of fp8_ds_mla is bf16 and multiplies in bf16 (A from shared memory, its own accumulator); plain fp8 rows
are e4m3 throughout with the per-tensor ``k_scale`` applied to the scores and the output.

Measured on the H200 (BENCHMARKS.md section 7): D-h16 (b 128, top-k 2048) fp8 55 us, fp8_ds_mla 80 us
(68-91 us across the sweeps), against 101 / 119 us for the Triton kernels; D-h32 2-2.4x faster than them.

Same arguments and output contract as ``sparse_attention._fwd_fp8_kernel`` (split partials, normalized
output, natural-log lse).  Gluon does not run under the Triton interpreter: CPU CI compiles it for sm_90
(``tests/test_ws_attention.py``) and the GPU suite checks its numbers.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .ws_attention import _NEG_BIG, _coords

NS = gl.constexpr(4)  # ring stages of 64 rows

# S^T [64 rows, 16 heads] and O^T [128 dims, 16 heads] (one per 128-dim group) on wgmma m64n16
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_L.value, k_width=2))
ROW = gl.constexpr(gl.SliceLayout(1, S_L.value))   # one value per cache row (or output dim)
HEAD = gl.constexpr(gl.SliceLayout(0, S_L.value))  # one value per head
# Raw e4m3 bytes for QK, [64 rows, 64 bytes] (one 64-dim chunk): thread (warp w, lane 4g + t) holds rows
# 16w + g and 16w + g + 8, bytes 16t .. 16t + 15.  Register order = byte order (128-bit loads).  Byte
# 16 t + 4 s + 2 p + e is the fragment's k = 16 s + 8 p + 2 t + e (see _relabel64).
L_QK = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 64]))
# Raw e4m3 bytes for PV, [16 rows, 128 dims] (one k-step of one group): thread (w, 4g + t) holds rows
# 2t, 2t + 1, 2t + 8, 2t + 9 and dims 32w + 4g .. 32w + 4g + 3 (32-bit loads).  Dim 32 w + 4 g + 2 i + h is
# the fragment's M row 64 i + 16 w + 8 h + g (see _pv_operand and _dims).
L_V = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]], warp_bases=[[0, 32], [0, 64]], block_bases=[],
    shape=[16, 128]))
# fp8_ds_mla tile scales [64 rows, 4 groups] with the rows of S^T (all four in each thread's registers)
SC_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4]))


@gluon.jit
def _dims(m):
    """Accumulator row m (0..127) of a group -> the output dim within the group (see L_V)."""
    return 32 * ((m >> 4) & 3) + 4 * (m & 7) + 2 * (m >> 6) + ((m >> 3) & 1)


@gluon.jit
def _qk_operand(raw, C: gl.constexpr):
    """64-byte chunk C of the stage's e4m3 bytes -> the fp16 A operand [64 rows, 64 k] (k permuted)."""
    a = raw.slice(64 * C, 64, dim=1).load(L_QK).to(gl.float8e4nv, bitcast=True).to(gl.float16)
    return gl.convert_layout(_relabel64(a), A_OP)


@gluon.jit
def _ratio(scl, G: gl.constexpr):
    """fp8_ds_mla: each row's scale of group G over the row's largest scale (<= 1; 0 for a row without a
    positive scale), fp16, one value per row of the A operand.  Read from shared memory where it is used,
    so that no scales stay in registers across the QK chain."""
    sv = scl.load(SC_L)
    smax = gl.max(sv, 1)
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
    r = gl.sum(gl.where(c[None, :] == G, sv, 0.0), 1) / gl.where(smax > 0, smax, 1.0)
    return gl.convert_layout(r.to(gl.float16), gl.SliceLayout(1, A_OP))


@gluon.jit
def _qk_a(raw, C: gl.constexpr, r, DS: gl.constexpr):
    """Latent chunk C's QK A operand; fp8_ds_mla: times ``r``, the rows' _ratio of the chunk's group."""
    a = _qk_operand(raw, C)
    if DS:
        a = a * r[:, None]
    return a


@gluon.jit
def _rope_operand(rope):
    """Plain fp8 rows: the 64 e4m3 rope bytes -> fp16 A operand [64 rows, 64 k] (k permuted like L_QK)."""
    return _qk_operand(rope, 0)


@gluon.jit
def _pv_operand(raw, ks: gl.constexpr, G: gl.constexpr):
    """Rows 16 ks .. 16 ks + 15, group G -> the fp16 A operand V^T [128 dims (permuted, _dims), 16 rows]."""
    v = raw.slice(16 * ks, 16, dim=0).slice(128 * G, 128, dim=1).load(L_V)
    v = v.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    v = v.permute(1, 0).reshape([4, 8, 2, 2, 16]).permute(2, 0, 3, 1, 4).reshape([128, 16])
    return gl.convert_layout(v, A_OP)


@gluon.jit
def _idx(idx_row, p0, k_end, rows_l: gl.constexpr):
    """The cache rows at positions p0 .. p0 + 63 (-1 past the split's end)."""
    offs = p0 + gl.arange(0, 64, layout=rows_l)
    return gl.load(idx_row + offs, mask=offs < k_end, other=-1)


@gluon.jit
def _copy(dst, kv_ptr, idx, BPT: gl.constexpr, off: gl.constexpr, cols, ty: gl.constexpr):
    """cp.async of the columns ``cols`` (elements of ``ty``) at byte ``off`` of each row; -1 rows zero-filled."""
    valid = idx >= 0
    base = gl.multiple_of(kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * BPT, 16)
    if off != 0:
        base = gl.multiple_of(base + off, 16).to(gl.pointer_type(ty))
    async_copy.async_copy_global_to_shared(dst, base[:, None] + cols[None, :], mask=valid[:, None])


@gluon.jit
def _producer(args, BPT: gl.constexpr, DS: gl.constexpr, ROPE: gl.constexpr):
    """Gathers each 64-row block's raw bytes into stage b % NS: e4m3 values, then (fp8_ds_mla) the four
    scales and the bf16 rope, or (fp8) the e4m3 rope.  The next block's indices are loaded before waiting
    for a free stage, so their latency is not on the producer's path."""
    kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, smem, bars, NG, HAS_VC = args
    raw, scl, rope, qn, qr, pb, vec = smem
    q_bar, ready, free, done_bar, all_done = bars
    t, s, g, k_begin, k_end = _coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    lv: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])   # [64, 512] u8, 16 B each, 4 rows a thread
    ls: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [4, 1], [1, 0])   # [64, 4] f32, 8 B each
    lr: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])    # [64, 64] bf16, 16 B each
    lq: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # [64, 64] u8, 16 B each
    cv = gl.arange(0, 512, layout=gl.SliceLayout(0, lv))
    cs = gl.arange(0, 4, layout=gl.SliceLayout(0, ls))
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, lr))
    cq = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
    iv = _idx(idx_row, k_begin, k_end, gl.SliceLayout(1, lv))
    i_s = _idx(idx_row, k_begin, k_end, gl.SliceLayout(1, ls))
    ir = _idx(idx_row, k_begin, k_end, gl.SliceLayout(1, lr))
    iq = _idx(idx_row, k_begin, k_end, gl.SliceLayout(1, lq))
    for b in range(n_blocks):
        st = b % NS
        p1 = k_begin + (b + 1) * 64
        nv = _idx(idx_row, p1, k_end, gl.SliceLayout(1, lv))
        if DS:
            ns = _idx(idx_row, p1, k_end, gl.SliceLayout(1, ls))
            if ROPE:
                nr = _idx(idx_row, p1, k_end, gl.SliceLayout(1, lr))
            else:
                nr = ir
            nq = iq
        else:
            ns = i_s
            nr = ir
            if ROPE:
                nq = _idx(idx_row, p1, k_end, gl.SliceLayout(1, lq))
            else:
                nq = iq
        mbarrier.wait(free.index(st), ((b // NS) & 1) ^ 1)  # fresh barriers pass phase 1 at once
        _copy(raw.index(st), kv_ptr, iv, BPT, 0, cv, gl.uint8)
        if DS:
            _copy(scl.index(st), kv_ptr, i_s, BPT, 512, cs, gl.float32)
            if ROPE:
                _copy(rope.index(st), kv_ptr, ir, BPT, 528, cr, gl.bfloat16)
        elif ROPE:
            _copy(rope.index(st), kv_ptr, iq, BPT, 512, cq, gl.uint8)
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        iv = nv
        i_s = ns
        ir = nr
        iq = nq


@gluon.jit
def _q_group(q_row, hm, off: gl.constexpr, lay: gl.constexpr):
    """q[:, off : off + 128] as fp32 [16, 128] (contiguous 16-byte loads)."""
    k = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    return gl.load(q_row + off + k[None, :], mask=hm, other=0.0).to(gl.float32)


@gluon.jit
def _absmax(x):
    return gl.max(gl.max(gl.abs(x), 1), 0)


@gluon.jit
def _stage_q(q_ptr, stride_qt, stride_qh, t, g, H, qn, qr, DS: gl.constexpr, ROPE: gl.constexpr):
    """q * c into shared memory as the QK B operand, once per program; returns c, the per-token power of two
    that brings q into fp16 range (amax * c in [2^13, 2^15); over the latent dims, and the rope dims too
    when they are fp16 operands (plain fp8)).  Groups are fp16 [4, 16, 128] with columns permuted like the
    A fragments (the same register relabelling as _qk_operand, applied to q loaded in natural order); the
    rope part is bf16 in natural order (fp8_ds_mla) or fp16 permuted (fp8)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, lay))
    hm = (heads < H)[:, None]
    q_row = q_ptr + t.to(gl.int64) * stride_qt + gl.where(heads < H, heads, 0).to(gl.int64)[:, None] * stride_qh
    x0 = _q_group(q_row, hm, 0, lay)
    x1 = _q_group(q_row, hm, 128, lay)
    x2 = _q_group(q_row, hm, 256, lay)
    x3 = _q_group(q_row, hm, 384, lay)
    amax = gl.maximum(gl.maximum(_absmax(x0), _absmax(x1)), gl.maximum(_absmax(x2), _absmax(x3)))
    if ROPE:
        k64 = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
        xr = gl.load(q_row + 512 + k64[None, :], mask=hm, other=0.0).to(gl.float32)
        if not DS:
            amax = gl.maximum(amax, _absmax(xr))
    e = gl.floor(gl.log2(gl.maximum(amax, 1e-30)))
    c = gl.where(amax > 0, gl.exp2(13.0 - e), 1.0)
    _store_chunks(qn, 0, x0 * c)
    _store_chunks(qn, 2, x1 * c)
    _store_chunks(qn, 4, x2 * c)
    _store_chunks(qn, 6, x3 * c)
    if ROPE:
        if DS:
            qr.index(0).store((xr * c).to(gl.bfloat16))
        else:
            qr.index(0).store(_relabel64(xr * c).to(gl.float16))
    return c


@gluon.jit
def _store_chunks(qn, C: gl.constexpr, x):
    """x [16, 128] (natural column order) -> chunks C and C + 1 of qn, each column-permuted like L_QK."""
    lo, hi = x.reshape([16, 2, 64]).permute(0, 2, 1).split()
    qn.index(C).store(_relabel64(lo).to(gl.float16))
    qn.index(C + 1).store(_relabel64(hi).to(gl.float16))


@gluon.jit
def _relabel64(x):
    """[R, 64] indexed by byte -> indexed by fragment column (byte 16t + 4s + 2p + e is column
    16s + 8p + 2t + e; see L_QK): a relabelling of the registers, no data movement."""
    return x.reshape([x.shape[0], 4, 4, 2, 2]).permute(0, 2, 3, 1, 4).reshape([x.shape[0], 64])


@gluon.jit
def _col(x, G: gl.constexpr):
    """Column G of a [64, 4] tensor in SC_L, as a per-row vector of S^T."""
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
    return gl.convert_layout(gl.sum(gl.where(c[None, :] == G, x, 0.0), 1), ROW)


@gluon.jit
def _pick(v, G: gl.constexpr):
    """Element G of a [4] vector in SliceLayout(0, SC_L), as a scalar (held in every thread)."""
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
    return gl.sum(gl.where(c == G, v, 0.0), 0)


@gluon.jit
def _pv_mma(v, pb, P0, ks: gl.constexpr, G: gl.constexpr, o0, o1, o2, o3, DS: gl.constexpr):
    """Issue O^T_G += V^T_G P_G^T over rows 16 ks .. 16 ks + 15 (asynchronous); fp8 rows share one P."""
    if DS:
        b = pb[G].index(P0).slice(16 * ks, 16, dim=0)
    else:
        b = pb[0].index(P0).slice(16 * ks, 16, dim=0)
    if G == 0:
        o0 = warpgroup_mma(v, b, o0, is_async=True)
    elif G == 1:
        o1 = warpgroup_mma(v, b, o1, is_async=True)
    elif G == 2:
        o2 = warpgroup_mma(v, b, o2, is_async=True)
    else:
        o3 = warpgroup_mma(v, b, o3, is_async=True)
    return o0, o1, o2, o3


@gluon.jit
def _consumer(args, WG: gl.constexpr, NC: gl.constexpr, DS: gl.constexpr, ROPE: gl.constexpr):
    """Consumer warpgroup WG of NC: blocks WG, WG + NC, ...; warpgroup 0 then merges and stores."""
    (q_ptr, stride_qt, stride_qh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr,
     stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, smem, bars, NG,
     HAS_VC) = args
    raw, scl, rope, qn, qr, pb, vec = smem
    q_bar, ready, free, done_bar, all_done = bars
    t, s, g, k_begin, k_end = _coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    if WG == 0:
        c = _stage_q(q_ptr, stride_qt, stride_qh, t, g, H, qn, qr, DS, ROPE)
        vec.index(0).store(gl.full([16], 1.0, gl.float32, HEAD) * c)  # c for warpgroup 1
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(q_bar, count=1)
    else:
        mbarrier.wait(q_bar, 0)
        fence_async_shared()
        c = gl.max(vec.index(0).load(HEAD), 0)
    score_scale = sm_scale_log2 / c
    s_zero = gl.zeros([64, 16], gl.float32, S_L)
    o0 = gl.zeros([128, 16], gl.float32, S_L)
    o1 = o0
    o2 = o0
    o3 = o0
    l_acc = s_zero
    m_i = gl.full([16], _NEG_BIG, gl.float32, HEAD)
    u = gl.full([4], 1.0, gl.float32, gl.SliceLayout(0, SC_L))  # fp8_ds_mla: each group's accumulator unit
    n_mine = (n_blocks + NC - 1 - WG) // NC
    for j in range(n_mine):
        b = NC * j + WG
        # z == 0, but the compiler cannot know it: shared-memory views indexed with it are recomputed in the
        # loop instead of their wgmma descriptors being hoisted out of it and spilled (as in ws_pair)
        z = j // (n_mine + 1)
        st = b % NS
        p0 = k_begin + b * 64
        offs = p0 + gl.arange(0, 64, layout=ROW)
        valid = gl.load(idx_row + offs, mask=offs < k_end, other=-1) >= 0
        mbarrier.wait(ready.index(st), (b // NS) & 1)
        fence_async_shared()  # cp.async data -> the wgmma (async proxy) reads of the rope part
        rs = raw.index(st)
        # S^T = K q^T as one chain of MMAs (A = the converted bytes, B = q^T).  fp8_ds_mla: each row's
        # group values are multiplied by scale / (the row's largest scale) on the A registers (a ratio
        # <= 1, in fp16), and S^T by the row's largest scale after.  The scales of a -1 row or one past the
        # end are 0 (cp.async zero-fills them).  A wait per chunk keeps two chunks' A registers alive at
        # most; it names no accumulator (waiting on the chain's pending accumulator would make ptxas
        # serialize the MMAs).
        r = 0.0
        if DS:
            r = _ratio(scl.index(st), 0)
        a = _qk_a(rs, 0, r, DS)
        acc = warpgroup_mma(a, qn.index(0 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        for C in gl.static_range(1, 8):
            if DS:
                if C % 2 == 0:
                    r = _ratio(scl.index(st), C // 2)
            a_prev = a
            a = _qk_a(rs, C, r, DS)
            acc = warpgroup_mma(a, qn.index(C + z).permute((1, 0)), acc, is_async=True)
            warpgroup_mma_wait(1, deps=(a_prev, ))
        if DS:
            sv = scl.index(st).load(SC_L)
            smax = gl.max(sv, 1)
        if DS:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            x = acc * gl.convert_layout(smax, ROW)[:, None]
            if ROPE:  # bf16 rope (A from shared memory, not scaled), added onto the scaled latent scores
                x = warpgroup_mma(rope.index(st), qr.index(z).permute((1, 0)), x, is_async=True)
                x = warpgroup_mma_wait(0, deps=(x, ))
        else:
            if ROPE:  # e4m3 rope, in the same chain
                acc = warpgroup_mma(_rope_operand(rope.index(st)), qr.index(z).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            x = acc * k_scale
        x = x * score_scale
        x = gl.where(valid[:, None], x, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(x, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(x - m_new[None, :])
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        if DS:
            # group units: the block's largest scale (a group without a positive scale keeps its unit)
            mx = gl.max(sv, 0)
            u_new = gl.where(mx > 0, mx, u)
            f = u / u_new
            inv = 1.0 / u_new
            pb[0].index(WG).store((p * (_col(sv, 0) * _pick(inv, 0))[:, None]).to(gl.float16))
            pb[1].index(WG).store((p * (_col(sv, 1) * _pick(inv, 1))[:, None]).to(gl.float16))
            pb[2].index(WG).store((p * (_col(sv, 2) * _pick(inv, 2))[:, None]).to(gl.float16))
            pb[3].index(WG).store((p * (_col(sv, 3) * _pick(inv, 3))[:, None]).to(gl.float16))
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
        gl.thread_barrier()  # every warp's part of P is in shared memory before the MMAs read it
        # PV, one MMA per (16-row step, group): each operand is converted while the previous MMA runs, and
        # a wait naming the operand before it releases that one's registers (a wait never names the
        # accumulators in flight: ptxas would then serialize every wgmma).  Two operands live at a time.
        v = _pv_operand(rs, 0, 0)
        for i in gl.static_range(16):
            o0, o1, o2, o3 = _pv_mma(v, pb, WG + z, i // 4, i % 4, o0, o1, o2, o3, DS)
            if i + 1 < 16:
                if i > 0:
                    warpgroup_mma_wait(1, deps=(v_prev, ))
                v_prev = v
                v = _pv_operand(rs, (i + 1) // 4, (i + 1) % 4)
                if i == 14:
                    gl.thread_barrier()  # this warpgroup's reads of the stage are done (the MMAs read registers)
                    mbarrier.arrive(free.index(st), count=1)
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
    if WG > 0:
        # warpgroup WG's accumulators go over stage WG's bytes: with two consumers only warpgroup 1 reads
        # stage 1; with more, every consumer must first be done with every stage
        if NC > 2:
            gl.thread_barrier()
            mbarrier.arrive(all_done, count=1)
            mbarrier.wait(all_done, 0)
        mrg = _merge_buf(raw, WG)
        mrg.index(0).store(o0)
        mrg.index(1).store(o1)
        mrg.index(2).store(o2)
        mrg.index(3).store(o3)
        vec.index(2 * WG).store(m_i)
        vec.index(2 * WG + 1).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done_bar, count=1)
    else:
        if NC > 2:
            gl.thread_barrier()
            mbarrier.arrive(all_done, count=1)
        mbarrier.wait(done_bar, 0)
        m = m_i
        for w in gl.static_range(1, NC):
            m = gl.maximum(m, vec.index(2 * w).load(HEAD))
        w0 = gl.exp2(m_i - m)
        l_t = l_i * w0
        o0 = o0 * w0[None, :]
        o1 = o1 * w0[None, :]
        o2 = o2 * w0[None, :]
        o3 = o3 * w0[None, :]
        for w in gl.static_range(1, NC):
            ww = gl.exp2(vec.index(2 * w).load(HEAD) - m)
            l_t = l_t + vec.index(2 * w + 1).load(HEAD) * ww
            mrg = _merge_buf(raw, w)
            o0 = o0 + mrg.index(0).load(S_L) * ww[None, :]
            o1 = o1 + mrg.index(1).load(S_L) * ww[None, :]
            o2 = o2 + mrg.index(2).load(S_L) * ww[None, :]
            o3 = o3 + mrg.index(3).load(S_L) * ww[None, :]
        has = l_t > 0
        inv_l = gl.where(has, 1.0 / gl.where(has, l_t, 1.0), 0.0)[None, :]
        heads = g * 16 + gl.arange(0, 16, layout=HEAD)
        hm = (heads < H)[None, :]
        obase = o_ptr + t.to(gl.int64) * stride_ot + s * stride_os + heads[None, :] * stride_oh
        d = _dims(gl.arange(0, 128, layout=ROW))[:, None]
        ty = o_ptr.dtype.element_ty
        gl.store(obase + d, (o0 * inv_l).to(ty), mask=hm)
        gl.store(obase + 128 + d, (o1 * inv_l).to(ty), mask=hm)
        gl.store(obase + 256 + d, (o2 * inv_l).to(ty), mask=hm)
        gl.store(obase + 384 + d, (o3 * inv_l).to(ty), mask=hm)
        lse = gl.where(has, (m + gl.log2(gl.where(has, l_t, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=heads < H)


@gluon.jit
def _merge_buf(raw, w: gl.constexpr):
    """Consumer w's accumulators for the final merge, fp32 [4 groups, 128, 16] over stage w's 32 KB."""
    return raw.index(w)._reinterpret(gl.float32, [4, 128, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


# ---- the partitions of each format variant: (warpgroup, consumers, DS, ROPE, bytes per token) as literals,
# the kernel's values as one tuple (constexpr arguments do not survive warp_specialize: see the kernel) ----
@gluon.jit
def _c0_ds2(args):
    _consumer(args, 0, 2, True, 64)


@gluon.jit
def _c1_ds2(args):
    _consumer(args, 1, 2, True, 64)


@gluon.jit
def _c0_ds_nope2(args):
    _consumer(args, 0, 2, True, 0)


@gluon.jit
def _c1_ds_nope2(args):
    _consumer(args, 1, 2, True, 0)


@gluon.jit
def _c0_fp82(args):
    _consumer(args, 0, 2, False, 64)


@gluon.jit
def _c1_fp82(args):
    _consumer(args, 1, 2, False, 64)


@gluon.jit
def _c0_fp8_nope2(args):
    _consumer(args, 0, 2, False, 0)


@gluon.jit
def _c1_fp8_nope2(args):
    _consumer(args, 1, 2, False, 0)


@gluon.jit
def _c0_ds3(args):
    _consumer(args, 0, 3, True, 64)


@gluon.jit
def _c1_ds3(args):
    _consumer(args, 1, 3, True, 64)


@gluon.jit
def _c2_ds3(args):
    _consumer(args, 2, 3, True, 64)


@gluon.jit
def _c0_ds_nope3(args):
    _consumer(args, 0, 3, True, 0)


@gluon.jit
def _c1_ds_nope3(args):
    _consumer(args, 1, 3, True, 0)


@gluon.jit
def _c2_ds_nope3(args):
    _consumer(args, 2, 3, True, 0)


@gluon.jit
def _c0_fp83(args):
    _consumer(args, 0, 3, False, 64)


@gluon.jit
def _c1_fp83(args):
    _consumer(args, 1, 3, False, 64)


@gluon.jit
def _c2_fp83(args):
    _consumer(args, 2, 3, False, 64)


@gluon.jit
def _c0_fp8_nope3(args):
    _consumer(args, 0, 3, False, 0)


@gluon.jit
def _c1_fp8_nope3(args):
    _consumer(args, 1, 3, False, 0)


@gluon.jit
def _c2_fp8_nope3(args):
    _consumer(args, 2, 3, False, 0)


@gluon.jit
def _p_ds(args):
    _producer(args, 656, True, 64)


@gluon.jit
def _p_ds_nope(args):
    _producer(args, 528, True, 0)


@gluon.jit
def _p_fp8(args):
    _producer(args, 576, False, 64)


@gluon.jit
def _p_fp8_nope(args):
    _producer(args, 512, False, 0)


@gluon.jit
def ws_few_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                  o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                  sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                  BPT: gl.constexpr, DS: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr,
                  NC: gl.constexpr = 2):
    """One program = one query token x 16 heads x one split; launch with num_warps=4 (warpgroup 0)."""
    raw = gl.allocate_shared_memory(gl.uint8, [NS, 64, 512], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if DS:
        scl = gl.allocate_shared_memory(gl.float32, [NS, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.bfloat16, [NS, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
        qr = gl.allocate_shared_memory(gl.bfloat16, [1, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16))
    else:
        scl = gl.allocate_shared_memory(gl.float32, [1, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
        qr = gl.allocate_shared_memory(gl.float16, [1, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16))
    qn = gl.allocate_shared_memory(gl.float16, [8, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16))
    # P (times each group's scale ratio) per group, [warpgroup, 64 rows, 16 heads]: one allocation per group
    # so that the four stores need no barrier between them (the barrier analysis works per allocation)
    pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 16], gl.float16)
    pb = (gl.allocate_shared_memory(gl.float16, [NC, 64, 16], pl), gl.allocate_shared_memory(gl.float16, [NC, 64, 16], pl),
          gl.allocate_shared_memory(gl.float16, [NC, 64, 16], pl), gl.allocate_shared_memory(gl.float16, [NC, 64, 16], pl))
    vec = gl.allocate_shared_memory(gl.float32, [2 * NC, 16], plain)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], bl)
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], bl)
    done_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    all_done = gl.allocate_shared_memory(gl.int64, [1], bl)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(done_bar, count=NC - 1)  # the other consumers' accumulators are in shared memory
    mbarrier.init(all_done, count=NC)      # (NC > 2) every consumer is done with every stage
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=128)  # one cp.async arrival per producer thread
        mbarrier.init(free.index(i), count=1)     # the consuming warpgroup
    smem = (raw, scl, rope, qn, qr, pb, vec)
    bars = (q_bar, ready, free, done_bar, all_done)
    # Constexpr arguments do not survive warp_specialize (they arrive as tensors, and an `if` on them then
    # traces both branches), so each warpgroup of each format variant has its own partition function.
    ca = ((q_ptr, stride_qt, stride_qh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh,
           lse_ptr, stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
           smem, bars, NG, HAS_VC), )
    pa = ((kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, smem, bars, NG, HAS_VC), )
    if NC == 2:
        if DS:
            if ROPE:
                gl.warp_specialize([(_c0_ds2, ca), (_c1_ds2, ca), (_p_ds, pa)], [4, 4], [232, 40])
            else:
                gl.warp_specialize([(_c0_ds_nope2, ca), (_c1_ds_nope2, ca), (_p_ds_nope, pa)], [4, 4], [232, 40])
        else:
            if ROPE:
                gl.warp_specialize([(_c0_fp82, ca), (_c1_fp82, ca), (_p_fp8, pa)], [4, 4], [232, 40])
            else:
                gl.warp_specialize([(_c0_fp8_nope2, ca), (_c1_fp8_nope2, ca), (_p_fp8_nope, pa)], [4, 4], [232, 40])
    else:
        if DS:
            if ROPE:
                gl.warp_specialize([(_c0_ds3, ca), (_c1_ds3, ca), (_c2_ds3, ca), (_p_ds, pa)], [4, 4, 4], [160, 160, 32])
            else:
                gl.warp_specialize([(_c0_ds_nope3, ca), (_c1_ds_nope3, ca), (_c2_ds_nope3, ca), (_p_ds_nope, pa)],
                                   [4, 4, 4], [160, 160, 32])
        else:
            if ROPE:
                gl.warp_specialize([(_c0_fp83, ca), (_c1_fp83, ca), (_c2_fp83, ca), (_p_fp8, pa)], [4, 4, 4], [160, 160, 32])
            else:
                gl.warp_specialize([(_c0_fp8_nope3, ca), (_c1_fp8_nope3, ca), (_c2_fp8_nope3, ca), (_p_fp8_nope, pa)],
                                   [4, 4, 4], [160, 160, 32])
