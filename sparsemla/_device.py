"""Facts about where kernels run: the interpreter, a device's SM count and compute capability (cached)."""
from __future__ import annotations

import torch


def interpreting() -> bool:
    """True when the library's Triton kernels run in Triton's CPU interpreter.  Triton reads
    ``TRITON_INTERPRET`` when it decorates a kernel, so the answer is what it decided for the library's kernels
    (asked of one of them once), not the variable's value now."""
    global _INTERPRET
    if _INTERPRET is None:
        from triton.runtime.interpreter import InterpretedFunction
        from .kernels.combine import combine_kernel
        _INTERPRET = isinstance(combine_kernel, InterpretedFunction)
    return _INTERPRET


_INTERPRET = None


def triton_runs_on(device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


# torch.cuda.current_device() without its Python wrapper (on every call's path)
current_cuda_index = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# torch.cuda.is_current_stream_capturing() without its Python wrapper (on every call's path)
stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)


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
