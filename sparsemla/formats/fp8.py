"""``fp8`` format, one per-tensor scale (``docs/kv-formats.md`` §2, §5).

Row: ``head_dim`` e4m3 codes, kv_c[0:512] at bytes [0, 512), then k_pe[0:64] at [512, 576)
(576 B/token; NoPE: 512 B/token, vLLM's head size 512).  No scale in the row: ``k_scale`` is one
fp32 per layer.
Encode (fp32): ``code = e4m3_RNE_saturating(x / fp32(k_scale))`` with a correctly rounded division
(Triton: ``tl.math.div_rn``).  Decode: ``float(e4m3) * fp32(k_scale)`` (one fp32 multiply).
This is the only format whose values depend on k_scale (``uses_k_scale``).
Non-finite input (``base`` module docstring): each NaN / inf value is stored as 0x7F (e4m3 NaN; an inf
does not saturate).
"""
from __future__ import annotations

import torch

from ._numerics import E4M3_NAN_CODE, div_rn, e4m3_decode, e4m3_encode
from .base import KVFormat, Layout


def _e4m3_nan(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of ``y``, 0x7F where the input ``x`` is NaN or inf."""
    codes = e4m3_encode(y)
    return torch.where(torch.isfinite(x), codes, torch.full_like(codes, E4M3_NAN_CODE))


class FP8Format(KVFormat):
    name = "fp8"
    uses_k_scale = True

    def _make_layout(self) -> Layout:
        rope = self.kv_lora_rank if self.rope_dim else -1
        return Layout(bytes_per_token=self.head_dim, value_offset=0, value_bytes=self.kv_lora_rank,
                      scale_offset=-1, scale_bytes=0, rope_offset=rope, rope_bytes=self.rope_dim,
                      rope_slot_offset=rope, rope_slot_bytes=self.rope_dim)

    def _nonfinite_parts(self):
        return {"value": (E4M3_NAN_CODE, 1), "rope": (E4M3_NAN_CODE, 1)}

    def _encode_parts(self, x, r, ks):
        parts = [(0, _e4m3_nan(div_rn(x, ks), x))]
        if r is not None:
            parts.append((self.layout.rope_offset, _e4m3_nan(div_rn(r, ks), r)))
        return parts

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]``."""
        ks = self._check_decode_args(rows, k_scale)
        return e4m3_decode(rows) * ks
