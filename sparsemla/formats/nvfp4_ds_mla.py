"""``nvfp4_ds_mla`` format: E2M1 values with an e4m3 scale per 16 dims (``docs/kv-formats.md`` §4-§6).

Row (352 B/token, vLLM's):
    [0, 256)    512 e2m1 codes, two per byte: dim 2k in the LOW nibble of byte k, dim 2k+1 HIGH
    [256, 320)  64 e4m3 RoPE codes, unscaled: e4m3_RNE_saturating(k_pe[j]) at byte 256 + j
    [320, 352)  32 e4m3 block scales, PERMUTED: block s (dims [16s, 16s+16)) at byte
                320 + 8 * (s % 4) + s // 4
NoPE (``nvfp4_ds_mla-nope``, vLLM's row for head size 512): the same 352 bytes with the RoPE slot
[256, 320) zero and the scales still at [320, 352).
NoPE compact (``nvfp4_ds_mla-nope-compact``, 288 B/token: values [0, 256), scales [256, 288) in the
same permutation) is this library's own layout, not vLLM's.
No global scale (gs = 1).

Write recipe, per 16-dim block, all fp32 (inputs upcast exactly):
    amax   = max |x|
    sf     = nvfp4_block_scale(amax): target = max(amax / 6, 2**-9) (correctly rounded division),
             e4m3 RNE saturating, then one code UP if float(sf) < target and the code < 0x7E
    code_i = e2m1_RNE_saturating(x_i / float(sf))   (correctly rounded fp32 division; Triton:
             tl.math.div_rn), ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, sign
             from the sign bit (a negative that rounds to 0 is code 8)
Read: ``e2m1(code) * float(sf)`` (exact), rope ``float(e4m3)``.  k_scale is validated and ignored.
Non-finite input (``base`` module docstring): a block holding a NaN / inf gets value bytes 0 (e2m1 has
no NaN) and the scale 0x7F (e4m3 NaN), so each of its values is ``0 * NaN = NaN``; a NaN / inf RoPE value
is stored as 0x7F; the slot of a NoPE row stays zero.
"""
from __future__ import annotations

import torch

from ._numerics import (E4M3_NAN_CODE, NVFP4_BLOCK, e2m1_decode_packed, e2m1_encode, e4m3_decode, e4m3_encode,
                        nvfp4_block_scale, pack_nibbles, permute_block_scales, unpermute_block_scales)
from .base import KV_LORA_RANK, KVFormat, Layout

ROPE_SLOT_DIMS = 64  # vLLM keeps a 64-byte e4m3 RoPE slot in every row, NoPE included


class NVFP4DSMLAFormat(KVFormat):
    name = "nvfp4_ds_mla"
    has_compact_nope = True

    def __init__(self, rope_dim: int = 64, compact: bool = False):
        # The 32-block scale permutation and the 352 / 288-byte rows are defined for 512 latent dims
        # and rope 64 or 0 only.
        if self.kv_lora_rank != KV_LORA_RANK:  # pragma: no cover - guards a future subclass
            raise ValueError(f"kv_lora_rank: nvfp4_ds_mla needs 512, got {self.kv_lora_rank}")
        if rope_dim not in (64, 0):
            raise ValueError(f"rope_dim: nvfp4_ds_mla needs rope_dim 64 or 0, got {rope_dim}")
        super().__init__(rope_dim, compact)

    @property
    def num_blocks(self) -> int:
        return self.kv_lora_rank // NVFP4_BLOCK

    def _make_layout(self) -> Layout:
        values = self.kv_lora_rank // 2
        slot_bytes = 0 if self.compact else ROPE_SLOT_DIMS
        scale = values + slot_bytes
        return Layout(bytes_per_token=scale + self.num_blocks, value_offset=0, value_bytes=values,
                      scale_offset=scale, scale_bytes=self.num_blocks,
                      rope_offset=values if self.rope_dim else -1, rope_bytes=self.rope_dim,
                      rope_slot_offset=values if slot_bytes else -1, rope_slot_bytes=slot_bytes)

    def _nonfinite_parts(self):
        return {"value": (0, 1), "scale": (E4M3_NAN_CODE, 1), "rope": (E4M3_NAN_CODE, 1)}

    def _encode_parts(self, x, r, ks):
        n = x.shape[0]
        lay = self.layout
        blocks = x.reshape(n, self.num_blocks, NVFP4_BLOCK)
        ok = torch.isfinite(blocks).all(dim=-1)                                  # [N, 32]: finite blocks
        blocks = torch.where(ok[..., None], blocks, torch.zeros((), device=x.device))
        sf_codes = nvfp4_block_scale(blocks.abs().amax(dim=-1))                  # [N, 32] uint8
        codes = e2m1_encode(blocks / e4m3_decode(sf_codes).unsqueeze(-1))        # [N, 32, 16]
        codes = torch.where(ok[..., None], codes, torch.zeros_like(codes))
        sf_codes = torch.where(ok, sf_codes, torch.full_like(sf_codes, E4M3_NAN_CODE))
        parts = [(0, pack_nibbles(codes.reshape(n, self.kv_lora_rank))),         # [N, 256]
                 (lay.scale_offset, permute_block_scales(sf_codes))]             # [N, 32]
        if r is not None:
            rope = e4m3_encode(r)                                                # [N, 64]
            parts.append((lay.rope_offset, torch.where(torch.isfinite(r), rope, torch.full_like(rope, E4M3_NAN_CODE))))
        return parts

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]`` (exact)."""
        self._check_decode_args(rows, k_scale)
        n = rows.shape[0]
        lay = self.layout
        sf = e4m3_decode(unpermute_block_scales(rows[:, lay.scale_offset:lay.scale_offset + lay.scale_bytes]))
        vals = e2m1_decode_packed(rows[:, :lay.value_bytes]).reshape(n, self.num_blocks, NVFP4_BLOCK)
        vals = (vals * sf.unsqueeze(-1)).reshape(n, self.kv_lora_rank)
        if not self.rope_dim:
            return vals
        rope = e4m3_decode(rows[:, lay.rope_offset:lay.rope_offset + lay.rope_bytes])
        return torch.cat((vals, rope), dim=1)
