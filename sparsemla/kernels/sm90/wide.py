"""sm_90 sparse MLA decode for ``fp8`` / ``fp8_ds_mla`` rows (RoPE or NoPE) at 64 heads per program,
warp-specialized (Gluon).

It keeps the few-heads kernel's idea (``few.py``: the cache rows are the wgmma's M dimension, their e4m3
bytes are converted in registers into the A operand and never written back) and gives it the pair schedule
of the bf16 kernel (``bf16.py``), so that each row is converted once for all 64 heads:

- a producer warpgroup (``rows.producer``) gathers raw rows into a ring of three 64-row stages;
- QK: consumer warpgroup w computes ``S^T = K q^T`` [64 rows, 64 heads] for blocks 2i + w (A = the converted
  bytes, 64 dims at a time; B = q^T, fp16, in shared memory);
- the two warpgroups exchange their blocks' per-head maxima (one mbarrier each way), so both hold the pair's
  running max, and each writes its block's P^T to shared memory;
- PV: warpgroup w owns output dims 256 w .. 256 w + 255 and multiplies both blocks' V^T (converted from the
  raw bytes, its own 256 dims) with both P^T: ``O^T [256 dims, 64 heads] += V^T P^T``.

Numbers.  fp8 rows: the MMAs run in fp16 (e4m3 is exact in fp16) with q brought into fp16 range by a
per-program power of two, k_scale applied to the scores and the output.  fp8_ds_mla rows carry an fp32
scale per 128-dim group: with u_r = the row's largest scale, the A operands hold e4m3 x (scale / u_r)
(<= 448 in magnitude: fp16 is safe whatever the scales), so the MMAs give S / u_r and V / u_r.  The scores
are multiplied back by u_r (folded into the log2 scaling), and instead of P the kernel stores
``P' = P x u_r``, computed as ``exp2(s + log2 u_r - m)`` where m is the reference max of ``s + log2 u_r``;
``P' (V / u_r) = P V``, and the normaliser adds ``P' / u_r``.  The reference max is lazy: a head's moves only
when its scores pass it by more than 8 (log2 units), so P' <= 256 (fp16 again) and the accumulators are
rescaled only in the pairs where some head's moved.  The bf16 rope part multiplies in bf16 first (A from
shared memory) and is divided by u_r before the fp16 chain joins it.

Once per program: both consumer warpgroups stage half of q each, and the output leaves through shared
memory (a ring stage, free at the end) as 16-byte row stores, where written directly from the accumulator
layout it would be 128 scattered 2-byte stores a thread.

FP8_QK (fp8 / fp8_ds_mla rows): as in the few-heads kernel, q as two e4m3 terms with a power of two per head
and S^T on e4m3 wgmma with the gathered bytes as the A operand; fp8_ds_mla's group scales by Horner's scheme
on one accumulator (``_scores8``).  PV and the softmax are the default mode's.

Gluon kernels do not run under the Triton interpreter: ``tests/test_sm90_compile.py`` compiles every
variant for sm_90 on the CPU; the GPU suite checks the numbers against the float64 reference.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import compat
from .common import NEG_BIG, PUBLISH, absmax, program_coords, publish, rcp
from .rows import (L_QK64, L_V, SC_L, block_indices, e4m3_view, load_q_group, load_q_rope, pow2_scale, producer,
                   pv_rows,
                   pv_values, relabel64, store_e4m3_terms)

NS = gl.constexpr(3)  # ring stages of 64 rows

# S^T [64 rows, 64 heads] and O^T [128 dims, 64 heads] (one per 128-dim group) on wgmma m64n64
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_L.value, k_width=2))
# FP8_QK: the e4m3 MMAs' accumulator (k = 32 per instruction); the same registers as S_L (convert_layout is free)
S8_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
ROW8 = gl.constexpr(gl.SliceLayout(1, S8_L.value))
ROW = gl.constexpr(gl.SliceLayout(1, S_L.value))   # one value per cache row (or output dim)
HEAD = gl.constexpr(gl.SliceLayout(0, S_L.value))  # one value per head
QROW = gl.constexpr(gl.SliceLayout(1, L_QK64.value))  # one value per row of a QK chunk (the rows of ROW)
KROW = gl.constexpr(gl.SliceLayout(0, A_OP.value))    # one value per row (K index) of a PV step


@gluon.jit
def _col(x, G: gl.constexpr):
    """Column G of a [64, 4] tensor in SC_L, as a per-row vector (a register relabelling)."""
    a, b = x.reshape([64, 2, 2]).split()  # columns 0, 2 and 1, 3
    if G % 2 == 0:
        c0, c2 = a.split()
    else:
        c0, c2 = b.split()
    if G < 2:
        return c0
    else:
        return c2


@gluon.jit
def _chunk(raw, C: gl.constexpr, r):
    """64-dim chunk C of a stage's e4m3 bytes -> the fp16 A operand [64 rows, 64 k] (k permuted like
    L_QK64 / relabel64), each row multiplied by r (fp16, <= 1) when r is given."""
    a = raw.slice(64 * C, 64, dim=1).load(L_QK64).to(gl.float8e4nv, bitcast=True).to(gl.float16)
    if r is not None:
        a = a * r[:, None]
    return gl.convert_layout(relabel64(a), A_OP)


@gluon.jit
def _scores(rs, sc_st, rope_st, qn, qr, z, valid, ss, rbuf, rb0, DS: gl.constexpr, ROPE: gl.constexpr):
    """One block's scores in log2 units, [64 rows, 64 heads] (-inf for rows without a token), and the
    normaliser weight of each row (1 / u_r; fp8: 1).  fp8_ds_mla: also stores the rows' scale / u_r (fp16)
    in rows rb0 .. rb0 + 3 of ``rbuf`` [8, 64] (one per group) for the PV operands.  ``ss``: log2(e) sm_scale
    / c (fp8: x k_scale)."""
    s_zero = gl.zeros([64, 64], gl.float32, S_L)
    if DS:
        sv = sc_st.load(SC_L)  # 0 for a -1 row (cp.async zero-fills it)
        u = gl.max(sv, 1)
        u1 = gl.where(u > 0, u, 1.0)  # a row of zero scales: ratios 0, unit 1
        ratio = (sv * (1.0 / u1)[:, None]).to(gl.float16)
        r0 = _col(ratio, 0)
        r1 = _col(ratio, 1)
        r2 = _col(ratio, 2)
        r3 = _col(ratio, 3)
        rbuf.index(rb0 + 0).store(r0)
        rbuf.index(rb0 + 1).store(r1)
        rbuf.index(rb0 + 2).store(r2)
        rbuf.index(rb0 + 3).store(r3)
        r0 = gl.convert_layout(r0, QROW)
        r1 = gl.convert_layout(r1, QROW)
        r2 = gl.convert_layout(r2, QROW)
        r3 = gl.convert_layout(r3, QROW)
        ur = gl.convert_layout(u1, ROW)
        inv_ur = 1.0 / ur
        if ROPE:  # bf16 rope first (A from shared memory), then brought to units of u_r
            x = warpgroup_mma(rope_st, qr.index(z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            a = _chunk(rs, 0, r0)
            x = warpgroup_mma_wait(0, deps=(x, ))
            x = x * inv_ur[:, None]
            x = warpgroup_mma(a, qn.index(0 + z).permute((1, 0)), x, is_async=True)
        else:
            a = _chunk(rs, 0, r0)
            x = warpgroup_mma(a, qn.index(0 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        prev = a
        for C in gl.static_range(1, 8):
            if C // 2 == 0:
                rc = r0
            elif C // 2 == 1:
                rc = r1
            elif C // 2 == 2:
                rc = r2
            else:
                rc = r3
            a = _chunk(rs, C, rc)
            x = warpgroup_mma(a, qn.index(C + z).permute((1, 0)), x, is_async=True)
            warpgroup_mma_wait(1, deps=(prev, ))  # the previous chunk's registers are free again
            prev = a
        x = warpgroup_mma_wait(0, deps=(x, ))
        bias = gl.where(valid, gl.log2(ur), float("-inf"))
        return x * (ur * ss)[:, None] + bias[:, None], inv_ur
    else:
        a = _chunk(rs, 0, None)
        x = warpgroup_mma(a, qn.index(0 + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        prev = a
        n_chunks: gl.constexpr = 9 if ROPE else 8
        for C in gl.static_range(1, n_chunks):
            if C < 8:
                a = _chunk(rs, C, None)
            else:  # the e4m3 rope: chunk 8 of q
                a = _chunk(rope_st, 0, None)
            x = warpgroup_mma(a, qn.index(C + z).permute((1, 0)), x, is_async=True)
            warpgroup_mma_wait(1, deps=(prev, ))
            prev = a
        x = warpgroup_mma_wait(0, deps=(x, ))
        bias = gl.where(valid, 0.0, float("-inf"))
        return x * ss + bias[:, None], gl.full([64], 1.0, gl.float32, ROW)


@gluon.jit
def _group8(raw, st, qn, z, G: gl.constexpr, acc, use_acc: gl.constexpr):
    """FP8_QK: acc (+)= K_G (q_G c)^T over group G's 128 dims: e4m3 MMAs with A = the stage's piece G (the gathered
    bytes, in shared memory) and B = q's two terms, hi then lo, into the same accumulator (both terms carry the
    same per-head power of two, so their products add)."""
    a = e4m3_view(raw, 4 * st + G)
    acc = warpgroup_mma(a, qn.index(2 * G + z).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    return warpgroup_mma(a, qn.index(2 * G + 1 + z).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _scores8(raw, st, sc_st, rope_st, qn, qr, z, valid, ss, rbuf, rb0, DS: gl.constexpr, ROPE: gl.constexpr):
    """FP8_QK: ``_scores`` on e4m3 MMAs (``ss``: one value per head, [64] in HEAD).  fp8_ds_mla's per-row group
    scales s_g, with one accumulator (a second one in flight does not fit beside O^T's 128 registers): Horner's
    scheme, acc = (((K_0 q_0) s_0 / s_1 + K_1 q_1) s_1 / s_2 + K_2 q_2) s_2 / s_3 + K_3 q_3, then x s_3 and the
    bf16 rope MMA on top, each rescale between a group's MMAs and the next (a wait per group).  A zero scale is
    floored at 2^-24 of the row's largest, so that the ratios stay finite (such a group's bytes then count
    2^-24 of a real group at most).  The scores are in true units, so log2 u_r only enters as the bias that
    turns P into P' = P u_r (as in _scores).  Plain fp8: one chain, the e4m3 rope included."""
    s8_zero = gl.zeros([64, 64], gl.float32, S8_L)
    if DS:
        sv = sc_st.load(SC_L)  # 0 for a -1 row (cp.async zero-fills it)
        u = gl.max(sv, 1)
        u1 = gl.where(u > 0, u, 1.0)
        ratio = (sv * (1.0 / u1)[:, None]).to(gl.float16)
        rbuf.index(rb0 + 0).store(_col(ratio, 0))
        rbuf.index(rb0 + 1).store(_col(ratio, 1))
        rbuf.index(rb0 + 2).store(_col(ratio, 2))
        rbuf.index(rb0 + 3).store(_col(ratio, 3))
        sf = gl.maximum(sv, (u1 * 5.9604644775390625e-08)[:, None])
        rf = rcp(sf)
        s3 = gl.convert_layout(_col(sf, 3), ROW8)
        acc = _group8(raw, st, qn, z, 0, s8_zero, False)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = acc * gl.convert_layout(_col(sf, 0) * _col(rf, 1), ROW8)[:, None]
        acc = _group8(raw, st, qn, z, 1, acc, True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = acc * gl.convert_layout(_col(sf, 1) * _col(rf, 2), ROW8)[:, None]
        acc = _group8(raw, st, qn, z, 2, acc, True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = acc * gl.convert_layout(_col(sf, 2) * _col(rf, 3), ROW8)[:, None]
        acc = _group8(raw, st, qn, z, 3, acc, True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        x = gl.convert_layout(acc * s3[:, None], S_L)
        if ROPE:  # bf16 rope (A from shared memory), x c_h like q's terms
            x = warpgroup_mma(rope_st, qr.index(z).permute((1, 0)), x, is_async=True)
            x = warpgroup_mma_wait(0, deps=(x, ))
        bias = gl.where(valid, gl.log2(gl.convert_layout(u1, ROW)), float("-inf"))
        return x * ss[None, :] + bias[:, None], gl.convert_layout(rcp(u1), ROW)
    else:
        acc = _group8(raw, st, qn, z, 0, s8_zero, False)
        for G in gl.static_range(1, 4):
            acc = _group8(raw, st, qn, z, G, acc, True)
        if ROPE:
            a = compat.reinterpret(rope_st, gl.float8e4nv, [64, 64], rope_st.layout)
            acc = warpgroup_mma(a, qr.index(0 + z).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a, qr.index(1 + z).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        bias = gl.where(valid, 0.0, float("-inf"))
        return gl.convert_layout(acc, S_L) * ss[None, :] + bias[:, None], gl.full([64], 1.0, gl.float32, ROW)


@gluon.jit
def _v_operand(rs, st, ks: gl.constexpr, G: gl.constexpr, rbuf, rb0, DS: gl.constexpr, FP8_QK: gl.constexpr):
    """Rows 16 ks .. 16 ks + 15, group G -> the V^T A operand [128 dims (permuted, rows.acc_dim), 16 rows];
    fp8_ds_mla: each row multiplied by its scale / u_r (row rb0 + G of ``rbuf``).  ``rs``: the stage ([64, 512]),
    or (FP8_QK) the whole ring, whose stage st is four [64, 128] pieces (rs.index(4 st + G))."""
    if FP8_QK:
        v = gl.convert_layout(pv_rows(rs.index(4 * st + G).slice(16 * ks, 16, dim=0).load(L_V)), A_OP)
    else:
        v = gl.convert_layout(pv_values(rs, ks, G), A_OP)
    if DS:
        r = rbuf.index(rb0 + G).slice(16 * ks, 16, dim=0).load(KROW)
        v = v * r[None, :]
    return v


@gluon.jit
def _pv(raw, st, pbuf, rbuf, rb0, oa, ob, WG: gl.constexpr, DS: gl.constexpr, FP8_QK: gl.constexpr):
    """O^T of this warpgroup's groups 2 WG and 2 WG + 1 += V^T P^T over one block (P^T: ``pbuf``, [64 rows,
    64 heads] fp16), 16 rows a step: a step's MMAs are issued, the previous step's retired (their operand
    registers are free again; the wait names no accumulator, or ptxas would serialize the chain), then the
    next step's operands are converted while the MMAs run.  Returns the pending accumulators."""
    if FP8_QK:
        rs = raw
    else:
        rs = raw.index(st)
    va = _v_operand(rs, st, 0, 2 * WG, rbuf, rb0, DS, FP8_QK)
    vb = _v_operand(rs, st, 0, 2 * WG + 1, rbuf, rb0, DS, FP8_QK)
    for ks in gl.static_range(4):
        b = pbuf.slice(16 * ks, 16, dim=0)
        oa = warpgroup_mma(va, b, oa, is_async=True)
        ob = warpgroup_mma(vb, b, ob, is_async=True)
        if ks > 0:
            warpgroup_mma_wait(2, deps=(prev_a, prev_b))  # the previous step's operands are free again
        prev_a = va
        prev_b = vb
        if ks < 3:
            va = _v_operand(rs, st, ks + 1, 2 * WG, rbuf, rb0, DS, FP8_QK)
            vb = _v_operand(rs, st, ks + 1, 2 * WG + 1, rbuf, rb0, DS, FP8_QK)
    return oa, ob


@gluon.jit
def _pv_own(raw, pb, rbuf, z, st, free, oa, ob, WG: gl.constexpr, DS: gl.constexpr, FP8_QK: gl.constexpr):
    """PV over this warpgroup's own block of the pair (its P^T is in pb[WG]); then releases the stage."""
    oa, ob = _pv(raw, st, pb.index(WG + z), rbuf, 4 * (WG + z), oa, ob, WG, DS, FP8_QK)
    oa, ob = warpgroup_mma_wait(0, deps=(oa, ob))
    compat.barrier()  # all of this warpgroup's reads of the stage are done
    mbarrier.arrive(free.index(st), count=1)
    return oa, ob


@gluon.jit
def _pv_other(raw, pb, rbuf, z, so, b_oth, ready, free, p_ready, p_free, ph, oa, ob, WG: gl.constexpr,
              DS: gl.constexpr, FP8_QK: gl.constexpr):
    """PV over the other warpgroup's block of the pair, once its P^T is published; then releases that P^T
    (and its ratios) and the stage."""
    n_st: gl.constexpr = raw.shape[0] // (4 if FP8_QK else 1)
    mbarrier.wait(p_ready.index(1 - WG), ph)
    mbarrier.wait(ready.index(so), (b_oth // n_st) & 1)  # passed already: makes the bytes visible here
    oa, ob = _pv(raw, so, pb.index(1 - WG + z), rbuf, 4 * (1 - WG + z), oa, ob, WG, DS, FP8_QK)
    oa, ob = warpgroup_mma_wait(0, deps=(oa, ob))
    compat.barrier()
    mbarrier.arrive(p_free.index(1 - WG), count=1)
    mbarrier.arrive(free.index(so), count=1)
    return oa, ob


@gluon.jit
def _stage_q(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, q_amax, q_bar,
             WG: gl.constexpr, DS: gl.constexpr,
             ROPE: gl.constexpr):
    """q x c into shared memory as the QK B operand, once per program, half by each consumer warpgroup
    (WG w: latent groups 2w, 2w + 1; warpgroup 1 also the rope), in 64-dim chunks with columns permuted like
    the A chunks (relabel64); c: the power of two that brings this program's q into fp16 range (amax x c in
    [2^13, 2^15); the rope dims count for plain fp8, whose rope is chunk 8).  fp8_ds_mla: the rope part bf16
    in natural order.  The two halves' maxima meet through ``q_amax[w]``; ``q_bar[w]``: warpgroup w's
    maximum is published, ``q_bar[2 + w]``: its chunks are stored (two barriers, not two phases of one: a
    warpgroup could otherwise complete both phases before the other waits for the first).  Returns c."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
    hm = (heads < H)[:, None]
    q_row = q_ptr + t.to(gl.int64) * stride_qt + gl.where(heads < H, heads, 0).to(gl.int64)[:, None] * stride_qh
    amax = gl.maximum(absmax(load_q_group(q_row, hm, 256 * WG, lay)), absmax(load_q_group(q_row, hm, 256 * WG + 128, lay)))
    if ROPE and WG == 1:
        xr = load_q_rope(qr_ptr, stride_rt, stride_rh, t, heads, H, hm, lay)
        if not DS:
            amax = gl.maximum(amax, absmax(xr))
    q_amax.index(WG).store(gl.full([64], 1.0, gl.float32, HEAD) * amax)
    publish(q_bar.index(WG))
    mbarrier.wait(q_bar.index(1 - WG), 0)
    amax = gl.maximum(amax, gl.max(q_amax.index(1 - WG).load(HEAD), 0))
    e = gl.floor(gl.log2(gl.maximum(amax, 1e-30)))
    c = gl.where(amax > 0, gl.exp2(13.0 - e), 1.0)
    for G in gl.static_range(2):  # loaded again (from L1 / L2): q is not held across the wait
        x = load_q_group(q_row, hm, 256 * WG + 128 * G, lay)
        lo, hi = (x * c).reshape([64, 2, 64]).permute(0, 2, 1).split()
        qn.index(4 * WG + 2 * G).store(relabel64(lo).to(gl.float16))
        qn.index(4 * WG + 2 * G + 1).store(relabel64(hi).to(gl.float16))
    if ROPE and WG == 1:
        if DS:
            qr.index(0).store((xr * c).to(gl.bfloat16))
        else:
            qn.index(8).store(relabel64(xr * c).to(gl.float16))
    fence_async_shared()  # generic stores -> the wgmma (async proxy) reads of q
    publish(q_bar.index(2 + WG))
    mbarrier.wait(q_bar.index(3 - WG), 0)
    return c


@gluon.jit
def _stage_q8(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, q_amax, q_bar,
              WG: gl.constexpr, DS: gl.constexpr,
              ROPE: gl.constexpr):
    """FP8_QK: q x c_h as two e4m3 terms, both into one accumulator (hi + lo hold bf16 q exactly but for elements
    below ~2^-9 of the head's largest), c_h a power of two per head with amax_h x c_h in [128, 256).  Half by each
    warpgroup as in _stage_q (WG w: groups 2w, 2w + 1, as qn[2 G] = hi and qn[2 G + 1] = lo, [64 heads, 128],
    natural order: the A operands are the rows' bytes in shared memory); warpgroup 1 also the rope (bf16 x c_h
    for fp8_ds_mla, two e4m3 terms in qr[0], qr[1] for fp8).  The per-head maxima of the two halves meet
    through ``q_amax[w]``.  Returns 1 / c_h ([64], HEAD)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hl: gl.constexpr = gl.SliceLayout(1, lay)
    heads = g * 64 + gl.arange(0, 64, layout=hl)
    hm = (heads < H)[:, None]
    q_row = q_ptr + t.to(gl.int64) * stride_qt + gl.where(heads < H, heads, 0).to(gl.int64)[:, None] * stride_qh
    amax = gl.maximum(gl.max(gl.abs(load_q_group(q_row, hm, 256 * WG, lay)), 1),
                      gl.max(gl.abs(load_q_group(q_row, hm, 256 * WG + 128, lay)), 1))
    if ROPE and WG == 1:
        xr = load_q_rope(qr_ptr, stride_rt, stride_rh, t, heads, H, hm, lay)
        if not DS:
            amax = gl.maximum(amax, gl.max(gl.abs(xr), 1))
    q_amax.index(WG).store(amax)
    publish(q_bar.index(WG))
    mbarrier.wait(q_bar.index(1 - WG), 0)
    c, inv_c = pow2_scale(gl.maximum(amax, q_amax.index(1 - WG).load(hl)))
    for G in gl.static_range(2):  # loaded again (from L1 / L2): q is not held across the wait
        x = load_q_group(q_row, hm, 256 * WG + 128 * G, lay) * c[:, None]
        store_e4m3_terms(qn.index(2 * (2 * WG + G)), qn.index(2 * (2 * WG + G) + 1), x, 1.0)
    if ROPE and WG == 1:
        if DS:
            qr.index(0).store((xr * c[:, None]).to(gl.bfloat16))
        else:
            store_e4m3_terms(qr.index(0), qr.index(1), xr * c[:, None], 1.0)
    fence_async_shared()  # generic stores -> the wgmma (async proxy) reads of q
    publish(q_bar.index(2 + WG))
    mbarrier.wait(q_bar.index(3 - WG), 0)
    return gl.convert_layout(inv_c, HEAD)


@gluon.jit
def _unpermute(o):
    """O^T [128 accumulator rows m, 64 heads] -> O [64 heads, 128 dims], row m being dim rows.acc_dim(m)
    (dim bits 6..0 = m bits 5, 4, 2, 1, 0, 6, 3): a register relabelling, no data movement."""
    x = o.reshape([2, 2, 2, 2, 2, 2, 2, 64]).permute(1, 2, 4, 5, 6, 0, 3, 7).reshape([128, 64])
    return x.permute(1, 0)


@gluon.jit
def _store_group(o, scale, buf, o_tok, g, H, stride_oh, col0):
    """One 128-dim group of the output: O^T [128 accumulator rows, 64 heads] x scale (per head) -> columns
    col0 .. col0 + 127 of heads 64 g .. 64 g + 63 at ``o_tok`` (row stride ``stride_oh``), through shared
    memory (``buf``: [64, 128] of the output type).  In the accumulator layout each thread holds 4
    consecutive dims of 32 heads, which written directly are 128 scattered 2-byte stores a thread (~1600
    instructions a warpgroup, once per program); read back row-wise they are 16-byte stores of whole rows."""
    ty: gl.constexpr = buf.dtype
    vec_n: gl.constexpr = 128 // ty.primitive_bitwidth
    out_l: gl.constexpr = gl.BlockedLayout([1, vec_n], [32 * vec_n // 128, 128 // vec_n], [4, 1], [1, 0])
    buf.store(_unpermute((o * scale[None, :]).to(ty)))
    compat.barrier()
    heads = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
    d = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, out_l))
    gl.store(o_tok + heads.to(gl.int64)[:, None] * stride_oh + d[None, :], buf.load(out_l),
             mask=(heads < H)[:, None])
    compat.barrier()  # every warp has read buf before it is written again


@gluon.jit
def _consumer(args, WG: gl.constexpr, DS: gl.constexpr, ROPE: gl.constexpr, FP8_QK: gl.constexpr,
              NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Consumer warpgroup WG (0 or 1): QK and softmax of blocks 2 i + WG, PV of every block for output dims
    256 WG .. 256 WG + 255.  FP8_QK: QK on e4m3 MMAs (see the module docstring)."""
    (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot,
     stride_os, stride_oh, lse_ptr,
     stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, smem,
     bars) = args
    raw, scl, rope, qn, qr, pb, rbuf, pair_max, row_sum, run_max, q_amax = smem
    q_bar, ready, free, m_bar, p_ready, p_free, l_bar = bars
    n_st: gl.constexpr = raw.shape[0] // (4 if FP8_QK else 1)
    t, s, g, k_begin, k_end = program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    if FP8_QK:  # 1 / c_h, one per head
        ss = sm_scale_log2 * _stage_q8(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr,
                                       q_amax, q_bar, WG, DS, ROPE)
    else:
        c = _stage_q(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, t, g, H, qn, qr, q_amax, q_bar, WG,
                     DS, ROPE)
        ss = sm_scale_log2 / c
    if not DS:
        ss = ss * k_scale
    oa = gl.zeros([128, 64], gl.float32, S_L)
    ob = oa
    # the normaliser's partial sums: each thread adds its two rows of a block ([4 warps, 2, 8 lanes, 64]: row
    # 16 w + 8 h + g) and keeps [4, 8, 64] (16 registers instead of 32); reduced across threads at the end
    l_acc = gl.sum(gl.zeros([64, 64], gl.float32, S_L).reshape([4, 2, 8, 64]), 1)
    # the running max lives in shared memory between pairs (run_max[WG]): 16 registers fewer
    run_max.index(WG).store(gl.full([64], NEG_BIG, gl.float32, HEAD))
    compat.barrier()
    n_pairs = gl.cdiv(n_blocks, 2)
    for i in range(n_pairs):
        ph = i & 1
        # z == 0, but the compiler cannot know it: shared-memory views indexed with it are recomputed in the
        # loop instead of their wgmma descriptors being hoisted out of it and spilled
        z = i // (n_pairs + 1)
        b_own = 2 * i + WG
        b_oth = 2 * i + 1 - WG
        st = b_own % n_st
        so = b_oth % n_st
        own = b_own < n_blocks
        oth = b_oth < n_blocks
        if own:
            mbarrier.wait(ready.index(st), (b_own // n_st) & 1)
            fence_async_shared()  # cp.async data -> the wgmma (async proxy) reads of the rope part
            if i > 0:  # rbuf[WG] and pb[WG] are free once the other warpgroup's PV of the last pair read them
                mbarrier.wait(p_free.index(WG), ph ^ 1)
            valid = block_indices(idx_row, k_begin + b_own * 64, k_end, ROW) >= 0
            if FP8_QK:
                y, w = _scores8(raw, st, scl.index(st), rope.index(st), qn, qr, z, valid, ss, rbuf, 4 * (WG + z),
                                DS, ROPE)
            else:
                y, w = _scores(raw.index(st), scl.index(st), rope.index(st), qn, qr, z, valid, ss, rbuf,
                               4 * (WG + z), DS, ROPE)
        else:  # an odd number of blocks: the last pair has no second block
            y = gl.full([64, 64], float("-inf"), gl.float32, S_L)
            w = gl.full([64], 1.0, gl.float32, ROW)
        # the pair's max: publish this block's, read the other's
        m_i = run_max.index(WG).load(HEAD)
        m_blk = gl.max(y, 0)
        pair_max.index(WG).store(m_blk)
        compat.barrier()
        mbarrier.arrive(m_bar.index(WG), count=1)
        mbarrier.wait(m_bar.index(1 - WG), ph)
        m_blk = gl.maximum(m_blk, pair_max.index(1 - WG).load(HEAD))
        # lazy rescaling: a head's reference max moves only when its scores pass it by more than 8 (log2
        # units; P <= 256 then, well inside fp16), and the accumulators are rescaled only in a pair where
        # some head's moved.  Both warpgroups decide alike: they hold the same maxima.
        upd = m_blk > m_i + 8.0
        if gl.max(upd.to(gl.int32), 0) > 0:
            m_new = gl.where(upd, m_blk, m_i)
            alpha = gl.exp2(m_i - m_new)
            oa = oa * alpha[None, :]
            ob = ob * alpha[None, :]
            a3 = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(0, l_acc.type.layout)))
            l_acc = l_acc * gl.expand_dims(gl.expand_dims(a3, 0), 0)
            run_max.index(WG).store(m_new)
            m_i = m_new
        p = gl.exp2(y - m_i[None, :])
        l_acc = l_acc + gl.sum((p * w[:, None]).reshape([4, 2, 8, 64]), 1)
        if own:
            pb.index(WG + z).store(p.to(gl.float16))
            fence_async_shared()
            compat.barrier()  # every warp's part of P^T (and of the ratios) is in shared memory
            mbarrier.arrive(p_ready.index(WG), count=1)
        # both warpgroups multiply block 2i first, so that its stage is free for block 2i + 3 (which
        # warpgroup 1 needs first thing in the next pair) while block 2i + 1 is multiplied
        if WG == 0:
            oa, ob = _pv_own(raw, pb, rbuf, z, st, free, oa, ob, WG, DS, FP8_QK)
            if oth:
                oa, ob = _pv_other(raw, pb, rbuf, z, so, b_oth, ready, free, p_ready, p_free, ph, oa, ob, WG, DS,
                                   FP8_QK)
        else:
            oa, ob = _pv_other(raw, pb, rbuf, z, so, b_oth, ready, free, p_ready, p_free, ph, oa, ob, WG, DS, FP8_QK)
            if own:
                oa, ob = _pv_own(raw, pb, rbuf, z, st, free, oa, ob, WG, DS, FP8_QK)
    # the normaliser: this warpgroup's blocks plus the other's (both use the same running max)
    l_own = gl.convert_layout(gl.sum(gl.sum(l_acc, 1), 0), HEAD)  # lanes first: a small cross-warp scratch
    row_sum.index(WG).store(l_own)
    publish(l_bar.index(WG))
    mbarrier.wait(l_bar.index(1 - WG), 0)  # also: the other warpgroup has read every stage for the last time
    l_i = l_own + row_sum.index(1 - WG).load(HEAD)
    m_i = run_max.index(WG).load(HEAD)
    # IEEE 1 / l and libdevice log2, written out here rather than common.normalizer's approximate forms
    # (inline asm), with which ptxas allocates the loop's registers differently and the loop runs slower
    has = l_i != 0  # NaN (a selected row held a NaN) passes through, see common.normalizer
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if not DS:
        inv_l = inv_l * k_scale
    # the output through stage WG of the ring (free now: every block has been multiplied by both warpgroups)
    o_tok = o_ptr + t.to(gl.int64) * stride_ot + s * stride_os
    ty: gl.constexpr = o_ptr.dtype.element_ty
    ol: gl.constexpr = gl.SwizzledSharedLayout(128 // ty.primitive_bitwidth, 1, 8, [1, 0])
    if FP8_QK:  # the ring as [64, 128] tiles of the output type: two pieces each
        buf = compat.reinterpret(raw, ty, [raw.shape[0] * 128 // (ty.primitive_bitwidth * 16), 64, 128], ol).index(WG)
    else:  # stage WG as [64, 128] tiles of the output type (two of bf16, one of fp32): the first one
        n_tiles: gl.constexpr = raw.shape[2] * 8 // (128 * ty.primitive_bitwidth)
        buf = compat.reinterpret(raw.index(WG), ty, [n_tiles, 64, 128], ol).index(0)
    _store_group(oa, inv_l, buf, o_tok, g, H, stride_oh, 256 * WG)
    _store_group(ob, inv_l, buf, o_tok, g, H, stride_oh, 256 * WG + 128)
    if WG == 1:
        heads = g * 64 + gl.arange(0, 64, layout=HEAD)
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=heads < H)


@gluon.jit
def wide_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh,
                BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
                NG: gl.constexpr, HAS_VC: gl.constexpr, DS: gl.constexpr, FP8_QK: gl.constexpr):
    """One program = one query token x 64 heads (head group g of NG) x one split; launch with num_warps=4 (the
    default partition, consumer warpgroup 0) and maxnreg=168 (see ``launch``)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    f16_64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    if FP8_QK:
        f8_128: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
        raw = gl.allocate_shared_memory(gl.uint8, [4 * NS, 64, 128], f8_128)
        # q's two terms per 128-dim group: [2 G] hi, [2 G + 1] lo, [64 heads, 128 dims]
        qn = gl.allocate_shared_memory(gl.float8e4nv, [8, 64, 128], f8_128)
    else:
        raw = gl.allocate_shared_memory(gl.uint8, [NS, 64, 512], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
        # q in 64-dim chunks [chunk, 64 heads, 64 dims] (plain fp8: chunk 8 = the rope)
        n_q: gl.constexpr = 8 if DS else 9
        qn = gl.allocate_shared_memory(gl.float16, [n_q, 64, 64], f16_64)
    pb = gl.allocate_shared_memory(gl.float16, [2, 64, 64], f16_64)  # P^T of blocks 2i and 2i + 1
    # fp8_ds_mla: each row's scale / u_r per group, [block 2i: 0-3, block 2i + 1: 4-7; 64 rows]
    rbuf = gl.allocate_shared_memory(gl.float16, [8, 64], plain)
    if DS:
        scl = gl.allocate_shared_memory(gl.float32, [NS, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        bf16_64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        rope = gl.allocate_shared_memory(gl.bfloat16, [NS, 64, 64], bf16_64)
        qr = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], bf16_64)
    elif FP8_QK:
        scl = gl.allocate_shared_memory(gl.float32, [1, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        f8_64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv)
        rope = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], f8_64)
        qr = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64], f8_64)  # the rope's hi and lo
    else:
        scl = gl.allocate_shared_memory(gl.float32, [1, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rope = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
        qr = qn
    # per consumer warpgroup (indexed by WG), one value per head: its block's max in the current pair, its
    # normaliser sum, its running max, the abs max of its half of q
    pair_max = gl.allocate_shared_memory(gl.float32, [2, 64], plain)
    row_sum = gl.allocate_shared_memory(gl.float32, [2, 64], plain)
    run_max = gl.allocate_shared_memory(gl.float32, [2, 64], plain)
    q_amax = gl.allocate_shared_memory(gl.float32, [2, 64], plain)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [4, 1], bl)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], bl)
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], bl)
    m_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=128)  # one cp.async arrival per producer thread
        mbarrier.init(free.index(i), count=2)     # both consumer warpgroups read every block
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=PUBLISH)  # q's hand-offs, once a program (publish())
        mbarrier.init(q_bar.index(2 + i), count=PUBLISH)
        mbarrier.init(m_bar.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(l_bar.index(i), count=PUBLISH)
    # (constexprs in warp_specialize's argument tuples written there, not in tuples assigned to names: see few.py)
    ca = (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot,
          stride_os, stride_oh,
          lse_ptr, stride_lt, stride_ls, stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
          (raw, scl, rope, qn, qr, pb, rbuf, pair_max, row_sum, run_max, q_amax), (q_bar, ready, free, m_bar, p_ready, p_free, l_bar))
    pa = (kv_ptr, idx_ptr, stride_it, vc_ptr, H, K, rows_per_split, num_splits, raw, scl, rope, ready, free)
    gl.warp_specialize([(_consumer, (ca, 0, DS, ROPE, FP8_QK, NG, HAS_VC)), (_consumer, (ca, 1, DS, ROPE, FP8_QK, NG, HAS_VC)),
                        (producer, (pa, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, False, FP8_QK, NG, HAS_VC))],
                       [4, 4], [232, 40])

KINDS = ("fp8", "fp8_ds_mla")  # the row formats this kernel reads


# How sparsemla.kernels.attention launches it (one cached launch per plan, compile-time arguments from
# meta()):
# ``grid``: ``(tokens x splits x num_groups,)`` (program p: head group p % num_groups, 64 heads, of split
# (p // num_groups) % splits of token p // (num_groups x splits)); ``args``: the positional arguments of
# the few-heads kernel (few.py; k_scale included).  12 warps, 168 registers each at launch.

def meta(*, kind: str, bytes_per_row: int, rope_dim: int, rope_offset: int, scale_offset: int, num_groups: int,
         has_valid_counts: bool, fp8_qk: bool = False) -> dict:
    """``wide_kernel``'s constexprs and launch options for one variant (the arguments as in ``few.meta``;
    ``num_groups`` = ceil(heads / 64)).  It has no FUSED variant: the merge after its loop made its consumer warpgroup
    spill 40 bytes more (SASS, Triton 3.6), and it serves only the FP8-QK mode and unaligned q above 32 heads."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    ds = kind == "fp8_ds_mla"
    return dict(BPT=bytes_per_row, ROPE=rope_dim, SCALE_OFF=scale_offset if ds else 0,
                ROPE_OFF=rope_offset if rope_dim else 0, NG=num_groups, HAS_VC=bool(has_valid_counts), DS=ds,
                FP8_QK=bool(fp8_qk), num_warps=4, maxnreg=168, enable_fp_fusion=True)
