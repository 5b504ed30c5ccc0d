"""What every sm_90 kernel shares: the program's coordinates, fast fp32 reciprocal / log2, the softmax
normalizer, ``NEG_BIG``.

Output contract of every kernel here (the portable kernels' contract): with one split, ``o`` is the
normalized output ``[tokens, heads, 512]`` and ``lse`` the natural-log log-sum-exp ``[tokens, heads]``
(0 and -inf for a token without a valid row); with several, each split writes its normalized partial
output and lse (strides ``stride_os`` / ``stride_ls``) and the combine kernel merges them.
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


@gluon.jit
def program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Program id -> (token, split, head group, first position, end position).  Head groups vary fastest so
    that the programs that read the same rows run side by side (L2 reuse).  The portable kernels map
    program ids the same way (the split plan is shared); positions past the token's valid count (``vc_ptr``,
    when HAS_VC) are not read."""
    pid = gl.program_id(0)
    g = pid % NG
    ts = pid // NG
    s = ts % num_splits
    t = ts // num_splits
    n = K
    if HAS_VC:
        n = gl.minimum(gl.maximum(gl.load(vc_ptr + t), 0), K)
    k_begin = s * rows_per_split
    k_end = gl.minimum(k_begin + rows_per_split, n)
    return t, s, g, k_begin, k_end


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
