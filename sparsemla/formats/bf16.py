"""``bf16`` format (``docs/kv-formats.md`` §1, §5): the key as plain bfloat16, no scale.

Row (little-endian bf16, 2 bytes per value):
    rope_dim 64: bytes [0, 1024) kv_c[0:512], bytes [1024, 1152) k_pe[0:64]   -> 1152 B/token
    rope_dim 0:  bytes [0, 1024) kv_c[0:512]                                   -> 1024 B/token
Encode: ``x.to(bfloat16)`` (round to nearest even from fp32 / fp16).  Decode: ``float(bf16)``.
k_scale is validated but does not change anything.
"""
from __future__ import annotations

import torch

from ._numerics import bf16_to_bytes, bytes_to_bf16
from .base import KVFormat, Layout


class BF16Format(KVFormat):
    name = "bf16"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.head_dim

    @property
    def layout(self) -> Layout:
        return Layout(value_offset=0, rope_offset=2 * self.kv_lora_rank if self.rope_dim else -1, scale_offset=-1)

    def encode(self, kv_c: torch.Tensor, k_pe: torch.Tensor | None = None, k_scale: float = 1.0) -> torch.Tensor:
        """kv_c ``[N, 512]``, k_pe ``[N, rope_dim]`` (fp16/bf16/fp32) -> uint8 ``[N, bytes_per_token]``."""
        x, r, _ = self._check_encode_args(kv_c, k_pe, k_scale)
        if r is not None:
            x = torch.cat((x, r), dim=1)
        return bf16_to_bytes(x.to(torch.bfloat16))

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]`` (exact)."""
        self._check_decode_args(rows, k_scale)
        return bytes_to_bf16(rows).to(torch.float32)
