"""The benchmark harness: accounting math, configuration filtering, workload properties, timing, runner output.

CPU only, tiny sizes.  Cache writes use the PyTorch encoders here (TRITON_INTERPRET=0 per test):
the harness is under test, not the write kernel, and the interpreter would make these tests slow.
"""
import csv
import json
import math
import os

import pytest
import torch

from sparsemla.bench import accounting as A
from sparsemla.bench.baseline import torch_gather_attention
from sparsemla.bench.chart import write_svg
from sparsemla.bench.configs import QUICK_NAMES, STANDARD_CONFIGS, BenchConfig, select_configs
from sparsemla.bench.runner import (add_peer_ratios, compare_to_reference, format_table, resolve_formats,
                                    run_benchmarks)
from sparsemla.bench.timing import time_fn, time_fns
from sparsemla.bench.workload import (build_cache, build_queries, build_workload, heavy_tailed, make_layout,
                                      random_topk_positions, source_tokens)
from sparsemla.reference import sparse_mla


@pytest.fixture
def no_interpreter(monkeypatch):
    """A machine without a GPU and without the interpreter: the library then runs the float64 reference."""
    import sparsemla._device as d
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # "0" = off, and `check` leaves a set value alone
    monkeypatch.setattr(d, "_INTERPRET", False)  # what the library decided at its kernels' decoration


H200 = A.Ceilings(device="H200", copy_bytes_per_s=4.24e12, matmul_flop_per_s=769e12)


# --- accounting -----------------------------------------------------------------------------------------

def test_flops_formula():
    # 2 * h * pairs * (d_qk + d_v): rope keys (576) and NoPE keys (512), values 512.
    assert A.attention_flops(128, 262144, 576) == 2 * 128 * 262144 * 1088
    assert A.attention_flops(16, 10, 512) == 2 * 16 * 10 * 1024


def test_work_counts_valid_pairs_and_unique_rows():
    q = torch.zeros(3, 2, 576, dtype=torch.bfloat16)
    idx = torch.tensor([[5, 7, 7, -1],     # 3 valid pairs, rows {5, 7}
                        [7, 9, 11, 13],    # valid count 2 below: pairs 7, 9 (11, 13 ignored)
                        [-1, -1, -1, -1]], dtype=torch.int32)
    vc = torch.tensor([4, 2, 4], dtype=torch.int32)
    w = A.attention_work(q, idx, 656, vc)
    assert w.valid_pairs == 5
    assert w.unique_rows == 3  # {5, 7, 9}
    assert w.flops == 2 * 2 * 5 * (576 + 512)
    q_bytes = 3 * 2 * 576 * 2
    out_bytes = 3 * 2 * 512 * 2
    lse_bytes = 3 * 2 * 4
    assert w.nbytes == 3 * 656 + q_bytes + out_bytes + lse_bytes
    # Without valid counts every non-negative entry counts.
    w2 = A.attention_work(q, idx, 656)
    assert (w2.valid_pairs, w2.unique_rows) == (7, 5)


def test_sol_matches_the_documented_anchors():
    # D-h16 / D-h128: b 128, top-k 2048, all rows distinct (distinct positions, distinct requests).
    pairs = 128 * 2048
    for bpt, want_us in ((656, 41.0), (352, 22.0)):
        q = torch.zeros(128, 16, 576, dtype=torch.bfloat16)
        nbytes = pairs * bpt + q.numel() * 2 + 128 * 16 * 512 * 2 + 128 * 16 * 4
        w = A.Work(flops=A.attention_flops(16, pairs, 576), nbytes=nbytes)
        assert A.bound(w, H200) == "memory"
        assert A.sol_seconds(w, H200) * 1e6 == pytest.approx(want_us, rel=0.05)  # the doc says "about"
    w = A.Work(flops=A.attention_flops(128, pairs, 576), nbytes=pairs * 656)
    assert A.bound(w, H200) == "compute"
    assert A.sol_seconds(w, H200) == pytest.approx(2 * 128 * pairs * 1088 / 769e12)


def test_achieved_rates():
    w = A.Work(flops=int(1e12), nbytes=int(2e12))
    r = A.achieved(1.0, w, H200)
    assert r["tflops"] == pytest.approx(1.0) and r["tbps"] == pytest.approx(2.0)
    sol = max(1e12 / 769e12, 2e12 / 4.24e12)
    assert r["sol_us"] == pytest.approx(sol * 1e6)
    assert r["pct_sol"] == pytest.approx(100 * sol)
    with pytest.raises(ValueError, match="time_s"):
        A.achieved(0.0, w, H200)


def test_cache_write_bytes():
    w = A.cache_write_work(65536, 576, 352)
    assert w.nbytes == 65536 * (576 * 2 + 8 + 352) and w.flops == 0


# --- configurations --------------------------------------------------------------------------------------

def test_standard_table():
    names = [c.name for c in STANDARD_CONFIGS]
    assert len(names) == len(set(names)) == 18
    by = {c.name: c for c in STANDARD_CONFIGS}
    assert (by["D-h16"].batch, by["D-h16"].s_q, by["D-h16"].num_heads, by["D-h16"].topk) == (128, 1, 16, 2048)
    assert by["D-h128-mtp"].s_q == 2 and by["D-h128-mtp"].num_tokens == 256
    assert by["P-32k"].kind == "prefill" and by["P-32k"].s_q == 4096 and by["P-32k"].context == 32768
    assert by["W"].kind == "write" and by["W"].tokens == 65536
    assert all(c.context == 32768 for c in STANDARD_CONFIGS if c.kind != "write")


def test_filtering():
    assert [c.name for c in select_configs("D-small")] == [
        "D-small-b1-h16", "D-small-b1-h128", "D-small-b4-h16", "D-small-b4-h128", "D-small-b16-h16",
        "D-small-b16-h128"]
    assert [c.name for c in select_configs("D-h*")] == ["D-h16", "D-h32", "D-h64", "D-h128", "D-h128-mtp"]
    # Table order whatever the pattern order; duplicates once.
    assert [c.name for c in select_configs(["W", "D-h16,D-h16"])] == ["D-h16", "W"]
    assert {c.kind for c in select_configs(kinds=["prefill"])} == {"prefill"}
    assert [c.name for c in select_configs(quick=True)] == list(QUICK_NAMES)
    assert select_configs(None) == list(STANDARD_CONFIGS)
    with pytest.raises(ValueError, match="'D-h7'"):
        select_configs("D-h7")
    with pytest.raises(ValueError, match="kinds"):
        select_configs(kinds=["encode"])


def test_scaled_down_keeps_structure():
    mtp = select_configs("D-h128-mtp")[0].scaled_down()
    assert mtp.scaled and mtp.s_q == 2 and mtp.topk < mtp.context
    pre = select_configs("P-32k")[0].scaled_down()
    assert pre.kind == "prefill" and pre.s_q > 1 and pre.batch == 1


# --- workload ---------------------------------------------------------------------------------------------

def test_topk_positions_distinct_in_range_and_padded():
    g = torch.Generator().manual_seed(1)
    visible = torch.tensor([1000, 30, 64, 1])
    pos = random_topk_positions(visible, 64, generator=g)
    assert pos.shape == (4, 64) and pos.dtype == torch.int32
    for t, v in enumerate(visible.tolist()):
        row = pos[t]
        n = min(v, 64)
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()          # valid prefix, then -1
        assert row[:n].unique().numel() == n                            # distinct
        assert int(row[:n].max()) < v                                   # inside the visible context
    # Random, not the first positions.
    assert sorted(pos[0].tolist()) != list(range(64))


def test_layout_blocks_shuffled_and_complete():
    lay = make_layout([300, 64, 1000], block_size=64, seed=3, extra_blocks=5)
    bt = lay.block_table
    need = [5, 1, 16]
    assert bt.shape == (3, 16)
    used = torch.cat([bt[r, :n] for r, n in enumerate(need)])
    assert (bt[0, 5:] == -1).all() and (bt[1, 1:] == -1).all()
    assert used.unique().numel() == used.numel() == sum(need)
    assert int(used.min()) >= 0 and int(used.max()) < lay.num_blocks == sum(need) + 5
    assert not torch.equal(used, torch.sort(used).values)  # shuffled
    slots = lay.token_slots()
    assert slots.numel() == 1364 and slots.unique().numel() == 1364


def test_workload_properties(no_interpreter):
    cfg = BenchConfig("t", "t-decode", "decode", batch=3, s_q=2, num_heads=4, topk=64, context=512, scaled=True)
    wl = build_workload(cfg, "fp8_ds_mla", context_lens=[512, 40, 200], seed=5)
    assert wl.q.shape == (6, 4, 576) and wl.q.dtype == torch.bfloat16
    assert wl.indices.shape == (6, 64) and wl.indices.dtype == torch.int32
    # Query positions: the last s_q tokens of each request; causal visibility.
    assert wl.query_pos.tolist() == [510, 511, 38, 39, 198, 199]
    assert wl.valid_counts.tolist() == [64, 64, 39, 40, 64, 64]
    for t in range(6):
        n = int(wl.valid_counts[t])
        assert (wl.indices[t, n:] == -1).all()
        assert wl.indices[t, :n].unique().numel() == n
        assert int(wl.topk_local[t, :n].max()) <= int(wl.query_pos[t])
    # Rows hold the tokens at those positions: decode(row) == the value written at that position.
    kv, slots = source_tokens(wl.layout, device="cpu", seed=5)
    starts = torch.tensor([0, 512, 552])
    t = 2  # request 1
    pos = wl.topk_local[t, :10].long()
    want = wl.cache.fmt.decode(wl.cache.fmt.encode(kv[starts[1] + pos, :512], kv[starts[1] + pos, 512:]))
    got = wl.cache.read(wl.indices[t, :10])
    assert torch.equal(got, want)
    # Heavy-tailed, not constant.
    x = kv.float()
    assert x.std() > 0.5
    kurt = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
    assert kurt > 6  # a normal distribution has 3


def test_workload_deterministic_and_shared_across_formats(no_interpreter):
    cfg = BenchConfig("t", "t-decode", "decode", batch=2, s_q=1, num_heads=2, topk=64, context=256, scaled=True)
    a = build_workload(cfg, "bf16", seed=1)
    b = build_workload(cfg, "nvfp4_ds_mla", seed=1)
    assert torch.equal(a.q, b.q) and torch.equal(a.indices, b.indices)
    c = build_workload(cfg, "bf16", seed=2)
    assert not torch.equal(a.q, c.q)
    nope = build_queries(cfg, build_cache("bf16-nope", a.layout, device="cpu", seed=1), a.layout, seed=1)
    assert nope.q.shape[-1] == 512 and torch.equal(nope.q, a.q[..., :512])


def test_heavy_tailed_outlier_channels():
    g = torch.Generator().manual_seed(0)
    ch = torch.tensor([3, 7])
    x = heavy_tailed((4096, 16), generator=g, device="cpu", dtype=torch.float32, channels=ch, channel_gain=8.0)
    amp = x.abs().mean(0)
    assert amp[ch].min() > 4 * amp[[i for i in range(16) if i not in (3, 7)]].max()


# --- timing, baseline, runner --------------------------------------------------------------------------------

def test_time_fn_cpu():
    calls = []
    t = time_fn(lambda: calls.append(1), device="cpu", reps=7, warmup=2)
    assert len(calls) == 9 and t.reps == 7 and t.method == "perf_counter" and not t.l2_flushed
    assert t.min_s <= t.p20_s <= t.median_s <= t.p80_s
    with pytest.raises(ValueError, match="reps"):
        time_fn(lambda: None, device="cpu", reps=0)


def test_time_fns_interleaves_the_calls_cpu():
    """After each call's warm-up, every round runs each call once in turn: calls compared with each other see the
    same span of the process (the prefill driver times its formats and FlashMLA this way)."""
    order = []
    ts = time_fns([lambda: order.append("a"), lambda: order.append("b"), lambda: order.append("c")], device="cpu",
                  reps=3, warmup=1)
    assert order == ["a", "b", "c"] + ["a", "b", "c"] * 3
    assert [t.reps for t in ts] == [3, 3, 3] and all(t.method == "perf_counter" for t in ts)
    with pytest.raises(ValueError, match="warmup"):
        time_fns([lambda: None], device="cpu", reps=1, warmup=-1)


def test_torch_floor_matches_reference(no_interpreter):
    cfg = BenchConfig("t", "t", "decode", batch=3, s_q=1, num_heads=4, topk=64, context=256, scaled=True)
    wl = build_workload(cfg, "bf16", context_lens=[256, 30, 100], seed=0)
    vc = wl.valid_counts.clone()
    vc[2] = 0
    out, lse = torch_gather_attention(wl.q, wl.cache, wl.indices, wl.sm_scale, vc)
    ref_out, ref_lse = sparse_mla(wl.q, wl.cache, wl.indices, wl.sm_scale, vc)
    rel, lse_err = compare_to_reference(out, lse, ref_out, ref_lse)
    assert rel < 1e-2 and lse_err < 1e-2
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


def test_compare_to_reference_catches_nan_and_wrong_empty_rows():
    ref = torch.ones(2, 2, 512)
    ref_lse = torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]])
    bad = ref.clone()
    bad[0, 0, 0] = float("nan")
    assert math.isnan(compare_to_reference(bad, ref_lse, ref, ref_lse)[0])
    assert compare_to_reference(ref, torch.zeros(2, 2), ref, ref_lse)[1] == float("inf")
    assert compare_to_reference(ref, ref_lse, ref, ref_lse) == (0.0, 0.0)


def test_resolve_formats():
    assert resolve_formats(None) == ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"]
    assert len(resolve_formats("all")) == 8
    assert resolve_formats("*-nope") == ["bf16-nope", "fp8-nope", "fp8_ds_mla-nope", "nvfp4_ds_mla-nope"]
    with pytest.raises(ValueError, match="fp4"):
        resolve_formats("fp4")


def test_peer_ratios():
    rs = [{"config": "c", "backend": "triton", "format": "fp8_ds_mla", "peer": False, "status": "ok", "time_us": 50.0},
          {"config": "c", "backend": "flashinfer", "format": "bf16", "peer": True, "status": "ok", "time_us": 100.0},
          {"config": "c", "backend": "flashmla", "format": "fp8_ds_mla", "peer": True, "status": "ok", "time_us": 120.0},
          {"config": "c", "backend": "flashmla", "format": "bf16", "peer": True, "status": "skipped"}]
    add_peer_ratios(rs)
    assert rs[0]["vs_best_peer"] == pytest.approx(2.0) and rs[0]["best_peer"] == "flashinfer (bf16)"
    assert rs[2]["vs_best_peer"] == pytest.approx(100 / 120)
    assert "vs_best_peer" not in rs[3]


def test_runner_cpu_end_to_end(tmp_path, no_interpreter):
    cfgs = select_configs("D-h16,P-h16,W")
    logs = []
    rep = run_benchmarks(cfgs, "bf16,nvfp4_ds_mla", "torch-gather", out_dir=str(tmp_path), reps=2, warmup=0,
                         show_progress=False, log=logs.append)
    res = rep["results"]
    assert any("scaled-down" in line for line in logs)
    ok = [r for r in res if r["status"] == "ok"]
    # The floor runs on bf16 only; writes run per format.
    assert {(r["config"], r["format"], r["backend"]) for r in ok} == {
        ("D-h16", "bf16", "torch-gather"), ("P-h16", "bf16", "torch-gather"),
        ("W", "bf16", "cache.write"), ("W", "nvfp4_ds_mla", "cache.write")}
    skipped = [r for r in res if r["status"] == "skipped"]
    assert skipped and all("bf16" in r["reason"] for r in skipped)
    for r in ok:
        assert r["time_us"] > 0 and r["sol_us"] > 0 and 0 < r["pct_sol"]
        if r["kind"] != "write":
            assert r["rel_err"] < 1e-2 and r["flops"] > 0
    d = next(r for r in ok if r["config"] == "D-h16")
    assert d["scaled"] and d["num_heads"] == 4 and d["topk"] == 64
    assert d["valid_pairs"] == 2 * 64
    files = rep["files"]
    assert set(files) >= {"json", "csv", "svg"}
    saved = json.load(open(files["json"]))
    assert saved["environment"]["torch"] == torch.__version__
    assert saved["ceilings"]["copy_bytes_per_s"] > 0
    assert len(saved["results"]) == len(res)
    rows = list(csv.DictReader(open(files["csv"])))
    assert len(rows) == len(res) and {"config", "time_us", "pct_sol", "vs_best_peer"} <= set(rows[0])
    svg = open(files["svg"]).read()
    assert svg.startswith("<svg") and "torch-gather" in svg and "D-h16" in svg
    table = format_table(res)
    assert "D-h16" in table and "skipped: torch-gather" in table


def test_svg_chart(tmp_path):
    rs = [{"config": c, "kind": "decode", "format": f, "backend": b, "status": "ok", "time_us": t, "sol_us": 20.0}
          for c, f, b, t in (("D-h16", "fp8_ds_mla", "triton", 30.0), ("D-h16", "fp8_ds_mla", "flashmla", 121.0),
                             ("D-h128", "nvfp4_ds_mla", "triton", 150.0))]
    p = write_svg(rs, str(tmp_path / "c.svg"))
    s = open(p).read()
    assert s.count("<rect") >= 4 and "nvfp4_ds_mla" in s and "speed-of-light" in s
    assert write_svg([], str(tmp_path / "none.svg")) is None
    assert not os.path.exists(tmp_path / "none.svg")


def test_tolerances():
    from sparsemla.bench import backends as B
    assert B.tolerance("triton", "nvfp4_ds_mla") == B.EXACT_TOLERANCE == (1e-2, 1e-2)
    assert B.tolerance("triton-staged", "fp8") == B.EXACT_TOLERANCE
    # Staging re-quantizes bf16, fp8_ds_mla and nvfp4 rows to plain e4m3: only gross errors are caught.
    assert B.tolerance("triton-staged", "fp8_ds_mla") == B.LOSSY_TOLERANCE
    assert B.tolerance("triton-staged", "nvfp4_ds_mla") == B.LOSSY_TOLERANCE
    assert B.tolerance("triton-staged", "bf16-nope") == B.LOSSY_TOLERANCE
    assert B.tolerance("torch-gather", "bf16") == B.TORCH_TOLERANCE


# --- results file, renderer, history check ---------------------------------------------------------------

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from sparsemla.bench import results as R  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script(rel):
    spec = importlib.util.spec_from_file_location(os.path.basename(rel)[:-3], os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ENV = dict(gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", python="3.12", cuda="13.0",
           commit="0" * 40, date="2026-12-01T00:00:00Z", command="python3 benchmarks/decode.py")


def _row(**kw):
    base = dict(config="D-h16", kind="decode", fmt="fp8_ds_mla", heads=16, batch=128, s_q=1, topk=2048,
                impl="sparsemla", timing="graph", value=70.0, sol_pct=59.0)
    base.update(kw)
    return R.make_row(ENV, **base)


@pytest.mark.parametrize("name", ["h100.jsonl", "h200.jsonl"])
def test_results_file_rows_follow_the_schema(name):
    rows = R.load(os.path.join(ROOT, "benchmarks", "results", name))
    assert rows, "the results file is empty"
    assert len({r["gpu"] for r in rows}) == 1, "one GPU a results file"
    for r in rows:
        assert r.get("source") or r.get("command")  # a driver writes the command; seeded rows name their source
    # every standard decode format at 16 / 64 / 128 heads, b 128, has a sparsemla row
    have = {(r["config"], r["format"]) for r in rows if r["impl"] == "sparsemla" and r["kind"] == "decode"}
    for fmt in ("bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"):
        for h in (16, 64, 128):
            assert (f"D-h{h}", fmt) in have


@pytest.mark.parametrize("bad", [dict(impl="mine"), dict(timing="wall"), dict(value=-1.0), dict(heads="16"),
                                 dict(date="yesterday"), dict(extra_key=1)])
def test_schema_rejects_bad_rows(bad):
    row = _row()
    row.update(bad)
    with pytest.raises(R.SchemaError):
        R.validate_row(row)
    missing = _row()
    del missing["commit"]
    with pytest.raises(R.SchemaError, match="commit"):
        R.validate_row(missing)


def test_latest_row_wins_and_append_validates(tmp_path):
    p = str(tmp_path / "r.jsonl")
    R.append(p, [_row(value=80.0), _row(config="D-h64", heads=64, value=150.0)])
    R.append(p, [_row(value=70.0)])
    rows = R.latest(R.load(p))
    assert [(r["config"], r["value"]) for r in rows] == [("D-h64", 150.0), ("D-h16", 70.0)]
    with pytest.raises(R.SchemaError):
        R.append(p, [dict(_row(), kind="training")])
    assert len(R.load(p)) == 3  # nothing of the bad batch was written


def test_render_tables_ratios_and_shortfalls(tmp_path):
    render = _load_script("benchmarks/render.py")
    p = str(tmp_path / "r.jsonl")
    R.append(p, [_row(config="D-h128", heads=128, value=272.0, sol_pct=34.0),
                 _row(config="D-h128", heads=128, fmt="bf16", value=243.0),
                 _row(config="D-h128", heads=128, impl="flashmla", timing="eager", value=179.4),
                 _row(config="D-h128", heads=128, fmt="bf16", impl="flashinfer", timing="eager", value=148.8),
                 _row(value=74.0, sol_pct=56.0)])
    rows = R.load(p)
    bench = render.render_benchmarks(rows, "r.jsonl")
    assert "| `fp8_ds_mla` | 128 | 272.0 us (34 %) |" in bench
    assert "0.66x" in bench and "0.55x" in bench       # 179.4 / 272 (same format), 148.8 / 272 (fastest peer)
    assert "Shortfalls" in bench and "reaches 56 % of speed-of-light" in bench
    block = render.render_readme_block(rows)
    assert block.startswith(render.BEGIN) and block.endswith(render.END)
    assert "| 128 | 243 us | -- | 272 us | -- | 149 us | -- | 179 us |" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{render.BEGIN}\nold\n{render.END}\ntail\n")
    out = tmp_path / "B.md"
    assert render.main(["--results", p, "--benchmarks", str(out), "--readme", str(readme)]) == 0
    assert render.main(["--results", p, "--benchmarks", str(out), "--readme", str(readme), "--check"]) == 0
    assert "old" not in readme.read_text() and readme.read_text().endswith("tail\n")
    R.append(p, [_row(value=60.0)])
    assert render.main(["--results", p, "--benchmarks", str(out), "--readme", str(readme), "--check"]) == 1


def test_render_per_release_table(tmp_path):
    render = _load_script("benchmarks/render.py")
    rows = [_row(), dict(_row(value=71.0), triton="3.8.0"), dict(_row(value=72.0), triton="3.9.0")]
    bench = render.render_benchmarks(rows, "r.jsonl", triton="3.6.0")
    assert "## Per Triton release" in bench
    c = "(`0000000`)"  # each cell names the commit of its row
    assert f"| D-h16 | `fp8_ds_mla` | 70.0 us {c} | 71.0 us {c} | 72.0 us {c} |" in bench
    assert "slower on some Triton releases" not in bench  # 72 / 70 is within the 1.1x the shortfall allows
    rows.append(dict(_row(value=80.0), triton="3.9.0", date="2026-12-31T00:00:00Z"))
    bench = render.render_benchmarks(rows, "r.jsonl", triton="3.6.0")
    assert "Decode is slower on some Triton releases than on 3.6.0" in bench
    assert "fp8_ds_mla D-h16 on 3.9.0 1.14x" in bench and "D-h16 on 3.8.0" not in bench


def test_render_each_gpu_on_its_own_newest_decode_run_first(tmp_path):
    """Rows of two GPUs: BENCHMARKS.md has a heading and tables per GPU (no ratio across them), the GPU with the
    newest decode run first, and the README block is that GPU's table."""
    render = _load_script("benchmarks/render.py")
    old = [_row(value=70.0), _row(impl="flashmla", value=100.0)]
    new = [dict(r, gpu="NVIDIA H100 80GB HBM3", date="2026-12-05T00:00:00Z")
           for r in (_row(value=90.0), _row(impl="flashmla", value=117.0))]
    p100, p200 = str(tmp_path / "h100.jsonl"), str(tmp_path / "h200.jsonl")
    R.append(p200, old)
    R.append(p100, new)
    rows = R.load(p100) + R.load(p200)
    assert render.gpus_newest_first(rows) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    bench = render.render_benchmarks(rows, "r.jsonl")
    a, b = bench.index("## NVIDIA H100 80GB HBM3"), bench.index("## NVIDIA H200")
    assert a < b and "### Decode" in bench[a:b] and "### Decode" in bench[b:]
    assert "| `fp8_ds_mla` | 16 | 90.0 us (59 %) |" in bench[a:b] and "1.30x" in bench[a:b]  # 117 / 90
    assert "| `fp8_ds_mla` | 16 | 70.0 us (59 %) |" in bench[b:] and "1.43x" in bench[b:]   # 100 / 70
    assert "1.11x" not in bench  # 100 / 90: never across GPUs
    block = render.render_readme_block(rows)
    assert "NVIDIA H100 80GB HBM3" in block and "| 16 | -- | -- | 90 us |" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{render.BEGIN}\nold\n{render.END}\n")
    out = tmp_path / "B.md"
    args = ["--results", p100, "--results", p200, "--benchmarks", str(out), "--readme", str(readme)]
    assert render.main(args) == 0 and render.main(args + ["--check"]) == 0
    assert "h100.jsonl" in out.read_text() and "h200.jsonl" in out.read_text()


def test_the_documents_match_the_results_file():
    render = _load_script("benchmarks/render.py")
    assert render.main(["--check"]) == 0, "run python3 benchmarks/render.py"


def test_history_check_finds_narration_and_leaves_plain_words():
    ch = _load_script("scripts/check_history.py")
    sess = "ses" + "sion"  # spelled apart so that this file does not trip the check
    hits = [
        f"measured in the twelfth {sess}", f"see {'tools'}/exp/ab.py", f"raw data in docs/{'data'}/s12",
        "in ru" + "n B, the", "call " + "5 script", "the A/B of BENCHMARKS sec" + "tion 11", "fp8 79 -" + "> 50 us", "run" + "2 of the sweep",
        "as in ta" + "ble 1b", "is" + "sue 4's bounds", "wa" + "s 72.1 us before",
    ]
    for line in hits:
        assert ch.check_text("docs/x.md", line), line
    assert ch.check_text("sparsemla/x.py", "# chosen on 2026-" + "11-29")
    clean = ["@pytest.fixture(scope=\"" + sess + "\")", "def pytest_" + sess + "start(s):",
             "the first call compiles the kernels", "a first pass counts the valid entries", "run B blocks",
             "fn() -> None", "bytes 528..655 zero", "kv-formats.md §7", "H100 and H200", "2026-11-29 on the H200"]
    for line in clean:
        assert not ch.check_text("docs/x.md", line), line
    # CHANGELOG may narrate versions, not how the work was organized
    assert not ch.check_text("CHANGELOG.md", "fp8_ds_mla D-h128 294 -" + "> 273 us (is" + "sue 4)")
    assert ch.check_text("CHANGELOG.md", f"in the ninth {sess}")


@pytest.mark.parametrize("driver,args", [
    ("decode.py", ["--formats", "bf16", "--heads", "16"]),
    ("prefill.py", ["--formats", "fp8_ds_mla", "--heads", "16", "--kernel", "sm90-conv"]),
    ("movement.py", ["--formats", "fp8", "--only", "gather,convert"]),
])
def test_drivers_dry_run_write_valid_rows(tmp_path, driver, args):
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", driver), "--dry-run", "--results",
                        str(out)] + args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = R.load(str(out))
    assert rows and all(row["gpu"] == "cpu" and "dry run" in row["variant"] for row in rows)


def test_decode_driver_times_a_workloads_calls_together(monkeypatch):
    """decode.py checks each call of one (format, configuration), then times ours and the peer in one
    ``time_many`` (a round of each in turn), not one after the other; a row per call, in the order prepared."""
    import argparse

    from sparsemla.bench import drivers as D
    from sparsemla.bench import peers as P
    decode = _load_script("benchmarks/decode.py")
    ran = []
    monkeypatch.setitem(P.DECODE_BUILDERS, "flashinfer", lambda wl: (lambda: ran.append("peer")))
    rec = D.Recorder(D.common_args(argparse.ArgumentParser(), formats="bf16").parse_args(["--dry-run"]))
    batches, time_many = [], rec.time_many
    monkeypatch.setattr(rec, "time_many", lambda fns, graph=True: batches.append(len(fns)) or time_many(fns, graph))
    decode.run_decode(rec, ["D-h16", "D-h64"], ["bf16"], fp8qk=False)
    assert batches == [2, 2] and ran
    assert [(r["config"], r["impl"]) for r in rec.rows] == [("D-h16", "sparsemla"), ("D-h16", "flashinfer"),
                                                            ("D-h64", "sparsemla"), ("D-h64", "flashinfer")]
    assert rec.rows[0]["rel_err"] is not None and rec.rows[1].get("rel_err") is None


def test_render_each_table_from_the_newest_run_of_its_driver():
    """A decode run at a newer commit leaves the prefill and host tables on the commit that measured them."""
    render = _load_script("benchmarks/render.py")
    old, new = "a" * 40, "b" * 40
    rows = [dict(_row(config="P-32k", kind="prefill", heads=128, batch=1, s_q=4096, variant="native reads",
                      fmt="bf16", value=4580.0, tflops=511.0), commit=old),
            dict(_row(config="H-run", kind="host", timing="host", value=39.3), commit=old),
            dict(_row(value=70.0), commit=new)]
    bench = render.render_benchmarks(rows, "r.jsonl")
    assert "No prefill rows" not in bench and "4.58 ms, 511 TFLOP/s" in bench
    assert "Measured at commit `aaaaaaa`" in bench and "Measured at commit `bbbbbbb`" in bench
    assert "| `SparseMLA.run`, one layer, b 128 | `fp8_ds_mla` | 128 | 16 | 39.3 us |" in bench


def test_decode_table_takes_the_newest_complete_run_with_the_peers():
    """A complete decode run without the peers (a per-release run, --no-peers) stays in the file and in the
    per-release table but does not replace the decode table's run, whose ratios need the peers beside it."""
    render = _load_script("benchmarks/render.py")

    def run(commit, value, peers):
        env = dict(ENV, commit=commit)
        out = [dict(R.make_row(env, config=f"D-h{h}", kind="decode", fmt=f, heads=h, batch=128, s_q=1, topk=2048,
                               impl="sparsemla", timing="graph", value=value))
               for h in (16, 64, 128) for f in render.FORMATS]
        if peers:
            out.append(R.make_row(env, config="D-h64", kind="decode", fmt="fp8_ds_mla", heads=64, batch=128, s_q=1,
                                  topk=2048, impl="flashmla", timing="graph", value=90.0))
        return out
    rows = run("a" * 40, 100.0, peers=True) + run("b" * 40, 80.0, peers=False)
    assert render.section_commit(rows, "decode") == "a" * 40
    assert not render.later_rows(rows)  # not a partial run with the peers either
    bench = render.render_benchmarks(rows, "r.jsonl")
    assert "Measured at commit `aaaaaaa`" in bench and "| `fp8` | 64 | 100.0 us |" in bench
    rows += run("c" * 40, 70.0, peers=True)
    assert render.section_commit(rows, "decode") == "c" * 40


def test_readme_table_takes_the_newest_run_of_its_own_cells():
    """The README's table (the four RoPE formats at 16 / 64 / 128 heads) shows the newest run with the peers that
    measured its cells, although that run left out the NoPE rows that BENCHMARKS.md's decode table needs."""
    render = _load_script("benchmarks/render.py")

    def run(commit, value, formats):
        env = dict(ENV, commit=commit)
        out = [dict(R.make_row(env, config=f"D-h{h}", kind="decode", fmt=f, heads=h, batch=128, s_q=1, topk=2048,
                               impl="sparsemla", timing="graph", value=value))
               for h in (16, 64, 128) for f in formats]
        out.append(R.make_row(env, config="D-h64", kind="decode", fmt="fp8_ds_mla", heads=64, batch=128, s_q=1,
                              topk=2048, impl="flashmla", timing="graph", value=90.0))
        return out
    rows = run("a" * 40, 100.0, render.FORMATS) + run("b" * 40, 80.0, render.README_FORMATS)
    assert render.section_commit(rows, "decode") == "a" * 40
    block = render.render_readme_block(rows)
    assert "commit `bbbbbbb`" in block and "| 64 | 80 us | 80 us | 80 us | 80 us | -- | -- | 90 us |" in block
    rows += run("c" * 40, 70.0, render.README_FORMATS[:3])  # not every cell of the table: not taken
    assert "commit `bbbbbbb`" in render.render_readme_block(rows)


def test_host_table_takes_the_newest_run_with_the_peers():
    """Host-time targets are compared with the peers timed in the same process: a later run without them (--no-peers)
    stays in the file but does not replace the table's run."""
    render = _load_script("benchmarks/render.py")

    def host(commit, value, impl="sparsemla"):
        return dict(R.make_row(dict(ENV, commit=commit, command="python3 benchmarks/host_overhead.py"),
                               config="H-decode-b128", kind="host", fmt="fp8_ds_mla", heads=16, batch=128, s_q=1,
                               topk=2048, impl=impl, timing="host", value=value))
    rows = [host("a" * 40, 30.0), host("a" * 40, 40.0, impl="flashmla"), host("b" * 40, 50.0)]
    assert render.section_commit(rows, "host") == "a" * 40
    bench = render.render_benchmarks(rows, "r.jsonl")
    assert "Measured at commit `aaaaaaa`" in bench and "| 30.0 us |" in bench and "50.0 us" not in bench
    rows.append(host("c" * 40, 20.0, impl="flashinfer"))
    rows.append(host("c" * 40, 25.0))
    assert render.section_commit(rows, "host") == "c" * 40


def test_ncu_profile_summary_reads_the_details_and_raw_pages():
    prof = _load_script("benchmarks/ncu_profile.py")
    details = ('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
               '"0","conv_kernel","GPU Speed Of Light Throughput","Duration","us","214.5"\n'
               '"0","conv_kernel","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","61.2"\n'
               '"0","conv_kernel","Launch Statistics","Registers Per Thread","register/thread","168"\n'
               '"0","conv_kernel","Launch Statistics","Something Else","","1"\n'
               '"1","combine","GPU Speed Of Light Throughput","Duration","us","3.1"\n')
    stall = prof.STALL_PREFIX + "{}" + prof.STALL_SUFFIX
    raw = ('"ID","Kernel Name","{}","{}","{}","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"\n'
           .format(stall.format("barrier"), stall.format("long_scoreboard"), stall.format("wait")) +
           '"","","ratio","ratio","ratio","%"\n'
           '"0","conv_kernel","3.5","12.25","0.5","22.1"\n'
           '"1","combine","0.1","4","1","0"\n')
    k = prof.summarize(details, raw, top_stalls=2)
    assert [x["kernel"] for x in k] == ["conv_kernel", "combine"]
    assert k[0]["metrics"] == {"Duration": "214.5 us", "Compute (SM) Throughput": "61.2 %",
                               "Registers Per Thread": "168 register/thread"}
    assert k[0]["stalls"] == [("long_scoreboard", 12.25), ("barrier", 3.5)]
    assert list(k[0]["tensor"].values()) == [22.1]
    text = prof.format_summary(k)
    assert "long_scoreboard 12.25" in text and "Duration" in text and "[1] combine" in text


def test_ncu_profile_dry_run_makes_the_call(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ncu_profile.py"), "--dry-run", "--format",
                        "fp8_ds_mla", "--config", "D-h16"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "profiled: D-h16 fp8_ds_mla" in r.stdout, r.stdout + r.stderr


def test_ncu_profile_peer_names_the_rows_it_reads(tmp_path):
    """--peer flashmla profiles FlashMLA's call: fp8_ds_mla rows in decode, bf16 rows in prefill; any other format is
    refused with the argument named."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ncu_profile.py"), "--dry-run", "--format",
                        "bf16", "--config", "D-h16", "--peer", "flashmla"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode != 0 and "--peer: flashmla reads" in r.stdout + r.stderr, r.stdout + r.stderr


def test_conv_trace_analysis_recovers_the_intervals_of_a_synthetic_trace():
    ct = _load_script("benchmarks/conv_trace.py")
    steps = dict(fill=3600, wait_free=2150, wait_ready=2900, qk=1270, softmax=1200, pv=1200)
    tr = ct.synthetic_trace(3, 12, steps)
    res = ct.analyze(tr, 12)
    assert res["period"] == 5750
    assert (res["producer fill"], res["producer wait_free"], res["producer fence"]) == (3600, 2150, 100)
    assert (res["wg0 wait_ready"], res["wg0 qk"], res["wg0 softmax"], res["wg1 pv"]) == (2900, 1270, 1200, 1200)
    assert res["q_staged"] == 500
    # a program with fewer blocks than the others: its unwritten (zero) entries are left out, not read as times
    short = ct.synthetic_trace(1, 4, steps)
    assert ct.analyze(tr + short, 12)["period"] == 5750
    assert "period" in ct.format_analysis(res, 12)


def test_conv_trace_meta_options_and_dry_run(tmp_path):
    ct = _load_script("benchmarks/conv_trace.py")
    assert ct._parse_meta(["idx_ahead=1", "named=false", "early=True"]) == dict(idx_ahead=True, named=False,
                                                                               early=True)
    with pytest.raises(SystemExit):
        ct._parse_meta(["idx_ahead"])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "conv_trace.py"), "--dry-run", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "producer fill" in r.stdout, r.stdout + r.stderr
    raw = json.loads((tmp_path / "trace-synthetic.json").read_text())
    assert raw["programs"] == len(raw["trace"]) <= ct.RAW_PROGRAMS


def test_config_named_gives_prefill_at_any_head_count():
    """``P-h<H>``: the P-32k workload at H heads (conv_trace.py and ncu_profile.py take prefill names this way)."""
    from sparsemla.bench import drivers as D
    base = D.config_named("P-32k")
    c = D.config_named("P-h64")
    assert (c.name, c.num_heads, c.s_q, c.batch, c.topk, c.context) == ("P-h64", 64, base.s_q, 1, base.topk,
                                                                        base.context)
    assert D.config_named("P-h96", batch=2).batch == 2
    with pytest.raises(KeyError):
        D.config_named("P-hx")


def test_plan_variant_builds_the_conv_and_pair_kernels_with_their_options_only():
    """A plan's ``variant`` (``decode.py --conv-variant``) builds sm90-conv with those conv.meta options, keyed apart
    from the default build, and sm90-bf16 with bf16.meta's; the launcher refuses options for any other kernel, and
    the trace build outside
    conv_trace.py (it writes into the final-out argument)."""
    from dataclasses import replace

    from sparsemla.formats import get_format
    from sparsemla.kernels import attention as A
    from sparsemla.plan import plan_attention
    fmt = get_format("fp8_ds_mla")
    conv_plan = plan_attention(fmt, 128, 64, 2048, kernel="sm90-conv")
    assert conv_plan.variant == ()
    idx2 = replace(conv_plan, variant=(("idx_ahead", True),))
    launch = A._launch_for(idx2, fmt, True)
    assert launch.meta["IDX2"] and not launch.meta["TRACE"]
    assert A._launch_for(conv_plan, fmt, True) is not launch
    traced = A._sm90_launch(replace(conv_plan, variant=(("idx_ahead", True), ("trace", True))), fmt, True, False)
    assert traced.meta["TRACE"] and traced.meta["IDX2"]
    with pytest.raises(ValueError, match="conv_trace"):
        A._launch_for(replace(conv_plan, variant=(("trace", True),)), fmt, True)
    few_plan = plan_attention(fmt, 128, 16, 2048)
    assert few_plan.kernel != "sm90-conv"
    with pytest.raises(ValueError, match="variant"):
        A._sm90_launch(replace(few_plan, variant=(("named", True),)), fmt, True, False)
    # sm90-bf16 (prefill.py --kernel sm90-bf16:rows128=0): bf16.meta's options
    b16 = get_format("bf16")
    pair = plan_attention(b16, 128, 64, 2048, kernel="sm90-bf16")
    assert pair.kernel == "sm90-bf16"
    default = A._sm90_launch(pair, b16, True, False).meta
    assert default["W128"] and default["SO"] and default["TF"] and not default["NAMED"]
    narrow = A._sm90_launch(replace(pair, variant=(("named", True), ("rows128", False))), b16, True, False).meta
    assert not narrow["W128"] and narrow["NAMED"] and narrow["SO"]
    decode = _load_script("benchmarks/decode.py")
    assert decode.parse_options("idx_ahead=1, named=false,early=True") == dict(idx_ahead=True, named=False,
                                                                                early=True)
