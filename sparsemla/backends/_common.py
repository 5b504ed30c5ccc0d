"""Small helpers shared by the backends."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..cache import PagedKVCache
from ..formats import KVFormat, get_format

V_DIM = 512


def kv_rows(kv) -> Tuple[torch.Tensor, KVFormat]:
    """(uint8 ``[rows, bytes_per_token]``, format) of a PagedKVCache or a bf16 ``[rows, D]`` workspace.

    A workspace is read as ``bf16`` rows: ``ws.view(torch.uint8)`` is ``[rows, 2 * D]`` bytes."""
    if isinstance(kv, PagedKVCache):
        return kv.rows, kv.fmt
    return kv.view(torch.uint8), get_format("bf16", int(kv.shape[1]) - V_DIM)


def ensure_outputs(q: torch.Tensor, out: Optional[torch.Tensor], lse: Optional[torch.Tensor]):
    """Allocate the outputs a caller did not pass: out bf16 ``[T, H, 512]``, lse fp32 ``[T, H]``."""
    t, h = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((t, h, V_DIM), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    return out, lse


def mask_past_counts(indices: torch.Tensor, valid_counts: Optional[torch.Tensor]) -> torch.Tensor:
    """indices with every entry at or past ``valid_counts[t]`` set to -1 (a new tensor; eager paths only)."""
    if valid_counts is None:
        return indices
    k = torch.arange(indices.shape[1], device=indices.device, dtype=torch.int32)
    return torch.where(k[None, :] < valid_counts[:, None], indices, torch.full_like(indices, -1))


def device_index(device=None) -> int:
    """Index of a CUDA device (default: the current one), -1 for the CPU or a machine without CUDA.
    Probe results are cached per device index."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return -1
        if device.index is not None:
            return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else -1
