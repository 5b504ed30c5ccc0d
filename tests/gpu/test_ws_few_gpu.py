"""The warp-specialized few-heads kernel for fp8 / fp8_ds_mla / nvfp4_ds_mla rows (sparsemla/kernels/ws_few.py)
on the H200: against the float64 reference, against the Triton kernels, k_scale, -1 padding, valid counts
with garbage past them, empty rows, odd head counts, splits.  Run with `pytest -m gpu`."""
import pytest
import torch

from sparsemla.kernels import ws_attention as ws
from sparsemla.reference import sparse_mla

import sys, os  # noqa: E401
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import check_ws_case, launch_case, make_case, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(c, sm_scale, k_scale, ws_kernel, splits=None):
    return launch_case(c, sm_scale, ws_kernel, splits, k_scale)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope", "nvfp4_ds_mla", "nvfp4_ds_mla-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(16, 2048, 1), (16, 2048, None), (1, 64, 1), (20, 2051, 3),
                                               (32, 192, None), (5, 2048, 2)])
def test_ws_few_matches_reference(fmt, heads, topk, splits):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is sm_90 only")
    k_scale = 0.5 if fmt.startswith("fp8-") or fmt == "fp8" else 1.0
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    assert ws.few_supported(c["q"], c["cache"].rows, c["fmt"].name, heads)
    # the Triton few-heads kernel on the same rows (both multiply in fp16 with fp32 accumulation)
    check_ws_case(c, c["fmt"].head_dim ** -0.5, k_scale, splits, 5e-3, 1e-3)


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
    assert not ws.few_supported(torch.zeros(1, 64, 576, dtype=torch.bfloat16, device="cuda"), kv, "fp8_ds_mla", 64)
