"""Native sparse-attention kernels vs the float64 reference, under the Triton interpreter (small shapes).

The same checks run at real sizes on the H200 in tests/gpu/test_sparse_attention_gpu.py.
"""
import pytest
import torch

from sparsemla.kernels.sparse_attention import sparse_mla_fwd, sparse_mla_fwd_staged
from sparsemla.kernels.staging import gather_topk_fp8
from sparsemla.reference import sparse_mla

from attn_cases import SEED, lse_err, make_case, rel_err

FORMATS = ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16-nope", "fp8-nope", "fp8_ds_mla-nope",
           "nvfp4_ds_mla-nope"]
TOL = 1e-2


def _run_native(c, sm_scale, k_scale=1.0, **kw):
    t, h = c["q"].shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=c["q"].device)  # poisoned
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=c["q"].device)
    return sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm_scale, c["valid_counts"], k_scale,
                          out=out, lse=lse, **kw)


def _check(out, lse, c, sm_scale, k_scale=1.0, tol=TOL):
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm_scale, c["valid_counts"], k_scale)
    assert torch.isfinite(out.float()).all(), f"non-finite output (seed {SEED})"
    assert rel_err(out, ref_o) <= tol, (rel_err(out, ref_o), SEED)
    assert lse_err(lse, ref_l) <= tol, (lse_err(lse, ref_l), SEED)
    empty = c["valid_counts"] == 0
    if empty.any():
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [1, 5, 20])
def test_native_matches_reference(fmt, heads, device):
    c = make_case(fmt, 3, heads, 48, device=device)
    out, lse = _run_native(c, 0.07, num_splits=2)
    _check(out, lse, c, 0.07)


@pytest.mark.parametrize("splits", [1, 3])
def test_split_kv_and_combine(splits, device):
    c = make_case("fp8_ds_mla", 3, 16, 96, device=device)
    out, lse = _run_native(c, 0.05, num_splits=splits)
    _check(out, lse, c, 0.05)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_k_scale_is_applied_once(fmt, device):
    """k_scale changes the values of the plain fp8 format only; a missing or doubled 1/k_scale fails here."""
    c1 = make_case(fmt, 3, 4, 32, device=device, seed=SEED + 1, k_scale=1.0)
    c5 = make_case(fmt, 3, 4, 32, device=device, seed=SEED + 1, k_scale=0.5)
    o1, l1 = _run_native(c1, 0.1, k_scale=1.0, num_splits=1)
    o5, l5 = _run_native(c5, 0.1, k_scale=0.5, num_splits=1)
    _check(o1, l1, c1, 0.1, 1.0)
    _check(o5, l5, c5, 0.1, 0.5)
    # Same source data: the two caches decode to (nearly, for fp8 rounding) the same tokens.
    assert rel_err(o5, o1) < 0.1
    if fmt != "fp8":
        # The cache bytes do not depend on k_scale, and neither may the result.
        assert torch.equal(c1["cache"].rows, c5["cache"].rows)
        assert torch.equal(o1, o5)
    # Wrong k_scale at read time must be visible (guards against the factor being ignored).
    ow, _ = _run_native(c5, 0.1, k_scale=1.0, num_splits=1)
    if fmt == "fp8":
        assert rel_err(ow, o5) > 0.2
    else:
        assert torch.equal(ow, o5)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "nvfp4_ds_mla-nope"])
@pytest.mark.parametrize("k_scale", [1.0, 0.5])
def test_staged_agrees_with_native(fmt, k_scale, device):
    c = make_case(fmt, 3, 5, 40, device=device, k_scale=k_scale if fmt.startswith("fp8") and "ds" not in fmt else 1.0)
    o_n, l_n = _run_native(c, 0.08, k_scale=k_scale)
    staged = gather_topk_fp8(c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"], k_scale)
    o_s, l_s = sparse_mla_fwd_staged(c["q"], staged, c["indices"], 0.08, c["valid_counts"], k_scale, num_splits=2)
    # Staging re-rounds to e4m3: within the fp8 tolerance of the native result.
    assert rel_err(o_s, o_n) < 0.08, rel_err(o_s, o_n)
    assert lse_err(l_s, l_n) < 0.08
    if fmt == "fp8":
        _check(o_s, l_s, c, 0.08, k_scale)


def test_no_valid_entry_anywhere(device):
    c = make_case("fp8_ds_mla", 2, 3, 16, device=device)
    c["indices"].fill_(-1)
    out, lse = _run_native(c, 0.1)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_bad_arguments(device):
    c = make_case("bf16", 2, 2, 16, device=device)
    with pytest.raises(ValueError, match="kv_rows"):
        sparse_mla_fwd(c["q"], c["cache"].rows[:, :100].contiguous(), c["fmt"], c["indices"], 0.1)
    with pytest.raises(TypeError, match="q"):
        sparse_mla_fwd(c["q"].float(), c["cache"].rows, c["fmt"], c["indices"], 0.1)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"].long(), 0.1)
