"""Cache write: quantize ``N`` tokens and scatter them into a paged KV cache, one Triton launch.

For every format of ``docs/kv-formats.md`` (bf16, fp8, fp8_ds_mla, nvfp4_ds_mla; rope 64, NoPE in vLLM's
rows and the compact ones) the bytes written are identical to ``fmt.encode`` (``formats/_numerics.py``
gives the exact fp32 recipe), on CUDA and under the interpreter:

* the RoPE slot of a NoPE DS row (``fmt.layout.zero_offset`` / ``zero_bytes``) is written as zeros;
* a NaN or inf input makes its value group (one bf16 / fp8 value; an fp8_ds_mla tile of 128 values or
  an nvfp4 block of 16, whose scale is shared; one RoPE value) decode to NaN, with the canonical bytes of
  ``formats/base.py``: one compare per value, or the NaN-propagating per-group amax the recipe computes
  anyway; no reduction across groups, no host round trip;
* a slot outside ``[0, num_slots)`` (-1 included) skips the token: the kernel never writes outside ``rows``.

Tiling: one program = ``TOK`` tokens (8; per-format overrides in ``WRITE_TUNED``), each a whole row.  A
token's 512 latent values are one ``[TOK, 512]`` load (per-tile / per-block amax = a reduction over a
reshaped view, no per-element loop), its RoPE one ``[TOK, 64]`` load, and its row is written with wide
stores at byte offset ``row * bytes_per_token`` computed in int64 (caches above 2^31 bytes).  The slot ->
row division is by a constexpr block size (a shift for 64), not a 64-bit divide.  Every byte offset comes
from ``fmt.layout`` as a constexpr.

Bound: per token it reads 1152 B (bf16 kv_c + k_pe) and writes 288..1152 B, so 65,536 tokens move
98..151 MB, 23..36 us at the H200's ~4.2 TB/s.  bf16, fp8 and fp8_ds_mla need a few instructions per
element and stay under that; nvfp4 needs the most, so its code avoids divisions and works on bf16 pairs:

* ``e2m1(x / sf)`` without dividing: ``|x|`` against the exact decision points ``t * sf``
  (``_e2m1_codes``; the fp32 / fp16 input path);
* bf16 input, two values at a time in bf16x2 (``_e2m1_bytes_bf16x2_fma`` on the GPU: the three decisions
  and the code as bf16x2 compares and fmas, which issue on the FMA pipe rather than the integer one);
* the block scale of a bf16 amax without a division (``_nvfp4_scale_bf16``);
* one thread per 16-value block (two half-block loads of one layout), so the block's amax, scale and
  thresholds are computed once; bytes leave as 32-bit words.

Number conversions, and why there are two code paths (``EMULATE``):
  On the GPU, Triton lowers fp32 -> float8e4nv to ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest
  even, saturating to +-448, NaN -> 0x7F: exactly the contract) and fp32 -> bf16 to ``cvt.rn.bf16.f32``.
  The Triton *interpreter* gets both wrong (its fp8 cast rounds half-up without carrying into the
  exponent and does not saturate; its bf16 cast truncates), so under the interpreter the same
  conversions are done with integer bit arithmetic, which is exact everywhere.  The GPU test suite
  runs the emulated path on the GPU as well, so both paths are checked against ``fmt.encode``.
Divisions are correctly rounded (``tl.math.div_rn``; plain ``/`` on fp32 is approximate), as the
recipes require.  Division by a power of two is done as an exact multiply.

The fp32 helpers here (``e4m3_codes``, ``bf16_bits``, ``f32_from_e4m3``, ``apply_inv_k_scale``,
``k_scale_mode``, the ``FMT_*`` ids) are also used by the staging kernels (``staging.py``).
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Optional

import torch
import triton
import triton.language as tl

from .._validate import check_block_geometry, check_cache_rows, check_k_scale, check_tensor
from ..formats import KVFormat, get_format
from .._device import interpreting

# Format ids seen by the kernels (a constexpr selects the code of one format).
FMT_BF16 = tl.constexpr(0)
FMT_FP8 = tl.constexpr(1)
FMT_FP8_DS_MLA = tl.constexpr(2)
FMT_NVFP4_DS_MLA = tl.constexpr(3)
_FMT_IDS = {"bf16": FMT_BF16.value, "fp8": FMT_FP8.value, "fp8_ds_mla": FMT_FP8_DS_MLA.value,
            "nvfp4_ds_mla": FMT_NVFP4_DS_MLA.value}

# How ``x / k_scale`` is computed (constexpr): identity, an exact multiply by a power-of-two reciprocal,
# or a correctly rounded division.  All three give the correctly rounded fp32 quotient.
KS_ONE = tl.constexpr(0)
KS_POW2 = tl.constexpr(1)
KS_DIV = tl.constexpr(2)

# NaN bytes of a non-finite value group (``formats/base.py``)
BF16_NAN = tl.constexpr(0x7FC0)
FP32_NAN = tl.constexpr(0x7FC00000)
E4M3_NAN = tl.constexpr(0x7F)

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Default tiling: 8 tokens x 512 values with 4 warps is 32 values per thread, which keeps registers low
# enough for many programs per SM (loads in flight).
WRITE_TOKENS_PER_PROGRAM = 8
WRITE_NUM_WARPS = 4
# Per-format tiling picked by the movement benchmark's sweep on the H200 (looked up by format id first,
# then by name): fp8's short rows want more stores in flight (8 warps); nvfp4's ALU-heavy code wants
# small programs (4 tokens, 2 warps) so that more of them hide each other's latency.
WRITE_TUNED = {"fp8": {"num_warps": 8}, "nvfp4_ds_mla": {"TOK": 4, "num_warps": 2}}


def format_id(fmt: KVFormat) -> int:
    return _FMT_IDS[fmt.name]


@functools.lru_cache(maxsize=256)
def k_scale_mode(k_scale: float):
    """``(mode, k_scale_fp32, inv_k_scale)`` for dividing by ``k_scale`` in a kernel (see KS_*); cached
    (one layer's k_scale is the same every step)."""
    ks = struct.unpack("<f", struct.pack("<f", k_scale))[0]   # round to fp32
    if ks == 1.0:
        return KS_ONE.value, ks, 1.0
    mant, exp = math.frexp(ks)
    inv = 1.0 / ks
    # 1/ks is exact (and normal) for a power of two in this range; x * inv is then the rounded x / ks.
    if mant == 0.5 and -125 <= exp <= 126:
        return KS_POW2.value, ks, inv
    return KS_DIV.value, ks, inv


def check_config(config: Optional[dict], keys) -> dict:
    """A benchmark's tiling override: only ``keys`` (tile size, warps) may be given."""
    config = config or {}
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise ValueError(f"_config: unknown keys {unknown}; expected some of {list(keys)}")
    return config


def use_emulation(emulate: Optional[bool]) -> bool:
    """Bit-arithmetic conversions under the interpreter (or when a test forces them)."""
    return interpreting() if emulate is None else bool(emulate)


# --------------------------------------------------------------------------------------------------
# fp32 conversions shared with staging.py
# --------------------------------------------------------------------------------------------------
@triton.jit
def e4m3_codes(x, EMULATE: tl.constexpr):
    """fp32 (any shape) -> uint8 e4m3 codes: round to nearest even, saturating to +-448, NaN -> 0x7F,
    the sign kept for values that round to zero (``formats._numerics.e4m3_encode``)."""
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        ax = mag.to(tl.float32, bitcast=True)
        # |x| >= 2^-6 (normal e4m3): keep 3 mantissa bits, RNE (add 0x7FFFF plus the lowest kept bit;
        # a carry moves into the exponent, which is what rounding up to the next binade means).
        rnd = mag + 0x7FFFF + ((mag >> 20) & 1)
        normal = (rnd >> 20) - (120 << 3)  # rebias the exponent: 127 (fp32) -> 7 (e4m3)
        # |x| < 2^-6 (subnormal, step 2^-9): |x| * 2^9 rounded to an integer 0..8 by adding 2^23 (the
        # fp32 add rounds to nearest even; 8 is the code of 2^-6, the smallest normal).
        sub = (ax * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
        code = tl.where(ax < 0.015625, sub, normal)
        code = tl.where(ax > 448.0, 0x7E, code) | sign
        code = tl.where(x != x, 0x7F, code)
        return code.to(tl.uint8)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def bf16_bits(x, EMULATE: tl.constexpr):
    """fp32 (any shape) -> uint16 bits of the bf16 value, round to nearest even (NaN -> 0x7FC0)."""
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16)
    else:
        return x.to(tl.bfloat16).to(tl.uint16, bitcast=True)


@triton.jit
def f32_from_e4m3(code, EMULATE: tl.constexpr):
    """uint8 e4m3 codes -> fp32 (exact).  Emulated: the e4m3 bits shifted into an fp16 (same
    mantissa position, exponent bias 15 instead of 7, subnormals included) times 2^8."""
    if EMULATE:
        c = code.to(tl.uint16)
        h = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        v = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    else:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def apply_inv_k_scale(x, k_scale, inv_k_scale, KS_MODE: tl.constexpr):
    """The correctly rounded fp32 ``x / k_scale`` (``KS_MODE`` picks the cheapest exact way)."""
    if KS_MODE == KS_ONE:
        return x
    elif KS_MODE == KS_POW2:
        return x * inv_k_scale
    else:
        return tl.math.div_rn(x, tl.zeros_like(x) + k_scale)


@triton.jit
def nonfinite(x):
    """fp32 (any shape) -> int1: NaN or +-inf (``|x| <= FLT_MAX`` is false for both; one compare)."""
    return (tl.abs(x) <= 3.4028234663852886e38) == 0


@triton.jit
def _max_nan(a, b):
    """max that propagates NaN (a reduction combiner; ``tl.max`` drops NaN on the GPU)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# The interpreter runs a reduction with a jitted combiner once per pair of elements in Python (~100x slower
# than a built-in reduction): there, NaN is found by a second, built-in reduction instead.
_INTERPRETED = tl.constexpr(interpreting())


@triton.jit
def _amax_nan(x, axis: tl.constexpr):
    """max |x| over ``axis`` (fp32), NaN if any element is NaN, inf if any is infinite."""
    if _INTERPRETED:
        has_nan = tl.max((x != x).to(tl.int32), axis) > 0
        return tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis))
    else:
        return tl.reduce(tl.abs(x), axis, _max_nan)


# --------------------------------------------------------------------------------------------------
# nvfp4 helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_codes(x, sf):
    """e2m1 codes 0..15 (int32) of ``RNE_saturating(x / sf)`` for fp32 ``x [TOK, NB, 16]`` and e4m3 scale
    values ``sf [TOK, NB]`` -- without dividing.

    The recipe rounds the correctly rounded quotient ``q = fl(x / sf)`` to e2m1: code ``m`` counts the
    decision points below ``|q|`` (``> t`` for t in 0.25, 1.25, 2.5, 5 and ``>= t`` for 0.75, 1.75, 3.5:
    ties go to the even code).  Because ``t`` has at most 3 significant bits and ``sf`` at most 4,
    ``t * sf`` is exact in fp32, and for such ``sf`` rounding the quotient never moves it across a
    decision point: ``fl(x/sf) >= t  <=>  |x| >= t*sf`` and ``fl(x/sf) > t  <=>  |x| > t*sf`` (a
    neighbouring fp32 of ``t*sf``, divided by ``sf``, lies more than half an fp32 ulp away from ``t``;
    tests/test_cache_write.py checks this against the division for every e4m3 scale).  So each element
    costs three compares, found by a binary search over the eight codes: bit 2 (``>= 1.75 sf``), then
    bit 1 (``>= 3.5 sf`` or ``>= 0.75 sf``), then bit 0 (``> 5, 2.5, 1.25 or 0.25 sf``).
    The sign comes from the sign bit of ``x`` (``-0`` and negatives that round to 0 give code 8)."""
    s = sf[:, :, None]
    a = tl.abs(x)
    b2 = a >= 1.75 * s
    b1 = a >= tl.where(b2, 3.5 * s, 0.75 * s)
    b0 = a > tl.where(b2, tl.where(b1, 5.0 * s, 2.5 * s), tl.where(b1, 1.25 * s, 0.25 * s))
    # int32 arithmetic (8-bit integer ops cost byte permutes on the GPU)
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    return tl.where(b2, 4, 0) + tl.where(b1, 2, 0) + tl.where(b0, 1, 0) + sign


@triton.jit
def _bf16x2_mask(a, t, STRICT: tl.constexpr):
    """uint32 words each holding two NON-NEGATIVE bf16 values (``a``, ``t``) -> per 16-bit half 0xFFFF
    where ``a >= t`` (``a > t`` when STRICT), else 0.  Non-negative floats order like their bit
    patterns; SWAR compare: with the top bit of each half of ``a`` set, ``a - t`` cannot borrow across
    halves and that bit survives iff a >= t."""
    if STRICT:
        t = t + 0x00010001
    f = ((a | 0x80008000) - t) & 0x80008000
    return (f >> 15) * 0xFFFF


@triton.jit
def _bf16x2_nonfinite_nan(w):
    """uint32 words of two bf16 values -> the same words with each NaN / inf half replaced by 0x7FC0.
    A half has all exponent bits set iff ``(h & 0x7F80) + 0x80`` reaches bit 15 (no carry out of the half)."""
    m = (((w & 0x7F807F80) + 0x00800080) & 0x80008000) >> 15
    m = m * 0xFFFF
    return w ^ ((w ^ 0x7FC07FC0) & m)


@triton.jit
def _bf16x2_max(a, b):
    """Per-half max of two uint32 words of two NON-NEGATIVE bf16 values each (a reduction combiner), NaN
    if either half is NaN: one ``max.NaN.bf16x2`` on the FMA pipe (the integer form is 6 instructions)."""
    return tl.inline_asm_elementwise("max.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _bf16x2_mul(a, b):
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def _pair_threshold(sf, t: tl.constexpr, T2: tl.constexpr, EMULATE: tl.constexpr):
    """``t * sf`` (exact, at most 7 significant bits, so exact in bf16 too) as a bf16 pair: uint32
    ``[TOK, NB, 1]`` with the same bf16 in both halves.  ``T2`` is ``t`` as such a pair; on the GPU the
    product is one ``mul.rn.bf16x2`` of the pair of ``sf`` (exact in bf16: 4 significant bits) by ``T2``."""
    if EMULATE:
        b = (sf * t).to(tl.uint32, bitcast=True) >> 16
        return (b | (b << 16))[:, :, None]
    else:
        b = sf.to(tl.uint32, bitcast=True) >> 16
        return _bf16x2_mul(b | (b << 16), tl.full(b.shape, T2, tl.uint32))[:, :, None]


@triton.jit
def _e2m1_bytes_bf16x2(w, sf):
    """Packed nvfp4 bytes from bf16 pairs, integer arithmetic only (the interpreter's path): ``w`` uint32
    ``[TOK, NB, 8]`` (dims 2k, 2k+1 of a 16-dim block in the low / high half), ``sf`` fp32 ``[TOK, NB]``
    -> int32 ``[TOK, NB, 8]``, byte value ``code(2k) | code(2k+1) << 4``.

    The same decision points as ``_e2m1_codes`` (see there why ``|x|`` vs ``t * sf`` is exact), both
    values of a pair compared at once (a bf16 input and the thresholds are exact in bf16), the thresholds
    of the binary search chosen with bit masks."""
    a = w & 0x7FFF7FFF
    t075 = _pair_threshold(sf, 0.75, 0x3F403F40, True)
    t35 = _pair_threshold(sf, 3.5, 0x40604060, True)
    # bit 2: |x| >= 1.75 sf
    m2 = _bf16x2_mask(a, _pair_threshold(sf, 1.75, 0x3FE03FE0, True), False)
    m1 = _bf16x2_mask(a, t075 ^ ((t075 ^ t35) & m2), False)           # bit 1: >= 3.5 / 0.75 sf
    t25 = _pair_threshold(sf, 2.5, 0x40204020, True)
    t025 = _pair_threshold(sf, 0.25, 0x3E803E80, True)
    # bit 0: > 5 / 2.5 sf (hi) or > 1.25 / 0.25 sf (lo)
    hi = t25 ^ ((t25 ^ _pair_threshold(sf, 5.0, 0x40A040A0, True)) & m1)
    lo = t025 ^ ((t025 ^ _pair_threshold(sf, 1.25, 0x3FA03FA0, True)) & m1)
    m0 = _bf16x2_mask(a, lo ^ ((lo ^ hi) & m2), True)
    # Each half: sign (bit 15 -> bit 3) | code bits; then the high half's nibble (bits 16..19) moves
    # next to the low one (bits 4..7).
    c = (m2 & 0x00040004) | (m1 & 0x00020002) | (m0 & 0x00010001) | ((w >> 12) & 0x00080008)
    return ((c | (c >> 12)) & 0xFF).to(tl.int32)


@triton.jit
def _e2m1_bytes_bf16x2_fma(w, sf):
    """``_e2m1_bytes_bf16x2`` on the GPU with the decisions in bf16x2 arithmetic (the FMA pipe) instead of
    integer bit-mask selects.

    The three compares yield 1.0 / 0.0 per half (``set.ge.bf16x2.bf16x2``), so the binary search's next
    threshold is an fma: ``t1 = b2 * 2.75 sf + 0.75 sf`` (0.75 or 3.5 sf) and
    ``t0 = b2 * (b1 * 1.5 sf + 2.25 sf) + (b1 * sf + 0.25 sf)`` (0.25, 1.25, 2.5 or 5 sf); and the code is
    ``128 + b0 + 2 b1 + 4 b2`` in bf16, whose bits are ``0x4300 + code``.  Every value is exact in bf16:
    sf has at most 4 significant bits and the factors at most 4 (3.75 = 11.11b), so the products and sums
    have at most 8 -- tests/test_cache_write.py checks each threshold for every e4m3 scale.  Per pair of
    values that leaves ~7 integer instructions (abs, sign, nibble packing) next to 10 on the FMA pipe."""
    b = sf.to(tl.uint32, bitcast=True) >> 16
    s2 = (b | (b << 16))[:, :, None]
    t175 = _pair_threshold(sf, 1.75, 0x3FE03FE0, False)
    t075 = _pair_threshold(sf, 0.75, 0x3F403F40, False)
    d275 = _pair_threshold(sf, 2.75, 0x40304030, False)
    t025 = _pair_threshold(sf, 0.25, 0x3E803E80, False)
    k150 = _pair_threshold(sf, 1.5, 0x3FC03FC0, False)
    k225 = _pair_threshold(sf, 2.25, 0x40104010, False)
    c = tl.inline_asm_elementwise(
        """{
        .reg .b32 b2, b1, b0, t1, u, v, t0, k;
        set.ge.bf16x2.bf16x2 b2, $1, $2;
        fma.rn.bf16x2 t1, b2, $4, $3;
        set.ge.bf16x2.bf16x2 b1, $1, t1;
        fma.rn.bf16x2 u, b1, $6, $7;
        fma.rn.bf16x2 v, b1, $8, $5;
        fma.rn.bf16x2 t0, b2, u, v;
        set.gt.bf16x2.bf16x2 b0, $1, t0;
        mov.b32 k, 0x43004300;
        add.rn.bf16x2 t0, b0, k;
        mov.b32 k, 0x40004000;
        fma.rn.bf16x2 t0, b1, k, t0;
        mov.b32 k, 0x40804080;
        fma.rn.bf16x2 $0, b2, k, t0;
        }""",
        "=r,r,r,r,r,r,r,r,r", [w & 0x7FFF7FFF, t175, t075, d275, t025, k150, k225, s2], dtype=tl.uint32,
        is_pure=True, pack=1)
    n = (c & 0x00070007) | ((w >> 12) & 0x00080008)  # code bits | sign (bit 15 -> 3, bit 31 -> 19)
    return ((n | (n >> 12)) & 0xFF).to(tl.int32)


@triton.jit
def _nvfp4_scale(amax):
    """Block amax (fp32) -> (e4m3 code uint8, its value fp32): ``max(amax / 6, 2^-9)`` rounded to
    e4m3 and then one code UP if that is below the target (so ``amax / sf <= 6``).

    Always the bit-exact integer conversions, on the GPU too: built from the GPU's convert instructions,
    the round-up decision comes out inverted for some amax values on sm_90 although each conversion alone
    is right, and at one value per 16-element block the integer form's cost does not show."""
    target = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0), 0.001953125)
    code = e4m3_codes(target, True)
    up = (f32_from_e4m3(code, True) < target) & (code < 0x7E)
    code = code + up.to(tl.uint8)
    return code, f32_from_e4m3(code, True)


@triton.jit
def _nvfp4_scale_bf16(amax):
    """``_nvfp4_scale`` for a block amax that is a bf16 value (at most 8 significant bits), in ~15
    instructions instead of ~60 (a correctly rounded division and the e4m3 round trips).

    The recipe's code (round ``max(amax / 6, 2^-9)`` to e4m3, one code up if below) is the smallest e4m3
    value >= that target, saturated at 448.  ``amax * C`` with C a little below 1/6 gives the same answer:
    an exact multiple ``6 g`` of an e4m3 value g lands just below g (so the ceiling is g), and any other
    bf16 amax is at least one bf16 step (2^-8 relative) away from ``6 g``, far more than C's error.  The
    ceiling to 3 mantissa bits is an integer add-and-mask on the fp32 bits (normal e4m3) or
    ``ceil(t * 512) / 512`` (subnormal e4m3, below 2^-6).  tests/test_cache_write.py compares it with
    ``_nvfp4_scale`` on every positive bf16 value."""
    t = tl.maximum(amax * 0.16666650772094727, 0.001953125)
    tb = t.to(tl.uint32, bitcast=True)
    cb = (tb + 0xFFFFF) & 0xFFF00000                        # ceil to 3 mantissa bits (carries into the exponent)
    m = tl.math.ceil(tl.minimum(t, 0.015625) * 512.0)       # subnormal e4m3: m * 2^-9, m = 1..8
    sub = t < 0.015625
    code = tl.where(sub, m.to(tl.uint32), (cb >> 20) - 960)
    sf = tl.where(sub, m * 0.001953125, cb.to(tl.float32, bitcast=True))
    code = tl.minimum(code, 0x7E)
    sf = tl.minimum(sf, 448.0)
    return code.to(tl.uint8), sf


@triton.jit
def _bytes_to_words(b, TOK: tl.constexpr, NW: tl.constexpr):
    """Byte values (any integer type, 0..255) ``[TOK, 4 * NW]`` -> little-endian uint32 words ``[TOK, NW]``."""
    q = tl.reshape(b.to(tl.uint32), [TOK, NW, 2, 2])      # (token, word, half, byte in half)
    b_even, b_odd = tl.split(q)                            # bytes 0, 2 and 1, 3 of each word
    lo, hi = tl.split(b_even | (b_odd << 8))               # halves 0 and 1
    return lo | (hi << 16)


@triton.jit
def _quad_words(b):
    """Byte values ``[..., 4]`` (0..255) -> little-endian uint32 words ``[...]`` (the packing of
    ``_bytes_to_words``, on a trailing dim of 4)."""
    b02, b13 = tl.split(tl.reshape(b.to(tl.uint32), b.shape[:-1] + [2, 2]))   # bytes (0, 2) and (1, 3)
    lo, hi = tl.split(b02 | (b13 << 8))
    return lo | (hi << 16)


@triton.jit
def _store_words(rows_ptr, base, off: tl.constexpr, words, m2):
    """Store uint32 ``words [TOK, NW]`` at byte ``base + off`` of each row (rows and ``off`` 4-byte aligned)."""
    wp = (rows_ptr + base + off).to(tl.pointer_type(tl.uint32))
    tl.store(wp[:, None] + tl.arange(0, words.shape[1])[None, :], words, mask=m2)


# --------------------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _cache_write_kernel(
    rows_ptr,                       # uint8 [num_rows, BPT] (flat cache)
    kv_ptr, kv_stride,              # [N, 512] fp32/bf16/fp16, unit column stride
    pe_ptr, pe_stride,              # [N, ROPE] (unused when ROPE == 0)
    slot_ptr,                       # int32/int64 [N]; outside [0, num_slots) = skip
    N, num_slots, block_stride_rows,
    k_scale, inv_k_scale,
    BLOCK_SIZE: tl.constexpr,       # constexpr: slot // BLOCK_SIZE is then a shift, not a 64-bit divide
    FMT: tl.constexpr, ROPE: tl.constexpr, BPT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr, ZERO_BYTES: tl.constexpr,   # the RoPE slot of a NoPE row (written as zeros)
    KS_MODE: tl.constexpr, EMULATE: tl.constexpr,
    PAIRS: tl.constexpr,            # bf16 input: nvfp4 works on bf16 pairs (_e2m1_bytes_bf16x2), bf16 copies bits
    ALIGNED: tl.constexpr,          # kv_c rows start on 16-byte boundaries (vector loads; PAIRS only)
    TOK: tl.constexpr,
):
    D: tl.constexpr = 512
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * TOK + tl.arange(0, TOK)
    in_range = tok < N
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    row = (slot // BLOCK_SIZE) * block_stride_rows + slot % BLOCK_SIZE
    base = tl.where(live, row, 0) * BPT                       # int64 byte offset of each row
    col = tl.arange(0, D)
    col2 = tl.arange(0, D // 2)
    m2 = live[:, None]
    if ROPE > 0:
        rc = tl.arange(0, ROPE)
        r = tl.load(pe_ptr + tok[:, None] * pe_stride + rc[None, :], mask=m2, other=0.0).to(tl.float32)
        r_bad = nonfinite(r)

    # Non-finite input (formats/base.py): a value group with a NaN / inf gets the format's NaN bytes.  An
    # e4m3 group is converted from NaN (cvt.rn.satfinite and the emulation both give 0x7F); bf16 bits and
    # scales are selected, since a converted NaN's payload is not fixed.
    if FMT == FMT_BF16 and PAIRS:  # bf16 input: the row holds its bits (a NaN / inf becomes 0x7FC0)
        w = tl.load(kv_ptr.to(tl.pointer_type(tl.uint32)) + (tok * (kv_stride // 2))[:, None] + col2[None, :],
                    mask=m2, other=0)
        _store_words(rows_ptr, base, 0, _bf16x2_nonfinite_nan(w), m2)
        if ROPE > 0:
            rc2 = tl.arange(0, ROPE // 2)
            wr = tl.load(pe_ptr.to(tl.pointer_type(tl.uint32)) + (tok * (pe_stride // 2))[:, None] + rc2[None, :],
                         mask=m2, other=0)
            _store_words(rows_ptr, base, ROPE_OFF, _bf16x2_nonfinite_nan(wr), m2)
    elif FMT == FMT_BF16:  # 512 (+ 64) bf16 values, each its own group
        x = tl.load(kv_ptr + tok[:, None] * kv_stride + col[None, :], mask=m2, other=0.0).to(tl.float32)
        p16 = rows_ptr.to(tl.pointer_type(tl.uint16))
        v = bf16_bits(x, EMULATE)
        v = tl.where(nonfinite(x), tl.full(v.shape, BF16_NAN, tl.uint16), v)
        tl.store(p16 + (base // 2)[:, None] + col[None, :], v, mask=m2)
        if ROPE > 0:
            vr = bf16_bits(r, EMULATE)
            vr = tl.where(r_bad, tl.full(vr.shape, BF16_NAN, tl.uint16), vr)
            tl.store(p16 + ((base + ROPE_OFF) // 2)[:, None] + rc[None, :], vr, mask=m2)
    elif FMT == FMT_FP8:  # e4m3(x / k_scale) for all head dims, each value its own group
        x = tl.load(kv_ptr + tok[:, None] * kv_stride + col[None, :], mask=m2, other=0.0).to(tl.float32)
        x = tl.where(nonfinite(x), float("nan"), x)     # an inf would saturate; the NaN becomes 0x7F
        q = e4m3_codes(apply_inv_k_scale(x, k_scale, inv_k_scale, KS_MODE), EMULATE)
        tl.store(rows_ptr + base[:, None] + col[None, :], q, mask=m2)
        if ROPE > 0:
            r = tl.where(r_bad, float("nan"), r)
            qr = e4m3_codes(apply_inv_k_scale(r, k_scale, inv_k_scale, KS_MODE), EMULATE)
            tl.store(rows_ptr + (base + ROPE_OFF)[:, None] + rc[None, :], qr, mask=m2)
    elif FMT == FMT_FP8_DS_MLA:  # 4 tiles of 128 e4m3 with a power-of-two fp32 scale each, bf16 rope
        x = tl.load(kv_ptr + tok[:, None] * kv_stride + col[None, :], mask=m2, other=0.0).to(tl.float32)
        t3 = tl.reshape(x, [TOK, 4, 128])
        amax = _amax_nan(t3, 2)                                             # [TOK, 4], NaN / inf kept
        tile_bad = amax.to(tl.uint32, bitcast=True) >= 0x7F800000
        rr = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0), 1e-4)
        # 2 ** ceil(log2(rr)) on the bits: adding a full mantissa carries into the exponent unless rr
        # is already a power of two; the mask drops the mantissa.  1/s is a power of two as well.
        s_bits = (rr.to(tl.uint32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        inv_s = (0x7F000000 - s_bits).to(tl.float32, bitcast=True)
        inv_s = tl.where(tile_bad, float("nan"), inv_s)                     # the tile's codes: 0x7F
        q = tl.reshape(e4m3_codes(t3 * inv_s[:, :, None], EMULATE), [TOK, D])   # exact x / s, then RNE
        tl.store(rows_ptr + base[:, None] + col[None, :], q, mask=m2)
        s_bits = tl.where(tile_bad, tl.full(s_bits.shape, FP32_NAN, tl.uint32), s_bits)
        _store_words(rows_ptr, base, SCALE_OFF, s_bits, m2)
        if ROPE > 0:
            p16 = rows_ptr.to(tl.pointer_type(tl.uint16))
            vr = bf16_bits(r, EMULATE)
            vr = tl.where(r_bad, tl.full(vr.shape, BF16_NAN, tl.uint16), vr)
            tl.store(p16 + ((base + ROPE_OFF) // 2)[:, None] + rc[None, :], vr, mask=m2)
    else:  # nvfp4_ds_mla: 32 blocks of 16 e2m1 with an e4m3 scale (rounded up), e4m3 rope
        if PAIRS:
            # uint32 word k = bf16 dims 2k (low half) and 2k+1 (high half) = exactly one output byte.
            kw = kv_ptr.to(tl.pointer_type(tl.uint32))
            wrow = kw + tok * (kv_stride // 2)
            if ALIGNED:
                # Rows start on 16-byte boundaries (checked by the launcher).  Without the hint Triton loads
                # one word per instruction and spreads each 16-value block over 8 threads, each redoing the
                # block's thresholds and reducing its amax with shuffles.
                wrow = tl.multiple_of(wrow, 16)
            # A block of 16 values is 8 words; its two 16-byte halves are loaded as two [TOK, 32, 4] tensors
            # of the same layout, so one thread holds a whole block and computes its amax, scale and
            # thresholds once.
            boff = (tl.arange(0, 32) * 8)[None, :, None] + tl.arange(0, 4)[None, None, :]
            m3 = live[:, None, None]
            w_lo = tl.load(wrow[:, None, None] + boff, mask=m3, other=0)
            w_hi = tl.load(wrow[:, None, None] + boff + 4, mask=m3, other=0)
            a_lo = w_lo & 0x7FFF7FFF
            a_hi = w_hi & 0x7FFF7FFF
            if EMULATE:
                # bf16 bits of non-negative values order like the values, NaN (> 0x7F80) above inf (0x7F80)
                amax_bits = tl.maximum(tl.max(tl.maximum(a_lo & 0xFFFF, a_lo >> 16), axis=2),
                                       tl.max(tl.maximum(a_hi & 0xFFFF, a_hi >> 16), axis=2))
            else:
                a2 = _bf16x2_max(tl.reduce(a_lo, 2, _bf16x2_max), tl.reduce(a_hi, 2, _bf16x2_max))
                amax_bits = tl.maximum(a2 & 0xFFFF, a2 >> 16)
            block_bad = amax_bits >= 0x7F80                                 # [TOK, 32]
            sf_code, sf = _nvfp4_scale_bf16((amax_bits << 16).to(tl.float32, bitcast=True))
            # output word 2b (+1) = bytes 0-3 (4-7) of block b
            if EMULATE:
                q_lo = _e2m1_bytes_bf16x2(w_lo, sf)
                q_hi = _e2m1_bytes_bf16x2(w_hi, sf)
            else:
                q_lo = _e2m1_bytes_bf16x2_fma(w_lo, sf)
                q_hi = _e2m1_bytes_bf16x2_fma(w_hi, sf)
            q_lo = tl.where(block_bad[:, :, None], 0, q_lo)
            q_hi = tl.where(block_bad[:, :, None], 0, q_hi)
            words = tl.reshape(tl.join(_quad_words(q_lo), _quad_words(q_hi)), [TOK, 64])
        else:
            x = tl.load(kv_ptr + tok[:, None] * kv_stride + col[None, :], mask=m2, other=0.0).to(tl.float32)
            b3 = tl.reshape(x, [TOK, 32, 16])
            amax = _amax_nan(b3, 2)                                         # [TOK, 32], NaN / inf kept
            block_bad = amax.to(tl.uint32, bitcast=True) >= 0x7F800000
            sf_code, sf = _nvfp4_scale(amax)
            codes = tl.where(block_bad[:, :, None], 0, _e2m1_codes(b3, sf))
            lo, hi = tl.split(tl.reshape(codes, [TOK, 256, 2]))            # dim 2k low, 2k+1 high
            words = _bytes_to_words(lo | (hi << 4), TOK, 64)
        # Bytes go out as 32-bit words: one store instruction per four bytes.
        _store_words(rows_ptr, base, 0, words, m2)
        if ROPE > 0:
            qr = e4m3_codes(tl.where(r_bad, float("nan"), r), EMULATE)
            _store_words(rows_ptr, base, ROPE_OFF, _bytes_to_words(qr, TOK, 16), m2)
        # A bad block's scale is the NaN code; block b's scale goes to byte 8 * (b % 4) + b // 4: as
        # [TOK, 8, 4] (b // 4, b % 4), transposed.
        sf_code = tl.where(block_bad, tl.full(sf_code.shape, E4M3_NAN, tl.uint8), sf_code)
        sf_perm = tl.reshape(tl.permute(tl.reshape(sf_code, [TOK, 8, 4]), (0, 2, 1)), [TOK, 32])
        _store_words(rows_ptr, base, SCALE_OFF, _bytes_to_words(sf_perm, TOK, 8), m2)
    if ZERO_BYTES > 0:
        _store_words(rows_ptr, base, ZERO_OFF, tl.zeros([TOK, ZERO_BYTES // 4], tl.uint32), m2)


def _prep_input(t: torch.Tensor) -> torch.Tensor:
    # The kernel needs unit column stride (wide loads); a row stride is fine (e.g. a slice of a fused
    # [N, 576] projection output).
    return t if t.stride(1) == 1 else t.contiguous()


def cache_write(rows: torch.Tensor, fmt, kv_c: torch.Tensor, k_pe: Optional[torch.Tensor],
                slot_mapping: torch.Tensor, block_size: int, block_stride_rows: int, k_scale: float = 1.0,
                *, _config: Optional[dict] = None, _emulate: Optional[bool] = None) -> None:
    """Quantize ``N`` tokens into a paged cache, in place, in one Triton launch (no host sync).

    Args:
        rows: uint8 ``[num_rows, bytes_per_token]`` contiguous, the flat cache (``PagedKVCache.rows``);
            a slot whose row lies past its end is skipped (:func:`slots_in`).
        fmt: :class:`KVFormat` or format id.
        kv_c: ``[N, 512]`` bf16 / fp16 / fp32 latent values.
        k_pe: ``[N, rope_dim]`` same kinds of dtype, or None for NoPE formats.
        slot_mapping: int32 / int64 ``[N]`` contiguous; slot ``s`` goes to row
            ``(s // block_size) * block_stride_rows + s % block_size``; a slot outside
            ``[0, num_blocks * block_size)`` (-1 included) skips the token.
        block_size, block_stride_rows: cache geometry.
        k_scale: per-tensor scale (changes only the ``fp8`` format).
        _config: tiling override for benchmarks (``{"TOK": tokens per program, "num_warps": w}``).
        _emulate: force (True) or forbid (False) the bit-arithmetic conversions (tests on the GPU).

    Bytes written equal ``fmt.encode(kv_c, k_pe, k_scale)``, non-finite input and the NoPE slot included.
    """
    fmt = get_format(fmt)
    k_scale = check_k_scale(k_scale)
    dev = check_cache_rows(rows, fmt)
    check_tensor("kv_c", kv_c, dtypes=_INPUT_DTYPES, shape=(None, fmt.kv_lora_rank), device=dev)
    n = kv_c.shape[0]
    if fmt.rope_dim:
        if k_pe is None:
            raise ValueError(f"k_pe: format {fmt.id} stores {fmt.rope_dim} RoPE dims; got None")
        check_tensor("k_pe", k_pe, dtypes=_INPUT_DTYPES, shape=(n, fmt.rope_dim), device=dev)
    elif k_pe is not None and k_pe.numel() != 0:
        raise ValueError(f"k_pe: format {fmt.id} has no RoPE part; expected None, got shape {tuple(k_pe.shape)}")
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), shape=(n,), device=dev,
                 contiguous=True)
    block_stride_rows = check_block_geometry(block_size, block_stride_rows)
    launch_cache_write(rows, fmt, kv_c, k_pe, slot_mapping, block_size, block_stride_rows, k_scale,
                       check_config(_config, ("TOK", "num_warps")), _emulate)


@functools.lru_cache(maxsize=64)
def _format_args(fmt: KVFormat) -> dict:
    """The kernel's per-format constexprs and default tiling (from ``fmt.layout``), built once."""
    lay = fmt.layout
    tuned = {"TOK": WRITE_TOKENS_PER_PROGRAM, "num_warps": WRITE_NUM_WARPS}
    tuned.update(WRITE_TUNED.get(fmt.id, WRITE_TUNED.get(fmt.name, {})))
    return dict(FMT=format_id(fmt), ROPE=fmt.rope_dim, BPT=fmt.bytes_per_token,
                ROPE_OFF=max(lay.rope_offset, 0), SCALE_OFF=max(lay.scale_offset, 0),
                ZERO_OFF=max(lay.zero_offset, 0), ZERO_BYTES=lay.zero_bytes, **tuned)


def slots_in(num_rows: int, block_size: int, block_stride_rows: int) -> int:
    """How many slots have their row inside ``num_rows`` rows: the row of slot s,
    ``(s // block_size) * block_stride_rows + s % block_size``, grows with s, so they are a prefix (the last
    block may be partial)."""
    if num_rows <= 0:
        return 0
    last = (num_rows - 1) // block_stride_rows
    return last * block_size + min(block_size, num_rows - last * block_stride_rows)


def launch_cache_write(rows, fmt: KVFormat, kv_c, k_pe, slot_mapping, block_size: int, block_stride_rows: int,
                       k_scale: float, config: Optional[dict] = None, emulate: Optional[bool] = None) -> None:
    """``cache_write`` without argument checks, for callers that validated the same arguments already
    (``PagedKVCache.write``): ``fmt`` a :class:`KVFormat`, k_scale a float, the geometry checked."""
    n = kv_c.shape[0]
    num_slots = slots_in(rows.shape[0], block_size, block_stride_rows)
    if n == 0 or num_slots == 0:
        return
    kv_c = _prep_input(kv_c)
    pe = _prep_input(k_pe) if fmt.rope_dim else kv_c
    mode, ks, inv = k_scale_mode(k_scale)
    args = _format_args(fmt)
    if config:
        args = {**args, **config}
    tok = args["TOK"]
    # bf16 pairs as uint32 words need an even row stride and a 4-byte aligned start; 16-byte aligned rows
    # (stride a multiple of 8 bf16, 16-byte aligned start) get the alignment hint (16-byte loads).
    pairs = False
    aligned = False
    if args["FMT"] == FMT_BF16.value:
        # bf16 pairs as uint32 words: even row strides and 4-byte aligned starts
        pairs = all(t.dtype == torch.bfloat16 and t.stride(0) % 2 == 0 and t.data_ptr() % 4 == 0
                    for t in ((kv_c, pe) if fmt.rope_dim else (kv_c,)))
    elif args["FMT"] == FMT_NVFP4_DS_MLA.value and kv_c.dtype == torch.bfloat16:
        ptr, stride = kv_c.data_ptr(), kv_c.stride(0)
        pairs = stride % 2 == 0 and ptr % 4 == 0
        aligned = pairs and stride % 8 == 0 and ptr % 16 == 0
    _cache_write_kernel[(-(-n // tok),)](
        rows, kv_c, kv_c.stride(0), pe, pe.stride(0), slot_mapping,
        n, num_slots, block_stride_rows, ks, inv, BLOCK_SIZE=block_size, KS_MODE=mode,
        EMULATE=use_emulation(emulate), PAIRS=pairs, ALIGNED=aligned, **args)


__all__ = ["cache_write", "launch_cache_write", "e4m3_codes", "bf16_bits", "f32_from_e4m3", "apply_inv_k_scale", "nonfinite",
           "k_scale_mode", "format_id", "use_emulation", "check_config", "FMT_BF16", "FMT_FP8", "FMT_FP8_DS_MLA",
           "FMT_NVFP4_DS_MLA", "KS_ONE", "KS_POW2", "KS_DIV"]
