"""Facts about where kernels run: the interpreter, a device's SM count and compute capability (cached)."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).  Triton reads the variable
    when it decorates a kernel, so the answer is fixed at the first call (after the kernel modules loaded)."""
    global _INTERPRET
    if _INTERPRET is None:
        _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _INTERPRET


_INTERPRET = None


def triton_runs_on(device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


_PROPS: dict = {}


def _props(index: int):
    p = _PROPS.get(index)
    if p is None:
        p = _PROPS[index] = torch.cuda.get_device_properties(index)
    return p


def cuda_index(device) -> int:
    """The index of a CUDA device (the current one when the device has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device) -> int:
    """The device's SM count (132 for a CPU tensor: plans are made for an H200)."""
    device = torch.device(device)
    return _props(cuda_index(device)).multi_processor_count if device.type == "cuda" else 132


def capability(device) -> tuple:
    """(major, minor) compute capability of a CUDA device, (0, 0) for a CPU tensor."""
    device = torch.device(device)
    if device.type != "cuda":
        return (0, 0)
    p = _props(cuda_index(device))
    return (p.major, p.minor)
