"""sm_90 sparse MLA decode for quantized rows (``fp8``, ``fp8_ds_mla``, ``nvfp4_ds_mla``; RoPE or NoPE) at 64
heads per program, with a converting producer (Gluon, warp-specialized).

The other quantized kernels (``few.py``, ``wide.py``) convert the raw bytes in the MMA warpgroups' registers,
once per head group and operand; at 64-128 heads their tensor cores then idle most of the time.  Here the
conversion has its own warpgroup and the MMA warpgroups run the bf16 kernel's kind of loop on converted tiles:

- producer (worker partition, 4 warps): stages q (bf16, cp.async); per 64-row block, gathers the raw rows with
  16-byte ``gl.load`` s in 128-dim pieces, one piece ahead of the one it converts (registers allow no more
  without spilling), dequantizes each piece to bf16 and stores it into the block's tile (kL: dims 0-255, kR:
  256-511, kE: the rope), two tiles double-buffered.  Rows of -1 / past the valid count are never read and
  their tile rows are zeros (so that P = 0 times them stays 0);
- warpgroup 0 (default partition): S = q K^T over all 576 (512) dims for 64 heads x 64 rows (wgmma m64n64,
  q and the tile from shared memory), the online softmax (base 2), publishes P (bf16) and the rescale factor
  alpha for warpgroup 1, and PV for output columns 0-255 with P from shared memory too (P in registers needs 208
  registers, which leave the others too few; V = kL read as the MMA's B
  operand, MN-major: no transpose).  The next block's QK is issued behind this block's PV;
- warpgroup 1 (worker partition): PV for output columns 256-511 (A = P from shared memory, B = kR), its
  accumulator rescaled by warpgroup 0's alpha.

Values.  fp8: e4m3 -> bf16 (exact); the per-tensor k_scale multiplies the scores and the output.
fp8_ds_mla: e4m3 x the 128-dim group's fp32 scale, rounded to bf16 (exact for the power-of-two scales the
writers produce; other scales round once, like a bf16 cache); the bf16 rope is copied.  nvfp4_ds_mla: e2m1 x
the 16-dim block's e4m3 scale (exact in fp16 and in bf16, ``rows.fp4_values``); the e4m3 rope -> bf16.

mbarriers: ``q_bar`` (q staged: one cp.async arrival per producer thread), ``ready[b]`` (tile b converted;
the producer fences its generic-proxy stores for the async proxy first), ``free[b]`` (count 2: both
warpgroups done reading tile b), ``p_ready`` / ``p_free`` (P and alpha handed from warpgroup 0 to
warpgroup 1), ``l_bar`` (warpgroup 0's final row sums, so that both halves of the output are normalized by
the same l).

Shared memory: q 72 KB + 2 tiles x 72 KB + P 8 KB (NoPE the same: the rope buffers stay allocated).  Registers:
168 at launch for 12 warps; warpgroup 0 gets 192 (O 128 + S 32 + the next QK), warpgroup 1 160, the producer 152.

Gluon kernels do not run under the Triton interpreter: ``tests/test_sm90_compile.py`` compiles every variant
for sm_90 on the CPU; ``tests/gpu/test_sm90_conv_gpu.py`` checks the numbers against the float64 reference.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import compat
from .common import NEG_BIG, normalizer, program_coords
from .rows import block_indices, copy_rows, fp4_values

# warpgroup 0's S [64 heads, 64 rows] and each warpgroup's O [64 heads, 256 columns] on wgmma
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
SROW = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))  # one value per head (of S)
SCOL = gl.constexpr(gl.SliceLayout(0, S_LAYOUT.value))  # one value per cache row of the block
OROW = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))  # one value per head (of O)

# setmaxnreg of warpgroup 1 and the producer; warpgroup 0 gets the rest of 12 warps x 168, 192.  Below 160
# warpgroup 1 and below 192 warpgroup 0 make ptxas serialize the wgmma pipeline (C7512); a producer below 136
# spills its pieces.  Measured on Triton 3.6: 128 bytes of stack, all in warpgroup 0 (its 208-register split,
# producer 136, spills 16-176 bytes depending on the variant).
WG1_REGS = gl.constexpr(160)
PRODUCER_REGS = gl.constexpr(152)

# Producer register layouts (4 warps), 16 contiguous bytes a thread per row:
# e4m3 piece [64 rows, 128 bytes] (4 rows a thread)
L_E8 = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
# e2m1 piece [64 rows, 64 bytes = 128 dims] (2 rows a thread), and the same bytes as [64, 8 blocks, 8]
L_E2 = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
L_E2B = gl.constexpr(gl.BlockedLayout([1, 2, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0]))
L_E2S = gl.constexpr(gl.SliceLayout(2, L_E2B.value))  # the e4m3 block scales [64 rows, 8 blocks]
# e4m3 rope [64 rows, 64 bytes] (2 x 16 bytes a thread); bf16 rope / q rows [R, 64k elements] (8 elements)
L_R8 = gl.constexpr(gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0]))
L_B16 = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))


@gluon.jit
def _rows(idx_row, p0, k_end, kv_ptr, BPT: gl.constexpr, rows_l: gl.constexpr):
    """Byte pointers to the rows at positions p0 .. p0 + 63 [64] (row 0 for an invalid entry: never read) and
    which are valid."""
    idx = block_indices(idx_row, p0, k_end, rows_l)
    valid = idx >= 0
    return gl.multiple_of(kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * BPT, 16), valid


@gluon.jit
def _block_rows(idx_row, p0, k_end, kv_ptr, BPT: gl.constexpr, rl: gl.constexpr, sl: gl.constexpr,
                FP4: gl.constexpr):
    """``_rows`` of a block in the piece layout ``rl`` and, for nvfp4, in the block-scale layout ``sl`` (other
    rows read their scales with the pieces: the same pointers)."""
    base, valid = _rows(idx_row, p0, k_end, kv_ptr, BPT, rl)
    if FP4:
        sbase, svalid = _rows(idx_row, p0, k_end, kv_ptr, BPT, sl)
    else:
        sbase = base
        svalid = valid
    return base, valid, sbase, svalid


@gluon.jit
def _load_piece(base, valid, sbase, svalid, P: gl.constexpr, SCALE_OFF: gl.constexpr, DS: gl.constexpr,
                FP4: gl.constexpr):
    """Raw bytes of 128-dim piece P of 64 rows and their scales, zeros for invalid rows: e4m3 [64, 128] u8
    (L_E8) and, fp8_ds_mla, the group scale [64] fp32; nvfp4 [64, 64] u8 (L_E2) and the 8 block scales
    [64, 8] u8 (L_E2S; ``sbase`` / ``svalid`` are the rows in that layout).  Plain fp8: the scale is 0
    (unused)."""
    if FP4:
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, L_E2))
        raw = gl.load(gl.multiple_of(base + 64 * P, 16)[:, None] + c[None, :], mask=valid[:, None], other=0)
        # block 8 P + j of a row: its scale byte is at 8 (j % 4) + 2 P + j // 4 (kv-formats.md)
        j = gl.arange(0, 8, layout=gl.SliceLayout(0, L_E2S))
        so = SCALE_OFF + 2 * P + 8 * (j % 4) + j // 4
        sc = gl.load(sbase[:, None] + so[None, :], mask=svalid[:, None], other=0)
    else:
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, L_E8))
        raw = gl.load(gl.multiple_of(base + 128 * P, 16)[:, None] + c[None, :], mask=valid[:, None], other=0)
        if DS:
            sc = gl.load((base + (SCALE_OFF + 4 * P)).to(gl.pointer_type(gl.float32)), mask=valid, other=0.0)
        else:
            sc = 0.0
    return raw, sc


@gluon.jit
def _store_piece(raw, sc, dst, DS: gl.constexpr, FP4: gl.constexpr):
    """Dequantize a piece (``_load_piece``) to bf16 and store it into ``dst`` [64, 128] (a tile slice)."""
    if FP4:
        x = gl.convert_layout(raw.reshape([64, 8, 8]), L_E2B)  # the same registers
        v = fp4_values(x, gl.broadcast(sc[:, :, None], x)[0]).reshape([64, 128]).to(gl.bfloat16)
    elif DS:
        v = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]).to(gl.bfloat16)
    else:
        v = raw.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)
    dst.store(v)


@gluon.jit
def _load_rope(rbase, rvalid, ROPE_OFF: gl.constexpr, DS: gl.constexpr):
    """The rope part of 64 rows: bf16 [64, 64] (fp8_ds_mla, L_B16) or e4m3 bytes [64, 64] (L_R8); zeros for
    invalid rows."""
    if DS:
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, L_B16))
        p = gl.multiple_of(rbase + ROPE_OFF, 16).to(gl.pointer_type(gl.bfloat16))
    else:
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, L_R8))
        p = gl.multiple_of(rbase + ROPE_OFF, 16)
    return gl.load(p[:, None] + c[None, :], mask=rvalid[:, None], other=0)


@gluon.jit
def _store_rope(r, dst, DS: gl.constexpr):
    if DS:
        dst.store(r)
    else:
        dst.store(r.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16))


@gluon.jit
def _piece_dst(kL, kR, b, P: gl.constexpr):
    """Tile b's columns 128 P .. 128 P + 127 (kL: pieces 0, 1; kR: pieces 2, 3)."""
    if P < 2:
        return kL.index(b).slice(128 * P, 128, dim=1)
    else:
        return kR.index(b).slice(128 * (P - 2), 128, dim=1)


@gluon.jit
def _producer(args, BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
              DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Stages q, then converts each 64-row block into tile i % 2 (see the module docstring).  Loads run one
    piece ahead of the conversion: the next piece (after the last value piece: the rope, after the rope: the
    next block's first piece) is loaded before the current one is converted; the next block's rows are looked
    up at the start of a block."""
    (q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, smem,
     bars) = args
    qL, qR, qE, kL, kR, kE, sP, sA, sL = smem
    q_bar, ready, free, p_ready, p_free, l_bar = bars
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    # q [64 heads, 576] bf16 by cp.async (rows of heads >= H zero-filled)
    heads = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L_B16))
    hm = heads < H
    q_row = gl.multiple_of(q_ptr + t.to(gl.int64) * stride_qt + gl.where(hm, heads, 0).to(gl.int64) * stride_qh, 16)
    copy_rows(qL.index(0), q_row, 0, 256, hm, L_B16)
    copy_rows(qR.index(0), q_row, 256, 256, hm, L_B16)
    if ROPE:
        copy_rows(qE.index(0), q_row, 512, 64, hm, L_B16)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    if FP4:
        rl: gl.constexpr = gl.SliceLayout(1, L_E2)
    else:
        rl: gl.constexpr = gl.SliceLayout(1, L_E8)
    sl: gl.constexpr = gl.SliceLayout(1, L_E2S)
    if DS:
        el: gl.constexpr = gl.SliceLayout(1, L_B16)
    else:
        el: gl.constexpr = gl.SliceLayout(1, L_R8)
    base, valid, sbase, svalid = _block_rows(idx_row, k_begin, k_end, kv_ptr, BPT, rl, sl, FP4)
    raw, sc = _load_piece(base, valid, sbase, svalid, 0, SCALE_OFF, DS, FP4)
    for i in range(n_blocks):
        b = i % 2
        p_next = k_begin + (i + 1) * 64
        nbase, nvalid, nsbase, nsvalid = _block_rows(idx_row, p_next, k_end, kv_ptr, BPT, rl, sl, FP4)
        if ROPE:
            rbase, rvalid = _rows(idx_row, k_begin + i * 64, k_end, kv_ptr, BPT, el)
        raw1, sc1 = _load_piece(base, valid, sbase, svalid, 1, SCALE_OFF, DS, FP4)
        mbarrier.wait(free.index(b), ((i // 2) & 1) ^ 1)  # fresh mbarriers pass phase 1 at once
        _store_piece(raw, sc, _piece_dst(kL, kR, b, 0), DS, FP4)
        raw2, sc2 = _load_piece(base, valid, sbase, svalid, 2, SCALE_OFF, DS, FP4)
        _store_piece(raw1, sc1, _piece_dst(kL, kR, b, 1), DS, FP4)
        raw3, sc3 = _load_piece(base, valid, sbase, svalid, 3, SCALE_OFF, DS, FP4)
        _store_piece(raw2, sc2, _piece_dst(kL, kR, b, 2), DS, FP4)
        if ROPE:
            rope = _load_rope(rbase, rvalid, ROPE_OFF, DS)
            _store_piece(raw3, sc3, _piece_dst(kL, kR, b, 3), DS, FP4)
            # the next block's first piece (all zeros past the end: its rows are invalid)
            raw, sc = _load_piece(nbase, nvalid, nsbase, nsvalid, 0, SCALE_OFF, DS, FP4)
            _store_rope(rope, kE.index(b), DS)
        else:
            raw, sc = _load_piece(nbase, nvalid, nsbase, nsvalid, 0, SCALE_OFF, DS, FP4)
            _store_piece(raw3, sc3, _piece_dst(kL, kR, b, 3), DS, FP4)
        base = nbase
        valid = nvalid
        sbase = nsbase
        svalid = nsvalid
        fence_async_shared()  # this thread's tile stores -> the consumers' wgmma (async proxy) reads
        compat.barrier()      # every producer thread has stored and fenced
        mbarrier.arrive(ready.index(b), count=1)


@gluon.jit
def _qk(qL, qR, qE, kL, kR, kE, b, z, s_zero, ROPE: gl.constexpr):
    """S = q K^T for tile b (three chained wgmma, issued asynchronously)."""
    sc = warpgroup_mma(qL.index(z), kL.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma(qR.index(z), kR.index(b).permute((1, 0)), sc, is_async=True)
    if ROPE:
        sc = warpgroup_mma(qE.index(z), kE.index(b).permute((1, 0)), sc, is_async=True)
    return sc


@gluon.jit
def _out_store(acc, inv_l, col0: gl.constexpr, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H):
    """Columns col0 .. col0 + 255 of heads 64 g .. 64 g + 63: acc [64, 256] x inv_l (per head)."""
    heads = g * 64 + gl.arange(0, 64, layout=OROW)
    cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, O_LAYOUT))
    o = acc * inv_l[:, None]
    optr = (o_ptr + t.to(gl.int64) * stride_ot + s * stride_os + heads.to(gl.int64)[:, None] * stride_oh
            + cols[None, :])
    gl.store(optr, o.to(o_ptr.dtype.element_ty), mask=(heads < H)[:, None])


@gluon.jit
def _wg0(args, ROPE: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Warpgroup 0: QK, softmax, P and alpha for warpgroup 1, PV for output columns 0-255, the lse."""
    (idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
     sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, smem, bars) = args
    qL, qR, qE, kL, kR, kE, sP, sA, sL = smem
    q_bar, ready, free, p_ready, p_free, l_bar = bars
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    ss = sm_scale_log2
    if not DS and not FP4:
        ss = ss * k_scale  # plain fp8 rows hold value / k_scale
    s_zero = gl.zeros([64, 64], gl.float32, S_LAYOUT)
    m_i = gl.full([64], NEG_BIG, gl.float32, SROW)
    l_i = gl.zeros([64], gl.float32, SROW)
    acc = gl.zeros([64, 256], gl.float32, O_LAYOUT)
    mbarrier.wait(q_bar, 0)
    if n_blocks > 0:
        mbarrier.wait(ready.index(0), 0)
        fence_async_shared()
        sc = _qk(qL, qR, qE, kL, kR, kE, 0, 0, s_zero, ROPE)
        sc = warpgroup_mma_wait(0, deps=(sc, ))
    else:
        sc = s_zero
    for i in range(n_blocks):
        b = i % 2
        # z == 0, but the compiler cannot know it: shared-memory views indexed with it are recomputed in the
        # loop instead of their wgmma descriptors being hoisted out of it (and spilled)
        z = i // (n_blocks + 1)
        offs = k_begin + i * 64 + gl.arange(0, 64, layout=SCOL)
        ok = gl.load(idx_row + offs, mask=offs < k_end, other=-1) >= 0
        sc = gl.where(ok[None, :], sc * ss, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, OROW)[:, None]
        pb = p.to(gl.bfloat16)
        # hand P and alpha to warpgroup 1 once it is done with the previous ones
        mbarrier.wait(p_free, (i & 1) ^ 1)
        sP.store(pb)
        sA.store(alpha)
        fence_async_shared()  # P is read by warpgroup 1's wgmma (async proxy)
        compat.barrier()
        mbarrier.arrive(p_ready, count=1)
        # P for this warpgroup's PV from shared memory as well: as a register operand its 16 registers would be
        # live beside O and the next S, past the 192 that ptxas needs to keep the wgmma pipeline unserialized
        pa = sP
        if i + 1 < n_blocks:
            acc = warpgroup_mma(pa, kL.index(b + z), acc, is_async=True)
            # the next block's QK behind this block's PV
            nb = 1 - b
            mbarrier.wait(ready.index(nb), ((i + 1) // 2) & 1)
            fence_async_shared()
            sc = _qk(qL, qR, qE, kL, kR, kE, nb + z, z, s_zero, ROPE)
            sc, acc = warpgroup_mma_wait(0, deps=(sc, acc))
        else:
            acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(pa, kL.index(b + z), acc, is_async=True), ))
        compat.barrier()  # every warp's reads of tile b are done
        mbarrier.arrive(free.index(b), count=1)
    # both warpgroups normalize with these row sums
    sL.store(l_i)
    compat.barrier()
    mbarrier.arrive(l_bar, count=1)
    inv_l, lse = normalizer(m_i, l_i)
    if not DS and not FP4:
        inv_l = inv_l * k_scale
    _out_store(acc, gl.convert_layout(inv_l, OROW), 0, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H)
    heads = g * 64 + gl.arange(0, 64, layout=SROW)
    gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=heads < H)


@gluon.jit
def _wg1(args, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Warpgroup 1: PV for output columns 256-511 with warpgroup 0's P and alpha."""
    (idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
     sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, smem, bars) = args
    qL, qR, qE, kL, kR, kE, sP, sA, sL = smem
    q_bar, ready, free, p_ready, p_free, l_bar = bars
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    acc = gl.zeros([64, 256], gl.float32, O_LAYOUT)
    for i in range(n_blocks):
        b = i % 2
        z = i // (n_blocks + 1)  # == 0; see _wg0
        mbarrier.wait(ready.index(b), (i // 2) & 1)
        mbarrier.wait(p_ready, i & 1)
        fence_async_shared()
        acc = acc * sA.load(OROW)[:, None]
        acc = warpgroup_mma(sP, kR.index(b + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        compat.barrier()  # every warp's MMA has read P, alpha and tile b
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(free.index(b), count=1)
    mbarrier.wait(l_bar, 0)
    # the same normalizer as warpgroup 0 (m does not enter 1 / l)
    inv_l, lse_unused = normalizer(gl.zeros([64], gl.float32, OROW), sL.load(OROW))
    if not DS and not FP4:
        inv_l = inv_l * k_scale
    _out_store(acc, inv_l, 256, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H)


@gluon.jit
def conv_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
                NG: gl.constexpr, HAS_VC: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr):
    """One program = one query token x 64 heads (head group g of NG) x one split; launch with num_warps=4 (the
    default partition, warpgroup 0) and maxnreg=168 (see ``meta``)."""
    half: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
    small: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qL = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 256], half)
    qR = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 256], half)
    qE = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], small)
    kL = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], half)
    kR = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], half)
    kE = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], small)
    sP = gl.allocate_shared_memory(gl.bfloat16, [64, 64], small)
    sA = gl.allocate_shared_memory(gl.float32, [64], vec)
    sL = gl.allocate_shared_memory(gl.float32, [64], vec)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    free = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    p_ready = gl.allocate_shared_memory(gl.int64, [1], bl)
    p_free = gl.allocate_shared_memory(gl.int64, [1], bl)
    l_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    mbarrier.init(q_bar, count=128)  # one cp.async arrival per producer thread
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)  # the producer, after a warpgroup barrier
        mbarrier.init(free.index(b), count=2)   # both consumer warpgroups
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(l_bar, count=1)
    # (constexprs reach a partition as constexprs only when written into warp_specialize's argument tuples)
    ca = (idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls,
          stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
          (qL, qR, qE, kL, kR, kE, sP, sA, sL), (q_bar, ready, free, p_ready, p_free, l_bar))
    pa = (q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits,
          (qL, qR, qE, kL, kR, kE, sP, sA, sL), (q_bar, ready, free, p_ready, p_free, l_bar))
    gl.warp_specialize([(_wg0, (ca, ROPE, DS, FP4, NG, HAS_VC)), (_wg1, (ca, DS, FP4, NG, HAS_VC)),
                        (_producer, (pa, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, FP4, NG, HAS_VC))],
                       [4, 4], [WG1_REGS, PRODUCER_REGS])


KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")  # the row formats this kernel reads


# How sparsemla.kernels.attention launches it (one cached launch per plan, compile-time arguments from
# meta()):
# ``grid``: ``(tokens x splits x num_groups,)`` (program p: head group p % num_groups, 64 heads, of split
# (p // num_groups) % splits of token p // (num_groups x splits)); ``args``: the positional arguments of the
# few-heads kernel (few.py; k_scale included); q rows 16-byte aligned (cp.async).  12 warps, 168 registers
# each at launch (warpgroup 0: 192 after setmaxnreg, warpgroup 1: 160, the producer: 152).

def meta(*, kind: str, bytes_per_row: int, rope_dim: int, rope_offset: int, scale_offset: int, num_groups: int,
         has_valid_counts: bool) -> dict:
    """``conv_kernel``'s constexprs and launch options for one variant (the arguments as in ``few.meta``;
    ``num_groups`` = ceil(heads / 64))."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    ds, fp4 = kind == "fp8_ds_mla", kind == "nvfp4_ds_mla"
    return dict(BPT=bytes_per_row, ROPE=rope_dim, SCALE_OFF=scale_offset if ds or fp4 else 0,
                ROPE_OFF=rope_offset if rope_dim else 0, NG=num_groups, HAS_VC=bool(has_valid_counts), DS=ds,
                FP4=fp4, num_warps=4, maxnreg=168, enable_fp_fusion=True)
