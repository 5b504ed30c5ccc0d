"""Merge of split-KV partials: ``out = sum_s exp(lse_s - lse) o_s``, ``lse = log sum_s exp(lse_s)``."""
from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_wait


@triton.jit
def combine_kernel(op_ptr, lp_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, H, num_splits,
                    SP: tl.constexpr, PDL: tl.constexpr):
    """out[t, h] = sum_s exp(lse_s - lse) o_s,  lse = log sum_s exp(lse_s).  Partials: o [T, S, H, 512] fp32
    (normalized), lse [T, S, H] fp32 natural log (-inf for an empty split).

    One program = one (token, head, 128-column chunk): all splits of the chunk are one [SP, 128] load, so
    a small batch (few tokens, up to 32 splits) is not a chain of per-split loads in a handful of programs.

    PDL: launched with programmatic dependent launch (sm_90+), so that its launch overlaps the attention
    kernel's last programs; ``griddepcontrol.wait`` then holds it until that kernel has finished and its
    partials are visible."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    sp = tl.arange(0, SP)
    sm = sp < num_splits
    lp = tl.load(lp_ptr + (t.to(tl.int64) * num_splits + sp) * H + h, mask=sm, other=float("-inf"))  # [SP]
    mx = tl.max(lp, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lp - mx_safe)  # 0 for empty splits (their partial output is never read)
    tot = tl.sum(w, 0)
    has = tot != 0  # NaN (a split's NaN lse) passes through to out and lse
    w = w * tl.where(has, 1.0 / tl.where(has, tot, 1.0), 0.0)
    d = c * 128 + tl.arange(0, 128)
    part = tl.load(op_ptr + ((t.to(tl.int64) * num_splits + sp[:, None]) * H + h) * 512 + d[None, :],
                   mask=(sm & (w > 0))[:, None], other=0.0)
    acc = tl.sum(part * w[:, None], 0)
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, acc.to(o_ptr.dtype.element_ty))
    if c == 0:
        lse = tl.where(has, mx_safe + tl.log(tl.where(has, tot, 1.0)), float("-inf"))
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h * stride_lh, lse)

