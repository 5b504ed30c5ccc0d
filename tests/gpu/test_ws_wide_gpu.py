"""The warp-specialized wide kernel for fp8 / fp8_ds_mla rows at more than 32 heads (sparsemla/kernels/ws_wide.py)
on the H200: against the float64 reference, against the Triton wide kernel, k_scale, -1 padding, valid counts
with garbage past them, empty rows, head counts that are not a multiple of 64, odd block counts, splits.  Run
with `pytest -m gpu`."""
import pytest
import torch

from sparsemla.kernels import ws_attention as ws
from sparsemla.reference import sparse_mla

import sys, os  # noqa: E401
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, check_ws_case, launch_case, lse_err, make_case, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _any_size(monkeypatch):
    """The test cases are small (3-5 tokens): take the wide kernel where the dispatch would pick ws_few."""
    monkeypatch.setattr(ws, "FEW_WAVES", dict.fromkeys(ws.FEW_WAVES, 0))


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, None), (33, 64, 1), (100, 2051, 3),
                                               (64, 192, None), (128, 320, 2)])
def test_ws_wide_matches_reference(fmt, heads, topk, splits):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is sm_90 only")
    k_scale = 0.5 if fmt.startswith("fp8-") or fmt == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    assert ws.wide_q_supported(c["q"], c["cache"].rows, c["fmt"].name, heads)
    # the Triton wide kernel on the same rows: bf16 operands there, fp16 here, compared at the fp8 tolerance
    check_ws_case(c, c["fmt"].head_dim ** -0.5, k_scale, splits, 1e-2, 2e-3)


def test_ws_wide_k_scale_applied_once():
    """Plain fp8 rows written with k_scale 0.5 and read with 0.5: the reference agrees; read with 1.0 the
    result must differ (a missing or doubled 1/k_scale would pass one of the two)."""
    c = make_case("fp8", 4, 64, 256, ctx=1024, block_size=64, device="cuda", k_scale=0.5)
    sm = 576 ** -0.5
    o_good, _ = launch_case(c, sm, None, None, 0.5)
    o_bad, _ = launch_case(c, sm, None, None, 1.0)
    ref_o, _ = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], 0.5)
    assert rel_err(o_good, ref_o) <= 1e-2
    assert rel_err(o_bad, ref_o) > 5e-2


def test_ws_wide_ds_scales_far_apart():
    """fp8_ds_mla rows whose group scales differ by 2^20 between rows and groups: the A operands hold
    e4m3 x scale / (the row's largest scale), so nothing leaves fp16's range."""
    c = make_case("fp8_ds_mla", 3, 64, 256, ctx=1024, block_size=64, device="cuda")
    rows = c["cache"].rows
    scales = rows[:, 512:528].view(torch.float32)  # [rows, 4] fp32 scales
    g = torch.Generator(device="cuda").manual_seed(SEED)
    scales.mul_(torch.exp2(torch.randint(-10, 11, scales.shape, device="cuda", generator=g).float()))
    sm = 576 ** -0.5
    out, lse = launch_case(c, sm, None)
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"])
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref_o) <= 1e-2, (rel_err(out, ref_o), SEED)
    assert lse_err(lse, ref_l) <= 1e-2 * max(1.0, ref_l[torch.isfinite(ref_l)].abs().max().item() / 100)


def test_ws_wide_dispatch():
    kv = torch.zeros(64, 656, dtype=torch.uint8, device="cuda")
    want = torch.cuda.get_device_capability() == (9, 0)
    for h in (33, 64, 128):
        q = torch.zeros(1, h, 576, dtype=torch.bfloat16, device="cuda")
        assert ws.wide_q_supported(q, kv, "fp8_ds_mla", h) == want
        assert ws.wide_q_supported(q, kv, "fp8", h) == want
        assert not ws.wide_q_supported(q, kv, "nvfp4_ds_mla", h)
        assert not ws.wide_q_supported(q, kv, "bf16", h)
    q = torch.zeros(1, 32, 576, dtype=torch.bfloat16, device="cuda")
    assert not ws.wide_q_supported(q, kv, "fp8_ds_mla", 32)
