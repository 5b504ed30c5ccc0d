"""The dispatch table: which kernel, tiling and split count every kind of call gets (sparsemla.plan)."""
import pytest

from sparsemla import plan as P
from sparsemla.plan import explain, plan_attention

H200 = dict(capability=(9, 0), num_sms=132)
ADA = dict(capability=(8, 9), num_sms=128)


# (kind, tokens, heads) -> kernel on an H200, every kind of rows and the head counts that switch kernels
@pytest.mark.parametrize("kind, tokens, heads, kernel", [
    ("fp8_ds_mla", 128, 16, "sm90-few"), ("fp8_ds_mla", 128, 32, "sm90-few"), ("fp8_ds_mla", 128, 33, "sm90-conv"),
    ("fp8_ds_mla", 128, 128, "sm90-conv"), ("fp8_ds_mla", 1, 128, "sm90-few"), ("fp8_ds_mla", 8, 128, "sm90-few"),
    ("fp8_ds_mla", 9, 128, "sm90-conv"),  # 9 x 8 = 72 programs > half a wave of 132
    ("fp8", 128, 16, "sm90-few"), ("fp8", 128, 64, "sm90-conv"), ("fp8", 33, 64, "sm90-few"),
    ("fp8", 34, 64, "sm90-conv"),
    ("nvfp4_ds_mla", 128, 16, "sm90-few"), ("nvfp4_ds_mla", 128, 32, "sm90-few"),
    ("nvfp4_ds_mla", 16, 64, "sm90-few"), ("nvfp4_ds_mla", 8, 128, "sm90-few"),  # half a wave of 16-head programs
    ("nvfp4_ds_mla", 17, 64, "sm90-conv"), ("nvfp4_ds_mla", 128, 64, "sm90-conv"),
    ("nvfp4_ds_mla", 128, 128, "sm90-conv"), ("nvfp4_ds_mla-nope", 128, 96, "sm90-conv"),
    ("bf16", 128, 16, "portable-bf16"), ("bf16", 128, 32, "portable-bf16"), ("bf16", 128, 33, "sm90-conv"),
    ("bf16", 132, 64, "sm90-conv"), ("bf16", 133, 64, "sm90-conv"), ("bf16", 128, 65, "sm90-conv"),
    ("bf16", 132, 128, "sm90-conv"), ("bf16", 133, 128, "sm90-conv"), ("bf16", 128, 129, "sm90-bf16"),
    ("bf16", 4096, 64, "sm90-conv"), ("bf16", 4096, 128, "sm90-conv"), ("bf16", 4096, 192, "sm90-bf16"),
    ("fp8_ds_mla-nope", 128, 16, "sm90-few"), ("nvfp4_ds_mla-nope", 128, 16, "sm90-few"),
    ("bf16-nope", 128, 64, "sm90-conv"), ("bf16-nope", 128, 128, "sm90-conv"), ("fp8-nope", 128, 128, "sm90-conv"),
    ("fp8_ds_mla-nope", 128, 64, "sm90-conv"),
])
def test_hopper_table(kind, tokens, heads, kernel):
    assert plan_attention(kind, tokens, heads, 2048, **H200).kernel == kernel


@pytest.mark.parametrize("kind, heads, kernel, hpp", [
    ("bf16", 16, "portable-bf16", 16), ("bf16", 20, "portable-bf16", 32), ("bf16", 33, "portable-wide", 64),
    ("fp8", 5, "portable-fp8", 16), ("fp8_ds_mla", 32, "portable-fp8", 32), ("fp8_ds_mla", 40, "portable-wide", 64),
    ("nvfp4_ds_mla", 16, "portable-nvfp4", 16), ("nvfp4_ds_mla", 17, "portable-wide", 64),
])
def test_portable_table(kind, heads, kernel, hpp):
    for opts in (ADA, dict(H200, portable=True), dict(H200, interpret=True), dict(H200, kv_aligned=False)):
        p = plan_attention(kind, 128, heads, 2048, **opts)
        assert (p.kernel, p.heads_per_program) == (kernel, hpp), opts
    assert plan_attention("staged", 8, 40, 256, **ADA).kernel == "portable-wide"
    assert plan_attention("fp8", 8, 40, 256, staged=True, **H200).kernel == "portable-wide"  # staged rows


def test_bf16_needs_aligned_q_on_hopper():
    assert plan_attention("bf16", 128, 64, 2048, q_aligned=False, **H200).kernel == "portable-wide"
    # sm90-conv stages q by cp.async; sm90-wide reads any q
    assert plan_attention("fp8", 128, 64, 2048, q_aligned=False, **H200).kernel == "sm90-wide"


def test_unavailable_kernels_fall_back():
    for kernel, kind, tokens, heads in [("sm90-few", "fp8_ds_mla", 128, 16), ("sm90-bf16", "bf16", 4096, 192)]:
        p = plan_attention(kind, tokens, heads, 2048, unavailable=frozenset({kernel}), **H200)
        assert p.kernel.startswith("portable-"), (kernel, p)
    # bf16 rows at 64 heads: sm90-conv, then sm90-bf16, then the portable kernels
    assert plan_attention("bf16", 128, 64, 2048, unavailable=frozenset({"sm90-conv"}), **H200).kernel == "sm90-bf16"
    p = plan_attention("bf16", 128, 64, 2048, unavailable=frozenset({"sm90-conv", "sm90-bf16"}), **H200)
    assert p.kernel.startswith("portable-"), p
    # fp8 rows above 32 heads: sm90-conv, then sm90-wide, then the portable kernels
    assert plan_attention("fp8", 128, 64, 2048, unavailable=frozenset({"sm90-conv"}), **H200).kernel == "sm90-wide"
    p = plan_attention("fp8", 128, 64, 2048, unavailable=frozenset({"sm90-conv", "sm90-wide"}), **H200)
    assert p.kernel.startswith("portable-"), p


@pytest.mark.parametrize("tokens, heads, kind, splits", [
    # the portable kernels: about two programs per SM, splits of >= 2 tiles (up to 32)
    (128, 16, "fp8", 2), (128, 128, "bf16", 1), (4, 16, "fp8", 32), (4, 128, "bf16", 16),
    # one or two programs of work: splits of one 32-row tile, up to 64
    (1, 16, "fp8", 64), (1, 128, "bf16", 32),  # capped at one 64-row block per split
])
def test_portable_splits(tokens, heads, kind, splits):
    assert plan_attention(kind, tokens, heads, 2048, **ADA).num_splits == splits


@pytest.mark.parametrize("tokens, heads, kind, splits", [
    (128, 16, "fp8_ds_mla", 1), (64, 16, "fp8_ds_mla", 2), (1, 16, "fp8_ds_mla", 16), (1, 128, "fp8_ds_mla", 16),
    (4, 128, "fp8", 4), (128, 64, "fp8", 1),
])
def test_hopper_splits(tokens, heads, kind, splits):
    """At most one warp-specialized program per SM, each split at least two 64-row blocks (128 positions)."""
    p = plan_attention(kind, tokens, heads, 2048, **H200)
    assert p.num_splits == splits
    assert p.rows_per_split % 64 == 0 and p.rows_per_split * p.num_splits >= 2048


def test_splits_never_exceed_the_blocks_and_cover_topk():
    for k in (1, 8, 63, 64, 65, 2051, 2176):
        for t in (1, 3, 128):
            for kind in ("bf16", "fp8_ds_mla", "nvfp4_ds_mla"):
                for opts in (H200, ADA):
                    p = plan_attention(kind, t, 16, k, **opts)
                    assert p.rows_per_split % p.block_n == 0
                    assert (p.num_splits - 1) * p.rows_per_split < k <= p.num_splits * p.rows_per_split


def test_small_topk_one_split():
    assert plan_attention("bf16", 1, 16, 8, **ADA).num_splits == 1
    assert plan_attention("fp8", 1, 16, 64, **ADA).num_splits == 2  # two 32-row tiles


def test_fp8_qk_only_where_it_applies():
    assert plan_attention("fp8", 128, 16, 2048, fp8_qk=True, **H200).fp8_qk
    assert plan_attention("fp8_ds_mla", 128, 128, 2048, fp8_qk=True, **H200).kernel == "sm90-wide"
    with pytest.raises(ValueError, match="fp8_qk: the FP8-QK mode reads only fp8 or fp8_ds_mla rows, not nvfp4"):
        plan_attention("nvfp4_ds_mla", 128, 16, 2048, fp8_qk=True, **H200)
    with pytest.raises(ValueError, match="fp8_qk: .*built for sm_90"):
        plan_attention("fp8", 128, 16, 2048, fp8_qk=True, **ADA)


def test_forced_kernels_and_tiling():
    assert plan_attention("fp8_ds_mla", 1, 128, 2048, kernel="sm90-wide", **H200).kernel == "sm90-wide"
    with pytest.raises(ValueError, match="kernel: sm90-wide cannot serve 16 heads of fp8_ds_mla rows"):
        plan_attention("fp8_ds_mla", 1, 16, 2048, kernel="sm90-wide", **H200)
    with pytest.raises(ValueError, match="kernel: expected one of"):
        plan_attention("bf16", 1, 16, 2048, kernel="flash")
    p = plan_attention("bf16", 8, 16, 256, tiling=(32, 4, 2), **ADA)
    assert (p.block_n, p.num_warps, p.num_stages) == (32, 4, 2)
    with pytest.raises(ValueError, match="tiling: sm90-few has a fixed tiling"):
        plan_attention("fp8", 8, 16, 256, tiling=(32, 4, 2), **H200)
    assert plan_attention("bf16", 1, 16, 2048, num_splits=3, **ADA).num_splits == 3


def test_plans_are_cached_and_explained():
    a = plan_attention("fp8_ds_mla", 128, 128, 2048, **H200)
    assert plan_attention("fp8_ds_mla", 128, 128, 2048, **H200) is a
    text = explain("nvfp4_ds_mla", 128, 128, 2048, **H200)
    assert "sm90-conv" in text.splitlines()[0]
    assert "not sm90-few: 128 heads x 128 tokens need more than 0.5 wave(s)" in text
    assert "not sm90-wide: it reads fp8, fp8_ds_mla rows, not nvfp4_ds_mla" in text
    assert "did not build" in explain("bf16", 1, 64, 2048, unavailable=frozenset({"sm90-bf16"}), **H200)


def test_persistent_plans():
    """sm90-conv's persistent grid: bf16 rows with more work items (tokens x splits x head groups) than SMs (prefill,
    128-head decode at b 128); one item a program where they fit in a wave, for the quantized kinds, for other
    kernels and for the in-kernel merge; explain says how many programs serve how many items."""
    assert plan_attention("bf16", 4096, 128, 2048, **H200).persistent
    assert plan_attention("bf16-nope", 128, 128, 2048, **H200).persistent  # 256 items
    assert not plan_attention("bf16", 128, 64, 2048, **H200).persistent    # 128 items on 132 SMs
    assert not plan_attention("bf16", 4096, 128, 2048, num_sms=8192, capability=(9, 0)).persistent
    for kind in ("fp8", "fp8_ds_mla", "nvfp4_ds_mla"):
        assert plan_attention(kind, 4096, 128, 2048, **H200).kernel == "sm90-conv"
        assert not plan_attention(kind, 4096, 128, 2048, **H200).persistent
    assert not plan_attention("bf16", 4096, 192, 2048, **H200).persistent  # sm90-bf16
    assert not plan_attention("bf16", 4096, 128, 2048, portable=True, **H200).persistent
    assert "persistent: 132 programs serve the 8192 work items in turn" in explain("bf16", 4096, 128, 2048, **H200)
    assert "persistent" not in explain("bf16", 128, 64, 2048, **H200)


def test_conv_kernel_plans():
    """sm90-conv (quantized rows, 64 heads a program) takes fp8, fp8_ds_mla and nvfp4 rows above 32 heads past the
    few-heads kernel's waves by itself (not in the FP8-QK mode); a
    forced call gets sm90-wide's head groups and splits, and it refuses what it cannot read."""
    for kind in ("fp8", "fp8_ds_mla", "nvfp4_ds_mla", "fp8-nope", "fp8_ds_mla-nope", "nvfp4_ds_mla-nope"):
        for tokens, heads in ((1, 33), (4, 64), (128, 96), (128, 128)):
            auto = tokens == 128
            assert (plan_attention(kind, tokens, heads, 2048, **H200).kernel == "sm90-conv") == auto
            p = plan_attention(kind, tokens, heads, 2048, kernel="sm90-conv", **H200)
            assert (p.kernel, p.heads_per_program, p.num_groups) == ("sm90-conv", 64, -(-heads // 64))
            wide_splits = max(1, min(132 // (tokens * p.num_groups), 2048 // 128, 64))
            assert p.num_splits == wide_splits and p.rows_per_split % 64 == 0
    assert plan_attention("fp8", 1, 64, 2048, kernel="sm90-conv", num_splits=3, **H200).num_splits == 3
    for kind, opts, msg in (("staged", H200, "reads fp8, fp8_ds_mla, nvfp4_ds_mla, bf16 rows, not staged"),
                            ("fp8", ADA, "built for sm_90"), ("fp8", dict(H200, q_aligned=False), "aligned q rows"),
                            ("fp8", dict(H200, interpret=True), "interpreter")):
        with pytest.raises(ValueError, match=f"kernel: sm90-conv cannot serve .*{msg}"):
            plan_attention(kind, 4, 64, 2048, kernel="sm90-conv", **opts)
    with pytest.raises(ValueError, match="fp8_qk"):
        plan_attention("fp8", 4, 64, 2048, kernel="sm90-conv", fp8_qk=True, **H200)
    # bf16 rows above 128 heads: only when asked for, with sm90-bf16's head groups
    assert plan_attention("bf16", 128, 192, 2048, **H200).kernel == "sm90-bf16"
    assert "not sm90-conv: it takes bf16 rows by itself only up to 128 heads" in explain("bf16", 128, 192, 2048,
                                                                                         **H200)
    assert "not sm90-conv" not in explain("bf16", 4096, 64, 2048, **H200)
    p = plan_attention("bf16", 128, 192, 2048, kernel="sm90-conv", **H200)
    assert (p.kernel, p.heads_per_program, p.num_groups) == ("sm90-conv", 64, 3)
    assert plan_attention("fp8_ds_mla", 128, 64, 2048, fp8_qk=True, **H200).kernel == "sm90-wide"
    assert "not sm90-conv: it has no FP8-QK variant" in explain("fp8_ds_mla", 128, 64, 2048, fp8_qk=True, **H200)


def test_cluster_kernel_plans(monkeypatch):
    """sm90-cluster (sm90-conv as a cluster of two CTAs) only when asked for: fp8, fp8_ds_mla and nvfp4 rows (with
    or without rope) at 65-128 heads on Triton >= 3.8, one program of 128 heads per token and split, the splits
    sized for programs of two SMs; the reasons it refuses the rest."""
    monkeypatch.setattr(P, "triton_release", lambda: (3, 8))
    P._plan.cache_clear()
    for kind in ("fp8_ds_mla", "fp8_ds_mla-nope", "fp8_ds_mla-nope-compact", "fp8", "nvfp4_ds_mla",
                 "nvfp4_ds_mla-nope"):
        for tokens, heads in ((1, 65), (4, 96), (128, 128)):
            assert plan_attention(kind, tokens, heads, 2048, **H200).kernel != "sm90-cluster"
            p = plan_attention(kind, tokens, heads, 2048, kernel="sm90-cluster", **H200)
            assert (p.kernel, p.heads_per_program, p.num_groups, p.grid) == ("sm90-cluster", 128, 1, p.num_splits)
            assert p.num_splits == max(1, min(66 // tokens, 2048 // 128, 64)) and p.rows_per_split % 64 == 0
    assert "not sm90-cluster: it is measured slower than sm90-conv" in explain("fp8_ds_mla", 128, 128, 2048, **H200)
    for kind, heads, opts, msg in (("bf16", 128, H200, "reads fp8, fp8_ds_mla, nvfp4_ds_mla rows, not bf16"),
                                   ("fp8_ds_mla", 64, H200, "serves 65-128 heads"),
                                   ("fp8_ds_mla", 129, H200, "serves 65-128 heads"),
                                   ("fp8_ds_mla", 128, dict(H200, q_aligned=False), "aligned q rows"),
                                   ("fp8_ds_mla", 128, ADA, "built for sm_90")):
        with pytest.raises(ValueError, match=f"kernel: sm90-cluster cannot serve .*{msg}"):
            plan_attention(kind, 4, heads, 2048, kernel="sm90-cluster", **opts)
    monkeypatch.setattr(P, "triton_release", lambda: (3, 6))
    P._plan.cache_clear()
    with pytest.raises(ValueError, match="needs Triton >= 3.8"):
        plan_attention("fp8_ds_mla", 4, 128, 2048, kernel="sm90-cluster", **H200)
    P._plan.cache_clear()


def test_fused_combine_plans():
    """A split plan merges its splits in the kernel (``fused_combine``) only when asked for while the default is
    off, only on the kernels with a FUSED variant (sm90-few, sm90-conv, sm90-bf16), and only where every program of
    the grid is resident at once (at most one per SM: the grid barrier's cooperative launch); one split has
    nothing to merge.  ``explain`` says which merge a split plan gets."""
    assert P.FUSED_KERNELS == ("sm90-few", "sm90-conv", "sm90-bf16")
    default = plan_attention("fp8_ds_mla", 1, 16, 2048, **H200)
    assert default.num_splits > 1 and default.fused_combine == P.FUSED_COMBINE_DEFAULT
    for kind, tokens, heads, kernel in (("fp8_ds_mla", 1, 16, "sm90-few"), ("nvfp4_ds_mla", 2, 128, "sm90-few"),
                                        ("fp8_ds_mla", 32, 64, "sm90-conv"), ("bf16", 1, 64, "sm90-conv"),
                                        ("bf16", 1, 128, "sm90-conv"), ("bf16", 1, 192, "sm90-bf16")):
        p = plan_attention(kind, tokens, heads, 2048, fused_combine=True, **H200)
        assert p.kernel == kernel and p.num_splits > 1 and p.fused_combine, p
        assert tokens * p.grid <= H200["num_sms"]
        assert not plan_attention(kind, tokens, heads, 2048, fused_combine=False, **H200).fused_combine
        assert "splits merged in the kernel" in explain(kind, tokens, heads, 2048, fused_combine=True, **H200)
        assert "by the combine kernel" in explain(kind, tokens, heads, 2048, fused_combine=False, **H200)
    # not where it cannot apply: one split, sm90-wide, a forced split past one program per SM, the portable kernels
    assert plan_attention("fp8_ds_mla", 128, 64, 2048, fused_combine=True, **H200).num_splits == 1
    assert not plan_attention("fp8_ds_mla", 128, 64, 2048, fused_combine=True, **H200).fused_combine
    wide = plan_attention("fp8", 34, 64, 2048, fp8_qk=True, fused_combine=True, **H200)
    assert wide.kernel == "sm90-wide" and wide.num_splits > 1 and not wide.fused_combine
    many = plan_attention("fp8_ds_mla", 5, 16, 2048, num_splits=64, fused_combine=True, **H200)
    assert many.num_splits == 32 and 5 * many.grid > H200["num_sms"] and not many.fused_combine
    portable = plan_attention("fp8_ds_mla", 1, 16, 2048, portable=True, fused_combine=True, **H200)
    assert portable.num_splits > 1 and not portable.fused_combine
    assert "splits merged" not in explain("fp8_ds_mla", 128, 64, 2048, fused_combine=True, **H200)


def test_fused_combine_not_where_it_did_not_build():
    """A FUSED variant that failed to build is passed in ``unavailable`` as ``FUSED_COMBINE``: the kernel keeps the
    call, merged by the combine kernel, and ``explain`` says why."""
    broken = frozenset({P.FUSED_COMBINE})
    p = plan_attention("fp8_ds_mla", 1, 16, 2048, fused_combine=True, unavailable=broken, **H200)
    assert p.kernel == "sm90-few" and p.num_splits > 1 and not p.fused_combine
    P.mark_unavailable(P.FUSED_COMBINE, "RuntimeError: test")
    try:
        text = explain("fp8_ds_mla", 1, 16, 2048, fused_combine=True, unavailable=P.unavailable_set(), **H200)
        assert "by the combine kernel" in text and "the in-kernel merge did not build: RuntimeError: test" in text
    finally:
        P.clear_unavailable()
