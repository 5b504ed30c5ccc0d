"""Warp-specialized sparse MLA forward for bf16 rows at 64 heads per program (Hopper, Gluon): dispatch.

Why: the Triton wide kernel (``sparse_attention._fwd_wide_kernel``) runs every phase of a tile -- index
load, row gather, QK, softmax, PV -- one after the other in all of its warps, and Triton 3.6 cannot
warp-specialize a pointer-gather loop (kernel-notes.md).  Gluon (``triton.experimental.gluon``) lets the
phases go to different warps by hand: a producer warpgroup gathers rows with ``cp.async`` into shared
memory and signals mbarriers; consumer warpgroups run the wgmma work.  Two schedules:

- ``pair`` (default, ``ws_pair.py``): each consumer warpgroup owns every other 64-row block; the row max
  and P cross between them once per pair of blocks; buffers are refilled by halves;
- ``tile`` (``ws_tile.py``): both consumer warpgroups share each 64-row tile (the first version).

Rows: bf16 ``[rows, 576]`` (512 ``kv_c`` + 64 rope) or NoPE ``[rows, 512]``, 16-byte aligned (every bf16
cache and the prefill workspace).  Other formats and GPUs other than sm_90 use the Triton kernels.  Same
arguments and output contract as ``_fwd_wide_kernel`` (split partials, normalized output, natural-log lse).

Gluon kernels do not run under the Triton interpreter: the CPU tests compile them for sm_90
(``tests/test_ws_attention.py``: no spills, shared memory within the 227 KB limit) and the GPU suite
(``tests/gpu/test_ws_attention_gpu.py``) checks their numbers against the float64 reference.
"""
from __future__ import annotations

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .._runtime import capability as _capability
from .._runtime import num_sms as _sms

_NEG_BIG = gl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (no inf - inf in exp2)


@gluon.jit
def _coords(H, K, vc_ptr, rows_per_split, num_splits, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """Program id -> (token, split, head group, first position, end position).  Head groups vary fastest
    so the programs that read the same rows run side by side (L2 reuse).  The same mapping as
    ``sparse_attention._program_coords`` (the split plan is shared); a Gluon kernel cannot call that
    Triton function (its head offsets are a layout-less ``tl.arange``), hence this scalar copy."""
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
def _rcp(x):
    """1 / x for fp32, rounded approximately (``rcp.approx.f32``, within 1 ulp; subnormals kept): one MUFU
    instruction where ``1.0 / x`` is the IEEE division, ~15 instructions a value."""
    return gl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=f,f", [x], gl.float32, True, 1)


@gluon.jit
def _lg2(x):
    """log2 x for fp32, approximately (``lg2.approx.f32``, absolute error ~2^-22): one MUFU instruction where
    ``gl.log2`` is libdevice's log2f, ~25 instructions a value."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], gl.float32, True, 1)


@gluon.jit
def _normalizer(m, l):
    """From a head's running max ``m`` (log2 units) and sum ``l``: 1 / l and the natural-log lse (approximate
    reciprocal and log2, ~1e-7 relative); 0 and -inf for a head without a valid row (l == 0).  Used by ws_few
    and ws_tile; ws_wide and ws_pair write the IEEE forms out (see the comment in ws_wide's epilogue)."""
    has = l > 0
    l1 = gl.where(has, l, 1.0)
    inv_l = gl.where(has, _rcp(l1), 0.0)
    lse = gl.where(has, (m + _lg2(l1)) * 0.6931471805599453, float("-inf"))
    return inv_l, lse


def supported(q: torch.Tensor, kv: torch.Tensor, kind: str, num_heads: int) -> bool:
    """Whether the warp-specialized kernel can take this call: bf16 rows, > 32 heads, an sm_90 GPU, and
    16-byte aligned q rows and cache."""
    if kind != "bf16" or num_heads <= 32 or q.device.type != "cuda":
        return False
    if _capability(q.device) != (9, 0):
        return False
    return (q.data_ptr() % 16 == 0 and kv.data_ptr() % 16 == 0 and (q.stride(0) * 2) % 16 == 0
            and (q.stride(1) * 2) % 16 == 0)


# kinds the few-heads kernel (ws_few.py) reads (16 heads per program), and the most heads it always takes
FEW_KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")
FEW_MAX_HEADS = 32
# Above FEW_MAX_HEADS it runs ceil(H / 16) programs per token, each reading the token's rows (from L2 after the
# first).  It takes such a call while tokens x ceil(H / 16) programs fit in FEW_WAVES[kind] waves of one program
# per SM; fp8 / fp8_ds_mla then go to ws_wide (64 heads per program, each row converted once for all of them),
# nvfp4 (no wide warp-specialized kernel) to the Triton wide kernel.  H200, tenth session (tools/exp/s10_small.py,
# CUDA-graph replay): at 64-128 heads and 1-16 tokens ws_few took 16-66 us where the Triton wide kernel took
# 19-79 and ws_wide 35-69; with two waves (b 32 x 128 heads) ws_wide led (fp8_ds_mla 104 vs 127 us); nvfp4's
# ws_few still led the Triton kernel at four waves (b 64 x 128 heads: 256 vs 263 us, b 64 x 64: 133 vs 145).
FEW_WAVES = {"fp8": 1, "fp8_ds_mla": 1, "nvfp4_ds_mla": 4}
# kinds the wide quantized kernel (ws_wide.py) reads at more than FEW_MAX_HEADS heads, 64 heads per program
WIDE_Q_KINDS = ("fp8", "fp8_ds_mla")

def few_planned(kind: str, num_tokens: int, num_heads: int, num_sms: int = 132) -> bool:
    """Whether a call of this kind and size goes to the few-heads kernel (see FEW_WAVES)."""
    if kind not in FEW_KINDS:
        return False
    return num_heads <= FEW_MAX_HEADS or num_tokens * -(-num_heads // 16) <= FEW_WAVES[kind] * num_sms


def wide_q_planned(kind: str, num_tokens: int, num_heads: int, num_sms: int = 132) -> bool:
    """Whether a call of this kind and size goes to the wide kernel for quantized rows: fp8 / fp8_ds_mla above
    FEW_MAX_HEADS heads when the few-heads kernel does not take it."""
    return (kind in WIDE_Q_KINDS and num_heads > FEW_MAX_HEADS
            and not few_planned(kind, num_tokens, num_heads, num_sms))


def _quantized_ok(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """An sm_90 GPU, bf16 q, a 16-byte aligned cache (the warp-specialized kernels for quantized rows)."""
    if q.device.type != "cuda" or q.dtype != torch.bfloat16:
        return False
    return _capability(q.device) == (9, 0) and kv.data_ptr() % 16 == 0


def few_supported(q: torch.Tensor, kv: torch.Tensor, kind: str, num_heads: int) -> bool:
    """Whether the warp-specialized few-heads kernel takes this call: fp8 / fp8_ds_mla / nvfp4_ds_mla rows (rope
    or NoPE), ``few_planned`` for q's tokens and heads, an sm_90 GPU, a 16-byte aligned cache, bf16 q."""
    return few_planned(kind, q.shape[0], num_heads, _sms(q.device)) and _quantized_ok(q, kv)


def wide_q_supported(q: torch.Tensor, kv: torch.Tensor, kind: str, num_heads: int) -> bool:
    """Whether the warp-specialized wide kernel for quantized rows takes this call: ``wide_q_planned`` for q's
    tokens and heads, an sm_90 GPU, a 16-byte aligned cache, bf16 q."""
    return wide_q_planned(kind, q.shape[0], num_heads, _sms(q.device)) and _quantized_ok(q, kv)


def launch_wide_q(grid, args, bytes_per_token: int, kind: str, rope: int, num_groups: int, has_vc: bool,
                  fp8_arith: bool = False):
    """Launch ``ws_wide_kernel`` with ``_fwd_fp8_kernel``'s positional arguments (k_scale included); 12 warps
    as ``launch_few``.  ``fp8_arith``: the FP8-arithmetic variant."""
    from .ws_wide import ws_wide_kernel
    ws_wide_kernel[grid](*args, BPT=bytes_per_token, DS=kind == "fp8_ds_mla", ROPE=rope, NG=num_groups,
                         HAS_VC=has_vc, F8=bool(fp8_arith), num_warps=4, maxnreg=168)


def launch_few(grid, args, bytes_per_token: int, kind: str, rope: int, num_groups: int, has_vc: bool,
               fp8_arith: bool = False):
    """Launch ``ws_few_kernel`` with ``_fwd_fp8_kernel``'s positional arguments (k_scale included).  12 warps
    (two consumer warpgroups, one producer); 12 x 32 x 168 registers at launch, then setmaxnreg.
    ``fp8_arith``: the FP8-arithmetic variant (fp8 / fp8_ds_mla rows)."""
    from .ws_few import ws_few_kernel
    ws_few_kernel[grid](*args, BPT=bytes_per_token, DS=kind == "fp8_ds_mla", FP4=kind == "nvfp4_ds_mla", ROPE=rope,
                        NG=num_groups, HAS_VC=has_vc, F8=bool(fp8_arith), num_warps=4, maxnreg=168)


# Schedules by name; "tile-nogather" is a benchmark-only probe (the tile schedule without its row gathers:
# wrong results, it measures the consumers alone).
CONFIGS = ("pair", "tile")
PROBES = ("tile-nogather",)
DEFAULT = "pair"


def launch(grid, args, bytes_per_token: int, rope: int, num_groups: int, has_vc: bool, config: str = None):
    """Launch a warp-specialized kernel with ``_fwd_wide_kernel``'s positional arguments (without k_scale).

    Both kernels start 12 warps (8 consumer + 4 producer); 12 x 32 x 168 registers fill the register file
    and the partitions then re-balance with setmaxnreg (producer 40-56, consumers 224-240)."""
    config = config or DEFAULT
    meta = dict(BPT=bytes_per_token, ROPE=rope, NG=num_groups, HAS_VC=has_vc, maxnreg=168)
    if config == "pair":
        from .ws_pair import ws_pair_kernel
        ws_pair_kernel[grid](*args, num_warps=4, **meta)  # the default partition is warpgroup 0
    elif config in ("tile", "tile-nogather"):
        from .ws_tile import ws_tile_kernel
        ws_tile_kernel[grid](*args, GATHER=config == "tile", num_warps=8, **meta)
    else:
        raise ValueError(f"config: expected one of {CONFIGS + PROBES}, got {config!r}")
