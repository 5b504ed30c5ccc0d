"""The sm_90 wide kernel for fp8 / fp8_ds_mla rows (sparsemla/kernels/sm90/wide.py, plan kernel ``sm90-wide``,
64 heads per program) on the H200, forced by the plan: every format it reads, NoPE rows with and without a
(zero) rope slot, against the float64 reference and the portable Triton kernels; k_scale, -1 padding, valid
counts with garbage past them, empty rows, head counts that are not a multiple of 64, odd block counts,
splits.  Run with `pytest -m gpu`."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import make_case  # noqa: E402
from sm90_gpu import (check_case, check_ds_scales_far_apart, check_k_scale_applied_once,  # noqa: E402
                      skip_unless_sm90)

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.plan import plan_attention  # noqa: E402

pytestmark = pytest.mark.gpu

FORMATS = ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "fp8-nope"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, None), (33, 64, 1), (100, 2051, 3),
                                               (64, 192, None), (128, 320, 2)])
def test_wide_matches_reference(fmt, heads, topk, splits):
    skip_unless_sm90()
    k_scale = 0.5 if fmt.split("-")[0] == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    # the portable wide kernel multiplies bf16 operands, this one fp16: compared at the fp8 tolerance
    check_case(c, c["fmt"].head_dim ** -0.5, "sm90-wide", splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


def test_wide_k_scale_applied_once():
    """Plain fp8 rows written with k_scale 0.5 and read with 0.5: the reference agrees; read with 1.0 the
    result must differ (a missing or doubled 1/k_scale would pass one of the two)."""
    skip_unless_sm90()
    check_k_scale_applied_once("sm90-wide")


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope"])
def test_wide_ds_scales_far_apart(fmt):
    """fp8_ds_mla rows whose group scales differ by 2^20 between rows and groups: the A operands hold
    e4m3 x scale / (the row's largest scale), so nothing leaves fp16's range."""
    skip_unless_sm90()
    check_ds_scales_far_apart(fmt, "sm90-wide")


@pytest.mark.parametrize("fmt, fp8_qk", [("fp8", True), ("fp8_ds_mla", True)])
def test_wide_is_planned_for_large_batches(fmt, fp8_qk):
    """Above 32 heads the FP8-QK mode runs here (sm90-conv, which takes these rows otherwise, has none)."""
    skip_unless_sm90()
    plan = plan_attention(get_format(fmt), 128, 128, 2048, capability=(9, 0), num_sms=132, fp8_qk=fp8_qk)
    assert plan.kernel == "sm90-wide"
