"""Property-based differential tests on the CPU (Triton interpreter): sparse attention through the public API
against the float64 reference (``sparsemla.reference``) on cases drawn by hypothesis, and a NaN row in a
cache affecting only the queries that select it.

The space of cases (``tests/helpers/reliab_cases.py``): every format of ``sparsemla.all_formats()``, every
backend that runs here, decode / prefill over the cache / prefill over a bf16 workspace, 1-128 heads,
top-k widths that are no multiple of a tile (and pooled widths ``index_topk + kpool - 1`` with the pooled
valid-count rule), valid counts (none, full, random, past K, zero), -1 prefixes and holes, empty rows,
garbage past the valid counts pointing at rows nobody wrote (NaN bytes), block sizes 1-64 and block strides
past them, k_scale (it changes only the plain fp8 format), heavy-tailed keys and queries with outlier
channels, zero / constant / spiked / tiny / saturating rows, strided q / indices / out / lse views, the query as
an engine's two tensors (read in place by the launcher), outputs poisoned with NaN before the call.

CI runs a bounded, reproducible number of examples (``derandomize``; ``RELIAB_EXAMPLES`` to change it); the
H200 suite runs the same space with at least 10,000 cases (``tests/gpu/test_property_gpu.py``).
"""
import dataclasses
import json
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import reliab_cases as rc  # noqa: E402

EXAMPLES = int(os.environ.get("RELIAB_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@PROPERTY
@given(data=st.data())
def test_attention_matches_float64_reference(data, device):
    src = rc.HypothesisSource(data)
    dev_type = torch.device(device).type
    spec = rc.draw_spec(src, rc.CPU, backends=rc.attention_backends(dev_type))
    case = rc.build_case(spec, device)
    try:
        out, lse = rc.run_case(case)
    except rc.Refused as why:
        pytest.fail(f"{spec.short()}: a backend the space offers refused the call: {why}")
    ref_o, ref_l = rc.reference(case)
    m = rc.measure(case, out, lse, ref_o, ref_l).tolist()
    assert rc.passed(m), rc.describe_failure(spec, m)


@pytest.mark.parametrize("fmt", [f for f in rc.format_ids() if rc.sparsemla.get_format(f).rope_dim])
@pytest.mark.parametrize("seed", [1, 2])
def test_query_in_two_tensors_matches_float64_reference(fmt, seed, device):
    """Random cases with the query as an engine's two tensors (q_nope head-major, q_pe a strided view of a
    projection), through the launcher that reads them in place: the same bounds as any case."""
    import dataclasses
    src = rc.RandomSource(seed * 7919 + len(fmt))
    spec = rc.draw_spec(src, rc.CPU, fmts=[fmt], backends=["triton-portable"])
    spec = dataclasses.replace(spec, q_layout="pair")
    case = rc.build_case(spec, device)
    assert case["q_pair"] is not None and case["q_pair"][0].data_ptr() != case["q"].data_ptr()
    out, lse = rc.run_case(case)
    ref_o, ref_l = rc.reference(case)
    m = rc.measure(case, out, lse, ref_o, ref_l).tolist()
    assert rc.passed(m), rc.describe_failure(spec, m)


FORMATS = rc.format_ids()
# Under the interpreter ``triton`` runs the portable kernels, as ``triton-portable`` does: one of them suffices.
CPU_BACKENDS = [b for b in rc.attention_backends("cpu")
                if not (b == "triton" and "triton-portable" in rc.attention_backends("cpu"))]


# victim: mid (a row in the middle of the context), row0 (row 0 of the cache, where kernels point masked
# entries), write (a token with a NaN value written through the cache write, where the write policy stores it)
ISOLATION = [(f, b, v) for f in FORMATS for b in CPU_BACKENDS for v in ("mid", "row0", "write")
             if rc.is_staged(b) <= (v == "mid")]


@pytest.mark.parametrize("fmt, backend, victim", ISOLATION, ids=[f"{f}-{b}-{v}" for f, b, v in ISOLATION])
def test_nan_row_affects_only_the_queries_that_select_it(fmt, backend, victim, device):
    """Eight tokens over one request's cache: tokens that select the NaN row, hold it past their valid count,
    select its neighbours, or have -1 entries; the others must be bitwise unchanged."""
    c = rc.nan_isolation_case(fmt, 3, 8, 16, device, seed=11 + FORMATS.index(fmt), victim_row0=victim == "row0")
    rc.check_nan_isolation(c, backend, plant="write" if victim == "write" else "bytes")


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla", "fp8", "bf16-nope"])
def test_both_ways_of_writing_a_case_give_the_same_cache(fmt):
    """A case's cache is written by the library's cache write or, to spare a run the write's compiles, by the
    format's encoder: the same bytes in every row, the rows nobody wrote (poison) included.  Drawn specs take
    the encoder for most cases, so each way is forced here with an input dtype and k_scale the encoder must
    follow."""
    src = rc.RandomSource(f"two-writes:{fmt}")
    spec = rc.draw_spec(src, rc.CPU, backends=["triton"], fmts=[fmt])
    spec = dataclasses.replace(spec, in_dtype="float16", k_scale=0.37, tokens=len(spec.ctx[:2]), ctx=spec.ctx[:2],
                               block_size=5, stride_extra=2)
    kernel = rc.build_case(dataclasses.replace(spec, write="kernel"), "cpu")
    encoder = rc.build_case(dataclasses.replace(spec, write="encoder"), "cpu")
    a, b = kernel["cache"].rows, encoder["cache"].rows
    assert a.shape == b.shape and bool((a != rc.POISON).any())
    assert torch.equal(a, b), f"{int((a != b).any(1).sum())} rows differ"


def test_parallel_runs_merge_into_one_summary():
    """The H200 run's processes (``RELIAB_GPU_PROCS``) report through one summary: counts add up, the worst
    metric wins (NaN over any number), failures keep their seeds, a kernel counts as never planned only when
    no process planned it."""
    import math

    import reliab_property as rp
    base = {"device": "cpu", "torch": "t", "triton": "x", "seconds": 1.0, "configs": 3, "stopped_by_time": False}
    a = dict(base, seed=1, cases_run=10, failures=1, failed_cases=[{"case": [1, 0, 3]}], refused_configs={},
             worst={"out_err/tol": 0.5, "token_err/tol": 0.1, "lse_err/tol": 0.2, "exact_violations": 0.0},
             kernels_planned={"sm90-few": 4, "portable-bf16": 6}, kernels_never_planned=["sm90-conv", "sm90-wide"])
    b = dict(base, seed=2, cases_run=7, failures=0, failed_cases=[], refused_configs={4: "cannot serve"},
             seconds=3.0, stopped_by_time=True,
             worst={"out_err/tol": 0.7, "token_err/tol": float("nan"), "lse_err/tol": 0.1, "exact_violations": 0.0},
             kernels_planned={"sm90-few": 2, "sm90-conv": 5}, kernels_never_planned=["sm90-wide", "portable-bf16"])
    m = rp.merge_summaries([a, b])
    assert m["seeds"] == [1, 2] and m["cases_run"] == 17 and m["failures"] == 1
    assert m["failed_cases"] == [{"case": [1, 0, 3]}] and m["refused_configs"] == {"2:4": "cannot serve"}
    assert m["worst"]["out_err/tol"] == 0.7 and math.isnan(m["worst"]["token_err/tol"])
    assert m["worst"]["lse_err/tol"] == 0.2
    assert m["kernels_planned"] == {"sm90-few": 6, "portable-bf16": 6, "sm90-conv": 5}
    assert m["kernels_never_planned"] == ["sm90-wide"]
    assert m["stopped_by_time"] and m["seconds"] == 3.0 and len(m["runs"]) == 2
    # the merged summaries of two calls (files written by the H200 runs) merge again into one
    c = dict(base, seed=5, cases_run=4, failures=0, failed_cases=[], refused_configs={0: "refused"},
             worst={"out_err/tol": 0.9, "token_err/tol": 0.0, "lse_err/tol": 0.0, "exact_violations": 0.0},
             kernels_planned={"sm90-wide": 1}, kernels_never_planned=["portable-bf16"])
    both = rp.merge_summaries([json.loads(json.dumps(m, default=str)), rp.merge_summaries([c])])
    assert both["seeds"] == [1, 2, 5] and both["cases_run"] == 21 and both["failures"] == 1
    assert both["refused_configs"] == {"2:4": "cannot serve", "5:0": "refused"}
    assert both["worst"]["out_err/tol"] == 0.9 and both["kernels_never_planned"] == []
    assert [r["seed"] for r in both["runs"]] == [1, 2, 5]


def test_a_run_keeps_its_summary_so_far_in_a_checkpoint(tmp_path, monkeypatch):
    """A run the machine cuts off still leaves a summary: ``run_many(checkpoint=)`` rewrites it at every progress
    check (marked stopped until the run ends), and the ``merge`` command takes it."""
    import reliab_property as rp
    monkeypatch.setenv("RELIAB_OUT", str(tmp_path))
    seen = []
    real = rp.write_summary

    def spy(summary, name):
        seen.append((summary["cases_run"], summary["stopped_by_time"]))
        return real(summary, name)

    monkeypatch.setattr(rp, "write_summary", spy)
    name = rp.checkpoint_name(7)
    s = rp.run_many(7, 4, "cpu", rc.CPU, flush=2, checkpoint=name)
    assert s["cases_run"] >= 4
    assert seen[0] == (2, True) and seen[-1] == (s["cases_run"], False), seen
    saved = json.loads((tmp_path / name).read_text())
    assert saved["cases_run"] == s["cases_run"] and not saved["stopped_by_time"]
    assert rp.main(["merge", str(tmp_path / "m.json"), str(tmp_path / name)]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["cases_run"] == s["cases_run"]


def test_a_run_reaches_every_configuration_first(monkeypatch):
    """A run takes case 0 of every configuration before case 1 of any, so a run cut off after as many cases as
    there are configurations has reached each one (the kernel-covering configurations come last in the pool; a
    12-process H200 run, cut off before its 850 cases a process, took the configurations one after another and
    reached none of them)."""
    import reliab_property as rp
    assert rp.case_order(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    n = len(rp.draw_configs(3, "cpu"))
    seen = []
    real = rp.case_spec

    def spy(seed, i, j, config, profile):
        seen.append(i)
        return real(seed, i, j, config, profile)

    def no_kernel(case):
        raise RuntimeError("not run")

    monkeypatch.setattr(rp, "case_spec", spy)
    monkeypatch.setattr(rc, "build_case", lambda spec, device, storage=None: None)
    monkeypatch.setattr(rc, "run_case", no_kernel)
    s = rp.run_many(3, 2 * n, "cpu", rc.CPU, flush=10 ** 6)
    assert s["failures"] == 2 * n
    assert seen[:n] == list(range(n)) and seen[n:2 * n] == list(range(n)), seen


def test_the_gpu_pool_plans_every_kernel_in_its_first_cases():
    """Every kernel of the plan serves some configuration of an H200 run, whatever the seed, so that a short run
    (the GPU suite's few hundred cases) reaches each one: the random pool alone left the 64-head programs
    (``sm90-wide``) to chance.  The kernel choice is the pure plan, so this runs on the CPU.  Every configuration
    stays within what the API takes (1..128 heads): the plan alone would also place a call the API refuses."""
    import reliab_property as rp
    from sparsemla.attention import MAX_HEADS
    names = rc.plan_kernel_names()
    assert "sm90-wide" in names
    for seed in range(12):
        configs = rp.draw_configs(seed, "cuda")
        too_many = [c for c in configs if not 1 <= c.heads_band[0] <= c.heads_band[1] <= MAX_HEADS]
        assert not too_many, f"seed {seed}: head counts the API refuses: {too_many}"
        planned = {str(rc.planned_kernel(rp.case_spec(seed, i, 0, c, rc.GPU))) for i, c in enumerate(configs)}
        missing = [k for k in names if not any(p.startswith(k) for p in planned)]
        assert not missing, f"seed {seed}: no configuration plans {missing}"


def test_consan_driver_covers_every_sm90_kernel(monkeypatch):
    """tests/helpers/reliab_consan.py (Triton's concurrency sanitizer over the sm_90 kernels, on the GPU machine):
    every sm_90 kernel of the plan, in every mode it has, and each variant a call the plan accepts when that
    kernel is forced (so that no variant silently runs another kernel)."""
    import reliab_consan

    from sparsemla import plan as P
    from sparsemla.plan import SM90_KERNELS, plan_attention

    monkeypatch.setattr(P, "triton_release", lambda: P.CLUSTER_MIN_TRITON)  # sm90-cluster plans on any release
    P._plan.cache_clear()
    seen = set()
    for name, (kernel, fmt, heads, fp8_qk) in reliab_consan.VARIANTS.items():
        plan = plan_attention(fmt, 3, heads, 320, capability=(9, 0), num_sms=132, kernel=kernel, fp8_qk=fp8_qk)
        assert plan.kernel == kernel and plan.fp8_qk == fp8_qk, (name, plan)
        seen.add((kernel, fp8_qk))
    assert {k for k, _ in seen} == set(SM90_KERNELS)
    assert ("sm90-few", True) in seen and ("sm90-wide", True) in seen
    assert reliab_consan.main(["--list"]) == 0
    for bad in ("0", "x", ""):
        with pytest.raises(SystemExit):
            reliab_consan.main(["--splits", bad, "--list"])
    P._plan.cache_clear()
