"""A Triton probe of the cache-write conversion helpers (``e4m3_codes``, ``bf16_bits``, ``f32_from_e4m3``),
shared by the interpreter tests (tests/test_cache_write.py) and the H200 suite (tests/gpu/test_movement_gpu.py)."""
import torch
import triton
import triton.language as tl

from sparsemla.kernels.cache_write import _nvfp4_scale, _nvfp4_scale_bf16, bf16_bits, e4m3_codes, f32_from_e4m3


@triton.jit
def _convert_probe(x_ptr, e4_ptr, bf_ptr, back_ptr, N, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    q = e4m3_codes(x, EMULATE)
    tl.store(e4_ptr + o, q, mask=m)
    tl.store(bf_ptr + o, bf16_bits(x, EMULATE), mask=m)
    tl.store(back_ptr + o, f32_from_e4m3(q, EMULATE), mask=m)


def probe_conversions(x: torch.Tensor, emulate: bool):
    """fp32 ``x`` -> (e4m3 codes uint8, bf16 bits int16, the e4m3 codes decoded to fp32), by the kernel
    helpers (``emulate``: the bit-exact integer path, else the GPU's convert instructions)."""
    n = x.numel()
    e4 = torch.empty(n, dtype=torch.uint8, device=x.device)
    bf = torch.empty(n, dtype=torch.int16, device=x.device)
    back = torch.empty(n, dtype=torch.float32, device=x.device)
    _convert_probe[(triton.cdiv(n, 1024),)](x, e4, bf, back, n, EMULATE=emulate, BLOCK=1024)
    return e4, bf, back


@triton.jit
def _scale_probe(x_ptr, c1_ptr, s1_ptr, c2_ptr, s2_ptr, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    c1, s1 = _nvfp4_scale(x)
    c2, s2 = _nvfp4_scale_bf16(x)
    tl.store(c1_ptr + o, c1, mask=m)
    tl.store(s1_ptr + o, s1, mask=m)
    tl.store(c2_ptr + o, c2, mask=m)
    tl.store(s2_ptr + o, s2, mask=m)


def every_bf16_amax(device) -> torch.Tensor:
    """Every non-negative bf16 value from 0 to +inf, as fp32 (a block amax of bf16 input is one of them)."""
    return (torch.arange(0, 0x7F81, dtype=torch.int32, device=device) << 16).view(torch.float32)


def probe_nvfp4_scales(x: torch.Tensor):
    """fp32 block amax ``x`` -> (code, value) of the NVFP4 block scale by the general recipe
    (``_nvfp4_scale``) and by the bf16 shortcut (``_nvfp4_scale_bf16``): four tensors."""
    n = x.numel()
    c1 = torch.empty(n, dtype=torch.uint8, device=x.device)
    c2 = torch.empty_like(c1)
    s1 = torch.empty(n, dtype=torch.float32, device=x.device)
    s2 = torch.empty_like(s1)
    _scale_probe[(triton.cdiv(n, 1024),)](x, c1, s1, c2, s2, n, BLOCK=1024)
    return c1, s1, c2, s2
