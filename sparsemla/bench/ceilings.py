"""Measure the device's ceilings in the same run as the figures they normalise.

* copy bandwidth: one large device-to-device copy, counting bytes read + written (a kernel that
  gathers rows and writes a small output can at best stream like this);
* dense bf16 matmul TFLOP/s (square, large enough to be compute-bound);
* fp8 e4m3 ``torch._scaled_mm`` TFLOP/s where the GPU and PyTorch have it (informational: our
  kernels compute in bf16 by default, so SOL uses the bf16 ceiling).

On CPU the same functions run small fp32 problems; the numbers only make CPU-path figures
self-consistent.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .accounting import Ceilings
from .timing import time_fn


def measure_copy_bandwidth(device, nbytes: Optional[int] = None, reps: int = 20) -> float:
    """Bytes read + written per second of ``dst.copy_(src)`` (1 GiB on GPU, 64 MiB on CPU)."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 256)  # real data, not a fresh zero page
    dst = torch.empty_like(src)
    # The copy is 4x larger than any L2, so flushing would only add noise.
    t = time_fn(lambda: dst.copy_(src), device=device, reps=reps, warmup=3, flush_l2=False)
    return 2 * nbytes / t.median_s


def measure_matmul(device, n: Optional[int] = None, dtype=None, reps: int = 20) -> Tuple[float, str]:
    """(FLOP/s, dtype name) of an ``n x n x n`` matmul: bf16 8192 on GPU, fp32 1024 on CPU."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b, device=device, reps=reps, warmup=3, flush_l2=False)
    return 2 * n ** 3 / t.median_s, str(dtype).replace("torch.", "")


def measure_fp8_matmul(device, n: int = 8192, reps: int = 20) -> Tuple[Optional[float], str]:
    """(FLOP/s, note) of ``torch._scaled_mm`` on e4m3 operands; (None, why) where it cannot run."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "fp8 matmul: CUDA only"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return None, "fp8 matmul: this PyTorch has no torch._scaled_mm"
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        # _scaled_mm wants the second operand column-major.
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device, dtype=torch.float32)

        def mm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        mm()
        t = time_fn(mm, device=device, reps=reps, warmup=3, flush_l2=False)
    except Exception as e:  # e.g. a GPU without fp8 tensor cores
        return None, f"fp8 matmul unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return 2 * n ** 3 / t.median_s, "e4m3 torch._scaled_mm"


def measure_ceilings(device=None, *, quick: bool = False) -> Ceilings:
    """All ceilings of ``device`` (default: the current CUDA device, else CPU)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    reps = 5 if quick else 20
    copy = measure_copy_bandwidth(device, reps=reps)
    mm, mm_dtype = measure_matmul(device, reps=reps)
    fp8, note = measure_fp8_matmul(device, reps=reps) if device.type == "cuda" else (None, "")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(device=name, copy_bytes_per_s=copy, matmul_flop_per_s=mm, fp8_flop_per_s=fp8,
                    matmul_dtype=mm_dtype, note=note)


def format_ceilings(c: Ceilings) -> str:
    """One line for logs and tables."""
    s = (f"ceilings on {c.device}: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s (read+write), "
         f"{c.matmul_dtype} matmul {c.matmul_flop_per_s / 1e12:.1f} TFLOP/s")
    if c.fp8_flop_per_s:
        s += f", fp8 matmul {c.fp8_flop_per_s / 1e12:.1f} TFLOP/s"
    elif c.note:
        s += f" ({c.note})"
    return s


__all__ = ["measure_copy_bandwidth", "measure_matmul", "measure_fp8_matmul", "measure_ceilings", "format_ceilings"]
