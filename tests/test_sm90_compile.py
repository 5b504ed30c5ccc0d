"""The sm_90 Gluon kernels compile for sm_90 on a machine without a GPU, on whichever Triton is installed
(Gluon does not run under the interpreter; tests/gpu/test_sm90_*_gpu.py check their numbers on the H200):
every variant builds, fits Hopper's shared memory, is warp-specialized (setmaxnreg) and mbarrier-fed
(cp.async.mbarrier.arrive), keeps ptxas' wgmma pipeline unserialized, and spills no more than it does on
that release (``STACK``).  Every variant is compiled once per process (tests/helpers/sm90_sass.py, two
worker processes)."""
import inspect
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import sm90_sass  # noqa: E402

from sparsemla.kernels.sm90 import common, compat, conv, few, rows, wide  # noqa: E402

HOPPER_SMEM = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
# Stack bytes (spill slots) per kernel family and Triton release, the largest over the family's variants.
# The wide kernel keeps part of its loop state (the normaliser's partial sums) in local memory on every
# release; a variant above its bound spills more than this code does on that release.  Releases not
# listed get the largest bound of any.  The conv kernel: 0-16 bytes on 3.6 and 0-24 on 3.8; 0-136 on 3.9, whose
# first MMA warpgroup builds a wgmma op's shared-memory descriptors in registers up front (docs/design/kernels.md),
# measured.  The pair kernel (bf16): 64 / 64 / 80-104 since its vector hand-offs arrive per thread (publish()); with
# its 128-byte gather, tile output and per-thread releases (the defaults since) 0 on 3.6 and 3.8, 80-112 on 3.9.
STACK = {
    "3.6": {"bf16": 64, "few": 0, "wide": 88, "wide-fp8qk": 128, "conv": 32, "conv-early": 0, "conv-idx2": 16,
            "conv-trace": 72},
    "3.8": {"bf16": 64, "few": 16, "wide": 96, "wide-fp8qk": 144, "conv": 24, "conv-early": 32, "conv-idx2": 8,
            "conv-trace": 16},
    "3.9": {"bf16": 112, "few": 0, "wide": 160, "wide-fp8qk": 216, "conv": 144, "conv-early": 152, "conv-idx2": 136,
            "conv-trace": 224},
}
# conv: each kind with its conv.TUNED producer options (fp8_ds_mla's NoPE rows with early + late_next spill 24
# bytes on 3.8) and with them all off (-plain) or the hint alone (-hint).  conv-early: the producer with a fourth
# piece's words in flight across its free wait, the next block's loaded after its fence, the consumers' in-loop
# fences left to the writers (meta(early=True, late_next=True, lean_fences=True)) where a kind does not take them by
# default.  conv-idx2: the producer holding the next block's indices as well (meta(idx_ahead=True)) where a kind
# does not take it by default: fp8_ds_mla spills 16 / 8 / 120 bytes on 3.6 / 3.8 / 3.9, nvfp4 136 on 3.9.  conv-trace: the diagnostic
# trace build (meta(trace=True), benchmarks/conv_trace.py), fp8_ds_mla: 72 / 16 / 224 bytes.


def _stack_limit(name):
    family = name.split("-")[0] + ("-fp8qk" if name.startswith("wide") and name.endswith("-fp8qk") else "")
    for suffix in ("-early", "-idx2", "-trace"):
        family += suffix if name.endswith(suffix) else ""
    release = ".".join(triton.__version__.split(".")[:2])
    if release in STACK and family in STACK[release]:
        return STACK[release][family]
    return max(limits.get(family, 0) for limits in STACK.values())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm90") / "reports.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, sm90_sass.__file__, "--jobs", "2", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())["variants"]


@pytest.mark.parametrize("name", list(sm90_sass.VARIANTS))
def test_compiles_for_sm90_within_limits(compiled, name):
    r = compiled[name]
    assert "error" not in r, r.get("error")
    assert r["smem"] <= HOPPER_SMEM, r
    assert r["setmaxnreg"], r
    # every kernel arrives on mbarriers per thread by cp.async: its gathers into mbarrier-tracked stages, and
    # (the conv kernel's converting producer has none) its once-a-program hand-offs between partitions
    # through common.publish, the form compute-sanitizer's racecheck follows
    assert r["mbarrier_cp_async"], r
    assert r["stack"] <= _stack_limit(name), r
    # a wait that names accumulators still in flight makes ptxas serialize every wgmma (visible only in its
    # log): the kernel then runs about half as fast
    assert not r["serialized"], r
    # only sm90-conv's 2-CTA kernel addresses another CTA's shared memory
    assert (r["cluster"]["st_async"] > 0) == name.endswith("-cluster"), r["cluster"]


@pytest.mark.parametrize("name", list(sm90_sass.VARIANTS))
def test_no_shared_access_over_an_initialized_mbarrier(compiled, name):
    """Every mbarrier a variant initializes is used (TTGIR), and no ordinary shared load or store addresses an
    initialized mbarrier's offset (PTX): one that no partition uses (conv's P hand-off pair under NAMED, before)
    is dead to the allocator, which placed scratch over it -- sm90-conv's producer then read its row pointers
    back as the mbarrier's state under compute-sanitizer."""
    r = compiled[name]
    assert "error" not in r, r.get("error")
    assert r["unused_mbarriers"] == [], r["unused_mbarriers"]
    assert r["mbarrier_overlap"] == [], r["mbarrier_overlap"]


@pytest.mark.parametrize("name", list(sm90_sass.VARIANTS))
def test_only_fused_variants_merge_in_the_kernel(compiled, name):
    """A FUSED variant (``-fused``: its splits merged by its own programs, common.combine_in_kernel) is launched
    cooperatively and its PTX has the grid barrier once (thread 0's fence and arrival, the last arrival's release,
    the others' acquiring loads) and reads the partials from L2; every other variant has none of it."""
    r = compiled[name]
    assert "error" not in r, r.get("error")
    b = r["grid_barrier"]
    if name.endswith("-fused"):
        assert r["cooperative"], r
        assert (b["fence"], b["arrive"], b["release"], b["acquire"]) == (1, 1, 1, 1), b
        assert b["cg_loads"] > 0, b
    else:
        assert not r["cooperative"] and b == dict(fence=0, arrive=0, release=0, acquire=0, cg_loads=0), (r, b)


@pytest.mark.parametrize("name", [n for n in sm90_sass.VARIANTS if n.endswith("-cluster")])
def test_cluster_kernel_protocol(compiled, name):
    """sm90-cluster's PTX: the producers' st.async stores reach both CTAs (``mapa`` to ranks 0 and 1); each tile's
    ``ready`` mbarrier expects the whole tile from both producers (64 rows x 512 16-bit values, 576 where the e4m3
    rope is converted and sent too) and each ``free`` mbarrier the consumers' signals (``conv.SIG_BYTES``); the
    mbarrier initializations are fenced for the cluster, and cluster barriers (after them and at the end) keep
    either CTA from sending before the other is ready or exiting while the other may still send to it."""
    c = compiled[name]["cluster"]
    sent_rope = "nope" not in name and "fp8_ds_mla" not in name
    tile = 64 * (576 if sent_rope else 512) * 2
    assert c["mapa_ranks"] == [0, 1], c
    assert c["expect_tx"] == sorted({conv.SIG_BYTES.value, tile}), c
    assert c["init_fence"] and c["cluster_barriers"] >= 2, c


@pytest.mark.parametrize("named,mbar", [(f"conv-{kind}", f"conv-{kind}-mbar") for kind in conv.KINDS]
                         + [("bf16-bf16-named", "bf16-bf16")])
def test_named_hand_off_spills_no_more_and_runs_fewer_instructions(compiled, named, mbar):
    """``sm90-conv`` and the pair kernel with their hand-offs between MMA warpgroups through named barriers
    (``meta(named=True)``; conv's default) against mbarriers: what makes them faster is fewer
    instructions (no mbarrier try-wait loops, fewer warpgroup barriers) and, for conv on 3.9, the shared-memory
    descriptors no longer built ahead and spilled -- so each must keep both on every release."""
    n, m = compiled[named], compiled[mbar]
    assert "error" not in n and "error" not in m, (n.get("error"), m.get("error"))
    assert n["stack"] <= m["stack"], (n["stack"], m["stack"])
    assert n["instructions"] < m["instructions"], (n["instructions"], m["instructions"])
    assert n["regs"] == m["regs"]


def test_every_format_layout_has_variants():
    """Each row layout the kernels read, NoPE rows with and without a (zero) rope slot included, is compiled
    with and without FP8-QK where the mode exists."""
    names = set(sm90_sass.VARIANTS)
    for fid in sm90_sass.LAYOUTS:
        kind = fid.split("-")[0]
        if kind == "bf16":
            assert {f"bf16-{fid}", f"conv-{fid}"} <= names
            continue
        assert f"few-{fid}" in names
        assert f"conv-{fid}" in names
        if fid == kind:
            assert f"conv-{fid}-split" in names
        if kind != "nvfp4_ds_mla":
            assert {f"few-{fid}-fp8qk", f"wide-{fid}", f"wide-{fid}-fp8qk"} <= names


def test_meta_takes_offsets_from_the_layout_and_rejects_what_a_kernel_cannot_read():
    m = few.meta(kind="nvfp4_ds_mla", bytes_per_row=352, rope_dim=0, rope_offset=-1, scale_offset=320,
                 num_groups=1, has_valid_counts=False)
    assert (m["BPT"], m["ROPE"], m["SCALE_OFF"], m["ROPE_OFF"], m["FP4"], m["DS"]) == (352, 0, 320, 0, True, False)
    m = wide.meta(kind="fp8", bytes_per_row=576, rope_dim=64, rope_offset=512, scale_offset=-1, num_groups=2,
                  has_valid_counts=True, fp8_qk=True)
    assert (m["SCALE_OFF"], m["ROPE_OFF"], m["FP8_QK"]) == (0, 512, True)
    with pytest.raises(ValueError, match="kind"):
        few.meta(kind="nvfp4_ds_mla", bytes_per_row=352, rope_dim=64, rope_offset=256, scale_offset=320,
                 num_groups=1, has_valid_counts=False, fp8_qk=True)
    with pytest.raises(ValueError, match="kind"):
        wide.meta(kind="nvfp4_ds_mla", bytes_per_row=352, rope_dim=64, rope_offset=256, scale_offset=320,
                  num_groups=1, has_valid_counts=False)
    m = conv.meta(kind="nvfp4_ds_mla", bytes_per_row=288, rope_dim=0, rope_offset=-1, scale_offset=256,
                  num_groups=2, has_valid_counts=True)
    assert (m["BPT"], m["ROPE"], m["SCALE_OFF"], m["ROPE_OFF"], m["FP4"], m["DS"], m["NG"]) == (288, 0, 256, 0, True,
                                                                                                False, 2)
    m = conv.meta(kind="fp8", bytes_per_row=576, rope_dim=64, rope_offset=512, scale_offset=-1, num_groups=1,
                  has_valid_counts=False)
    assert (m["SCALE_OFF"], m["ROPE_OFF"], m["FP4"], m["DS"], m["maxnreg"]) == (0, 512, False, False, 168)
    m = conv.meta(kind="bf16", bytes_per_row=1152, rope_dim=64, rope_offset=1024, scale_offset=-1, num_groups=1,
                  has_valid_counts=False)
    assert (m["SCALE_OFF"], m["ROPE_OFF"], m["FP4"], m["DS"], m["B16"]) == (0, 1024, False, False, True)
    with pytest.raises(ValueError, match="kind"):
        conv.meta(kind="staged", bytes_per_row=576, rope_dim=64, rope_offset=512, scale_offset=-1, num_groups=1,
                  has_valid_counts=False)


def test_conv_meta_takes_each_kinds_tuned_producer_options():
    """conv.meta's producer and consumer options: None takes the kind's conv.TUNED entry, an explicit value wins,
    the 2-CTA kernel takes none of them (its producer has its own loop, its consumers their own signals)."""
    common = dict(rope_dim=64, num_groups=1, has_valid_counts=False)
    rows = {"bf16": (1152, 1024, -1), "fp8": (576, 512, -1), "fp8_ds_mla": (656, 512, 528),
            "nvfp4_ds_mla": (352, 256, 320)}
    flags = dict(l2_hint="HINT", rows128="W128", early="EARLY", late_next="LATE", lean_fences="LEAN",
                 idx_ahead="IDX2", free_first="FF", smem_out="SO", early_idx="EI", row_prefetch="PF",
                 named="NAMED")
    for kind, (bpr, rope_off, scale_off) in rows.items():
        args = dict(kind=kind, bytes_per_row=bpr, rope_offset=rope_off, scale_offset=scale_off, **common)
        m = conv.meta(**args)
        assert {f for f, c in flags.items() if m[c]} == {f for f, v in conv.tuned(kind, 64).items() if v}, kind
        off = conv.meta(**args, **{f: False for f in flags})
        assert not any(off[c] for c in flags.values()), kind
        if kind != "bf16":
            cl = conv.meta(**args, cluster=True)
            assert not any(cl[c] for c in flags.values()), kind
    ell = {"early": True, "late_next": True, "lean_fences": True}
    nso = {"smem_out": True, "named": True}
    assert conv.TUNED == {"bf16": dict(nso, rows128=True, free_first=True),
                          "nvfp4_ds_mla": dict(nso, l2_hint=True, early_idx=True),
                          "fp8": dict(ell, **nso, idx_ahead=True), "fp8_ds_mla": dict(ell, **nso, row_prefetch=True)}
    # nvfp4_ds_mla: fp8_ds_mla's L2 handling for NoPE rows, and for RoPE rows from Triton 3.9
    fp4 = conv.TUNED["nvfp4_ds_mla"]
    assert conv.tuned("nvfp4_ds_mla", 64, (3, 6)) == fp4 == conv.tuned("nvfp4_ds_mla", 64, (3, 8))
    assert conv.tuned("nvfp4_ds_mla", 0, (3, 6)) == dict(fp4, **conv.ROWS_PF) == conv.tuned("nvfp4_ds_mla", 64, (3, 9))
    assert conv.ROWS_PF == dict(l2_hint=False, early_idx=False, row_prefetch=True)
    # fp8_ds_mla above 64 heads on Triton >= 3.9: without late_next; at 64 heads and on older releases with it
    ds = conv.TUNED["fp8_ds_mla"]
    assert conv.tuned("fp8_ds_mla", 64, (3, 9), num_groups=2) == dict(ds, late_next=False)
    assert conv.tuned("fp8_ds_mla", 64, (3, 9), num_groups=1) == ds == conv.tuned("fp8_ds_mla", 64, (3, 8), num_groups=2)
    nope = conv.meta(kind="nvfp4_ds_mla", bytes_per_row=288, rope_offset=-1, scale_offset=256, rope_dim=0,
                     num_groups=1, has_valid_counts=False)
    assert nope["PF"] and not nope["HINT"] and not nope["EI"] and nope["NAMED"] and nope["SO"]
    on = conv.meta(kind="nvfp4_ds_mla", bytes_per_row=352, rope_offset=256, scale_offset=320, l2_hint=True, **common)
    assert on["HINT"] and not on["W128"]
    # the L2 prefetch of the next rows is the converting producer's: not bf16 rows', not the 2-CTA kernel's
    for kind, extra in (("bf16", {}), ("fp8", dict(cluster=True))):
        bpr, rope_off, scale_off = rows[kind]
        with pytest.raises(ValueError, match="row_prefetch"):
            conv.meta(kind=kind, bytes_per_row=bpr, rope_offset=rope_off, scale_offset=scale_off, row_prefetch=True,
                      **common, **extra)


def test_compat_names_exist_on_this_release():
    assert all(callable(f) for f in (compat.barrier, compat.async_load, compat.reinterpret))


def test_wide_output_relabelling_matches_the_accumulator_dims():
    """The wide kernel writes its output through shared memory after relabelling O^T's accumulator rows as
    output dims (``wide._unpermute``: a reshape into bits, a permute, a reshape back).  That permutation must
    be the inverse of ``rows.acc_dim`` (accumulator row -> dim, which the PV operands follow): both are read
    from the kernels' source and compared on every row, so neither can change alone."""
    dims_expr = re.search(r"return (.+)", inspect.getsource(rows.acc_dim.fn)).group(1)
    m = np.arange(128)
    dim_of_row = eval(dims_expr, {"m": m})  # noqa: S307 (the kernel's own expression, integer ops only)
    assert sorted(dim_of_row) == list(range(128))
    src = inspect.getsource(wide._unpermute.fn)
    order = [int(v) for v in re.search(r"\.permute\(([\d, ]+)\)\.reshape\(\[128, 64\]\)", src).group(1).split(",")]
    assert order[-1] == 7  # the head axis stays last
    row_at_dim = m.reshape([2] * 7).transpose(order[:-1]).reshape(128)  # position d holds accumulator row m
    assert (dim_of_row[row_at_dim] == np.arange(128)).all()


def test_kernel_modules_hold_no_policy_and_import_no_other_kernel():
    """Kernel modules import only compat / common / rows (no import circles, no private names across
    kernels) and read no environment variables."""
    pkg = os.path.dirname(common.__file__)
    for f in ("common.py", "rows.py", "few.py", "wide.py", "bf16.py", "conv.py", "compat.py"):
        src = open(os.path.join(pkg, f)).read()
        assert "os.environ" not in src and "getenv" not in src, f
        local = re.findall(r"^\s*from \.(\w*) import (.+)$", src, re.M)
        for mod, names in local:
            assert mod in ("", "compat", "common", "rows"), (f, mod)
            assert not any(n.strip().startswith("_") for n in names.strip("()").split(",")), (f, names)
