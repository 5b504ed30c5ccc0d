"""The warp-specialized few-heads kernel for fp8 / fp8_ds_mla / nvfp4_ds_mla rows (sparsemla/kernels/ws_few.py)
on the H200: against the float64 reference, against the Triton kernels, k_scale, -1 padding, valid counts
with garbage past them, empty rows, odd head counts, splits.  Run with `pytest -m gpu`."""
import pytest
import torch

from sparsemla.kernels import ws_attention as ws
from sparsemla.reference import sparse_mla

import sys, os  # noqa: E401
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, check_ws_case, launch_case, lse_err, make_case, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(c, sm_scale, k_scale, ws_kernel, splits=None):
    return launch_case(c, sm_scale, ws_kernel, splits, k_scale)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope", "nvfp4_ds_mla", "nvfp4_ds_mla-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(16, 2048, 1), (16, 2048, None), (1, 64, 1), (20, 2051, 3),
                                               (32, 192, None), (5, 2048, 2), (128, 2048, None), (70, 2051, 3)])
def test_ws_few_matches_reference(fmt, heads, topk, splits):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is sm_90 only")
    k_scale = 0.5 if fmt.startswith("fp8-") or fmt == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    assert ws.few_supported(c["q"], c["cache"].rows, c["fmt"].name, heads)
    # the Triton few-heads kernel on the same rows (both multiply in fp16 with fp32 accumulation)
    check_ws_case(c, c["fmt"].head_dim ** -0.5, k_scale, splits, 5e-3, 1e-3)


@pytest.mark.parametrize("heads,splits", [(16, 1), (16, None), (128, 1)])
def test_ws_few_ds_scales_far_apart(heads, splits):
    """fp8_ds_mla group scales 2^+-10 apart between rows and groups, and the first two blocks of every token
    (one per consumer warpgroup) with scales 2^30 larger than the rest and zero values: each warpgroup's group
    units must move up there and back down after (P x scale / unit in fp16 would otherwise flush the later
    blocks' values to zero), and the lazy units must stay exact (the float64 reference)."""
    c = make_case("fp8_ds_mla", 3, heads, 1024, ctx=2048, block_size=64, device="cuda")
    rows = c["cache"].rows
    scales = rows[:, 512:528].view(torch.float32)  # [rows, 4] fp32 scales
    g = torch.Generator(device="cuda").manual_seed(SEED)
    scales.mul_(torch.exp2(torch.randint(-10, 11, scales.shape, device="cuda", generator=g).float()))
    first = c["indices"][:, :128].reshape(-1)
    first = first[first >= 0].long()
    rows[first, :512] = 0
    scales[first] *= 2.0 ** 30
    sm = 576 ** -0.5
    out, lse = launch_case(c, sm, None, splits)
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"])
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref_o) <= 1e-2, (rel_err(out, ref_o), SEED)
    assert lse_err(lse, ref_l) <= 1e-2 * max(1.0, ref_l[torch.isfinite(ref_l)].abs().max().item() / 100)


def test_ws_few_k_scale_applied_once():
    """Plain fp8 rows written with k_scale 0.5 and read with 0.5: the reference agrees; read with 1.0 the
    result must differ (a missing or doubled 1/k_scale would pass one of the two)."""
    c = make_case("fp8", 4, 16, 256, ctx=1024, block_size=64, device="cuda", k_scale=0.5)
    sm = 576 ** -0.5
    o_good, _ = _run(c, sm, 0.5, None)
    o_bad, _ = _run(c, sm, 1.0, None)
    ref_o, _ = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], 0.5)
    assert rel_err(o_good, ref_o) <= 1e-2
    assert rel_err(o_bad, ref_o) > 5e-2


def test_ws_few_dispatch():
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(64, 656, dtype=torch.uint8, device="cuda")
    want = torch.cuda.get_device_capability() == (9, 0)
    assert ws.few_supported(q, kv, "fp8_ds_mla", 16) == want
    assert ws.few_supported(q, kv, "nvfp4_ds_mla", 16) == want
    assert not ws.few_supported(q, kv, "bf16", 16)
    # above 32 heads only while tokens x ceil(H / 16) programs fit in ws.FEW_WAVES waves (small batches)
    q64 = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device="cuda")
    assert ws.few_supported(q64, kv, "fp8_ds_mla", 64) == want
    assert not ws.few_supported(q64.expand(200, 64, 576), kv, "fp8_ds_mla", 64)
