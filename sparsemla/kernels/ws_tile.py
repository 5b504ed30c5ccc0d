"""Warp-specialized sparse MLA forward, "tile" schedule: both consumer warpgroups share each 64-row tile
(bf16 rows, 64 heads per program; Hopper only; Gluon).  The first Gluon kernel; ``ws_pair`` (the default)
replaced it -- it is kept as the measured alternative (``ws_attention.CONFIGS["tile"]``, BENCHMARKS.md).

- a producer warpgroup (4 warps, 56 registers) loads the indices and gathers each tile's rows with
  ``cp.async`` into two shared-memory buffers; each thread's copies arrive on the buffer's "ready"
  mbarrier when they land (``cp.async.mbarrier.arrive.noinc``, 128 arrivals);
- two consumer warpgroups (the default partition, 8 warps, warps [4, 2]) split a tile's 64 keys for
  ``S = Q K^T`` (32 each, wgmma m64n32) and the 512 output columns for ``O += P V`` (256 each); P goes
  through shared memory and the row max through one cross-warpgroup reduction per tile.

Shared memory: q [64, 576] (72 KB), 2 x 64 rows x 1152 B of tiles (144 KB), P [64, 64] bf16 (8 KB).
Measured on the H200 (BENCHMARKS.md): 1.47x the Triton wide kernel at P-32k, about 20 % behind
``ws_pair``; without its row gathers (``GATHER=False``, a probe) only 5 % faster, so its limit is the
lock-step schedule (both warpgroups read all of q for 32 keys each, a max exchange per tile), not the loads.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .sm90 import compat

from .ws_attention import _NEG_BIG, _coords, _normalizer

PRODUCER_REGS = gl.constexpr(56)


@gluon.jit
def _producer(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits,
              q_smem, qr_smem, k_smem, kr_smem, q_bar, ready, empty,
              BPT: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr,
              GATHER: gl.constexpr):
    """Gather q and then each tile's rows into shared memory with cp.async (4 warps)."""
    t, s, g, k_begin, k_end = _coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    # 8 bf16 (16 bytes) per thread and copy, 4 threads across a row's 64-dim chunk, 8 rows per warp.
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, lay)
    d = gl.arange(0, 512, layout=gl.SliceLayout(0, lay))
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))

    heads = g * 64 + gl.arange(0, 64, layout=rows_l)
    hm = heads < H
    # heads past H are zero-filled from head 0's address (never read: source size 0)
    q_row = gl.multiple_of(q_ptr + t.to(gl.int64) * stride_qt + gl.where(hm, heads, 0).to(gl.int64) * stride_qh, 16)
    compat.async_load(q_smem, q_row[:, None] + d[None, :], mask=hm[:, None])
    if ROPE:
        compat.async_load(qr_smem, q_row[:, None] + 512 + dr[None, :], mask=hm[:, None])
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    NB: gl.constexpr = k_smem.type.shape[0]
    BN: gl.constexpr = k_smem.type.shape[1]
    n_tiles = gl.cdiv(k_end - k_begin, BN)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    for j in range(n_tiles):
        b = j % NB
        phase = (j // NB) & 1
        offs = k_begin + j * BN + gl.arange(0, BN, layout=rows_l)
        idx = gl.load(idx_row + offs, mask=offs < k_end, other=-1)
        valid = idx >= 0
        # Invalid rows are zero-filled (cp.async with source size 0) from row 0's address.
        base = gl.multiple_of(kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * BPT, 16).to(gl.pointer_type(gl.bfloat16))
        mbarrier.wait(empty.index(b), phase ^ 1)  # the consumers are done with this buffer
        if GATHER:
            compat.async_load(k_smem.index(b), base[:, None] + d[None, :], mask=valid[:, None])
            if ROPE:
                compat.async_load(kr_smem.index(b), base[:, None] + 512 + dr[None, :],
                                                       mask=valid[:, None])
        async_copy.mbarrier_arrive(ready.index(b), increment_count=False)


@gluon.jit
def _qk(q_smem, qr_smem, k_smem, kr_smem, b, s_zero, ROPE: gl.constexpr):
    """Issue S = q K^T (+ rope) for tile buffer b on the tensor cores (asynchronous)."""
    if ROPE:
        sc = warpgroup_mma(qr_smem, kr_smem.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_smem, k_smem.index(b).permute((1, 0)), sc, is_async=True)
    else:
        sc = warpgroup_mma(q_smem, k_smem.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return sc


@gluon.jit
def _tile_valid(idx_row, k0, k_end, BN: gl.constexpr, cols_l: gl.constexpr):
    offs = k0 + gl.arange(0, BN, layout=cols_l)
    return gl.load(idx_row + offs, mask=offs < k_end, other=-1) >= 0


@gluon.jit
def _softmax(sc, valid, m_i, l_acc, sm_scale_log2):
    """Online softmax step in base 2 on one tile's scores: (p, alpha, m_new, l_acc)."""
    sc = gl.where(valid[None, :], sc * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    return p, alpha, m_new, l_acc * alpha[:, None] + p


@gluon.jit
def _consumer(o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
              idx_ptr, stride_it, vc_ptr, sm_scale_log2, H, K, rows_per_split, num_splits,
              q_smem, qr_smem, k_smem, kr_smem, p_smem, q_bar, ready, empty,
              ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Two warpgroups: QK, online softmax, PV, and the output (8 warps)."""
    t, s, g, k_begin, k_end = _coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    NB: gl.constexpr = k_smem.type.shape[0]
    BN: gl.constexpr = k_smem.type.shape[1]
    # warps [4, 2]: each warpgroup takes half of a tile's keys for S and half of the output columns for O
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    cols_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    srow_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)

    s_zero = gl.zeros([64, BN], gl.float32, s_layout)
    m_i = gl.full([64], _NEG_BIG, gl.float32, srow_l)
    l_acc = gl.zeros([64, BN], gl.float32, s_layout)  # row sums kept per column: no cross-warp sum per tile
    acc = gl.zeros([64, 512], gl.float32, o_layout)
    n_tiles = gl.cdiv(k_end - k_begin, BN)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    mbarrier.wait(q_bar, 0)
    fence_async_shared()
    for j in range(n_tiles):
        b = j % NB
        valid = _tile_valid(idx_row, k_begin + j * BN, k_end, BN, cols_l)
        mbarrier.wait(ready.index(b), (j // NB) & 1)
        fence_async_shared()  # cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        sc = warpgroup_mma_wait(0, deps=(_qk(q_smem, qr_smem, k_smem, kr_smem, b, s_zero, ROPE),))
        p, alpha, m_i, l_acc = _softmax(sc, valid, m_i, l_acc, sm_scale_log2)
        acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        compat.barrier()  # both warpgroups' halves of P are in shared memory
        acc = warpgroup_mma(p_smem, k_smem.index(b), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        compat.barrier()  # both warpgroups' PV of buffer b is done
        mbarrier.arrive(empty.index(b), count=1)

    l_i = gl.sum(l_acc, 1)
    inv_l, lse = _normalizer(m_i, l_i)
    heads = g * 64 + gl.arange(0, 64, layout=orow_l)
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, o_layout))
    o = acc * gl.convert_layout(inv_l, orow_l)[:, None]
    optr = o_ptr + t.to(gl.int64) * stride_ot + s * stride_os + heads[:, None] * stride_oh + cols[None, :]
    gl.store(optr, o.to(o_ptr.dtype.element_ty), mask=(heads < H)[:, None])
    lh = g * 64 + gl.arange(0, 64, layout=srow_l)
    gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + lh * stride_lh, lse, mask=lh < H)


@gluon.jit
def ws_tile_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                   o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                   sm_scale_log2, H, K, rows_per_split, num_splits,
                   BPT: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr,
                   GATHER: gl.constexpr):
    """One program = one query token x 64 heads x one split.  Arguments as ``_fwd_wide_kernel`` (bf16 rows,
    BPT 1152 with rope, 1024 without); launch with num_warps=8 (the consumers) and maxnreg=168.
    GATHER=False skips the row copies (wrong results; a benchmark-only probe of the consumers' own speed)."""
    BN: gl.constexpr = 64
    NBUF: gl.constexpr = 2
    big: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    small: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    k_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 512], gl.bfloat16)
    kr_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16)
    p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], big)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, 512], k_lay)
    if ROPE:
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], small)
        kr_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, 64], kr_lay)
    else:
        qr_smem = q_smem  # unused
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BN], p_lay)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=128)  # every producer thread arrives once its copies landed
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=128)
        mbarrier.init(empty.index(i), count=1)  # one arrive from the consumers after a barrier
    gl.warp_specialize([
        (_consumer, (o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                     idx_ptr, stride_it, vc_ptr, sm_scale_log2, H, K, rows_per_split, num_splits,
                     q_smem, qr_smem, k_smem, kr_smem, p_smem, q_bar, ready, empty, ROPE, NG, HAS_VC)),
        (_producer, (q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split,
                     num_splits, q_smem, qr_smem, k_smem, kr_smem, q_bar, ready, empty, BPT, ROPE, NG, HAS_VC,
                     GATHER)),
    ], [4], [PRODUCER_REGS])


