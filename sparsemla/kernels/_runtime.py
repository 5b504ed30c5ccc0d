"""When can a Triton kernel run on a tensor?"""
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
