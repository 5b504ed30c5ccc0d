"""``fp8_ds_mla`` format: e4m3 values with an fp32 scale per 128 dims (``docs/kv-formats.md`` §3, §5).

Row (656 B/token, vLLM's and FlashMLA's "V3.2 FP8 with scale"):
    [0, 512)    512 e4m3 codes, latent dim i at byte i
    [512, 528)  4 fp32 tile scales, little-endian; scale t covers dims [128t, 128t + 128)
    [528, 656)  64 bf16 RoPE values (not quantized), rope dim j at byte 528 + 2j
NoPE (``fp8_ds_mla-nope``, vLLM's row for head size 512): the same 656 bytes with the RoPE slot
[528, 656) zero; readers take a 512-dim query and skip the slot.
NoPE compact (``fp8_ds_mla-nope-compact``, 528 B/token: bytes [0, 528) only) is this library's own
layout, not vLLM's; 528 B is also the size of FlashMLA's DSv4.1 MXFP8 record, from which
FlashMLA infers a cache's format, so such a cache must not be handed to FlashMLA as fp8_ds_mla.

Write recipe, per 128-dim tile, all fp32 (inputs upcast exactly):
    amax = max |x|                              (exact)
    s    = 2 ** ceil(log2(max(amax / 448, 1e-4)))   -- see _numerics.pow2_tile_scale: correctly
                                                   rounded division, then exact bit arithmetic
    code = e4m3_RNE_saturating(x / s)            (exact division: s is a power of two)
    rope = bf16_RNE(k_pe)
Read recipe: ``float(e4m3) * scale`` as one fp32 multiply, the scale read as an ARBITRARY fp32
(other writers store plain amax / 448), rope as bf16.  k_scale is validated and ignored.
Non-finite input (``base`` module docstring): a tile holding a NaN / inf gets codes 0x7F and the scale
0x7FC00000 (fp32 NaN); a NaN / inf RoPE value is stored as 0x7FC0; the slot of a NoPE row stays zero.
"""
from __future__ import annotations

import torch

from ._numerics import (BF16_NAN, E4M3_NAN_CODE, FP8_TILE, FP32_NAN, bf16_bytes_nonfinite_nan, bytes_to_bf16,
                        bytes_to_f32, e4m3_decode, e4m3_encode, f32_to_bytes, pow2_tile_scale)
from .base import KVFormat, Layout

ROPE_SLOT_DIMS = 64  # vLLM keeps a 64-dim bf16 RoPE slot in every row, NoPE included


class FP8DSMLAFormat(KVFormat):
    name = "fp8_ds_mla"
    has_compact_nope = True

    @property
    def num_tiles(self) -> int:
        return self.kv_lora_rank // FP8_TILE

    def _make_layout(self) -> Layout:
        scale = self.kv_lora_rank
        slot = scale + 4 * self.num_tiles
        slot_bytes = 0 if self.compact else 2 * ROPE_SLOT_DIMS
        return Layout(bytes_per_token=slot + slot_bytes, value_offset=0, value_bytes=self.kv_lora_rank,
                      scale_offset=scale, scale_bytes=4 * self.num_tiles,
                      rope_offset=slot if self.rope_dim else -1, rope_bytes=2 * self.rope_dim,
                      rope_slot_offset=slot if slot_bytes else -1, rope_slot_bytes=slot_bytes)

    def _nonfinite_parts(self):
        return {"value": (E4M3_NAN_CODE, 1), "scale": (FP32_NAN, 4), "rope": (BF16_NAN, 2)}

    def _encode_parts(self, x, r, ks):
        n = x.shape[0]
        lay = self.layout
        tiles = x.reshape(n, self.num_tiles, FP8_TILE)
        ok = torch.isfinite(tiles).all(dim=-1)                                   # [N, 4]: finite tiles
        tiles = torch.where(ok[..., None], tiles, torch.zeros((), device=x.device))
        scale = pow2_tile_scale(tiles.abs().amax(dim=-1))                        # [N, 4] fp32
        codes = e4m3_encode(tiles / scale.unsqueeze(-1))
        codes = torch.where(ok[..., None], codes, torch.full_like(codes, E4M3_NAN_CODE)).reshape(n, self.kv_lora_rank)
        sbits = torch.where(ok, scale.view(torch.int32), torch.full_like(scale.view(torch.int32), FP32_NAN))
        parts = [(0, codes), (lay.scale_offset, f32_to_bytes(sbits.view(torch.float32)))]
        if r is not None:
            parts.append((lay.rope_offset, bf16_bytes_nonfinite_nan(r)))
        return parts

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]``."""
        self._check_decode_args(rows, k_scale)
        n = rows.shape[0]
        lay = self.layout
        scale = bytes_to_f32(rows[:, lay.scale_offset:lay.scale_offset + lay.scale_bytes])          # [N, 4]
        vals = e4m3_decode(rows[:, :self.kv_lora_rank]).reshape(n, self.num_tiles, FP8_TILE) * scale.unsqueeze(-1)
        vals = vals.reshape(n, self.kv_lora_rank)
        if not self.rope_dim:
            return vals
        rope = bytes_to_bf16(rows[:, lay.rope_offset:lay.rope_offset + lay.rope_bytes]).to(torch.float32)
        return torch.cat((vals, rope), dim=1)
