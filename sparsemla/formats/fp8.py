"""``fp8`` format, one per-tensor scale (``docs/kv-formats.md`` §2, §5).

Row: ``head_dim`` e4m3 codes, kv_c[0:512] at bytes [0, 512), then k_pe[0:64] at [512, 576)
(576 B/token; NoPE: 512 B/token).  No scale in the row: ``k_scale`` is one fp32 per layer.
Encode (fp32): ``code = e4m3_RNE_saturating(x / fp32(k_scale))`` with a correctly rounded division
(Triton: ``tl.math.div_rn``).  Decode: ``float(e4m3) * fp32(k_scale)`` (one fp32 multiply).
This is the only format whose values depend on k_scale (``uses_k_scale``).
"""
from __future__ import annotations

import torch

from ._numerics import div_rn, e4m3_decode, e4m3_encode
from .base import KVFormat, Layout


class FP8Format(KVFormat):
    name = "fp8"
    uses_k_scale = True

    @property
    def bytes_per_token(self) -> int:
        return self.head_dim

    @property
    def layout(self) -> Layout:
        return Layout(value_offset=0, rope_offset=self.kv_lora_rank if self.rope_dim else -1, scale_offset=-1)

    def encode(self, kv_c: torch.Tensor, k_pe: torch.Tensor | None = None, k_scale: float = 1.0) -> torch.Tensor:
        """kv_c ``[N, 512]``, k_pe ``[N, rope_dim]`` (fp16/bf16/fp32) -> uint8 ``[N, bytes_per_token]``."""
        x, r, ks = self._check_encode_args(kv_c, k_pe, k_scale)
        if r is not None:
            x = torch.cat((x, r), dim=1)
        return e4m3_encode(div_rn(x, ks))

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]``."""
        ks = self._check_decode_args(rows, k_scale)
        return e4m3_decode(rows) * ks
