"""Shared steps of the sm_90 kernels' GPU tests (tests/gpu/test_sm90_*_gpu.py): plans that force one kernel
and split count, a run with poisoned outputs through the one launcher, and the checks against the float64
reference and the portable Triton kernels."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, lse_err, lse_scale, make_case, rel_err  # noqa: E402

from sparsemla.kernels.attention import attention_fwd  # noqa: E402
from sparsemla.plan import plan_attention  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402


def skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernels need an sm_90 GPU")


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def plan_for(c, kernel=None, splits=None, fp8_qk=False, capability=(9, 0)):
    """The plan for case ``c`` (``kernel``: force one kernel; ``splits``: force a split count, with rows per
    split rounded up to the plan's block)."""
    t, h = c["q"].shape[:2]
    k = c["indices"].shape[1]
    plan = plan_attention(c["fmt"], t, h, k, capability=capability, num_sms=num_sms(), fp8_qk=fp8_qk, kernel=kernel)
    if kernel is not None:
        assert plan.kernel == kernel, plan
    if splits is not None:
        bn = plan.block_n
        rows = -(-(-(-k // splits)) // bn) * bn
        plan = dataclasses.replace(plan, num_splits=max(1, -(-k // rows)), rows_per_split=rows)
    return plan


def run(c, sm_scale, plan, k_scale=1.0):
    """attention_fwd on case ``c`` with ``plan``, outputs poisoned (NaN) first."""
    t, h = c["q"].shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=c["q"].device)
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=c["q"].device)
    return attention_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm_scale, plan=plan,
                         valid_counts=c["valid_counts"], k_scale=k_scale, out=out, lse=lse)


def check_reference(c, sm_scale, out, lse, k_scale=1.0, o_tol=1e-2, lse_tol=1e-2):
    """Finite, output within ``o_tol`` of the float64 reference (relative norm), lse within ``lse_tol`` x
    max(1, |lse| / 100) (heavy-tailed q gives |lse| ~1500, where one fp32 ulp is 1.2e-4), empty rows exactly
    0 / -inf."""
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm_scale, c["valid_counts"], k_scale)
    assert torch.isfinite(out.float()).all(), f"seed {SEED}"
    assert rel_err(out, ref_o) <= o_tol, (rel_err(out, ref_o), SEED)
    scale = lse_scale(ref_l)
    assert lse_err(lse, ref_l) <= lse_tol * scale, (lse_err(lse, ref_l), scale, SEED)
    empty = c["valid_counts"] == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    return ref_o, ref_l


def check_case(c, sm_scale, kernel, splits, k_scale=1.0, o_tol=5e-3, lse_tol=1e-3, fp8_qk=False):
    """``kernel`` on case ``c``: against the float64 reference (``check_reference``), then against the
    portable Triton kernels on the same rows (the plan for an sm_80 device): output within ``o_tol``, lse
    within ``lse_tol`` x max(1, |lse| / 100)."""
    plan = plan_for(c, kernel, splits, fp8_qk=fp8_qk)
    out, lse = run(c, sm_scale, plan, k_scale)
    _, ref_l = check_reference(c, sm_scale, out, lse, k_scale)
    portable = plan_for(c, None, splits, capability=(8, 0))
    assert portable.kernel.startswith("portable-"), portable
    o2, l2 = run(c, sm_scale, portable, k_scale)
    tol = lse_tol * lse_scale(ref_l)
    assert rel_err(out, o2) <= o_tol and lse_err(lse, l2) <= tol, (rel_err(out, o2), lse_err(lse, l2), SEED)
    return out, lse


def scales_view(c):
    """fp8_ds_mla rows' four fp32 group scales, [rows, 4] (a view: writes change the cache)."""
    off = c["fmt"].layout.scale_offset
    return c["cache"].rows[:, off:off + 16].view(torch.float32)


def check_k_scale_applied_once(kernel):
    """Plain fp8 rows written with k_scale 0.5 and read with 0.5 on ``kernel``: the reference agrees; read with
    1.0 the result must differ (a missing or doubled 1/k_scale would pass one of the two)."""
    c = make_case("fp8", 4, 64, 256, ctx=1024, block_size=64, device="cuda", k_scale=0.5)
    sm = 576 ** -0.5
    plan = plan_for(c, kernel)
    o_good, _ = run(c, sm, plan, 0.5)
    o_bad, _ = run(c, sm, plan, 1.0)
    ref_o, _ = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], 0.5)
    assert rel_err(o_good, ref_o) <= 1e-2
    assert rel_err(o_bad, ref_o) > 5e-2


def check_ds_scales_far_apart(fmt, kernel):
    """fp8_ds_mla rows (``fmt``) whose group scales differ by 2^20 between rows and groups, on ``kernel``."""
    c = make_case(fmt, 3, 64, 256, ctx=1024, block_size=64, device="cuda")
    scales = scales_view(c)
    g = torch.Generator(device="cuda").manual_seed(SEED)
    scales.mul_(torch.exp2(torch.randint(-10, 11, scales.shape, device="cuda", generator=g).float()))
    sm = c["fmt"].head_dim ** -0.5
    out, lse = run(c, sm, plan_for(c, kernel))
    check_reference(c, sm, out, lse)


@contextlib.contextmanager
def named_hand_off(module, kernel):
    """Inside: the sm_90 kernel of ``module`` (``sparsemla.kernels.sm90.conv`` or ``.bf16``; plan kernel ``kernel``)
    built with ``meta(named=True)`` -- its hand-offs between MMA warpgroups through named barriers -- which the
    plan does not choose (:func:`meta_variant`)."""
    with meta_variant(module, kernel, named=True):
        yield


@contextlib.contextmanager
def meta_variant(module, kernel, **options):
    """Inside: the sm_90 kernel of ``module`` (plan kernel ``kernel``) built with ``meta(**options)``, a variant the
    plan does not choose.  The launcher's caches are emptied on the way in and out, so that no launch of the
    default variant is reused, or kept; on the way out the kernel must have built (a kernel that fails to build
    is recorded and its calls served by the portable kernels, which would pass the checks)."""
    from sparsemla.kernels import attention
    from sparsemla.plan import unavailable_kernels

    def clear():
        for cache in (attention._BY_PLAN, attention._LAUNCHES, attention._BOUND):
            cache.clear()

    default = module.meta
    module.meta = lambda **kw: default(**dict(kw, **options))  # (options over what the launcher passes)
    clear()
    try:
        yield
    finally:
        module.meta = default
        clear()
    assert kernel not in unavailable_kernels(), unavailable_kernels()[kernel]
