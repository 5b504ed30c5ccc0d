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


_SMS: dict = {}
_CAPS: dict = {}


def num_sms(device) -> int:
    """The device's SM count (132 for a CPU tensor: plans are made for an H200), cached: the split plan asks
    on every attention call."""
    device = torch.device(device)
    if device.type != "cuda":
        return 132
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def capability(device) -> tuple:
    """(major, minor) compute capability of a CUDA device, (0, 0) for a CPU tensor; cached."""
    device = torch.device(device)
    if device.type != "cuda":
        return (0, 0)
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CAPS:
        _CAPS[key] = tuple(torch.cuda.get_device_capability(key))
    return _CAPS[key]
