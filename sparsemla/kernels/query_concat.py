"""The query as the attention kernels take it, from an engine's two parts: ``dst[t, h] = [q_nope[t, h], q_pe[t, h]]``.

vLLM hands a sparse MLA backend its query as a pair: ``ql_nope`` [T, H, 512] (the absorbed no-RoPE part) and
``q_pe`` [T, H, 64] (a strided view of the projection's output).  The kernels read one [T, H, 576] tensor, so the
pair is copied into a persistent buffer once per call.  ``torch.cat(..., out=)`` does the same copy on the GPU,
but spends most of a decode call's host time budget on its argument handling; this launcher goes through
:class:`~sparsemla.kernels.launch.Launch` (the compiled kernel's C launcher, a specialization key from the
integer arguments) instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch

HEADS_PER_PROGRAM = 16


@triton.jit
def query_concat_kernel(n_ptr, stride_nt, stride_nh, p_ptr, stride_pt, stride_ph, d_ptr, stride_dt, stride_dh, H,
                        NOPE: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr):
    """One program = one token x HB heads: ``NOPE`` values from ``n_ptr`` then ``ROPE`` from ``p_ptr`` per head
    (every last dim contiguous; strides in elements)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = (h < H)[:, None]
    hh = h.to(tl.int64)[:, None]
    c = tl.arange(0, NOPE)[None, :]
    dst = d_ptr + t * stride_dt + hh * stride_dh
    tl.store(dst + c, tl.load(n_ptr + t * stride_nt + hh * stride_nh + c, mask=hm), mask=hm)
    r = tl.arange(0, ROPE)[None, :]
    tl.store(dst + NOPE + r, tl.load(p_ptr + t * stride_pt + hh * stride_ph + r, mask=hm), mask=hm)


def query_concat(q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = concat(q_nope[t, h], q_pe[t, h])`` (arguments are not checked here: the caller does).

    Args:
        q_nope: ``[T, H, N]`` (N a power of two), q_pe: ``[T, H, R]`` (R a power of two), out: ``[T, H, N + R]``,
            one dtype, each with a contiguous last dim (any token / head strides).

    Returns ``out``.  One launch, no allocation, no host sync.
    """
    t, h, n = q_nope.shape
    r = q_pe.shape[2]
    if not t or not h:
        return out
    key = (n, r)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = Launch(query_concat_kernel, dict(NOPE=n, ROPE=r, HB=HEADS_PER_PROGRAM),
                                         dict(num_warps=4))
    ns, ps, ds = q_nope.stride(), q_pe.stride(), out.stride()
    pn, pp, pd = q_nope.data_ptr(), q_pe.data_ptr(), out.data_ptr()
    addrs = (pn, ns[0], ns[1], pp, ps[0], ps[1], pd, ds[0], ds[1], h)
    # ceil(h / HB) in Python: triton.cdiv is a jit function, ~4 us through its launcher when called from the host
    gy = -(-h // HEADS_PER_PROGRAM)
    # every pointer 16-byte aligned (and the one dtype): the integers decide Triton's specialization
    spec = None if (pn | pp | pd) & 15 else (q_nope.dtype, ns, ps, ds, h)
    if spec is None or not launch.launch_known(t, gy, 1, spec, addrs):
        launch((t, gy), (q_nope, ns[0], ns[1], q_pe, ps[0], ps[1], out, ds[0], ds[1], h), spec, addrs)
    return out


_LAUNCHES: dict = {}

__all__ = ["query_concat", "query_concat_kernel"]
