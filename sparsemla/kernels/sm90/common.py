"""What every sm_90 kernel shares: the program's coordinates, fast fp32 reciprocal / log2, the softmax
normalizer, ``NEG_BIG``, and the merge of split partials inside the kernel (:func:`combine_in_kernel`).

Output contract of every kernel here (the portable kernels' contract): with one split, ``o`` is the
normalized output ``[tokens, heads, 512]`` and ``lse`` the natural-log log-sum-exp ``[tokens, heads]``
(0 and -inf for a token without a valid row); with several, each split writes its normalized partial
output and lse (strides ``stride_os`` / ``stride_ls``) and the combine kernel merges them -- or, in a
``FUSED`` variant, the kernel's own programs merge them into ``fo`` / ``fl`` after a grid barrier.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from . import compat

NEG_BIG = gl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (no inf - inf in exp2)
PUBLISH = gl.constexpr(129)  # arrivals of one warpgroup's publish() on an mbarrier


@gluon.jit
def publish(bar):
    """One warpgroup (4 warps) hands what it stored to shared memory with generic stores, and is done reading
    there, to the waiters on the mbarrier ``bar``, which counts :data:`PUBLISH` arrivals for each warpgroup that
    publishes on it.  Used for sm90-bf16's row max / sum vectors, and in every sm_90 kernel for the hand-offs
    made once a program (q and its scales, the final row sums, sm90-few's merge of the two warpgroups).

    After a warpgroup barrier one thread's ordinary arrival (a release) is what the waiters' wait acquires: the
    memory model needs nothing more.  Every thread also arrives by cp.async: at once where it has no copy in
    flight, once its own copies have landed where it has (a producer's tile).  Those per-thread arrivals order
    each thread's own shared-memory accesses before the waiters', which is the ordering compute-sanitizer's
    racecheck follows; it does not carry the warpgroup barrier through one thread's arrival, and reported every
    hand-off made that way as a hazard."""
    compat.barrier()
    async_copy.mbarrier_arrive(bar, increment_count=False)
    mbarrier.arrive(bar, count=1)


# one value per thread of a 4-warp partition: the operand of an asm statement that every thread runs once
PER_THREAD = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


def named_asm(op: str, barrier_id: int):
    """The statement :func:`named_barrier` runs: ``bar.<op> <barrier_id>, 256`` (``op`` "sync" or "arrive"; 256
    threads: the two MMA warpgroups), as a constexpr string."""
    return gl.constexpr(f"bar.{op} {barrier_id}, 256; mov.u32 $0, $1;")


@gluon.jit
def named_barrier(ASM: gl.constexpr):
    """One named hardware barrier statement (``ASM``, from :func:`named_asm`), run once by every thread of the
    calling 4-warp partition.  Two partitions hand data over with one: the writer's threads store, then arrive;
    the reader's threads sync, then load (the barrier orders each thread's accesses, and the waiting, in
    hardware).  Ids 0-3 are the ones Triton gives the partitions' own barriers (3.6-3.9); the kernels here use
    12-15."""
    one = gl.full([128], 0, gl.int32, PER_THREAD)
    gl.inline_asm_elementwise(ASM, "=r,r", [one], gl.int32, False, 1)


# a bf16 output staged through shared memory, read back as [16 heads, 256 columns]: 8 columns (16 bytes) a thread,
# a warp along one head's 256
L_OUT = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))


@gluon.jit
def store_via_tile(o, stage, o_ptr, t, s, g, stride_ot, stride_os, col0: gl.constexpr, H, stride_oh):
    """Store a warpgroup's bf16 output ``o`` [64 heads, 256 columns] (heads 64 g .. 64 g + 63, columns col0 .. col0 +
    255 of token t's split s at ``o_ptr``; heads >= H left out) through ``stage``, a [64, 256] bf16 tile that only
    this warpgroup reads now: out in 16-byte row stores, a warp writing 512 contiguous bytes of a head's row.
    Stores from the wgmma accumulator layout cover 16 bytes of 8 rows a warp instruction, and a program's last
    block waited on them.  (Its address arithmetic after the tile's barrier, as where it came from in sm90-conv:
    that kernel's PTX is unchanged by the move.)"""
    stage.store(o)
    compat.barrier()  # every warp's part of the tile is stored
    cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, L_OUT))
    obase = o_ptr + t.to(gl.int64) * stride_ot + s * stride_os
    for j in gl.static_range(4):  # 16 heads at a time: fewer registers live
        heads = g * 64 + 16 * j + gl.arange(0, 16, layout=gl.SliceLayout(1, L_OUT))
        o16 = stage.slice(16 * j, 16, dim=0).load(L_OUT)
        gl.store(obase + heads.to(gl.int64)[:, None] * stride_oh + cols[None, :], o16, mask=(heads < H)[:, None])


@gluon.jit
def program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Program id -> (token, split, head group, first position, end position).  Head groups vary fastest so
    that the programs that read the same rows run side by side (L2 reuse).  The portable kernels map
    program ids the same way (the split plan is shared); positions past the token's valid count (``vc_ptr``,
    when HAS_VC) are not read."""
    return item_coords(gl.program_id(0), H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC)


@gluon.jit
def item_coords(pid, H, K, vc_ptr, rows_per_split, num_splits, NG: gl.constexpr, HAS_VC: gl.constexpr, n=None):
    """:func:`program_coords` of work item ``pid`` (a persistent program's items are what the programs of the
    one-item-a-program grid would be); ``n``: the item's token's valid rows (:func:`valid_rows`) when loaded
    ahead."""
    g = pid % NG
    ts = pid // NG
    s = ts % num_splits
    t = ts // num_splits
    if n is None:
        n = valid_rows(pid, K, vc_ptr, num_splits, NG, HAS_VC)
    k_begin = s * rows_per_split
    k_end = gl.minimum(k_begin + rows_per_split, n)
    return t, s, g, k_begin, k_end


@gluon.jit
def valid_rows(pid, K, vc_ptr, num_splits, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Work item ``pid``'s token's valid rows (``vc_ptr``'s count within [0, K]; K without counts)."""
    n = K
    if HAS_VC:
        n = gl.minimum(gl.maximum(gl.load(vc_ptr + pid // NG // num_splits), 0), K)
    return n


@gluon.jit
def rcp(x):
    """1 / x for fp32, rounded approximately (``rcp.approx.f32``, within 1 ulp; subnormals kept): one MUFU
    instruction where ``1.0 / x`` is the IEEE division, ~15 instructions a value."""
    return gl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=f,f", [x], gl.float32, True, 1)


@gluon.jit
def lg2(x):
    """log2 x for fp32, approximately (``lg2.approx.f32``, absolute error ~2^-22): one MUFU instruction where
    ``gl.log2`` is libdevice's log2f, ~25 instructions a value."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], gl.float32, True, 1)


@gluon.jit
def normalizer(m, l):
    """From a head's running max ``m`` (log2 units) and sum ``l``: 1 / l and the natural-log lse (approximate
    reciprocal and log2, ~1e-7 relative); 0 and -inf for a head without a valid row (l == 0).  A NaN l (a
    selected row held a NaN) passes through to both, as the cache's non-finite policy says."""
    has = l != 0
    l1 = gl.where(has, l, 1.0)
    inv_l = gl.where(has, rcp(l1), 0.0)
    lse = gl.where(has, (m + lg2(l1)) * 0.6931471805599453, float("-inf"))
    return inv_l, lse


@gluon.jit
def absmax(x):
    """max |x| over a 2-D tensor, as a scalar."""
    return gl.max(gl.max(gl.abs(x), 1), 0)


# --- the merge of split partials inside the kernel (FUSED variants) ---------------------------------------------
# A FUSED launch is cooperative (every program resident at once: the plan gives it at most one program per SM),
# and its split partials live in a buffer whose first 16 bytes are the grid barrier's words, zero when the
# buffer is first used (sparsemla.kernels.attention): [count, generation, -, -] just before the partial outputs.
# Thread 0 of each program: fence its program's partial stores for the GPU (every thread's stores are ordered
# before it by the CTA barrier in front), arrive on the count; the last to arrive resets the count and releases
# the next generation, the others wait for it with acquiring loads (a sense-reversing barrier).  The
# count is back at 0 after every barrier, so the buffer serves the next call as it is.
GRID_BARRIER = gl.constexpr("""{
.reg .pred p, last;
.reg .u32 gen, old, now;
.reg .u64 gen_addr;
mov.u32 $0, 0;
setp.ne.u32 p, $1, 0;
@p bra SMLA_DONE;
add.u64 gen_addr, $2, 4;
ld.relaxed.gpu.global.u32 gen, [gen_addr];
fence.acq_rel.gpu;
atom.acq_rel.gpu.global.add.u32 old, [$2], 1;
add.u32 old, old, 1;
setp.eq.u32 last, old, $3;
@!last bra SMLA_WAIT;
st.relaxed.gpu.global.u32 [$2], 0;
red.release.gpu.global.add.u32 [gen_addr], 1;
bra SMLA_DONE;
SMLA_WAIT:
ld.acquire.gpu.global.u32 now, [gen_addr];
setp.eq.u32 p, now, gen;
@p nanosleep.u32 32;
@p bra SMLA_WAIT;
SMLA_DONE:
}""")
COMBINE_SPLITS = gl.constexpr(8)  # splits merged per step: a [8, 512] fp32 tile, 32 registers a thread
COMBINE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0]))


def fused_meta(fused: bool) -> dict:
    """A kernel's ``meta`` entries for its FUSED constexpr; the FUSED variant is launched cooperatively, which the
    driver refuses rather than start a grid whose programs cannot all be resident (the grid barrier would wait
    for the missing ones forever)."""
    return dict(FUSED=True, launch_cooperative_grid=True) if fused else dict(FUSED=False)


@gluon.jit
def grid_barrier(bar_ptr, num_programs):
    """Every program of the grid waits here until all ``num_programs`` have arrived (the 4-warp partition that
    runs after ``warp_specialize``; see GRID_BARRIER).  ``bar_ptr``: int32 pointer to the barrier's words."""
    tid = gl.arange(0, 128, layout=PER_THREAD)
    addr = gl.full([128], 0, gl.int64, PER_THREAD) + bar_ptr.to(gl.int64, bitcast=True)
    count = gl.full([128], 0, gl.int32, PER_THREAD) + num_programs
    compat.barrier()  # every thread's partial stores before thread 0's fence
    gl.inline_asm_elementwise(GRID_BARRIER, "=r,r,l,r", [tid, addr, count], gl.int32, False, 1)
    compat.barrier()  # no thread reads the partials before thread 0 has seen every program arrive


@gluon.jit
def combine_in_kernel(o_ptr, lse_ptr, fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh, H, num_splits,
                      NG: gl.constexpr):
    """The combine kernel's merge, by the programs of the attention kernel that wrote the partials: after a grid
    barrier, program p merges heads p, p + G, ... (G programs; flat over tokens x heads) of
    ``o_ptr`` fp32 [T, S, H, 512] / ``lse_ptr`` fp32 [T, S, H] (normalized partials, natural-log lse, -inf for an
    empty split) into ``fo_ptr`` (bf16 [T, H, 512], strides ``stride_ft`` / ``stride_fh``) and ``fl_ptr`` (fp32
    [T, H], strides ``stride_gt`` / ``stride_gh``):  out = sum_s exp(lse_s - lse) o_s,  lse = log sum_s exp(lse_s).
    The barrier's words are the 16 bytes before ``o_ptr``."""
    G = gl.num_programs(0)
    grid_barrier(o_ptr.to(gl.pointer_type(gl.int32), bitcast=True) - 4, G)
    T = G // (num_splits * NG)
    L: gl.constexpr = COMBINE_LAYOUT
    sp = gl.arange(0, COMBINE_SPLITS, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, L))
    for item in range(gl.program_id(0), T * H, G):
        t = item // H
        h = item - t * H
        row0 = t.to(gl.int64) * num_splits  # (token, split 0) in the partials
        mx = gl.max(gl.full([COMBINE_SPLITS], float("-inf"), gl.float32, gl.SliceLayout(1, L)), 0)
        for s0 in range(0, num_splits, COMBINE_SPLITS):
            s = s0 + sp
            lp = gl.load(lse_ptr + (row0 + s) * H + h, mask=s < num_splits, other=float("-inf"),
                         cache_modifier=".cg")
            mx = gl.maximum(mx, gl.max(lp, 0))
        mx_safe = gl.where(mx == float("-inf"), 0.0, mx)
        tot = gl.sum(gl.zeros([COMBINE_SPLITS], gl.float32, gl.SliceLayout(1, L)), 0)
        acc = gl.zeros([512], gl.float32, gl.SliceLayout(0, L))
        for s0 in range(0, num_splits, COMBINE_SPLITS):
            s = s0 + sp
            sm = s < num_splits
            lp = gl.load(lse_ptr + (row0 + s) * H + h, mask=sm, other=float("-inf"), cache_modifier=".cg")
            w = gl.exp(lp - mx_safe)  # 0 for an empty split (its partial output is never read)
            tot = tot + gl.sum(w, 0)
            part = gl.load(o_ptr + ((row0 + s) * H + h)[:, None] * 512 + cols[None, :],
                           mask=(sm & (w > 0))[:, None], other=0.0, cache_modifier=".cg")
            acc = acc + gl.sum(part * w[:, None], 0)
        has = tot != 0  # NaN (a split's NaN lse) passes through to out and lse
        inv = gl.where(has, 1.0 / gl.where(has, tot, 1.0), 0.0)
        gl.store(fo_ptr + t.to(gl.int64) * stride_ft + h * stride_fh + cols, (acc * inv).to(fo_ptr.dtype.element_ty))
        lse = gl.where(has, mx_safe + gl.log(gl.where(has, tot, 1.0)), float("-inf"))
        gl.store(fl_ptr + t.to(gl.int64) * stride_gt + h * stride_gh, lse)
