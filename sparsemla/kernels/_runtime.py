"""When can a Triton kernel run on a tensor, and facts about the device it runs on (cached)."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


_PROPS: dict = {}


def _props(device: torch.device):
    """torch.cuda.get_device_properties of a CUDA device, cached: the split plan asks on every attention call."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PROPS:
        _PROPS[key] = torch.cuda.get_device_properties(key)
    return _PROPS[key]


def num_sms(device) -> int:
    """The device's SM count (132 for a CPU tensor: plans are made for an H200)."""
    device = torch.device(device)
    return _props(device).multi_processor_count if device.type == "cuda" else 132


def capability(device) -> tuple:
    """(major, minor) compute capability of a CUDA device, (0, 0) for a CPU tensor."""
    device = torch.device(device)
    if device.type != "cuda":
        return (0, 0)
    p = _props(device)
    return (p.major, p.minor)
