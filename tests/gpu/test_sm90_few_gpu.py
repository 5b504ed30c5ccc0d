"""The sm_90 few-heads kernel for quantized rows (sparsemla/kernels/sm90/few.py, plan kernel ``sm90-few``) on
the H200: every format it reads, NoPE rows with and without a (zero) rope slot, against the float64 reference
and the portable Triton kernels; k_scale, -1 padding, valid counts with garbage past them, empty rows, odd
head counts, head groups above 32 heads, splits.  Run with `pytest -m gpu`."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, make_case, rel_err  # noqa: E402
from sm90_gpu import check_case, check_reference, plan_for, run, scales_view, skip_unless_sm90  # noqa: E402

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.plan import plan_attention  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

pytestmark = pytest.mark.gpu

FORMATS = ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "fp8-nope", "nvfp4_ds_mla",
           "nvfp4_ds_mla-nope", "nvfp4_ds_mla-nope-compact"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,topk,splits", [(16, 2048, 1), (16, 2048, None), (1, 64, 1), (20, 2051, 3),
                                               (32, 192, None), (5, 2048, 2), (128, 2048, None), (70, 2051, 3)])
def test_few_matches_reference(fmt, heads, topk, splits):
    skip_unless_sm90()
    k_scale = 0.5 if fmt.split("-")[0] == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    check_case(c, c["fmt"].head_dim ** -0.5, "sm90-few", splits, k_scale)


@pytest.mark.parametrize("heads,splits", [(16, 1), (16, None), (128, 1)])
def test_few_ds_scales_far_apart(heads, splits):
    """fp8_ds_mla group scales 2^+-10 apart between rows and groups, and the first two blocks of every token
    (one per consumer warpgroup) with scales 2^30 larger than the rest and zero values: each warpgroup's group
    units must move up there and back down after (P x scale / unit in fp16 would otherwise flush the later
    blocks' values to zero), and the lazy units must stay exact (the float64 reference)."""
    skip_unless_sm90()
    c = make_case("fp8_ds_mla", 3, heads, 1024, ctx=2048, block_size=64, device="cuda")
    rows, scales = c["cache"].rows, scales_view(c)
    g = torch.Generator(device="cuda").manual_seed(SEED)
    scales.mul_(torch.exp2(torch.randint(-10, 11, scales.shape, device="cuda", generator=g).float()))
    first = c["indices"][:, :128].reshape(-1)
    first = first[first >= 0].long()
    rows[first, :512] = 0
    scales[first] *= 2.0 ** 30
    sm = 576 ** -0.5
    out, lse = run(c, sm, plan_for(c, "sm90-few", splits))
    check_reference(c, sm, out, lse)


def test_few_k_scale_applied_once():
    """Plain fp8 rows written with k_scale 0.5 and read with 0.5: the reference agrees; read with 1.0 the
    result must differ (a missing or doubled 1/k_scale would pass one of the two)."""
    skip_unless_sm90()
    c = make_case("fp8", 4, 16, 256, ctx=1024, block_size=64, device="cuda", k_scale=0.5)
    sm = 576 ** -0.5
    plan = plan_for(c, "sm90-few")
    o_good, _ = run(c, sm, plan, 0.5)
    o_bad, _ = run(c, sm, plan, 1.0)
    ref_o, _ = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], 0.5)
    assert rel_err(o_good, ref_o) <= 1e-2
    assert rel_err(o_bad, ref_o) > 5e-2


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "nvfp4_ds_mla", "nvfp4_ds_mla-nope-compact"])
def test_few_is_planned_for_few_heads(fmt):
    skip_unless_sm90()
    assert plan_attention(get_format(fmt), 1, 16, 2048, capability=(9, 0), num_sms=132).kernel == "sm90-few"
