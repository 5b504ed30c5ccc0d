"""Rotary position embedding and RMSNorm, shared by the attention layer and the indexer."""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float = 10000.0, dtype=torch.float32):
    """cos, sin ``[T, dim // 2]`` for integer ``positions [T]``.

    The angles are formed in float64: at position 32K an fp32 angle is off by ~2e-3 rad, which would
    show up as a position-dependent error against the float64 reference.  (Tiny tensors; graph-safe.)
    """
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, *, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [T, ..., dim]`` (``dim`` even) by its token's position.

    ``interleaved=True`` rotates pairs ``(2i, 2i+1)`` (DeepSeek's MLA RoPE); ``False`` rotates
    ``(i, i + dim/2)`` (GPT-NeoX style, used here for the indexer).  Computed in float32 (float64
    for float64 input); returns ``x``'s dtype.
    """
    dim = x.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_cos_sin(positions, dim, theta, work)
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = cos.view(view), sin.view(view)
    xf = x.to(work)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., : dim // 2], xf[..., dim // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in float32 (float64 for float64 input)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(work)
    return y.to(x.dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


__all__ = ["rope_cos_sin", "apply_rope", "rms_norm", "RMSNorm"]
