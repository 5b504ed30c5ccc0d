"""FLOP and byte accounting, speed-of-light (SOL) time, and achieved rates.

Exactly the rules of ``docs/benchmarking.md``, so that our figures compare with FlashMLA's:

* FLOPs = ``2 * h_q * valid_pairs * (d_qk + d_v)``, d_qk = 576 (512 for NoPE), d_v = 512; a pair is
  one (query token, selected key) with a valid index — padding (-1, or past the valid count) is free.
* Bytes = ``unique(valid rows) * bytes_per_token + q bytes + out bytes + lse bytes``: a row that
  several queries of a request select is read from DRAM once (the rest hits L2), so it counts once.
* SOL time = ``max(FLOPs / matmul ceiling, bytes / copy ceiling)``; achieved / SOL is reported as a
  percentage (100 % = the ceiling), with TFLOP/s and TB/s.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

V_DIM = 512  # value dims (the latent part of the key)


@dataclass(frozen=True)
class Ceilings:
    """Measured ceilings of one device, in base units.

    copy_bytes_per_s: device-to-device copy bandwidth, bytes read + written per second.
    matmul_flop_per_s: dense bf16 matmul (fp32 on CPU; see ``matmul_dtype``).
    fp8_flop_per_s: ``torch._scaled_mm`` with e4m3 operands, or None where it is unavailable.
    """

    device: str
    copy_bytes_per_s: float
    matmul_flop_per_s: float
    fp8_flop_per_s: Optional[float] = None
    matmul_dtype: str = "bfloat16"
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Work:
    """What one call must do at the least: FLOPs and DRAM bytes under the accounting rules."""

    flops: int
    nbytes: int
    valid_pairs: int = 0
    unique_rows: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def valid_entries(indices: torch.Tensor, valid_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool ``[T, K]``: the entry names a token (>= 0 and before the valid count, if one is given)."""
    mask = indices >= 0
    if valid_counts is not None:
        k = torch.arange(indices.shape[-1], device=indices.device)
        mask &= k < valid_counts.to(indices.device).reshape(-1, 1)
    return mask


def count_pairs_and_rows(indices: torch.Tensor, valid_counts: Optional[torch.Tensor] = None):
    """(valid (query, key) pairs, unique valid rows) of int indices ``[T, K]``."""
    mask = valid_entries(indices, valid_counts)
    rows = indices[mask]
    return int(mask.sum()), int(torch.unique(rows).numel())


def attention_flops(num_heads: int, valid_pairs: int, head_dim: int) -> int:
    """``2 * h_q * valid_pairs * (d_qk + d_v)``: one multiply-add per element of QK^T and of PV."""
    return 2 * int(num_heads) * int(valid_pairs) * (int(head_dim) + V_DIM)


def attention_work(q: torch.Tensor, indices: torch.Tensor, bytes_per_token: int,
                   valid_counts: Optional[torch.Tensor] = None, *, out_dtype=None, with_lse: bool = True) -> Work:
    """FLOPs and bytes of one sparse-attention call.

    q ``[T, H, head_dim]``; indices int ``[T, K]`` rows of the cache; ``bytes_per_token`` of the
    cache format; the output is ``[T, H, 512]`` in ``out_dtype`` (q's by default) and lse fp32 ``[T, H]``.
    """
    t, h, d = q.shape
    pairs, rows = count_pairs_and_rows(indices, valid_counts)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    out_elem = torch.empty((), dtype=out_dtype).element_size()
    nbytes = rows * int(bytes_per_token) + q.numel() * q.element_size() + t * h * V_DIM * out_elem
    if with_lse:
        nbytes += t * h * 4
    return Work(flops=attention_flops(h, pairs, d), nbytes=nbytes, valid_pairs=pairs, unique_rows=rows)


def cache_write_work(num_tokens: int, head_dim: int, bytes_per_token: int, *, in_elem_size: int = 2,
                     slot_elem_size: int = 8) -> Work:
    """Bytes of a cache write: source values + slot mapping read, ``bytes_per_token`` per token written."""
    n = int(num_tokens)
    return Work(flops=0, nbytes=n * (head_dim * in_elem_size + slot_elem_size + bytes_per_token))


def sol_seconds(work: Work, ceilings: Ceilings) -> float:
    """Speed-of-light time: the slower of the compute bound and the memory bound."""
    return max(work.flops / ceilings.matmul_flop_per_s, work.nbytes / ceilings.copy_bytes_per_s)


def bound(work: Work, ceilings: Ceilings) -> str:
    """``"compute"`` or ``"memory"``: which ceiling sets the SOL time."""
    return "compute" if work.flops / ceilings.matmul_flop_per_s > work.nbytes / ceilings.copy_bytes_per_s \
        else "memory"


def achieved(time_s: float, work: Work, ceilings: Ceilings) -> dict:
    """Rates of one measured call: TFLOP/s, TB/s, SOL time (us) and % of SOL (SOL / time * 100)."""
    if not time_s > 0:
        raise ValueError(f"time_s: expected a positive time, got {time_s}")
    sol = sol_seconds(work, ceilings)
    return {
        "time_us": time_s * 1e6,
        "tflops": work.flops / time_s / 1e12,
        "tbps": work.nbytes / time_s / 1e12,
        "sol_us": sol * 1e6,
        "pct_sol": 100.0 * sol / time_s,
        "bound": bound(work, ceilings),
    }


__all__ = ["Ceilings", "Work", "V_DIM", "valid_entries", "count_pairs_and_rows", "attention_flops",
           "attention_work", "cache_write_work", "sol_seconds", "bound", "achieved"]
