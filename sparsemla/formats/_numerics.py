"""Bit-exact number-format helpers shared by every KV format (``docs/kv-formats.md`` §2-§6).

These functions ARE the rounding contract: the Triton cache-write kernels must produce the same
bytes, so every recipe below is written as plain fp32 arithmetic plus integer bit operations, and
each docstring says exactly which fp32 operations happen in which order.

Rules that hold everywhere:

* Inputs are upcast to fp32 first (exact for fp16 / bf16), and every step is IEEE fp32.
* Divisions are correctly rounded fp32 divisions (``x / d``), never ``x * (1 / d)``.  In Triton use
  ``tl.math.div_rn`` (plain ``/`` on fp32 lowers to an approximate divide).  In PyTorch the divisor
  must be a tensor on the same device: CUDA turns division by a *Python number* into a multiply by
  its reciprocal, which is one bit off for some inputs (see :func:`div_rn`).
* "RNE" = round to nearest, ties to the even code.  "Saturating" = values beyond the largest finite
  magnitude (including +-inf) become that magnitude with their sign.
* A negative value that rounds to zero keeps its sign (the -0 code), as an IEEE conversion does.

Number formats (unsigned magnitude ``m``, sign in the top bit of the code):

* e4m3 (``float8_e4m3fn``): ``code = s<<7 | e<<3 | f``; ``e == 0`` -> ``f * 2**-9`` (subnormal, the
  smallest is 2**-9), else ``(1 + f/8) * 2**(e-7)``; largest finite 448 (``0x7E``); ``0x7F``/``0xFF``
  are NaN; there is no infinity.
* e2m1 (FP4): ``code = s<<3 | e<<1 | f``; magnitudes of codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""
from __future__ import annotations

import sys

import torch

E4M3_MAX = 448.0          # largest finite e4m3 magnitude (code 0x7E)
E4M3_MAX_CODE = 0x7E
E4M3_NAN_CODE = 0x7F      # canonical NaN written by e4m3_encode
BF16_NAN = 0x7FC0         # the bf16 NaN the formats write for non-finite input
FP32_NAN = 0x7FC00000     # the fp32 NaN the formats write as the scale of a non-finite group
E4M3_MIN_SUBNORMAL = 2.0 ** -9
E2M1_MAX = 6.0
POW2_SCALE_FLOOR = 1e-4   # fp8_ds_mla: the tile scale is at least 2**ceil(log2(1e-4)) = 2**-13
NVFP4_SCALE_FLOOR = 2.0 ** -9   # nvfp4: the block scale target is at least the smallest e4m3
FP8_TILE = 128            # fp8_ds_mla: dims per fp32 scale
NVFP4_BLOCK = 16          # nvfp4: dims per e4m3 scale

# Magnitudes of e2m1 codes 0..7; codes 8..15 are their negatives (8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# e2m1 RNE decision points: a magnitude m gets code sum_i [m > t] over _E2M1_GT plus
# sum_i [m >= t] over _E2M1_GE.  Each threshold is the midpoint of two neighbouring values; at a
# midpoint the tie goes to the even code, which is the upper neighbour at 0.75, 1.75, 3.5 (codes
# 2, 4, 6) and the lower one at 0.25, 1.25, 2.5, 5 (codes 0, 2, 4, 6).
_E2M1_GT = (0.25, 1.25, 2.5, 5.0)
_E2M1_GE = (0.75, 1.75, 3.5)

_LITTLE_ENDIAN = sys.byteorder == "little"


# --------------------------------------------------------------------------------------------
# small fp32 helpers
# --------------------------------------------------------------------------------------------
def f32_const(value: float, device) -> torch.Tensor:
    """A 0-d fp32 tensor on ``device`` (so arithmetic with it is a real tensor op, see div_rn)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def div_rn(x: torch.Tensor, d) -> torch.Tensor:
    """Correctly rounded fp32 ``x / d``; ``d`` is a tensor (broadcast) or a number.

    Why not ``x / 448.0``: on CUDA, PyTorch computes ``tensor / python_number`` as
    ``tensor * (1 / number)`` (one extra rounding), which can move e.g. ``amax / 448`` off an exact
    power of two and change a pow2 scale.  A 0-d device tensor takes the true-division path.
    """
    if not isinstance(d, torch.Tensor):
        d = f32_const(float(d), x.device)
    return torch.div(x, d)


# --------------------------------------------------------------------------------------------
# e4m3
# --------------------------------------------------------------------------------------------
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float tensor (any shape) -> uint8 e4m3 codes, RNE, saturating to +-448; NaN -> 0x7F.

    Recipe: upcast to fp32; clamp to [-448, 448] (this is the saturation: torch's cast to
    ``float8_e4m3fn`` rounds to nearest-even but turns out-of-range values into NaN instead of
    saturating in every version; the clamp leaves NaN as NaN); cast (RNE, subnormals included);
    NaN of either sign becomes the canonical code 0x7F.  For finite inputs this is what PTX
    ``cvt.rn.satfinite.e4m3x2.f32`` computes (Triton's fp32 -> float8e4nv cast on sm_90), so a
    Triton kernel can use that cast.  (The format encoders store a value group with a NaN / inf input
    with fixed NaN bytes, so this NaN convention only matters to direct callers.)
    """
    y = torch.clamp(x.to(torch.float32), -E4M3_MAX, E4M3_MAX)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    # After the clamp only NaN can produce 0x7F / 0xFF (torch keeps NaN's sign bit): canonicalise.
    # (Comparing the uint8 codes is cheaper than another fp32 pass with isnan.)
    return torch.where(codes == 0xFF, torch.full_like(codes, E4M3_NAN_CODE), codes)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes (any shape, any strides) -> float32 (exact; 0x7F / 0xFF -> NaN)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected dtype torch.uint8, got {codes.dtype}")
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


# --------------------------------------------------------------------------------------------
# power-of-two fp32 tile scales (fp8_ds_mla, §3)
# --------------------------------------------------------------------------------------------
def ceil_pow2(r: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= ``r``, for positive *normal* fp32 ``r`` (exact: bit arithmetic).

    ``2 ** ceil(log2(r))`` through ``log2`` can be one off near powers of two; on the bits it is
    exact: ``bits(s) = (bits(r) + 0x7FFFFF) & 0x7F800000`` -- adding a mantissa-full of ones
    carries into the exponent unless the mantissa is already zero (r is a power of two), and the
    mask drops the mantissa.  E.g. 0.75 -> 1.0, 1.0 -> 1.0, 0.5 -> 0.5, 1.0000001 -> 2.0.
    """
    bits = r.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def pow2_tile_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax (any shape, >= 0, finite) -> fp32 scale ``2 ** ceil(log2(max(amax / 448, 1e-4)))``.

    Recipe (all fp32): ``r = amax / 448`` (correctly rounded division); ``r = max(r, fp32(1e-4))``;
    ``s = ceil_pow2(r)`` (exact, see :func:`ceil_pow2`).  Amax / 448 == 0.75 -> 1.0, == 1.0 -> 1.0,
    == 0.5 -> 0.5; an all-zero tile gets 2**-13 (1e-4 lies between 2**-14 and 2**-13).
    Since ``|x| <= amax <= 448 s``, ``x / s`` never needs saturation.
    """
    r = div_rn(amax.to(torch.float32), E4M3_MAX)
    r = torch.maximum(r, f32_const(POW2_SCALE_FLOOR, r.device))
    return ceil_pow2(r)


# --------------------------------------------------------------------------------------------
# e2m1 (FP4) and nibbles (nvfp4_ds_mla, §4)
# --------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float tensor (any shape) -> uint8 e2m1 codes 0..15 (one per element), RNE, saturating at +-6.

    ``code = signbit(x) << 3 | m`` with ``m = #{t in (0.25, 1.25, 2.5, 5): |x| > t}
    + #{t in (0.75, 1.75, 3.5): |x| >= t}``: nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 with ties
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (the even code); above 5 -> 6.
    The sign comes from the sign bit, so -0.0 and small negatives that round to 0 give code 8 (-0).
    NaN input gives some code (the format encoders never pass one: a value group with a non-finite input
    is stored with fixed NaN bytes).
    """
    x = x.to(torch.float32)
    a = x.abs()
    m = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    hit = torch.empty(x.shape, dtype=torch.bool, device=x.device)  # reused: saves 7 allocations
    for t in _E2M1_GT:
        m += torch.gt(a, t, out=hit)
    for t in _E2M1_GE:
        m += torch.ge(a, t, out=hit)
    return m | (torch.signbit(x).to(torch.uint8) << 3)


_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes 0..15 (any shape) -> float32 values (code 8 -> -0.0)."""
    table = _E2M1_TABLE.to(codes.device)
    return table[codes.to(torch.int64)]


# value pairs of every packed byte: row b = (e2m1(b & 0xF), e2m1(b >> 4))
_E2M1_PAIR_TABLE = torch.stack((_E2M1_TABLE[torch.arange(256) & 0xF], _E2M1_TABLE[torch.arange(256) >> 4]), dim=1)


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., k]`` packed pairs -> float32 ``[..., 2k]`` values (= e2m1_decode(unpack_nibbles(.)),
    one table lookup per byte instead of one per nibble)."""
    table = _E2M1_PAIR_TABLE.to(packed.device)
    return table[packed.to(torch.int64)].reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., 2k]`` (each 0..15) -> uint8 ``[..., k]``: byte ``j`` holds element ``2j`` in
    its LOW nibble and element ``2j + 1`` in its HIGH nibble (torch.float4_e2m1fn_x2's order)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., k]`` -> uint8 codes ``[..., 2k]`` (inverse of :func:`pack_nibbles`)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_block_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 block amax (any shape, >= 0, finite) -> uint8 e4m3 scale codes, rounded UP.

    Recipe (all fp32): ``target = max(amax / 6, 2**-9)`` (correctly rounded division);
    ``code = e4m3_encode(target)`` (RNE, saturating); if ``e4m3_decode(code) < target`` and
    ``code < 0x7E``, ``code += 1`` (the next e4m3 value up; codes of positive e4m3 are ordered like
    their values).  So ``amax / scale <= 6`` and the block maximum is not clipped, except when
    ``amax > 6 * 448`` where the scale stays 448 and the values saturate at +-6.
    """
    target = div_rn(amax.to(torch.float32), E2M1_MAX)
    target = torch.maximum(target, f32_const(NVFP4_SCALE_FLOOR, target.device))
    code = e4m3_encode(target)
    up = (e4m3_decode(code) < target) & (code < E4M3_MAX_CODE)
    return code + up.to(torch.uint8)


def permute_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` per-block scale bytes in block order -> ``[..., 32]`` in storage order.

    The scale of block ``s`` (dims ``[16s, 16s+16)``) goes to byte ``8 * (s % 4) + s // 4``, i.e.
    byte ``p`` holds block ``4 * (p % 8) + p // 8``: view the 32 blocks as ``[8, 4]`` (s//4, s%4) and
    transpose to ``[4, 8]``.
    """
    lead = scales.shape[:-1]
    return scales.reshape(*lead, 8, 4).transpose(-1, -2).reshape(*lead, 32)


def unpermute_block_scales(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_block_scales`: storage order ``[..., 32]`` -> block order."""
    lead = stored.shape[:-1]
    return stored.reshape(*lead, 4, 8).transpose(-1, -2).reshape(*lead, 32)


def scale_byte_of_block(s: int) -> int:
    """Byte (relative to the scale area) holding the scale of nvfp4 block ``s`` (0..31)."""
    return 8 * (s % 4) + s // 4


# --------------------------------------------------------------------------------------------
# little-endian byte views
# --------------------------------------------------------------------------------------------
def _to_bytes(x: torch.Tensor, width: int) -> torch.Tensor:
    b = x.contiguous().view(torch.uint8)
    if not _LITTLE_ENDIAN:  # pragma: no cover - every supported machine is little-endian
        b = b.reshape(*x.shape, width).flip(-1).reshape(*x.shape[:-1], x.shape[-1] * width)
    return b


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    if b.dtype != torch.uint8:
        raise TypeError(f"bytes: expected dtype torch.uint8, got {b.dtype}")
    if b.shape[-1] % width:
        raise ValueError(f"bytes: last dim {b.shape[-1]} is not a multiple of {width}")
    b = b.contiguous()
    if not _LITTLE_ENDIAN:  # pragma: no cover
        b = b.reshape(*b.shape[:-1], b.shape[-1] // width, width).flip(-1).reshape(b.shape).contiguous()
    return b.view(dtype)


def f32_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., n]`` -> uint8 ``[..., 4n]``, each value little-endian (low byte first)."""
    return _to_bytes(x.to(torch.float32), 4)


def bytes_to_f32(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4n]`` (little-endian fp32s, any strides) -> fp32 ``[..., n]``."""
    return _from_bytes(b, torch.float32, 4)


def bf16_bytes_nonfinite_nan(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., n]`` -> uint8 ``[..., 2n]``: bf16 RNE, little-endian, with NaN and +-inf stored as the
    bf16 NaN 0x7FC0 (the formats' rule for non-finite input)."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    bits = torch.where(torch.isfinite(x), bits, torch.full_like(bits, BF16_NAN))
    return _to_bytes(bits.view(torch.bfloat16), 2)


def bf16_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``[..., n]`` -> uint8 ``[..., 2n]``, little-endian.  (Cast to bf16 first: RNE.)"""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected dtype torch.bfloat16, got {x.dtype}")
    return _to_bytes(x, 2)


def bytes_to_bf16(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2n]`` (little-endian bf16s, any strides) -> bf16 ``[..., n]``."""
    return _from_bytes(b, torch.bfloat16, 2)


__all__ = [
    "E4M3_MAX", "E4M3_MAX_CODE", "E4M3_NAN_CODE", "BF16_NAN", "FP32_NAN", "E4M3_MIN_SUBNORMAL", "E2M1_MAX",
    "E2M1_VALUES", "bf16_bytes_nonfinite_nan",
    "POW2_SCALE_FLOOR", "NVFP4_SCALE_FLOOR", "FP8_TILE", "NVFP4_BLOCK",
    "f32_const", "div_rn", "e4m3_encode", "e4m3_decode", "ceil_pow2", "pow2_tile_scale",
    "e2m1_encode", "e2m1_decode", "e2m1_decode_packed", "pack_nibbles", "unpack_nibbles", "nvfp4_block_scale",
    "permute_block_scales", "unpermute_block_scales", "scale_byte_of_block",
    "f32_to_bytes", "bytes_to_f32", "bf16_to_bytes", "bytes_to_bf16",
]
