"""The CLI's GPU paths on the H200 (``pytest -m gpu tests/gpu/test_cli_gpu.py``): demo, bench, check, info.

Reduced sizes (a few seconds each) that still go through every GPU-only branch: CUDA-event timing with
the L2 flush, ceilings, the runner-path call of each backend, the float64 verification, JSON/CSV/SVG.
"""
import csv
import json

import pytest
import torch

from sparsemla.bench.ceilings import measure_ceilings
from sparsemla.bench.timing import time_fn
from sparsemla.cli.main import main

pytestmark = pytest.mark.gpu


def test_ceilings_are_plausible():
    c = measure_ceilings("cuda", quick=True)
    assert 0.5e12 < c.copy_bytes_per_s < 20e12
    assert 50e12 < c.matmul_flop_per_s < 5000e12


def test_cuda_timing_flushes_and_measures():
    x = torch.randn(1 << 24, device="cuda")
    t = time_fn(lambda: x.mul_(1.0), device="cuda", reps=30, warmup=3)
    assert t.method == "cuda-events" and t.l2_flushed and t.reps == 30
    assert 0 < t.min_s <= t.median_s < 0.1


def test_info_on_gpu(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "compute capability" in out and 'backend="auto" chooses: ' in out


def test_demo_gpu(tmp_path, capsys):
    p = tmp_path / "demo.json"
    rc = main(["demo", "--requests", "8", "--context", "4096", "--heads", "16,128", "--topk", "2048",
               "--reps", "10", "--no-progress", "--json", str(p)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = json.loads(p.read_text())["rows"]
    assert {(r["heads"], r["format"]) for r in rows} == {(h, f) for h in (16, 128)
                                                         for f in ("bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla")}
    for r in rows:
        assert "error" not in r, r
        assert r["kernel_err"] < 1e-2, r          # the kernel against float64 over the same rows
        assert r["kernel_us"] > 0 and r["tbps"] > 0
        if r["format"] == "bf16":
            assert r["attn_err"] < 1e-2 and r["vs_bf16"] == pytest.approx(1.0)
    assert "kernel us" in out and "CUDA-graph replay" in out and "vs bf16" in out


def test_bench_gpu(tmp_path, capsys):
    out_dir = tmp_path / "b"
    rc = main(["bench", "--configs", "D-small-b1-h16,D-small-b4-h128,W", "--formats", "bf16,nvfp4_ds_mla",
               "--reps", "10", "--out", str(out_dir), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = list(csv.DictReader(open(out_dir / "bench.csv")))
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["config"] for r in ok} == {"D-small-b1-h16", "D-small-b4-h128", "W"}
    assert any(r["backend"] == "triton" for r in ok)
    assert any(r["backend"] == "torch-gather" for r in ok)
    for r in ok:
        assert 0 < float(r["pct_sol"]) <= 100.5, r    # nothing beats the measured ceilings
    rep = json.load(open(out_dir / "bench.json"))
    assert rep["environment"]["cuda"] and rep["ceilings"]["copy_bytes_per_s"] > 1e12
    assert all(r["l2_flushed"] for r in rep["results"] if r["status"] == "ok")


def test_check_gpu_quick(capsys):
    rc = main(["check", "--quick", "--formats", "fp8_ds_mla,nvfp4_ds_mla"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 failed" in out
