"""The kernel plan: which kernel serves a sparse MLA attention call, and how it is tiled.

:func:`plan_attention` is the only place that decides.  It is a pure, cached function of (row kind, query tokens,
heads, top-k, device capability and SM count, options) and returns a :class:`KernelPlan`; the launcher
(:mod:`sparsemla.kernels.attention`) executes plans and holds no policy.  ``docs/design/dispatch.md`` has the
table in prose; ``tests/test_plan.py`` pins it.

Kernels (:data:`KERNELS`):

=================  ==========================================  ============================================
kernel             rows                                        takes a call when
=================  ==========================================  ============================================
``sm90-few``       fp8, fp8_ds_mla, nvfp4_ds_mla (rope, NoPE)  sm_90, H <= 32, or a batch small enough that
                                                               tokens x ceil(H / 16) programs fit in
                                                               ``FEW_WAVES[kind]`` waves of one per SM
``sm90-conv``      fp8, fp8_ds_mla, nvfp4_ds_mla (rope, NoPE)  sm_90, H > 32 otherwise (64 heads a program, a
                   and bf16 (H <= 128)                         converting producer warpgroup, 16-byte aligned q;
                                                               not in the FP8-QK mode)
``sm90-cluster``   fp8, fp8_ds_mla, nvfp4_ds_mla (rope, NoPE)  only when asked for (``kernel="sm90-cluster"``):
                                                               sm_90, 65-128 heads, Triton >= 3.8; sm90-conv as
                                                               a cluster of two CTAs, 64 heads each, each
                                                               converting half of every block's rows for both
``sm90-wide``      fp8, fp8_ds_mla                             sm_90, H > 32 in the FP8-QK mode or with q rows
                                                               not 16-byte aligned (64 heads a program)
``sm90-bf16``      bf16 (cache or prefill workspace)           sm_90, H > 128 (64 heads a program); sm90-conv
                                                               takes H <= 128
``portable-wide``  every kind                                  H >= ``WIDE_MIN_HEADS[kind]`` (33; nvfp4 17)
``portable-fp8``   fp8, staged fp8, fp8_ds_mla                 fewer heads (16-32 heads a program)
``portable-nvfp4`` nvfp4_ds_mla                                fewer heads
``portable-bf16``  bf16                                        fewer heads
=================  ==========================================  ============================================

The sm_90 kernels are Gluon kernels (warp-specialized: a producer warpgroup gathers rows, two consumer warpgroups
run wgmma).  They need compute capability 9.0 exactly, a compiled (not interpreted) Triton, a 16-byte aligned
cache (and, for ``sm90-bf16``, 16-byte aligned q rows), and a build that succeeded on the installed Triton:
kernels that failed to build are passed in ``unavailable`` and the portable kernels serve those calls.

Splits (split-KV): a small batch does not fill the GPU, so each query's top-k list is cut into splits whose
normalized partial outputs are merged by the combine kernel -- or, with ``fused_combine``, by the attention
kernel's own programs after a grid barrier (:data:`FUSED_KERNELS`; one launch instead of two, which is most of a
small call's host time).  The warp-specialized kernels hold a whole SM
(190-220 KB of shared memory): at most one program per SM, each split at least two 64-row blocks (one per
consumer warpgroup).  The portable kernels hold ~200 registers a thread, so two 4-warp programs fit on an SM:
aim for two programs per SM; each split keeps at least two tiles (up to 32 splits), or with one or two
programs of work a single 32-row tile (up to 64 splits).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple

from . import host_entry
from .formats import KVFormat, get_format

KERNELS = ("sm90-few", "sm90-conv", "sm90-cluster", "sm90-wide", "sm90-bf16", "portable-wide", "portable-fp8",
           "portable-nvfp4", "portable-bf16")
SM90_KERNELS = ("sm90-few", "sm90-conv", "sm90-cluster", "sm90-wide", "sm90-bf16")
CONV_KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16")  # sm90-conv: rows it stages as 16-bit tiles
# Kinds the plan gives sm90-conv by itself (ahead of sm90-wide, but not in the FP8-QK mode, which it does not
# have).  H200, b 128, 64 / 128 heads, one process (decode.py --conv, Triton 3.6): plain fp8 105.9 / 198.9 us against
# sm90-wide's 117.1 / 209.1, NoPE 92.8 / 178.3 against 109.5 / 195.5; forced, per release (other processes): 108.5 /
# 204.7 against 119.2 / 220.4 on 3.8, 111.9 / 207.2 against 128.1 / 232.1 on 3.9.
CONV_AUTO_KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")
# sm90-cluster (sm90-conv's 2-CTA kernel): its rows, its head counts (two CTAs of 64 heads; above 64, where a
# token's rows would otherwise be converted by two programs), the Triton release that builds it.  Measured slower
# than sm90-conv (docs/design/kernels.md): the plan takes it only when asked for.
CLUSTER_KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")
CLUSTER_HEADS = (65, 128)
CLUSTER_MIN_TRITON = (3, 8)
# Kernels the plan takes only when asked for (``kernel=``), never by itself.
FORCED_ONLY = ("sm90-cluster",)
# Kernels the plan takes by itself, within the API's 128 heads, only where a kernel ahead of them did not build
# (``unavailable``): sm90-bf16 behind sm90-conv for bf16 rows at 33-128 heads (its own calls: above 128 heads).
BACKUP_ONLY = ("sm90-bf16",)
# bf16 rows: sm90-conv (a producer keeping two whole 64-row blocks in flight, gathering 128-byte row segments,
# warpgroup 0 freeing a tile when its PV is done) at 33-128 heads, decode and prefill; sm90-bf16 (both warpgroups on
# QK, a pair of blocks at a time) above.  H100, one process: decode b 128, D-h64 123 us against 149, D-h128 169
# against 240 (FlashInfer 122 / 159); prefill (4,096 tokens, benchmarks/prefill.py --kernel sm90-conv) P-32k 4,175
# us against 4,579, P-h64 2,146 against 2,335 (FlashMLA 3,738 / 1,964).  With sm90-bf16's defaults since (128-byte
# gather, tile output, per-thread releases) the two run prefill within 3 % of each other, either ahead (H100, two
# rounds: P-32k 4,125-4,328 against 4,234-4,256, P-h64 2,153-2,229 against 2,160-2,207): sm90-conv stays.
CONV_BF16_MAX_HEADS = 128

# Kernels with a FUSED variant: the split partials merged by the kernel's own programs after a grid barrier, in a
# cooperative launch (every program resident at once: the plan fuses only a grid of at most one program per SM).
# sm90-wide has none (the merge made its consumer spill more), the 2-CTA kernel neither.
FUSED_KERNELS = ("sm90-few", "sm90-conv", "sm90-bf16")
# The name under which a FUSED variant that did not build is recorded among the unavailable kernels: its kernel
# keeps serving, with the combine kernel.
FUSED_COMBINE = "fused-combine"
# Whether a split plan merges in the kernel by default (``fused_combine=None``).  Off: it saves one launch of host
# time a call (H100, b 1: 16.3 against 22.6 us) but costs GPU time (graph replay 19.4 against 16.4 us;
# docs/design/dispatch.md); ``fused_combine=True`` asks for it.
FUSED_COMBINE_DEFAULT = False

# sm90-conv's persistent grid (``conv.meta(persist=True)``): row kinds that take it where a call has more work items
# (tokens x splits x head groups) than SMs.  bf16 rows (prefill, and bf16 decode at 128 heads): each program's next
# item starts while its last one ends.  The quantized kinds keep one item a program: their producer is busy to the
# end of an item, and its loop needs 8 more registers there (docs/design/kernels.md has the A/B).
PERSISTENT_KINDS = ("bf16",)

# Row kinds: a format's name, or "staged" (FP8 rows gathered per query, [T, K, D]).
ROW_KINDS = ("bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "staged")

# --- sm90-few / sm90-wide: which rows, and how many waves a small batch may take on the few-heads kernel ----
FEW_KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")
FEW_MAX_HEADS = 32  # the few-heads kernel always takes up to this many heads
# Above FEW_MAX_HEADS the few-heads kernel runs ceil(H / 16) programs per token, each reading the token's rows
# (from L2 after the first); it keeps a call while those programs fit in this many waves of one program per SM.
# Beyond that the 64-head kernels (sm90-wide, sm90-conv) read each row once per 64 heads.
# fp8_ds_mla and nvfp4 rows: half a wave (H200, 128 heads, graph replay: b 4 on sm90-few 29-30 us against
# 30-32 on sm90-conv; b 16 on sm90-few 66-69 us against 50-53 on sm90-conv).
FEW_WAVES = {"fp8": 1, "fp8_ds_mla": 0.5, "nvfp4_ds_mla": 0.5}
WIDE_KINDS = ("fp8", "fp8_ds_mla")
FP8_QK_KINDS = ("fp8", "fp8_ds_mla")  # e4m3 rows: the QK MMAs take their bytes as they are

# --- portable kernels: (BLOCK_N, num_warps, num_stages) of the few-heads kernels; the wide kernel ---------------
PORTABLE_TILING = {"bf16": (64, 4, 3), "fp8": (32, 4, 3), "staged": (32, 4, 3), "fp8_ds_mla": (32, 4, 3),
                   "nvfp4_ds_mla": (32, 4, 3)}
WIDE_TILING = (64, 8)  # BLOCK_N, num_warps (64 heads per program)
# Three stages prefetch the indices two tiles ahead; fp8_ds_mla's larger tile keeps two.
WIDE_STAGES = {"bf16": 3, "nvfp4_ds_mla": 3}
# Fewest heads that take the wide kernel: nvfp4's few-heads kernel at 32 heads costs more than the wide kernel
# at 64 (the same work as at 17-64 heads).
WIDE_MIN_HEADS = {"nvfp4_ds_mla": 17}
INTERPRETER_BLOCK_N = 16  # small tiles keep the CPU interpreter fast

_FAMILY = {"bf16": "portable-bf16", "fp8": "portable-fp8", "staged": "portable-fp8", "fp8_ds_mla": "portable-fp8",
           "nvfp4_ds_mla": "portable-nvfp4"}


@dataclass(frozen=True)
class KernelPlan:
    """How one attention call runs.

    kernel: one of :data:`KERNELS`; kind: the row kind (a format name, or ``"staged"``).
    heads_per_program, num_groups: heads each program takes and head groups per token (``ceil(H / hpp)``).
    block_n, num_warps, num_stages: the portable kernels' tiling (the sm_90 kernels use 64-row blocks and their
        own fixed warp layout).
    num_splits, rows_per_split: split-KV factor and the top-k positions of one split (a multiple of block_n).
    fp8_qk: the FP8-QK mode (QK on e4m3 tensor cores; ``sm90-few`` / ``sm90-wide`` over e4m3 rows).
    why: one sentence saying why this kernel takes the call.
    fused_combine: the splits are merged by the kernel's own programs (one launch), not the combine kernel.
    persistent: at most one program per SM, each serving work items (token, split, head group) in turn
        (``sm90-conv``, :data:`PERSISTENT_KINDS`, more items than SMs).
    variant: options of the kernel's build that the plan never chooses, as sorted ``(name, value)`` pairs of
        ``conv.meta`` keywords (``sm90-conv`` only; ``dataclasses.replace`` a plan to time a variant beside the
        default, e.g. ``benchmarks/decode.py --conv-variant idx_ahead=1``); empty for every plan the library makes.
    """

    kernel: str
    kind: str
    heads_per_program: int
    num_groups: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    rows_per_split: int
    fp8_qk: bool
    why: str
    fused_combine: bool = False
    persistent: bool = False
    variant: tuple = ()

    @property
    def grid(self) -> int:
        """Programs per query token (the launch grid is ``tokens * grid``)."""
        return self.num_splits * self.num_groups


def row_kind(fmt, staged: bool = False) -> str:
    """The row kind of a format (``"staged"`` for FP8 rows staged per query, or given as ``fmt="staged"``)."""
    return "staged" if staged or fmt == "staged" else get_format(fmt).name


def head_block(num_heads: int) -> int:
    """Heads per program of the portable few-heads kernels: the next power of two >= H, at least 16 (the smallest
    tensor-core M), at most 64."""
    hb = 16
    while hb < num_heads and hb < 64:
        hb *= 2
    return hb


def few_planned(kind: str, num_tokens: int, num_heads: int, num_sms: int) -> bool:
    """Whether ``sm90-few`` takes a call of this kind and size (device conditions aside)."""
    if kind not in FEW_KINDS:
        return False
    return num_heads <= FEW_MAX_HEADS or num_tokens * -(-num_heads // 16) <= FEW_WAVES[kind] * num_sms


def _sm90_why_not(kernel: str, kind: str, num_tokens: int, num_heads: int, num_sms: int, capability, interpret: bool,
                  portable: bool, q_aligned: bool, kv_aligned: bool, unavailable: FrozenSet[str]) -> Optional[str]:
    if portable:
        return "the portable Triton kernels were asked for (backend triton-portable)"
    if interpret:
        return "Gluon kernels do not run under the Triton interpreter"
    if tuple(capability) != (9, 0):
        return f"it is built for sm_90 (Hopper), this device is sm_{capability[0]}{capability[1]}"
    if kernel in unavailable:
        return f"it did not build on the installed Triton ({unavailable_reason(kernel)})"
    if not kv_aligned:
        return "it needs a 16-byte aligned cache"
    if kernel == "sm90-few":
        if kind not in FEW_KINDS:
            return f"it reads {', '.join(FEW_KINDS)} rows, not {kind}"
        if not few_planned(kind, num_tokens, num_heads, num_sms):
            return (f"{num_heads} heads x {num_tokens} tokens need more than {FEW_WAVES[kind]} wave(s) of 16-head "
                    f"programs")
        return None
    if kernel == "sm90-conv":
        if kind not in CONV_KINDS:
            return f"it reads {', '.join(CONV_KINDS)} rows, not {kind}"
        if num_heads <= FEW_MAX_HEADS:
            return f"it serves more than {FEW_MAX_HEADS} heads"
        if not q_aligned:
            return "it needs 16-byte aligned q rows"
        return None
    if kernel == "sm90-cluster":
        if kind not in CLUSTER_KINDS:
            return f"it reads {', '.join(CLUSTER_KINDS)} rows, not {kind}"
        if not CLUSTER_HEADS[0] <= num_heads <= CLUSTER_HEADS[1]:
            return f"it serves {CLUSTER_HEADS[0]}-{CLUSTER_HEADS[1]} heads (two CTAs of 64)"
        if not q_aligned:
            return "it needs 16-byte aligned q rows"
        if not cluster_builds():
            return "its Gluon build (st.async into another CTA's shared memory) needs Triton >= 3.8"
        return None
    if kernel == "sm90-wide":
        if kind not in WIDE_KINDS:
            return f"it reads {', '.join(WIDE_KINDS)} rows, not {kind}"
        if num_heads <= FEW_MAX_HEADS:
            return f"it serves more than {FEW_MAX_HEADS} heads"
        return None
    # sm90-bf16
    if kind != "bf16":
        return f"it reads bf16 rows, not {kind}"
    if num_heads <= FEW_MAX_HEADS:
        return f"it serves more than {FEW_MAX_HEADS} heads"
    if not q_aligned:
        return "it needs 16-byte aligned q rows"
    return None


def _portable_why_not(kernel: str, kind: str, num_heads: int) -> Optional[str]:
    wide = num_heads >= WIDE_MIN_HEADS.get(kind, FEW_MAX_HEADS + 1)
    if kernel == "portable-wide":
        return None if wide else f"it serves {WIDE_MIN_HEADS.get(kind, FEW_MAX_HEADS + 1)} heads or more"
    if _FAMILY[kind] != kernel:
        return f"it does not read {kind} rows"
    if wide:
        return f"{num_heads} heads go to the wide kernel"
    return None


def _why_not(kernel, kind, num_tokens, num_heads, num_sms, capability, interpret, portable, q_aligned, kv_aligned,
             unavailable):
    if kernel in SM90_KERNELS:
        return _sm90_why_not(kernel, kind, num_tokens, num_heads, num_sms, capability, interpret, portable,
                             q_aligned, kv_aligned, unavailable)
    return _portable_why_not(kernel, kind, num_heads)


def _auto_why_not(kernel: str, kind: str, num_tokens: int, num_heads: int, num_sms: int,
                  fp8_qk: bool) -> Optional[str]:
    """Why the plan does not choose ``kernel`` by itself for a call it can serve (None: it may).  sm90-conv:
    :data:`CONV_AUTO_KINDS`, and bf16 rows within :data:`CONV_BF16_MAX_HEADS` heads;
    never in the FP8-QK mode."""
    if kernel in FORCED_ONLY:
        return f"it is measured slower than sm90-conv (docs/design/kernels.md); kernel={kernel!r} forces it"
    if kernel != "sm90-conv":
        return None
    if fp8_qk:
        return "it has no FP8-QK variant"
    if kind in CONV_AUTO_KINDS:
        return None
    if kind == "bf16":
        if num_heads <= CONV_BF16_MAX_HEADS:
            return None
        return f"it takes bf16 rows by itself only up to {CONV_BF16_MAX_HEADS} heads; kernel='sm90-conv' forces it"
    return f"it serves {kind} rows only when asked for (kernel={kernel!r})"


def _splits(kernel: str, num_tokens: int, num_heads: int, topk: int, hpp: int, block_n: int, num_sms: int) -> int:
    programs = max(1, num_tokens * -(-num_heads // hpp))
    if kernel in ("sm90-few", "sm90-wide", "sm90-conv", "sm90-cluster"):
        sms = num_sms // 2 if kernel == "sm90-cluster" else num_sms  # an sm90-cluster program holds two SMs
        return max(1, min(sms // programs, max(1, topk // 128), 64))
    want = max(1, (2 * num_sms) // programs)
    if programs <= 2:
        return max(1, min(want, topk // 32, 64))
    return max(1, min(want, max(1, topk // (2 * block_n)), 32))


@functools.lru_cache(maxsize=8192)
def _plan(kind, num_tokens, num_heads, topk, capability, num_sms, fp8_qk, portable, interpret, q_aligned,
          kv_aligned, kernel, tiling, unavailable, num_splits, fused_combine=None) -> KernelPlan:
    args = (kind, num_tokens, num_heads, num_sms, capability, interpret, portable, q_aligned, kv_aligned, unavailable)
    if kernel is not None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
        reason = _why_not(kernel, *args)
        if reason is not None:
            raise ValueError(f"kernel: {kernel} cannot serve {num_heads} heads of {kind} rows: {reason}")
        chosen, why = kernel, "asked for"
    else:
        chosen = why = None
        for name in KERNELS:
            if _auto_why_not(name, kind, num_tokens, num_heads, num_sms, fp8_qk) is None and _why_not(name, *args) is None:
                chosen = name
                break
        why = _WHY[chosen]
    if fp8_qk:
        if kind not in FP8_QK_KINDS:
            raise ValueError(f"fp8_qk: the FP8-QK mode reads only {' or '.join(FP8_QK_KINDS)} rows, not {kind}")
        if chosen not in ("sm90-few", "sm90-wide"):
            reason = (_sm90_why_not("sm90-few", kind, num_tokens, num_heads, num_sms, capability, interpret,
                                    portable, q_aligned, kv_aligned, unavailable)
                      or f"{chosen} has no FP8-QK variant")
            raise ValueError(f"fp8_qk: the FP8-QK mode runs on the sm_90 kernels, which cannot serve this call: "
                             f"{reason}")
    if chosen in SM90_KERNELS:
        hpp = 16 if chosen == "sm90-few" else 128 if chosen == "sm90-cluster" else 64
        block_n, warps, stages = 64, 4, 1
    elif chosen == "portable-wide":
        hpp = 64
        block_n, warps = WIDE_TILING
        stages = WIDE_STAGES.get(kind, 2)
    else:
        hpp = head_block(num_heads)
        block_n, warps, stages = PORTABLE_TILING[kind]
    if tiling is not None:
        if chosen in SM90_KERNELS:
            raise ValueError(f"tiling: {chosen} has a fixed tiling (64-row blocks, 12 warps)")
        block_n, warps, stages = tiling
    elif interpret:
        block_n = INTERPRETER_BLOCK_N
    splits = _splits(chosen, num_tokens, num_heads, topk, hpp, block_n, num_sms) if num_splits is None else num_splits
    splits = max(1, min(splits, -(-topk // block_n)))
    rows_per_split = -(-(-(-topk // splits)) // block_n) * block_n
    splits = max(1, -(-topk // rows_per_split))
    groups = -(-num_heads // hpp)
    want = FUSED_COMBINE_DEFAULT if fused_combine is None else fused_combine
    fused = bool(want and chosen in FUSED_KERNELS and FUSED_COMBINE not in unavailable and splits > 1
                 and num_tokens * groups * splits <= num_sms)
    persistent = (chosen == "sm90-conv" and kind in PERSISTENT_KINDS and not fused
                  and num_tokens * groups * splits > num_sms)
    return KernelPlan(chosen, kind, hpp, groups, block_n, warps, stages, splits, rows_per_split, bool(fp8_qk), why,
                      fused, persistent)


_WHY = {
    "sm90-few": "e4m3 / e2m1 rows on Hopper at few heads per call: rows as the wgmma's M, 16 heads a program",
    "sm90-wide": "e4m3 rows on Hopper above 32 heads: 64 heads a program, each row converted once for all of them",
    "sm90-bf16": ("bf16 rows on Hopper above 128 heads (and where sm90-conv did not build): 64 heads a program, rows "
                  "gathered by a producer warpgroup"),
    "portable-wide": "many heads off Hopper's Gluon kernels: 64 heads a program, each tile converted once to bf16",
    "portable-fp8": "few heads: e4m3 rows converted on the operand registers (mma.sync)",
    "portable-nvfp4": "few heads: e2m1 rows converted on the operand registers (mma.sync)",
    "portable-bf16": "few heads: bf16 rows straight from memory (mma.sync)",
    "sm90-cluster": ("e4m3 / fp8_ds_mla / e2m1 rows on Hopper at 65-128 heads, asked for: sm90-conv as a cluster of "
                     "two CTAs (64 heads each) whose producers each convert half of every block's rows into both "
                     "CTAs' tiles"),
    "sm90-conv": ("e4m3 / fp8_ds_mla / e2m1 rows on Hopper above 32 heads (bf16 rows at 33-128 heads): a producer "
                  "warpgroup converts (or copies) each row once into a 16-bit tile, the MMA warpgroups run on it (64 "
                  "heads a program)"),
}


def plan_attention(fmt, num_tokens: int, num_heads: int, topk: int, *, capability: Tuple[int, int] = (9, 0),
                   num_sms: int = 132, fp8_qk: bool = False, portable: bool = False, interpret: bool = False,
                   q_aligned: bool = True, kv_aligned: bool = True, staged: bool = False,
                   kernel: Optional[str] = None, tiling: Optional[Tuple[int, int, int]] = None,
                   unavailable: FrozenSet[str] = frozenset(), num_splits: Optional[int] = None,
                   fused_combine: Optional[bool] = None) -> KernelPlan:
    """The plan of one attention call (cached; pure).

    Args:
        fmt: the rows' :class:`~sparsemla.formats.KVFormat` or format id (a bf16 workspace is ``bf16``).
        num_tokens, num_heads, topk: query tokens T, heads H, width K of the index rows.
        capability, num_sms: the device (``(0, 0)`` and any SM count for the CPU interpreter).
        fp8_qk: the FP8-QK mode (ValueError with the reason where it cannot apply).
        portable: the portable Triton kernels only (backend ``triton-portable``).
        interpret: Triton runs in its CPU interpreter.
        q_aligned, kv_aligned: q rows / the cache are 16-byte aligned (the sm_90 kernels need it).
        staged: the rows are FP8 rows staged per query (``[T, K, D]``), not cache rows.
        kernel: force a kernel (tests, benchmarks); ValueError with the reason when it cannot serve the call.
        tiling: ``(block_n, num_warps, num_stages)`` of a portable kernel (tuning).
        unavailable: kernels that did not build on the installed Triton.
        num_splits: force a split-KV factor (tests, benchmarks); it is capped at one block per split.
        fused_combine: merge the splits in the kernel (True: wherever a kernel of :data:`FUSED_KERNELS` splits
            within one program per SM; False: never; None: :data:`FUSED_COMBINE_DEFAULT`).
    """
    kind = row_kind(fmt, staged)
    return _plan(kind, int(num_tokens), int(num_heads), int(topk), tuple(capability), int(num_sms), bool(fp8_qk),
                 bool(portable), bool(interpret), bool(q_aligned), bool(kv_aligned), kernel,
                 None if tiling is None else tuple(int(v) for v in tiling), frozenset(unavailable),
                 None if num_splits is None else max(1, int(num_splits)),
                 None if fused_combine is None else bool(fused_combine))


def explain(fmt, num_tokens: int, num_heads: int, topk: int, *, mode: str = "decode", **options) -> str:
    """A few lines saying which kernel a call gets, its tiling and splits, and why every other kernel does not
    take it (the options of :func:`plan_attention`; decode and prefill calls are planned alike)."""
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode: expected 'decode' or 'prefill', got {mode!r}")
    plan = plan_attention(fmt, num_tokens, num_heads, topk, **options)
    kind = plan.kind
    lines = [f"{kind} rows, T={num_tokens}, H={num_heads}, top-k={topk}: {plan.kernel} ({plan.why})",
             f"  {plan.heads_per_program} heads a program, {plan.num_groups} head group(s), "
             f"block {plan.block_n}, {plan.num_splits} split(s) of {plan.rows_per_split} positions"
             + (", FP8-QK" if plan.fp8_qk else "")]
    if plan.persistent:
        lines.append(f"  persistent: {min(num_tokens * plan.grid, int(options.get('num_sms', 132)))} programs serve the "
                     f"{num_tokens * plan.grid} work items in turn")
    if plan.num_splits > 1:
        lines.append("  splits merged " + ("in the kernel after a grid barrier (one launch)" if plan.fused_combine
                                           else "by the combine kernel (a second launch)"))
        if FUSED_COMBINE in options.get("unavailable", ()):
            lines.append(f"  (the in-kernel merge did not build: {unavailable_reason(FUSED_COMBINE)})")
    o = dict(capability=(9, 0), num_sms=132, interpret=False, portable=False, q_aligned=True, kv_aligned=True,
             unavailable=frozenset())
    o.update({k: v for k, v in options.items() if k in o})
    for name in KERNELS:
        if name == plan.kernel:
            continue
        reason = _why_not(name, kind, num_tokens, num_heads, o["num_sms"], tuple(o["capability"]), o["interpret"],
                          o["portable"], o["q_aligned"], o["kv_aligned"], frozenset(o["unavailable"]))
        if reason is None:
            reason = _auto_why_not(name, kind, num_tokens, num_heads, o["num_sms"], plan.fp8_qk)
        lines.append(f"  not {name}: {reason or 'a kernel earlier in the order takes it'}")
    return "\n".join(lines)


# --- kernels that failed to build on the installed Triton --------------------------------------------------------
_UNAVAILABLE: dict = {}
_UNAVAILABLE_SET: FrozenSet[str] = frozenset()


def mark_unavailable(kernel: str, reason: str) -> None:
    """Record that a kernel cannot be built here (the launcher calls this on a build failure); later plans skip it."""
    global _UNAVAILABLE_SET
    _UNAVAILABLE[kernel] = reason
    _UNAVAILABLE_SET = frozenset(_UNAVAILABLE)
    host_entry.clear()  # recorded calls may launch it


def clear_unavailable() -> None:
    """Forget recorded build failures (tests)."""
    global _UNAVAILABLE_SET
    _UNAVAILABLE.clear()
    _UNAVAILABLE_SET = frozenset()
    host_entry.clear()


def unavailable_kernels() -> dict:
    """Kernels that failed to build in this process, mapped to the reason."""
    return dict(_UNAVAILABLE)


def unavailable_reason(kernel: str) -> str:
    return _UNAVAILABLE.get(kernel, "unknown")


def unavailable_set() -> FrozenSet[str]:
    return _UNAVAILABLE_SET


def split_buffer_shapes(num_tokens: int, num_heads: int, num_splits: int):
    """Shapes of the fp32 split partials: (o_part [T, S, H, 512], lse_part [T, S, H])."""
    return (num_tokens, num_splits, num_heads, 512), (num_tokens, num_splits, num_heads)


@functools.lru_cache(maxsize=1)
def triton_release() -> Tuple[int, int]:
    """(major, minor) of the installed Triton ((0, 0) when it cannot be read)."""
    try:
        import triton
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except Exception:
        return (0, 0)


def cluster_builds() -> bool:
    """Whether the installed Triton builds sm90-cluster (:data:`CLUSTER_MIN_TRITON`: Gluon's st.async into another
    CTA's shared memory)."""
    return triton_release() >= CLUSTER_MIN_TRITON
