"""``fp8_ds_mla`` format: e4m3 values with an fp32 scale per 128 dims (``docs/kv-formats.md`` §3, §5).

Row (rope_dim 64, 656 B/token; NoPE 528 B/token = the first two parts):
    [0, 512)    512 e4m3 codes, latent dim i at byte i
    [512, 528)  4 fp32 tile scales, little-endian; scale t covers dims [128t, 128t + 128)
    [528, 656)  64 bf16 RoPE values (not quantized), rope dim j at byte 528 + 2j

Write recipe, per 128-dim tile, all fp32 (inputs upcast exactly):
    amax = max |x|                              (exact)
    s    = 2 ** ceil(log2(max(amax / 448, 1e-4)))   -- see _numerics.pow2_tile_scale: correctly
                                                   rounded division, then exact bit arithmetic
    code = e4m3_RNE_saturating(x / s)            (exact division: s is a power of two)
    rope = bf16_RNE(k_pe)
Read recipe: ``float(e4m3) * scale`` as one fp32 multiply, the scale read as an ARBITRARY fp32
(older writers stored plain amax / 448), rope as bf16.  k_scale is validated and ignored.
"""
from __future__ import annotations

import torch

from ._numerics import (FP8_TILE, bf16_to_bytes, bytes_to_bf16, bytes_to_f32, e4m3_decode, e4m3_encode,
                        f32_to_bytes, pow2_tile_scale)
from .base import KVFormat, Layout


class FP8DSMLAFormat(KVFormat):
    name = "fp8_ds_mla"

    @property
    def num_tiles(self) -> int:
        return self.kv_lora_rank // FP8_TILE

    @property
    def bytes_per_token(self) -> int:
        return self.kv_lora_rank + 4 * self.num_tiles + 2 * self.rope_dim

    @property
    def layout(self) -> Layout:
        scale = self.kv_lora_rank
        rope = scale + 4 * self.num_tiles
        return Layout(value_offset=0, rope_offset=rope if self.rope_dim else -1, scale_offset=scale)

    def encode(self, kv_c: torch.Tensor, k_pe: torch.Tensor | None = None, k_scale: float = 1.0) -> torch.Tensor:
        """kv_c ``[N, 512]``, k_pe ``[N, rope_dim]`` (fp16/bf16/fp32) -> uint8 ``[N, bytes_per_token]``."""
        x, r, _ = self._check_encode_args(kv_c, k_pe, k_scale)
        n = x.shape[0]
        tiles = x.reshape(n, self.num_tiles, FP8_TILE)
        scale = pow2_tile_scale(tiles.abs().amax(dim=-1))                        # [N, 4] fp32
        codes = e4m3_encode(tiles / scale.unsqueeze(-1)).reshape(n, self.kv_lora_rank)
        parts = [codes, f32_to_bytes(scale)]
        if r is not None:
            parts.append(bf16_to_bytes(r.to(torch.bfloat16)))
        return torch.cat(parts, dim=1)

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]``."""
        self._check_decode_args(rows, k_scale)
        n = rows.shape[0]
        lay = self.layout
        scale = bytes_to_f32(rows[:, lay.scale_offset:lay.scale_offset + 4 * self.num_tiles])  # [N, 4]
        vals = e4m3_decode(rows[:, :self.kv_lora_rank]).reshape(n, self.num_tiles, FP8_TILE) * scale.unsqueeze(-1)
        vals = vals.reshape(n, self.kv_lora_rank)
        if not self.rope_dim:
            return vals
        rope = bytes_to_bf16(rows[:, lay.rope_offset:lay.rope_offset + 2 * self.rope_dim]).to(torch.float32)
        return torch.cat((vals, rope), dim=1)
