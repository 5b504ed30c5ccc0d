"""``bf16`` format (``docs/kv-formats.md`` §1, §5): the key as plain bfloat16, no scale.

Row (little-endian bf16, 2 bytes per value):
    rope_dim 64: bytes [0, 1024) kv_c[0:512], bytes [1024, 1152) k_pe[0:64]   -> 1152 B/token
    rope_dim 0:  bytes [0, 1024) kv_c[0:512]                                   -> 1024 B/token (vLLM, head size 512)
Encode: ``x.to(bfloat16)`` (round to nearest even from fp32 / fp16; an fp32 beyond the largest bf16
rounds to inf).  Decode: ``float(bf16)``.  k_scale is validated but does not change anything.
Non-finite input (``base`` module docstring): each NaN / inf value is stored as 0x7FC0 (bf16 NaN).
"""
from __future__ import annotations

import torch

from ._numerics import BF16_NAN, bf16_bytes_nonfinite_nan, bytes_to_bf16
from .base import KVFormat, Layout


class BF16Format(KVFormat):
    name = "bf16"

    def _make_layout(self) -> Layout:
        values = 2 * self.kv_lora_rank
        rope = values if self.rope_dim else -1
        return Layout(bytes_per_token=2 * self.head_dim, value_offset=0, value_bytes=values,
                      scale_offset=-1, scale_bytes=0, rope_offset=rope, rope_bytes=2 * self.rope_dim,
                      rope_slot_offset=rope, rope_slot_bytes=2 * self.rope_dim)

    def _nonfinite_parts(self):
        return {"value": (BF16_NAN, 2), "rope": (BF16_NAN, 2)}

    def _encode_parts(self, x, r, ks):
        parts = [(0, bf16_bytes_nonfinite_nan(x))]
        if r is not None:
            parts.append((self.layout.rope_offset, bf16_bytes_nonfinite_nan(r)))
        return parts

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]`` (exact)."""
        self._check_decode_args(rows, k_scale)
        return bytes_to_bf16(rows).to(torch.float32)
