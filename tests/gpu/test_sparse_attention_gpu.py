"""Native and staged sparse attention on the H200 at real sizes, against the float64 reference.

Run with `pytest -m gpu`.  Every format, H in {1, 16, 20, 64, 128}, K in {64, 2048}, padding, valid counts
with garbage past them, empty rows, poisoned outputs, fresh heavy-tailed data each run.
"""
import pytest
import torch

import sparsemla
from sparsemla import plan as plan_mod
from sparsemla.formats import get_format
from sparsemla.kernels import attention as attn_mod
from sparsemla.kernels.staging import gather_topk_fp8
from sparsemla.reference import sparse_mla

import sys, os  # noqa: E401
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, lse_ref_err, make_case, rel_err, run_kernel  # noqa: E402

pytestmark = pytest.mark.gpu
FORMATS = ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16-nope", "fp8-nope", "fp8_ds_mla-nope",
           "nvfp4_ds_mla-nope"]


def _native(c, sm_scale, k_scale=1.0, **kw):
    return run_kernel(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm_scale, c["valid_counts"], k_scale, **kw)


def _check(out, lse, c, sm_scale, k_scale=1.0, tol=1e-2):
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm_scale, c["valid_counts"], k_scale)
    assert torch.isfinite(out.float()).all(), f"seed {SEED}"
    assert rel_err(out, ref_o) <= tol, (rel_err(out, ref_o), SEED)
    assert lse_ref_err(lse, ref_l) <= tol, (lse_ref_err(lse, ref_l), SEED)
    empty = c["valid_counts"] == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [1, 16, 20, 64, 128])
@pytest.mark.parametrize("topk", [64, 2048])
@pytest.mark.parametrize("portable", [False, True])
def test_native_gpu(fmt, heads, topk, portable):
    c = make_case(fmt, 6, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda")
    out, lse = _native(c, 576 ** -0.5, portable=portable)
    _check(out, lse, c, 576 ** -0.5)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("heads", [16, 20, 64, 128])
@pytest.mark.parametrize("portable", [False, True])
def test_query_in_two_tensors_gpu(fmt, heads, portable):
    """The query as an engine's pair: q_nope head-major, q_pe a strided view of a [T, H, 192] projection (read in
    place through its own pointer) -- bitwise the output of the one concatenated query, on every kernel."""
    c = make_case(fmt, 6, heads, 2048, ctx=4096, block_size=64, device="cuda")
    q = c["q"]
    t = q.shape[0]
    proj = torch.randn(t, heads, 192, device="cuda").to(torch.bfloat16)
    proj[..., 128:] = q[..., 512:]
    q_nope = torch.empty(heads, t, 512, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    q_nope.copy_(q[..., :512])
    plan = attn_mod.plan_for(q_nope, c["cache"].rows, c["fmt"], 2048, portable=portable, q_pe=proj[..., 128:])
    assert plan == attn_mod.plan_for(q, c["cache"].rows, c["fmt"], 2048, portable=portable)
    ref = _native(c, 576 ** -0.5, portable=portable)
    out = torch.full_like(ref[0], float("nan"))
    lse = torch.full_like(ref[1], float("nan"))
    attn_mod.attention_fwd(q_nope, c["cache"].rows, c["fmt"], c["indices"], 576 ** -0.5, plan=plan,
                           valid_counts=c["valid_counts"], out=out, lse=lse, q_pe=proj[..., 128:])
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_query_pair_with_an_unaligned_rope_part_gpu():
    """A q_pe whose rows are not 16-byte aligned cannot go to the Hopper kernels that copy q with 16-byte
    cp.async (sm90-conv, sm90-bf16): they refuse it; the call's plan serves it and matches the reference."""
    c = make_case("fp8_ds_mla", 6, 64, 2048, ctx=4096, block_size=64, device="cuda")
    q = c["q"]
    proj = torch.zeros(q.shape[0], 64, 200, device="cuda", dtype=torch.bfloat16)
    q_pe = proj[..., 131:195]  # 262 bytes into each 400-byte row
    q_pe.copy_(q[..., 512:])
    q_nope = q[..., :512]
    with pytest.raises(ValueError, match="16-byte aligned q"):
        attn_mod.plan_for(q_nope, c["cache"].rows, c["fmt"], 2048, q_pe=q_pe, kernel="sm90-conv")
    attn_mod.plan_for(q_nope, c["cache"].rows, c["fmt"], 2048, q_pe=proj[..., 128:192], kernel="sm90-conv")
    plan = attn_mod.plan_for(q_nope, c["cache"].rows, c["fmt"], 2048, q_pe=q_pe)
    assert plan.kernel != "sm90-conv", plan
    out, lse = attn_mod.attention_fwd(q_nope, c["cache"].rows, c["fmt"], c["indices"], 576 ** -0.5, plan=plan,
                                      valid_counts=c["valid_counts"], q_pe=q_pe)
    _check(out, lse, c, 576 ** -0.5)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16", "nvfp4_ds_mla"])
def test_a_kernel_that_does_not_build_falls_back(fmt, monkeypatch):
    """A Hopper kernel whose build fails (simulated) is recorded as unavailable, the call runs the portable kernels
    with the same result, and later plans skip it."""
    from triton.compiler.errors import CompilationError

    heads = 64 if fmt == "bf16" else 16
    c = make_case(fmt, 6, heads, 512, ctx=2048, block_size=64, device="cuda")
    want = plan_mod.plan_attention(fmt, 6, heads, 512).kernel
    assert want.startswith("sm90-")

    class Broken:  # the launcher's interface (sparsemla.kernels.launch.Launch) with a build that always fails
        built = False
        direct = False

        def launch_in(self, ctx, gx, gy, gz, key, addrs):
            return False  # never compiled

        def __call__(self, grid, args, key=None, addrs=None):
            raise CompilationError("simulated", None, "the installed Triton cannot build this kernel")

    monkeypatch.setattr(attn_mod, "_sm90_launch", lambda plan, fmt, has_vc, fused=False: Broken())
    monkeypatch.setattr(attn_mod, "_LAUNCHES", {})
    monkeypatch.setattr(attn_mod, "_BY_PLAN", {})
    monkeypatch.setattr(attn_mod, "_BOUND", {})
    plan_mod.clear_unavailable()
    try:
        out, lse = sparsemla.sparse_mla_decode(c["q"], c["cache"], c["indices"], 0.05, c["valid_counts"])
        _check(out, lse, c, 0.05)
        assert want in plan_mod.unavailable_kernels()
        assert "simulated" in plan_mod.unavailable_kernels()[want] or "CompilationError" in plan_mod.unavailable_kernels()[want]
        assert attn_mod.plan_for(c["q"], c["cache"].rows, c["fmt"], 512).kernel.startswith("portable-")
    finally:
        plan_mod.clear_unavailable()


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_splits_gpu(splits):
    c = make_case("nvfp4_ds_mla", 4, 16, 2048, ctx=8192, block_size=64, device="cuda")
    out, lse = _native(c, 0.05, num_splits=splits)
    _check(out, lse, c, 0.05)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_k_scale_gpu(fmt):
    c1 = make_case(fmt, 4, 16, 512, ctx=2048, device="cuda", seed=SEED + 7, k_scale=1.0)
    c5 = make_case(fmt, 4, 16, 512, ctx=2048, device="cuda", seed=SEED + 7, k_scale=0.5)
    o1, l1 = _native(c1, 0.05, 1.0)
    o5, l5 = _native(c5, 0.05, 0.5)
    _check(o1, l1, c1, 0.05, 1.0)
    _check(o5, l5, c5, 0.05, 0.5)
    ow, _ = _native(c5, 0.05, 1.0)
    if fmt == "fp8":
        assert rel_err(ow, o5) > 0.2
    else:
        assert torch.equal(o1, o5) and torch.equal(ow, o5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_staged_gpu(fmt):
    """Staged path exact on the staged values at real size; equal to native for plain fp8 (a byte copy)."""
    c = make_case(fmt, 6, 16, 2048, ctx=4096, block_size=64, device="cuda")
    staged = gather_topk_fp8(c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"], 1.0)
    fp8 = get_format("fp8", c["fmt"].rope_dim)
    o_s, l_s = run_kernel(c["q"], staged.view(torch.uint8).view(-1, staged.shape[2]), fp8, c["indices"], 0.05,
                          c["valid_counts"], 1.0, staged=True)
    t, k, d = staged.shape
    ws = staged.to(torch.float64).reshape(t * k, d)
    rows = torch.arange(t * k, device="cuda").view(t, k)
    idx = torch.where(c["indices"] >= 0, rows, torch.full_like(rows, -1))
    ref_o, ref_l = sparse_mla(c["q"].double(), ws, idx, 0.05, c["valid_counts"])
    assert rel_err(o_s, ref_o) <= 1e-2 and lse_ref_err(l_s, ref_l) <= 1e-2
    if fmt.startswith("fp8") and "ds" not in fmt:
        o_n, l_n = _native(c, 0.05)
        assert rel_err(o_s, o_n) < 2e-2
