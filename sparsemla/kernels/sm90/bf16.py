"""sm_90 sparse MLA forward for ``bf16`` rows (RoPE or NoPE) at 64 heads per program, warp-specialized
(Gluon), pair schedule: each consumer warpgroup owns every other 64-row block.

Two consumer warpgroups take different blocks, two at a time (block 2i -> warpgroup 0, block 2i+1 ->
warpgroup 1):

- QK: each warpgroup computes S for its own 64 rows (wgmma m64n64);
- softmax: warpgroup 0 publishes its block's new row max, warpgroup 1 folds in its own and publishes the
  pair's max, warpgroup 0 rescales its P to it (one multiply, no second exp);
- PV: warpgroup 0 owns output columns 0-255, warpgroup 1 columns 256-511; each multiplies its own P from
  registers with its own block's V columns, and the other warpgroup's P (through shared memory) with the
  other block's V columns;
- each block's buffer is split into a left (dims 0-255) and a right (256-511 + rope) half with their own
  ready / free mbarriers, so the producer refills a half as soon as its last reader is done: the left half
  of block 0 and the right half of block 1 are free after the owner's local PV, the other two after the
  other warpgroup's remote PV.  P of warpgroup 0 is written over block 0's rope part (read only by QK);
- a producer warpgroup (4 warps) loads the indices and gathers the halves with cp.async.

Shared memory: q 72 KB + 2 blocks x 72 KB + P of warpgroup 1 (8 KB) = 224 KB (the same without rope: the
rope buffers then hold only P0); one program per SM.  12 warps at launch (12 x 32 x 168 registers fill the
register file); setmaxnreg then gives the consumers 232 and the producer 40.  The schedule follows the one
FlashMLA's SM90 sparse prefill kernel describes (warpgroup-owned blocks, max hand-off, split V columns).

By default (``meta``) the producer gathers 128 contiguous bytes of 4 rows a warp instruction, a bf16 output goes
out through a tile only its warpgroup reads (``common.store_via_tile``), and each consumer thread arrives on the
free mbarriers itself (count 128: no warpgroup barrier before a release); measured in docs/design/kernels.md.

``NAMED`` (``meta(named=True)``; opt-in, the plan does not choose it): the four hand-offs of a pair (each warpgroup's
row max, each one's P) through named hardware barriers (ids 12-15, 256 threads: the writer's threads arrive, the
reader's sync) instead of mbarriers, as FlashMLA's prefill kernel hands them over; 16-40 instructions fewer, and
on the H200 (Triton 3.6) no faster: P-32k 4,466 against 4,486 us (docs/design/kernels.md).

Gluon kernels do not run under the Triton interpreter: ``tests/test_sm90_compile.py`` compiles both variants
for sm_90 on the CPU; the GPU suite checks the numbers against the float64 reference.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import compat

from .common import (NEG_BIG, PUBLISH, combine_in_kernel, fused_meta, named_asm, named_barrier, program_coords,
                     publish, store_via_tile)
from .rows import L_ROWS128, copy_rows

# Each consumer warpgroup (4 warps): S [64 heads, 64 rows] and O [64 heads, 256 columns] on wgmma; its own
# P enters PV from registers.
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
SROW = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))
OROW = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))
# NAMED: the four hand-offs of a pair between the consumers through named hardware barriers (both warpgroups,
# 256 threads) instead of mbarriers: the writer's threads store and arrive, the reader's threads sync and load
M0_ARRIVE = named_asm("arrive", 12)
M0_SYNC = named_asm("sync", 12)
M1_ARRIVE = named_asm("arrive", 13)
M1_SYNC = named_asm("sync", 13)
P0_ARRIVE = named_asm("arrive", 14)
P0_SYNC = named_asm("sync", 14)
P1_ARRIVE = named_asm("arrive", 15)
P1_SYNC = named_asm("sync", 15)


@gluon.jit
def _block_rows(idx_row, p0, k_end, kv_ptr, BPT: gl.constexpr, rows_l: gl.constexpr):
    offs = p0 + gl.arange(0, 64, layout=rows_l)
    idx = gl.load(idx_row + offs, mask=offs < k_end, other=-1)
    valid = idx >= 0
    base = gl.multiple_of(kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * BPT, 16)
    return base.to(gl.pointer_type(gl.bfloat16)), valid


@gluon.jit
def _producer(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K,
              rows_per_split, num_splits,
              smem, bars, BPT: gl.constexpr, ROPE: gl.constexpr, ROPE_OFF: gl.constexpr, NG: gl.constexpr,
              HAS_VC: gl.constexpr, W128: gl.constexpr = False):
    """q once, then per pair of blocks: left half of block 0, right half of block 1 (both freed early),
    right half of block 0, left half of block 1 (freed after the other warpgroup's remote PV).  W128: the blocks'
    16-byte copies cover 128 contiguous bytes of 4 rows a warp instruction (FlashInfer's gather), not 64 of 8."""
    qL, qR, qE, kL, kR, kE, sS1, sM0, sM1, sL0, sL1 = smem
    q_bar, ready_l, ready_r, free_l, free_r, m0_bar, m1_bar, p0_bar, p1_bar, l0_bar, l1_bar = bars
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, lay)
    if W128:
        klay: gl.constexpr = L_ROWS128
    else:
        klay: gl.constexpr = lay
    krows_l: gl.constexpr = gl.SliceLayout(1, klay)
    heads = g * 64 + gl.arange(0, 64, layout=rows_l)
    hm = heads < H
    q_row = gl.multiple_of(q_ptr + t.to(gl.int64) * stride_qt + gl.where(hm, heads, 0).to(gl.int64) * stride_qh, 16)
    copy_rows(qL.index(0), q_row, 0, 256, hm, lay)
    copy_rows(qR.index(0), q_row, 256, 256, hm, lay)
    if ROPE:
        qe_row = gl.multiple_of(qr_ptr + t.to(gl.int64) * stride_rt + gl.where(hm, heads, 0).to(gl.int64) * stride_rh,
                                16)
        copy_rows(qE.index(0), qe_row, 0, 64, hm, lay)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    n_pairs = gl.cdiv(gl.cdiv(k_end - k_begin, 64), 2)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    for i in range(n_pairs):
        ph = (i & 1) ^ 1  # fresh mbarriers complete phase "1" at once: the first waits pass
        r0, v0 = _block_rows(idx_row, k_begin + i * 128, k_end, kv_ptr, BPT, krows_l)
        r1, v1 = _block_rows(idx_row, k_begin + i * 128 + 64, k_end, kv_ptr, BPT, krows_l)
        mbarrier.wait(free_l.index(0), ph)
        copy_rows(kL.index(0), r0, 0, 256, v0, klay)
        async_copy.mbarrier_arrive(ready_l.index(0), increment_count=False)
        mbarrier.wait(free_r.index(1), ph)
        copy_rows(kR.index(1), r1, 256, 256, v1, klay)
        if ROPE:
            copy_rows(kE.index(1), r1, ROPE_OFF // 2, 64, v1, klay)
        async_copy.mbarrier_arrive(ready_r.index(1), increment_count=False)
        mbarrier.wait(free_r.index(0), ph)
        copy_rows(kR.index(0), r0, 256, 256, v0, klay)
        if ROPE:
            copy_rows(kE.index(0), r0, ROPE_OFF // 2, 64, v0, klay)
        async_copy.mbarrier_arrive(ready_r.index(0), increment_count=False)
        mbarrier.wait(free_l.index(1), ph)
        copy_rows(kL.index(1), r1, 0, 256, v1, klay)
        async_copy.mbarrier_arrive(ready_l.index(1), increment_count=False)


@gluon.jit
def _qk_half(q_part, k_part, sc, use_acc):
    return warpgroup_mma(q_part, k_part.permute((1, 0)), sc, use_acc=use_acc, is_async=True)


@gluon.jit
def _masked_scores(sc, idx_row, p0, k_end, cols_l: gl.constexpr):
    """The block's raw scores, -inf where its row is not valid (the softmax scale is applied inside the exponent:
    one FFMA a score)."""
    offs = p0 + gl.arange(0, 64, layout=cols_l)
    valid = gl.load(idx_row + offs, mask=offs < k_end, other=-1) >= 0
    return gl.where(valid[None, :], sc, float("-inf"))


@gluon.jit
def _free(bar, TF: gl.constexpr):
    """This warpgroup is done with a buffer half: a warpgroup barrier and one arrival on ``bar`` (count 1), or, with
    TF, every thread's own arrival (count 128; a cp.async arrival, at once: no copy of these threads is in flight),
    which needs no warpgroup barrier."""
    if TF:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        compat.barrier()
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _vec_publish(buf, v, bar):
    """Store this warpgroup's [64] vector for the other warpgroup and publish it on ``bar``."""
    buf.store(v)
    publish(bar)


@gluon.jit
def _swap_p(own, p, own_bar, other_bar, ph, ARRIVE: gl.constexpr, SYNC: gl.constexpr, NAMED: gl.constexpr):
    """Hand this warpgroup's P (bf16 [64, 64]) to the other through ``own`` and wait for the other's: by mbarriers
    (``own_bar`` / ``other_bar``, phase ``ph``) or, with NAMED, named barriers (``ARRIVE`` / ``SYNC``).  The wait
    stays one predicated op in both builds: inside a constexpr branch Triton 3.6 places more warpgroup barriers
    around it in the default build."""
    own.store(p)
    fence_async_shared()  # the other warpgroup's wgmma reads it (async proxy)
    if NAMED:
        named_barrier(ARRIVE)
    else:
        compat.barrier()
        mbarrier.arrive(own_bar, count=1)
    mbarrier.wait(other_bar, ph, pred=not NAMED)
    if NAMED:
        named_barrier(SYNC)


@gluon.jit
def _consumer_start(t, k_begin, k_end, idx_ptr, stride_it, q_bar):
    """A consumer warpgroup's initial state (zero S operand, running max and sum, accumulator), its number
    of block pairs and index row; returns once q is in shared memory."""
    s_zero = gl.zeros([64, 64], gl.float32, S_LAYOUT)
    m_i = gl.full([64], NEG_BIG, gl.float32, SROW)
    l_i = gl.zeros([64], gl.float32, SROW)
    acc = gl.zeros([64, 256], gl.float32, O_LAYOUT)
    n_pairs = gl.cdiv(gl.cdiv(k_end - k_begin, 64), 2)
    mbarrier.wait(q_bar, 0)
    return s_zero, m_i, l_i, acc, n_pairs, idx_ptr + t.to(gl.int64) * stride_it


@gluon.jit
def _epilogue(acc, l_own, m_i, sL_own, sL_other, bar_own, bar_other, col0: gl.constexpr, o_ptr, stride_ot,
              stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh, t, s, g, H, WRITE_LSE: gl.constexpr,
              stage=None, SO: gl.constexpr = False):
    """Add the other warpgroup's row sums to this one's (through shared memory), then store this
    warpgroup's 256 output columns (and, for one of them, the lse).  SO (a bf16 output): through ``stage``, a
    [64, 256] tile that only this warpgroup reads (``common.store_via_tile``); both warpgroups are past their last
    MMA once the row sums have crossed."""
    _vec_publish(sL_own, l_own, bar_own)
    mbarrier.wait(bar_other, 0)
    l_i = l_own + sL_other.load(SROW)
    has = l_i != 0  # NaN (a selected row held a NaN) passes through, see common.normalizer
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    o = acc * gl.convert_layout(inv_l, OROW)[:, None]
    if SO:
        store_via_tile(o.to(gl.bfloat16), stage, o_ptr, t, s, g, stride_ot, stride_os, col0, H, stride_oh)
    else:
        heads = g * 64 + gl.arange(0, 64, layout=OROW)
        cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, O_LAYOUT))
        optr = o_ptr + t.to(gl.int64) * stride_ot + s * stride_os + heads[:, None] * stride_oh + cols[None, :]
        gl.store(optr, o.to(o_ptr.dtype.element_ty), mask=(heads < H)[:, None])
    if WRITE_LSE:
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        lh = g * 64 + gl.arange(0, 64, layout=SROW)
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + lh * stride_lh, lse, mask=lh < H)


@gluon.jit
def _wg0(args, ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr, NAMED: gl.constexpr, SO: gl.constexpr,
         TF: gl.constexpr):
    """Warpgroup 0: blocks 2i, output columns 0-255."""
    (o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh, idx_ptr, stride_it, vc_ptr,
     sm_scale_log2, H, K, rows_per_split, num_splits, smem, bars) = args
    qL, qR, qE, kL, kR, kE, sS1, sM0, sM1, sL0, sL1 = smem
    q_bar, ready_l, ready_r, free_l, free_r, m0_bar, m1_bar, p0_bar, p1_bar, l0_bar, l1_bar = bars
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    sS0 = kE.index(0)
    s_zero, m_i, l_i, acc, n_pairs, idx_row = _consumer_start(t, k_begin, k_end, idx_ptr, stride_it, q_bar)
    if n_pairs > 0:
        mbarrier.wait(ready_l.index(0), 0)
        fence_async_shared()
        sc = _qk_half(qL.index(0), kL.index(0), s_zero, False)
        mbarrier.wait(ready_r.index(0), 0)
        fence_async_shared()
        sc = _qk_half(qR.index(0), kR.index(0), sc, True)
        if ROPE:
            sc = _qk_half(qE.index(0), kE.index(0), sc, True)
        sc = warpgroup_mma_wait(0, deps=(sc,))
    else:
        sc = s_zero
    for i in range(n_pairs):
        ph = i & 1
        # z == 0, but the compiler cannot know it: shared-memory views indexed with it are recomputed in
        # the loop instead of 72 wgmma descriptors being hoisted out of it (that spilled ~540 bytes)
        z = i // (n_pairs + 1)
        sc = _masked_scores(sc, idx_row, k_begin + i * 128, k_end, gl.SliceLayout(0, S_LAYOUT))
        m_new = gl.maximum(m_i, gl.max(sc, 1) * sm_scale_log2)
        if NAMED:
            sM0.store(m_new)
            named_barrier(M0_ARRIVE)
        else:
            _vec_publish(sM0, m_new, m0_bar)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc * sm_scale_log2 - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, OROW)[:, None]
        # local PV: P0 (registers) x block 0's V columns 0-255
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OP), kL.index(z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _free(free_l.index(0), TF)
        # the pair's max from warpgroup 1; rescale P0, the accumulator and l to it
        mbarrier.wait(m1_bar, ph, pred=not NAMED)
        if NAMED:
            named_barrier(M1_SYNC)
        m_fin = sM1.load(SROW)
        f = gl.exp2(m_new - m_fin)
        p = p * f[:, None]
        l_i = l_i * f
        acc = acc * gl.convert_layout(f, OROW)[:, None]
        m_i = m_fin
        # P0 over block 0's rope part (QK is done with it); then P1 for the remote PV (block 1's V columns 0-255)
        _swap_p(sS0, p.to(gl.bfloat16), p0_bar, p1_bar, ph, P0_ARRIVE, P1_SYNC, NAMED)
        if i + 1 < n_pairs:
            acc = warpgroup_mma(sS1, kL.index(1 + z), acc, is_async=True)
            # next block's QK behind the remote PV
            mbarrier.wait(ready_l.index(0), ph ^ 1)
            fence_async_shared()
            sc = _qk_half(qL.index(z), kL.index(z), s_zero, False)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            _free(free_l.index(1), TF)
            mbarrier.wait(ready_r.index(0), ph ^ 1)
            fence_async_shared()
            sc = _qk_half(qR.index(z), kR.index(z), sc, True)
            if ROPE:
                sc = _qk_half(qE.index(z), kE.index(z), sc, True)
            sc, acc = warpgroup_mma_wait(0, deps=(sc, acc))
        else:
            acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(sS1, kL.index(1 + z), acc, is_async=True),))
            _free(free_l.index(1), TF)
    _epilogue(acc, l_i, m_i, sL0, sL1, l0_bar, l1_bar, 0, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr,
              stride_lt, stride_ls, stride_lh, t, s, g, H, False, kL.index(0), SO)


@gluon.jit
def _wg1(args, ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr, NAMED: gl.constexpr, SO: gl.constexpr,
         TF: gl.constexpr):
    """Warpgroup 1: blocks 2i + 1, output columns 256-511, and the lse."""
    (o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh, idx_ptr, stride_it, vc_ptr,
     sm_scale_log2, H, K, rows_per_split, num_splits, smem, bars) = args
    qL, qR, qE, kL, kR, kE, sS1, sM0, sM1, sL0, sL1 = smem
    q_bar, ready_l, ready_r, free_l, free_r, m0_bar, m1_bar, p0_bar, p1_bar, l0_bar, l1_bar = bars
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    sS0 = kE.index(0)
    s_zero, m_i, l_i, acc, n_pairs, idx_row = _consumer_start(t, k_begin, k_end, idx_ptr, stride_it, q_bar)
    for i in range(n_pairs):
        ph = i & 1
        z = i // (n_pairs + 1)  # == 0; see _wg0
        mbarrier.wait(ready_r.index(1), ph)
        fence_async_shared()
        sc = _qk_half(qR.index(z), kR.index(1 + z), s_zero, False)
        if ROPE:
            sc = _qk_half(qE.index(z), kE.index(1 + z), sc, True)
        mbarrier.wait(ready_l.index(1), ph)
        fence_async_shared()
        sc = _qk_half(qL.index(z), kL.index(1 + z), sc, True)
        sc = warpgroup_mma_wait(0, deps=(sc,))
        sc = _masked_scores(sc, idx_row, k_begin + i * 128 + 64, k_end, gl.SliceLayout(0, S_LAYOUT))
        mbarrier.wait(m0_bar, ph, pred=not NAMED)
        if NAMED:
            named_barrier(M0_SYNC)
        m_fin = gl.maximum(sM0.load(SROW), gl.max(sc, 1) * sm_scale_log2)
        if NAMED:
            sM1.store(m_fin)
            named_barrier(M1_ARRIVE)
        else:
            _vec_publish(sM1, m_fin, m1_bar)
        alpha = gl.exp2(m_i - m_fin)
        p = gl.exp2(sc * sm_scale_log2 - m_fin[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_fin
        acc = acc * gl.convert_layout(alpha, OROW)[:, None]
        pb = p.to(gl.bfloat16)
        # local PV: P1 (registers) x block 1's V columns 256-511
        acc = warpgroup_mma(gl.convert_layout(pb, P_OP), kR.index(1 + z), acc, is_async=True)
        # P1 out; then P0 for the remote PV (block 0's V columns 256-511)
        _swap_p(sS1, pb, p1_bar, p0_bar, ph, P1_ARRIVE, P0_SYNC, NAMED)
        acc = warpgroup_mma(sS0, kR.index(z), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        _free(free_r.index(1), TF)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _free(free_r.index(0), TF)
    _epilogue(acc, l_i, m_i, sL1, sL0, l1_bar, l0_bar, 256, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr,
              stride_lt, stride_ls, stride_lh, t, s, g, H, True, kR.index(1), SO)


@gluon.jit
def bf16_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                sm_scale_log2, H, K, rows_per_split, num_splits,
                fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh,
                BPT: gl.constexpr, ROPE: gl.constexpr, ROPE_OFF: gl.constexpr, NG: gl.constexpr,
                HAS_VC: gl.constexpr, NAMED: gl.constexpr = False, FUSED: gl.constexpr = False,
                W128: gl.constexpr = False, SO: gl.constexpr = False, TF: gl.constexpr = False):
    """One program = one query token x 64 heads (head group g of NG) x one split; launch with num_warps=4 (the
    default partition, warpgroup 0) and maxnreg=168 (see ``launch``)."""
    half: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
    small: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qL = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 256], half)
    qR = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 256], half)
    kL = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], half)
    kR = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], half)
    # rope parts (unused but for P0 without rope) and P1: P0 goes over block 0's rope part, read only by QK
    qE = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], small)
    kE = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], small)
    sS1 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], small)
    sM0 = gl.allocate_shared_memory(gl.float32, [64], vec)
    sM1 = gl.allocate_shared_memory(gl.float32, [64], vec)
    sL0 = gl.allocate_shared_memory(gl.float32, [64], vec)
    sL1 = gl.allocate_shared_memory(gl.float32, [64], vec)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    ready_l = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    ready_r = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    free_l = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    free_r = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    m0_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    m1_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    p0_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    p1_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    l0_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    l1_bar = gl.allocate_shared_memory(gl.int64, [1], bl)
    mbarrier.init(q_bar, count=128)  # cp.async arrivals: one per producer thread
    for b in gl.static_range(2):
        mbarrier.init(ready_l.index(b), count=128)
        mbarrier.init(ready_r.index(b), count=128)
        # one consumer warpgroup frees each half: one arrival after a warpgroup barrier, or each thread's (TF)
        mbarrier.init(free_l.index(b), count=128 if TF else 1)
        mbarrier.init(free_r.index(b), count=128 if TF else 1)
    if not NAMED:  # NAMED: named barriers instead (Triton 3.9 drops the waits predicated off below), and an
        # initialized mbarrier that nothing uses is dead to the allocator, which may put scratch over it (conv_kernel
        # read wild row pointers so)
        mbarrier.init(m0_bar, count=PUBLISH)  # the vectors' hand-offs (publish())
        mbarrier.init(m1_bar, count=PUBLISH)
        mbarrier.init(p0_bar, count=1)
        mbarrier.init(p1_bar, count=1)
    mbarrier.init(l0_bar, count=PUBLISH)
    mbarrier.init(l1_bar, count=PUBLISH)
    smem = (qL, qR, qE, kL, kR, kE, sS1, sM0, sM1, sL0, sL1)
    bars = (q_bar, ready_l, ready_r, free_l, free_r, m0_bar, m1_bar, p0_bar, p1_bar, l0_bar, l1_bar)
    # SO: a bf16 output (one split) goes out through a tile (the partials of several splits are fp32)
    SOB: gl.constexpr = SO and o_ptr.dtype.element_ty == gl.bfloat16
    cargs = (o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
             idx_ptr, stride_it, vc_ptr, sm_scale_log2, H, K, rows_per_split, num_splits, smem, bars)
    # (constexprs reach a partition as constexprs only when written into warp_specialize's argument tuples)
    gl.warp_specialize([
        (_wg0, (cargs, ROPE, NG, HAS_VC, NAMED, SOB, TF)),
        (_wg1, (cargs, ROPE, NG, HAS_VC, NAMED, SOB, TF)),
        (_producer, (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr, H,
         K, rows_per_split,
                     num_splits, smem, bars, BPT, ROPE, ROPE_OFF, NG, HAS_VC, W128)),
    ], [4, 4], [232, 40])
    if FUSED:  # the splits' partials merged by this grid's programs (common.combine_in_kernel)
        combine_in_kernel(o_ptr, lse_ptr, fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh, H, num_splits,
                          NG)




# How sparsemla.kernels.attention launches it (one cached launch per plan, compile-time arguments from
# meta()):
# ``grid``: ``(tokens x splits x num_groups,)`` (program p: head group p % num_groups, 64 heads, of split
# (p // num_groups) % splits of token p // (num_groups x splits)).  ``args`` (positional, in this order): q
# [tokens, heads, 512 or more] bf16 and its strides (token, head; 16-byte aligned rows); the query's RoPE
# part and its strides (as for few.py; 16-byte aligned rows too); the cache rows
# (row r at byte r x bytes_per_row, 16-byte aligned); indices [tokens, top-k] int32 (-1: no row) and its
# token stride; valid counts [tokens] int32 (any tensor when has_valid_counts is False); out and its
# strides (token, split, head); lse and its strides; sm_scale x log2(e); heads; top-k; rows per split (a
# multiple of 64); splits (no k_scale: bf16 rows are unscaled); the final out and lse with their token and head
# strides (read by the FUSED variant only).

def meta(*, bytes_per_row: int, rope_dim: int, rope_offset: int, num_groups: int, has_valid_counts: bool,
         named: bool = False, fused: bool = False, rows128: bool = True, smem_out: bool = True,
         thread_free: bool = True) -> dict:
    """``bf16_kernel``'s constexprs and launch options: ``bytes_per_row`` the row stride in bytes (1152 or
    1024, or any larger multiple of 16), ``rope_dim`` 64 or 0, ``rope_offset`` the rope part's byte offset
    (ignored without rope), ``num_groups`` = ceil(heads / 64); ``fused`` as in ``few.meta``; ``rows128``: the
    producer's gather in 128 contiguous bytes of 4 rows a warp instruction (else 64 bytes of 8 rows);
    ``smem_out``: a bf16 output (one split) through a tile each warpgroup alone reads, out in 16-byte row stores;
    ``thread_free``: each consumer thread arrives on a buffer half's free mbarrier itself, no warpgroup barrier
    before a release.  The three are on by default (docs/design/kernels.md has the A/B)."""
    return dict(BPT=bytes_per_row, ROPE=rope_dim, ROPE_OFF=rope_offset if rope_dim else 0, NG=num_groups,
                HAS_VC=bool(has_valid_counts), NAMED=named, num_warps=4, maxnreg=168,
                enable_fp_fusion=True, W128=bool(rows128), SO=bool(smem_out), TF=bool(thread_free),
                **fused_meta(fused))
