"""The sm_90 converting-producer kernel for quantized rows (sparsemla/kernels/sm90/conv.py, plan kernel
``sm90-conv``, 64 heads per program; planned for fp8_ds_mla and nvfp4_ds_mla above 32 heads) on the H200,
forced here: every format it reads, NoPE rows with and without a (zero) rope slot, against the float64 reference and the portable Triton kernels; k_scale,
-1 padding, valid counts with garbage past them, no valid counts, empty rows, head counts that are not a
multiple of 64, odd block counts, forced splits, strided q, poisoned outputs.  Run with `pytest -m gpu`."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, make_case, rel_err  # noqa: E402
from sm90_gpu import (check_case, check_ds_scales_far_apart, check_k_scale_applied_once,  # noqa: E402
                      check_reference, meta_variant, plan_for, run, skip_unless_sm90)

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels.attention import attention_fwd, split_elements  # noqa: E402
from sparsemla.plan import plan_attention, unavailable_kernels  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _conv_built():
    """A kernel that fails to build at its first launch is recorded and the call runs the portable kernels,
    which would pass these checks: each test also asserts that sm90-conv built."""
    yield
    assert "sm90-conv" not in unavailable_kernels(), unavailable_kernels()["sm90-conv"]

KERNEL = "sm90-conv"
FORMATS = ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "fp8-nope",
           "nvfp4_ds_mla", "nvfp4_ds_mla-nope", "nvfp4_ds_mla-nope-compact", "bf16", "bf16-nope"]


def _k_scale(fmt):
    return 0.5 if fmt.split("-")[0] == "fp8" else 1.0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, None), (33, 64, 1), (48, 192, None),
                                               (96, 2051, 3), (128, 320, 2), (64, 2048, 32)])
def test_conv_matches_reference(fmt, heads, topk, splits):
    skip_unless_sm90()
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    # bf16 tiles, as the portable wide kernel's: compared at the quantized formats' tolerance
    check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "nvfp4_ds_mla-nope"])
@pytest.mark.parametrize("splits", [1, 4])
def test_conv_strided_q(fmt, splits):
    """q a view with padded head and token strides (16-byte aligned rows, what the kernel's cp.async needs)."""
    skip_unless_sm90()
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 4, 96, 512, ctx=2048, block_size=64, device="cuda", k_scale=k_scale)
    t, h, d = c["q"].shape
    big = torch.full((t, h + 3, d + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    big[:, :h, :d] = c["q"]
    c["q"] = big[:, :h, :d]
    assert c["q"].stride() == ((h + 3) * (d + 64), d + 64, 1)
    check_case(c, d ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8-nope", "nvfp4_ds_mla"])
def test_conv_without_valid_counts(fmt):
    """The variant without valid counts: -1 padding (in the middle and at the tail) only."""
    skip_unless_sm90()
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 3, 64, 448, ctx=2048, block_size=64, device="cuda", k_scale=k_scale)
    c["indices"][1, 100:] = -1  # instead of garbage past a valid count
    c["indices"][2, :] = -1     # the empty row, by padding alone
    c["valid_counts"] = None
    sm = c["fmt"].head_dim ** -0.5
    for splits in (1, 3):
        out, lse = run(c, sm, plan_for(c, KERNEL, splits), k_scale)
        ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, None, k_scale)
        assert torch.isfinite(out.float()).all()
        assert rel_err(out, ref_o) <= 1e-2, (rel_err(out, ref_o), SEED)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
        ok = torch.isfinite(ref_l)
        assert (lse[ok] - ref_l[ok].float()).abs().max() <= 2e-3 * max(1.0, ref_l[ok].abs().max().item() / 100)


def test_conv_k_scale_applied_once():
    """Plain fp8 rows written with k_scale 0.5 and read with 0.5: the reference agrees; read with 1.0 the
    result must differ (a missing or doubled 1/k_scale would pass one of the two)."""
    skip_unless_sm90()
    check_k_scale_applied_once(KERNEL)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope"])
def test_conv_ds_scales_far_apart(fmt):
    """fp8_ds_mla rows whose group scales differ by 2^20 between rows and groups (powers of two: the bf16
    tile holds e4m3 x scale exactly)."""
    skip_unless_sm90()
    check_ds_scales_far_apart(fmt, KERNEL)


@pytest.mark.parametrize("fmt", ["nvfp4_ds_mla", "fp8", "nvfp4_ds_mla-nope"])
def test_conv_fp16_q_across_the_bf16_range(fmt):
    """fp16 tiles (nvfp4, fp8): q is converted to fp16 per head times a power of two.  Heads whose q spans
    2^-100 .. 2^100 (far outside fp16's range), one head all zeros, one with a single huge entry among tiny
    ones: against the float64 reference.  sm_scale is shrunk with the largest head so that its scores stay
    finite in fp32."""
    skip_unless_sm90()
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 3, 64, 512, ctx=1024, block_size=64, device="cuda", k_scale=k_scale)
    q = c["q"].float()
    exps = torch.linspace(-100, 100, q.shape[1], device="cuda").round()
    q = q * torch.exp2(exps)[None, :, None]
    q[:, 5] = 0.0
    q[:, 6] = q[:, 6] * 2.0 ** -40
    q[:, 6, 7] = 2.0 ** 40
    c["q"] = q.to(torch.bfloat16)
    sm = 2.0 ** -110
    plan = plan_for(c, KERNEL, 1)
    out, lse = run(c, sm, plan, k_scale)
    check_reference(c, sm, out, lse, k_scale)


def test_conv_one_token_many_splits_and_poisoned_split_buffers():
    """One token, a split per 64-row block, a caller's split buffer full of NaN: every partial is written."""
    skip_unless_sm90()
    c = make_case("nvfp4_ds_mla", 1, 128, 2048, ctx=4096, block_size=64, device="cuda")
    sm = 576 ** -0.5
    plan = plan_for(c, KERNEL, 32)
    assert plan.num_splits == 32
    buf = torch.full((split_elements(plan, 1, 128),), float("nan"), dtype=torch.float32, device="cuda")
    out = torch.full((1, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((1, 128), float("nan"), dtype=torch.float32, device="cuda")
    attention_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm, plan=plan, valid_counts=c["valid_counts"],
                  out=out, lse=lse, split_buffers=buf)
    check_reference(c, sm, out, lse)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "nvfp4_ds_mla"])
def test_conv_planned_for_quantized_rows(fmt):
    """The plan gives sm90-conv fp8, fp8_ds_mla and nvfp4 rows above 32 heads past the few-heads kernel's waves."""
    skip_unless_sm90()
    kernel = plan_attention(get_format(fmt), 128, 128, 2048, capability=(9, 0), num_sms=132).kernel
    assert kernel == KERNEL


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "nvfp4_ds_mla", "bf16", "nvfp4_ds_mla-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2051, 3), (33, 64, 1), (96, 320, 2)])
def test_conv_other_hand_off_matches_reference(fmt, heads, topk, splits):
    """The hand-off between the MMA warpgroups a kind does not take by default (``conv.meta(named=...)``: named
    barriers for bf16 rows, mbarriers for the quantized kinds): the same checks as the default's (one block, odd
    block counts, splits, head counts that are not a multiple of 64)."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import conv
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    named = not conv.TUNED[c["fmt"].name].get("named", False)
    with meta_variant(conv, KERNEL, named=named):
        check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope", "nvfp4_ds_mla",
                                 "nvfp4_ds_mla-nope", "nvfp4_ds_mla-nope-compact"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (96, 2051, 3), (128, 320, 2)])
def test_conv_l2_hint_matches_reference(fmt, heads, topk, splits):
    """The producer's loads through the read-only path with an L2 prefetch hint (``conv.meta(l2_hint=True)``;
    invalid rows read row 0 and are zeroed): the default's checks, -1 padding and garbage past a valid count
    included (make_case)."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import conv
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 5, heads, topk, ctx=4096, block_size=64, device="cuda", k_scale=k_scale)
    with meta_variant(conv, KERNEL, l2_hint=True):
        check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "nvfp4_ds_mla",
                                 "nvfp4_ds_mla-nope", "nvfp4_ds_mla-nope-compact", "bf16"])
@pytest.mark.parametrize("heads,topk,splits,options", [
    (64, 2048, 1, dict(early=True)), (33, 64, 1, dict(early=True)), (96, 2051, 3, dict(early=True, late_next=True)),
    (64, 2048, 1, dict(late_next=True)), (64, 2048, 1, dict(lean_fences=True)),
    (96, 2051, 3, dict(early=True, late_next=True, lean_fences=True)),
    (128, 2048, None, dict(early=True, late_next=True, lean_fences=True)),
    (64, 2048, 32, dict(early=True, late_next=True, lean_fences=True)),
    (64, 2048, 1, dict(idx_ahead=True)), (33, 64, 1, dict(idx_ahead=True)), (96, 2051, 3, dict(idx_ahead=True)),
    (128, 320, 2, dict(idx_ahead=True, early=True, late_next=True, lean_fences=True)),
    (96, 2051, 3, dict(idx_ahead=True, l2_hint=True)),
    (64, 2048, 1, dict(free_first=True)), (33, 64, 1, dict(free_first=True)), (96, 2051, 3, dict(free_first=True)),
    (128, 2048, None, dict(free_first=True)), (64, 2048, 32, dict(free_first=True)),
    (128, 320, 2, dict(free_first=True, early=False, late_next=False, lean_fences=False)),
    (64, 2048, 1, dict(early_idx=True)), (33, 64, 1, dict(early_idx=True)), (96, 2051, 3, dict(early_idx=True)),
    (128, 2048, None, dict(early_idx=True)), (64, 2048, 32, dict(early_idx=True)),
    (128, 320, 2, dict(early_idx=True, idx_ahead=True)),
    (64, 2048, 1, dict(smem_out=True)), (33, 64, 1, dict(smem_out=True)), (96, 2051, 3, dict(smem_out=True)),
    (128, 2048, 1, dict(smem_out=True, early_idx=True)), (100, 320, 2, dict(smem_out=True))],
    ids=lambda v: "+".join(f"{k}={int(x)}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_conv_early_loads_match_reference(fmt, heads, topk, splits, options):
    """Every value piece's loads issued before the producer's free wait (``conv.meta(early=True)``), the next
    block's first pieces loaded after its fence (``late_next=True``), the consumers' in-loop proxy fences left to
    the writers (``lean_fences=True``), the rows looked up two blocks ahead (``idx_ahead=True``), warpgroup 0
    freeing a tile before its wait for the next (``free_first=True``), the indices prefetched and loaded without
    waiting for the valid count (``early_idx=True``), the output through a tile (``smem_out=True``), alone and
    together: one block, odd block counts, splits (one block each at 32), head counts that are not a multiple of
    64, NoPE rows with and without a rope slot."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import conv
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    with meta_variant(conv, KERNEL, **options):
        check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "fp8-nope",
                                 "nvfp4_ds_mla", "nvfp4_ds_mla-nope", "nvfp4_ds_mla-nope-compact"])
@pytest.mark.parametrize("heads,topk,splits,options", [
    (64, 2048, 1, {}), (33, 64, 1, {}), (96, 2051, 3, {}), (128, 2048, None, {}), (64, 2048, 32, {}),
    (64, 2048, 1, dict(idx_ahead=True)), (96, 2051, 3, dict(idx_ahead=True)), (33, 64, 1, dict(idx_ahead=True)),
    (128, 320, 2, dict(idx_ahead=False, early=False, late_next=False))],
    ids=lambda v: "+".join(f"{k}={int(x)}" for k, x in v.items()) or "alone" if isinstance(v, dict) else None)
def test_conv_row_prefetch_matches_reference(fmt, heads, topk, splits, options):
    """The producer prefetching the next block's rows into L2 (``conv.meta(row_prefetch=True)``), the block after
    next with ``idx_ahead``, beside the kind's other options: one block, odd block counts, splits, head counts that
    are not a multiple of 64, NoPE rows, -1 padding and garbage past the valid counts (a prefetch of an invalid row
    reads row 0)."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import conv
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    with meta_variant(conv, KERNEL, row_prefetch=True, **options):
        check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope", "nvfp4_ds_mla",
                                 "nvfp4_ds_mla-nope-compact", "bf16", "bf16-nope"])
@pytest.mark.parametrize("tokens,heads,topk,splits", [(140, 128, 320, 1), (150, 96, 2051, 2), (300, 64, 130, 1),
                                                      (5, 33, 64, 1), (70, 128, 200, 3)])
def test_conv_persistent_matches_reference(fmt, tokens, heads, topk, splits):
    """The persistent grid (``conv.meta(persist=True)``): more work items than SMs, so that each program serves
    several in turn (its tiles' phases, q and the hand-offs carried from one item to the next), with empty items
    among them (valid counts of 0, and of 5 with splits past them) and the kind's default options."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import conv
    k_scale = _k_scale(fmt)
    c = make_case(fmt, tokens, heads, topk, ctx=max(256, topk + 64), block_size=64, device="cuda",
                  k_scale=k_scale)
    vc = c["valid_counts"]
    vc[::7] = 0
    vc[3::11] = 5
    with meta_variant(conv, KERNEL, persist=True):
        check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, k_scale, o_tol=1e-2, lse_tol=2e-3)


@pytest.mark.parametrize("fmt", ["bf16", "bf16-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (33, 64, 1), (96, 2051, 3), (128, 320, 2)])
def test_conv_bf16_rows64_matches_reference(fmt, heads, topk, splits):
    """bf16 rows gathered 64 contiguous bytes of 8 rows a warp instruction (``conv.meta(rows128=False)``; the
    default gathers 128 bytes of 4 rows)."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import conv
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda")
    with meta_variant(conv, KERNEL, rows128=False):
        check_case(c, c["fmt"].head_dim ** -0.5, KERNEL, splits, 1.0, o_tol=1e-2, lse_tol=2e-3)


CLUSTER_SHAPES = [(5, 128, 2048, 1), (5, 128, 2051, 3), (3, 65, 64, 1), (4, 96, 320, 2), (1, 128, 2048, 32),
                  (128, 128, 2048, 1)]


def _skip_unless_cluster():
    skip_unless_sm90()
    from sparsemla.plan import cluster_builds
    if not cluster_builds():
        pytest.skip("sm90-cluster needs Triton >= 3.8")


@pytest.mark.parametrize("fmt,tokens,heads,topk,splits",
                         [("fp8_ds_mla",) + s for s in CLUSTER_SHAPES]
                         + [(f,) + s for f in ("fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "nvfp4_ds_mla",
                                               "nvfp4_ds_mla-nope", "fp8", "fp8-nope")
                            for s in (CLUSTER_SHAPES[1], CLUSTER_SHAPES[3], CLUSTER_SHAPES[5])])
def test_cluster_matches_reference(fmt, tokens, heads, topk, splits):
    """``sm90-cluster``, sm90-conv's 2-CTA kernel (each CTA converts half of every block's rows into both CTAs'
    tiles), forced: against the float64 reference -- one block, odd block counts, a split per block, head counts
    that are not a multiple of 64, a full batch (clusters in waves over every SM); every row format it reads, k_scale
    on fp8 rows; -1 padding, valid counts with garbage past them and poisoned outputs as in every case here."""
    _skip_unless_cluster()
    k_scale = _k_scale(fmt)
    c = make_case(fmt, tokens, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                  k_scale=k_scale)
    sm = c["fmt"].head_dim ** -0.5
    out, lse = run(c, sm, plan_for(c, "sm90-cluster", splits), k_scale)
    check_reference(c, sm, out, lse, k_scale)
    assert "sm90-cluster" not in unavailable_kernels(), unavailable_kernels()["sm90-cluster"]


@pytest.mark.parametrize("fmt", ["nvfp4_ds_mla", "fp8"])
def test_cluster_fp16_q_across_the_bf16_range(fmt):
    """sm90-cluster's fp16 q (nvfp4, fp8 rows), each CTA scaling its 64 heads: heads whose q spans 2^-100 .. 2^100,
    one head all zeros, one with a single huge entry among tiny ones (``test_conv_fp16_q_across_the_bf16_range``
    at 128 heads)."""
    _skip_unless_cluster()
    k_scale = _k_scale(fmt)
    c = make_case(fmt, 3, 128, 512, ctx=1024, block_size=64, device="cuda", k_scale=k_scale)
    q = c["q"].float() * torch.exp2(torch.linspace(-100, 100, 128, device="cuda").round())[None, :, None]
    q[:, 69] = 0.0
    q[:, 70] = q[:, 70] * 2.0 ** -40
    q[:, 70, 7] = 2.0 ** 40
    c["q"] = q.to(torch.bfloat16)
    sm = 2.0 ** -110
    out, lse = run(c, sm, plan_for(c, "sm90-cluster", 1), k_scale)
    check_reference(c, sm, out, lse, k_scale)
