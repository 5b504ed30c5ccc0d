"""The FP8-QK mode (``fp8_qk=True``: q as two e4m3 terms and QK on e4m3 wgmma; the FP8_QK variants of
sm90/few.py and sm90/wide.py) on the H200: against the float64 reference, every fp8 / fp8_ds_mla layout (NoPE
with and without a rope slot), -1 padding, valid counts with garbage past them, empty rows, odd head counts,
splits, head groups, per-head q scales far apart, fp8_ds_mla group scales far apart and zero, k_scale, and
where the mode applies.  Run with `pytest -m gpu`.

Error budget against the float64 reference: q's two e4m3 terms hold bf16 q exactly (but for its smallest
elements), so the outputs are as close as the default mode's (1e-2); the e4m3 tensor cores accumulate with
~14 significant bits (sm90-few adds each 128-dim group's accumulator in fp32), which moves the scores and the lse by up to a few 1e-3 x |lse|: lse within LSE_TOL x
max(10, |lse|)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, lse_err, make_case, rel_err  # noqa: E402
from sm90_gpu import plan_for, run, scales_view, skip_unless_sm90  # noqa: E402

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.plan import plan_attention  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

pytestmark = pytest.mark.gpu

O_TOL = 1e-2
LSE_TOL = 1e-2
FORMATS = ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "fp8-nope"]


def _run(c, sm, kernel, k_scale=1.0, splits=None, fp8_qk=True):
    plan = plan_for(c, kernel, splits, fp8_qk=fp8_qk)
    assert plan.fp8_qk == fp8_qk, plan
    return run(c, sm, plan, k_scale)


def _check(c, sm, kernel, k_scale=1.0, splits=None):
    out, lse = _run(c, sm, kernel, k_scale, splits)
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], k_scale)
    fin = torch.isfinite(ref_l)
    scale = max(10.0, ref_l[fin].abs().max().item()) if fin.any() else 10.0
    assert torch.isfinite(out.float()).all(), f"seed {SEED}"
    assert rel_err(out, ref_o) <= O_TOL, (rel_err(out, ref_o), SEED)
    assert lse_err(lse, ref_l) <= LSE_TOL * scale, (lse_err(lse, ref_l), scale, SEED)
    empty = c["valid_counts"] == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,topk,splits", [(16, 2048, 1), (16, 2048, None), (1, 64, 1), (20, 2051, 3),
                                               (32, 192, None), (5, 2048, 2), (128, 2048, None), (70, 2051, 3)])
def test_fp8_qk_few_matches_reference(fmt, heads, topk, splits):
    skip_unless_sm90()
    k_scale = 0.5 if fmt.split("-")[0] == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    _check(c, c["fmt"].head_dim ** -0.5, "sm90-few", k_scale, splits)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens,heads,topk,splits", [(40, 64, 2048, None), (20, 128, 2051, 3), (7, 33, 256, 1),
                                                      (9, 70, 512, 2), (4, 64, 64, 1)])
def test_fp8_qk_wide_matches_reference(fmt, tokens, heads, topk, splits):
    skip_unless_sm90()
    k_scale = 0.5 if fmt.split("-")[0] == "fp8" else 1.0
    c = make_case(fmt, tokens, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    _check(c, c["fmt"].head_dim ** -0.5, "sm90-wide", k_scale, splits)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8"])
@pytest.mark.parametrize("kernel,tokens,heads", [("sm90-few", 3, 16), ("sm90-wide", 40, 64)])
def test_fp8_qk_head_scales_far_apart(fmt, kernel, tokens, heads):
    """q's e4m3 scale is a power of two per head: heads 2^-20 .. 2^20 apart, one all-zero head (its scale
    stays 1, its scores 0: uniform weights), and one head with a single huge element.  The outputs are checked
    on the heads up to 2^2: above, the softmax is one-hot over scores of ~1e6, where the e4m3 tensor cores'
    ~14-bit accumulation (an error of ~1e-4 of the score's size) may pick another of two rows whose scores
    are within ~100 of each other (the default mode's fp32 accumulation does not); their lse, which such a
    tie barely moves, is checked on every head."""
    skip_unless_sm90()
    c = make_case(fmt, tokens, heads, 512, ctx=1024, block_size=64, device="cuda")
    q = c["q"].float()
    e = torch.linspace(-20, 20, heads, device="cuda")
    q *= torch.exp2(e)[None, :, None]
    q[:, 3] = 0
    q[:, 5, 7] = 3e4
    c["q"] = q.to(torch.bfloat16)
    sm = 576 ** -0.5
    out, lse = _run(c, sm, kernel)
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"])
    fin = torch.isfinite(ref_l)
    assert torch.isfinite(out.float()).all(), f"seed {SEED}"
    small = e <= 2
    assert rel_err(out[:, small], ref_o[:, small]) <= O_TOL, (rel_err(out[:, small], ref_o[:, small]), SEED)
    d = (lse.double() - ref_l.double()).abs()[fin]  # per head: the scores' sizes differ by 2^40
    tol = LSE_TOL * ref_l.double().abs().clamp_min(10.0)[fin]
    assert (d <= tol).all(), ((d / tol).max().item(), SEED)
    empty = c["valid_counts"] == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope"])
def test_fp8_qk_few_q_groups_far_apart(fmt):
    """sm90-few scales q by a power of two per head and 128-dim group: q's four groups lie 2^-12 .. 2^3 apart
    within every head and the keys' groups the other way (through the rows' group scales), so that each group
    adds as much to the scores as the others.  With one scale per head the small groups' elements would fall
    below e4m3's subnormals and be lost (the sm90-wide variant keeps one scale per head)."""
    skip_unless_sm90()
    c = make_case(fmt, 3, 16, 512, ctx=1024, block_size=64, device="cuda")
    e = torch.tensor([-12.0, 0.0, -6.0, 3.0], device="cuda")
    q = c["q"].float()
    for k in range(4):
        q[..., 128 * k:128 * (k + 1)] *= torch.exp2(e[k])
    c["q"] = q.to(torch.bfloat16)
    scales_view(c).mul_(torch.exp2(-e))
    _check(c, c["fmt"].head_dim ** -0.5, "sm90-few")


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope"])
@pytest.mark.parametrize("kernel,tokens,heads", [("sm90-few", 3, 16), ("sm90-wide", 40, 64)])
def test_fp8_qk_group_scales_far_apart_and_zero(fmt, kernel, tokens, heads):
    """fp8_ds_mla rows whose four group scales lie up to 2^30 apart (each row's largest kept, the others divided
    by up to 2^30, so the ratios between consecutive groups reach 2^+-30 while the scores keep their size), and
    rows with a zero-scale group over garbage bytes (the wide kernel's FP8_QK variant rescales its accumulator
    by ratios of the scales between groups)."""
    skip_unless_sm90()
    c = make_case(fmt, tokens, heads, 512, ctx=1024, block_size=64, device="cuda")
    rows, sc = c["cache"].rows, scales_view(c)
    g = torch.Generator(device="cpu").manual_seed(SEED)
    n = rows.shape[0]
    e = torch.randint(-30, 1, (n, 4), generator=g).to(torch.float32)
    e -= e.max(dim=1, keepdim=True).values
    sc.mul_(torch.exp2(e).to(rows.device))
    zero = torch.randint(0, 8, (n,), generator=g).to(rows.device) == 0  # about 1 row in 8
    grp = torch.randint(0, 4, (n,), generator=g).to(rows.device)
    sc[zero, grp[zero]] = 0.0
    junk = torch.randint(0, 0x7F, (n, 128), generator=g, dtype=torch.uint8).to(rows.device)  # no NaN codes
    junk |= (torch.randint(0, 2, (n, 128), generator=g, dtype=torch.uint8) << 7).to(rows.device)
    for k in range(4):
        sel = zero & (grp == k)
        rows[sel, 128 * k:128 * (k + 1)] = junk[sel]
    _check(c, c["fmt"].head_dim ** -0.5, kernel)


@pytest.mark.parametrize("kernel,heads", [("sm90-few", 16), ("sm90-wide", 64)])
def test_fp8_qk_k_scale_applied_once(kernel, heads):
    """Plain fp8 rows written with k_scale 0.5: read with 0.5 the reference agrees, with 1.0 it must not."""
    skip_unless_sm90()
    c = make_case("fp8", 4, heads, 256, ctx=1024, block_size=64, device="cuda", k_scale=0.5)
    sm = 576 ** -0.5
    o_good, _ = _run(c, sm, kernel, 0.5)
    o_bad, _ = _run(c, sm, kernel, 1.0)
    ref_o, _ = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], 0.5)
    assert rel_err(o_good, ref_o) <= O_TOL
    assert rel_err(o_bad, ref_o) > 5e-2


def test_fp8_qk_where_it_applies():
    """Other formats refuse the mode with a reason; in both kernels the mode's results differ from the default
    mode's (it really ran)."""
    skip_unless_sm90()
    with pytest.raises(ValueError, match="fp8_qk"):
        plan_attention(get_format("nvfp4_ds_mla"), 2, 16, 64, capability=(9, 0), num_sms=132, fp8_qk=True)
    for kernel, tokens, heads in (("sm90-wide", 8, 128), ("sm90-few", 4, 16)):
        c = make_case("fp8_ds_mla", tokens, heads, 256, ctx=512, block_size=64, device="cuda")
        a, _ = _run(c, 0.1, kernel)
        b, _ = _run(c, 0.1, kernel, fp8_qk=False)
        assert not torch.equal(a, b)
