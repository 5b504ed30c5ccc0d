"""Argument checks shared by every public function.

Each helper raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape,
device, range) with a message that names the argument and says what was expected.  Nothing in
the library silently truncates, clamps or casts a caller's input.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

from . import _device


def check_current_device(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the CUDA tensor ``t`` is on the current CUDA device: Triton launches a kernel on
    the current device, whatever device its tensors are on (the caller selects it: ``torch.cuda.device(...)``)."""
    idx = t.get_device()
    cur = _device.current_cuda_index()
    if idx != cur:
        raise ValueError(f"{name}: on cuda:{idx}, but the current CUDA device is cuda:{cur} (the kernels run on the "
                         f"current device): call under torch.cuda.device({name}.device)")


def check_tensor(name: str, t, *, dtype=None, dtypes: Optional[Iterable] = None, ndim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, device=None, contiguous: bool = False) -> torch.Tensor:
    """Check a tensor argument; ``shape`` entries that are ``None`` are free."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {tuple(t.shape)} (dim {i})")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {torch.device(device)}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def _fmt_shape(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def check_k_scale(k_scale) -> float:
    """``k_scale`` is one positive finite fp32 per layer (a Python number or a 1-element tensor)."""
    if isinstance(k_scale, torch.Tensor):
        if k_scale.numel() != 1:
            raise ValueError(f"k_scale: expected a scalar or 1-element tensor, got shape {tuple(k_scale.shape)}")
        k_scale = float(k_scale.item())
    if isinstance(k_scale, bool) or not isinstance(k_scale, (int, float)):
        raise TypeError(f"k_scale: expected a positive finite float, got {type(k_scale).__name__}")
    k_scale = float(k_scale)
    if not SCALE_MIN <= k_scale <= SCALE_MAX:
        raise ValueError(f"k_scale: expected a positive finite float in [2^-126, 2^126] (the kernels compute in "
                         f"fp32), got {k_scale}")
    return k_scale


# Scales reach the kernels as fp32 (sm_scale times log2 e): positive normal fp32 values with room for that factor.
SCALE_MIN, SCALE_MAX = 2.0 ** -126, 2.0 ** 126


def check_positive_int(name: str, v, *, multiple_of: Optional[int] = None, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v}")
    if multiple_of is not None and v % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {v}")
    return v


def check_sm_scale(sm_scale) -> float:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale: expected a positive finite float, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not SCALE_MIN <= sm_scale <= SCALE_MAX:
        raise ValueError(f"sm_scale: expected a positive finite float in [2^-126, 2^126] (the kernels compute in "
                         f"fp32), got {sm_scale}")
    return sm_scale


def check_index_range(name: str, idx: torch.Tensor, upper: int, *, what: str = "rows") -> None:
    """Every entry must be -1 or in ``[0, upper)``.  One reduction, so it costs a device sync on GPU;
    callers on a hot path may skip it (see ``check=False`` arguments)."""
    if idx.numel() == 0:
        return
    lo = int(idx.min())
    hi = int(idx.max())
    if lo < -1:
        raise ValueError(f"{name}: entries must be -1 (no token) or >= 0, found {lo}")
    if hi >= upper:
        raise ValueError(f"{name}: entries must be < {upper} (the number of {what}), found {hi}")


def check_block_geometry(block_size, block_stride_rows=None) -> int:
    """Validate a paged-cache geometry; returns ``block_stride_rows`` (default ``block_size``)."""
    check_positive_int("block_size", block_size)
    if block_stride_rows is None:
        block_stride_rows = block_size
    check_positive_int("block_stride_rows", block_stride_rows)
    if block_stride_rows < block_size:
        raise ValueError(f"block_stride_rows: expected >= block_size ({block_size}), got {block_stride_rows}")
    return block_stride_rows


def check_cache_rows(rows, fmt) -> torch.device:
    """``rows`` must be the contiguous uint8 ``[num_rows, fmt.bytes_per_token]`` row view of a cache;
    returns its device."""
    check_tensor("rows", rows, dtype=torch.uint8, ndim=2, contiguous=True)
    if rows.shape[1] != fmt.bytes_per_token:
        raise ValueError(f"rows: expected shape [num_rows, {fmt.bytes_per_token}] for {fmt.id}, "
                         f"got {tuple(rows.shape)}")
    return rows.device
