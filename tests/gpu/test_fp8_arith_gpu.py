"""The opt-in FP8-arithmetic mode (``sparse_mla_fwd(..., fp8_arith=True)``: q as two e4m3 terms and QK on e4m3
wgmma, the F8 variants of ws_few.py and ws_wide.py) on the H200: against the float64 reference, -1 padding,
valid counts with garbage past them, empty rows, odd head counts, splits, head groups, per-head q scales far
apart, fp8_ds_mla group scales far apart and zero, k_scale, and where the mode applies.  Run with
`pytest -m gpu`."""
import pytest
import torch

import sys, os  # noqa: E401
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, lse_err, make_case, rel_err  # noqa: E402

from sparsemla.kernels import ws_attention as ws  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

pytestmark = pytest.mark.gpu

# The mode's error budget against the float64 reference: q's two e4m3 terms hold bf16 q exactly (but for its
# smallest elements), so the outputs are as close as the default path's (1e-2 bound, 1.5e-3 - 3.8e-3 measured);
# the e4m3 tensor cores accumulate with ~14 significant bits, which moves the scores and the lse by up to
# ~2.7e-3 x |lse| (H200, eleventh session; BENCHMARKS.md section 12): lse within LSE_TOL x max(10, |lse|).
O_TOL = 1e-2
LSE_TOL = 1e-2


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8-arithmetic mode is sm_90 only")


def _run(c, sm, k_scale=1.0, splits=None, fp8_arith=True):
    t, h = c["q"].shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device="cuda")
    return sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm, c["valid_counts"], k_scale,
                          out=out, lse=lse, num_splits=splits, fp8_arith=fp8_arith)


def _check(c, sm, k_scale=1.0, splits=None):
    out, lse = _run(c, sm, k_scale, splits)
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], k_scale)
    fin = torch.isfinite(ref_l)
    scale = max(10.0, ref_l[fin].abs().max().item()) if fin.any() else 10.0
    assert torch.isfinite(out.float()).all(), f"seed {SEED}"
    assert rel_err(out, ref_o) <= O_TOL, (rel_err(out, ref_o), SEED)
    assert lse_err(lse, ref_l) <= LSE_TOL * scale, (lse_err(lse, ref_l), scale, SEED)
    empty = c["valid_counts"] == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    return out, lse


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(16, 2048, 1), (16, 2048, None), (1, 64, 1), (20, 2051, 3),
                                               (32, 192, None), (5, 2048, 2), (128, 2048, None), (70, 2051, 3)])
def test_fp8_arith_matches_reference(fmt, heads, topk, splits):
    _sm90()
    k_scale = 0.5 if fmt.startswith("fp8-") or fmt == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    assert ws.few_supported(c["q"], c["cache"].rows, c["fmt"].name, heads)
    _check(c, c["fmt"].head_dim ** -0.5, k_scale, splits)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope"])
@pytest.mark.parametrize("tokens,heads,topk,splits", [(40, 64, 2048, None), (20, 128, 2051, 3), (140, 33, 256, 1),
                                                      (40, 70, 512, 2), (34, 64, 64, 1)])
def test_fp8_arith_wide_matches_reference(fmt, tokens, heads, topk, splits):
    """Calls the wide kernel takes (ws_wide.py's F8 variant: 64 heads per program)."""
    _sm90()
    k_scale = 0.5 if fmt.startswith("fp8-") or fmt == "fp8" else 1.0
    c = make_case(fmt, tokens, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    assert ws.wide_q_supported(c["q"], c["cache"].rows, c["fmt"].name, heads)
    _check(c, c["fmt"].head_dim ** -0.5, k_scale, splits)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8"])
@pytest.mark.parametrize("tokens,heads", [(3, 16), (40, 64)])
def test_fp8_arith_head_scales_far_apart(fmt, tokens, heads):
    """q's e4m3 scale is a power of two per head: heads 2^-20 .. 2^20 apart, one all-zero head (its scale
    stays 1, its scores 0: uniform weights), and one head with a single huge element.  The outputs are checked
    on the heads up to 2^2: above, the softmax is one-hot over scores of ~1e6, where the e4m3 tensor cores'
    ~14-bit accumulation (an error of ~1e-4 of the score's size, BENCHMARKS.md section 12) may pick another of
    two rows whose scores are within ~100 of each other (the first version of this test, at 64 heads and 40
    tokens, failed that way: 2.5 % output error from a few near-ties; the default path's fp32 accumulation
    does not); their lse, which such a tie barely moves, is checked on every head."""
    _sm90()
    c = make_case(fmt, tokens, heads, 512, ctx=1024, block_size=64, device="cuda")
    q = c["q"].float()
    e = torch.linspace(-20, 20, heads, device="cuda")
    q *= torch.exp2(e)[None, :, None]
    q[:, 3] = 0
    q[:, 5, 7] = 3e4
    c["q"] = q.to(torch.bfloat16)
    sm = 576 ** -0.5
    out, lse = _run(c, sm)
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


@pytest.mark.parametrize("tokens,heads", [(3, 16), (40, 64)])
def test_fp8_arith_group_scales_far_apart_and_zero(tokens, heads):
    """fp8_ds_mla rows whose four group scales lie up to 2^30 apart (each row's largest kept, the others divided
    by up to 2^30, so the ratios between consecutive groups reach 2^+-30 while the scores keep their size: scaled
    up instead, the softmax turns one-hot over scores of ~1e9, where the e4m3 accumulation's ~1e-4 picks among
    near-tied rows, see test_fp8_arith_head_scales_far_apart), and rows with a zero-scale group over garbage
    bytes (ws_wide's F8 variant rescales its accumulator by ratios of the scales between groups)."""
    _sm90()
    c = make_case("fp8_ds_mla", tokens, heads, 512, ctx=1024, block_size=64, device="cuda")
    rows = c["cache"].rows
    sc = rows[:, 512:528].view(torch.float32)  # [rows, 4] group scales
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
    _check(c, 576 ** -0.5)


def test_fp8_arith_k_scale_applied_once():
    """Plain fp8 rows written with k_scale 0.5: read with 0.5 the reference agrees, with 1.0 it must not."""
    _sm90()
    c = make_case("fp8", 4, 16, 256, ctx=1024, block_size=64, device="cuda", k_scale=0.5)
    sm = 576 ** -0.5
    o_good, _ = _run(c, sm, 0.5)
    o_bad, _ = _run(c, sm, 1.0)
    ref_o, _ = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], 0.5)
    assert rel_err(o_good, ref_o) <= O_TOL
    assert rel_err(o_bad, ref_o) > 5e-2


def test_fp8_arith_where_it_applies():
    """Other formats raise; calls of both warp-specialized kernels (a large batch at 128 heads: ws_wide; a small
    one: ws_few) differ from the default path's (the mode really ran)."""
    _sm90()
    c = make_case("nvfp4_ds_mla", 2, 16, 64, ctx=256, block_size=64, device="cuda")
    with pytest.raises(ValueError, match="fp8_arith"):
        _run(c, 0.1)
    for tokens, heads, wide in ((300, 128, True), (4, 16, False)):
        c = make_case("fp8_ds_mla", tokens, heads, 256, ctx=512, block_size=64, device="cuda")
        assert ws.wide_q_supported(c["q"], c["cache"].rows, "fp8_ds_mla", heads) == wide
        a, _ = _run(c, 0.1)
        b, _ = _run(c, 0.1, fp8_arith=False)
        assert not torch.equal(a, b)
