"""Every ``sparsemla`` subcommand at tiny sizes on the CPU, through ``main([...])``: what it prints and writes.

Cache writes use the PyTorch encoders (TRITON_INTERPRET=0 in the tests that write caches), which is
also what the README's demo does on a machine with no GPU.
"""
import csv
import json

import pytest
import torch

from sparsemla.cli.main import COMMANDS, main


@pytest.fixture
def no_interpreter(monkeypatch):
    """A machine without a GPU and without the interpreter: the library then runs the float64 reference."""
    import sparsemla._device as d
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # "0" = off, and `check` leaves a set value alone
    monkeypatch.setattr(d, "_INTERPRET", False)  # read once per process: the library's view of it


def test_help_lists_every_subcommand(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("info", "demo", "bench", "check", "capacity"):
        assert name in out and name in COMMANDS


def test_capacity_headline(capsys):
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    # with the indexer's 132 B per token per layer: (656 + 132) / (352 + 132), (576 + 132) / (352 + 132)
    assert "1.63x the tokens of fp8_ds_mla" in out and "1.46x those of fp8" in out
    assert "61 layers" in out and "16 per GPU at TP 8" in out
    for fmt, bpt in (("bf16", 1152), ("fp8", 576), ("fp8_ds_mla", 656), ("nvfp4_ds_mla", 352)):
        assert any(line.split()[:2] == [fmt, str(bpt)] for line in out.splitlines())


def test_capacity_numbers(capsys):
    args = ["capacity", "--layers", "10", "--tp", "2", "--gpu-mem-gib", "100", "--utilization", "0.5",
            "--weights-gib", "40", "--reserve-gib", "5", "--indexer-bytes", "0", "--json"]
    assert main(args) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["kv_budget_gib"] == pytest.approx(100 * 0.5 - 40 / 2 - 5)
    by = {f["format"]: f for f in c["formats"]}
    per = 25 * 2 ** 30 // (10 * 352) // 64 * 64
    assert by["nvfp4_ds_mla"]["tokens_per_gpu"] == per
    assert by["nvfp4_ds_mla"]["vs_fp8_ds_mla"] == pytest.approx(656 / 352)
    # NoPE geometry and the indexer cache change bytes per token.
    assert main(args + ["--nope", "--indexer-bytes", "132"]) == 0
    c = json.loads(capsys.readouterr().out)
    f = {x["format"]: x for x in c["formats"]}["nvfp4_ds_mla-nope"]
    assert f["bytes_per_token_model"] == 10 * (352 + 132)  # vLLM's NoPE row keeps its 352 bytes


def test_capacity_no_room(capsys):
    # 640 GiB of weights on 8 x 80 GiB: no room for a KV cache; the answer says from which TP there is.
    assert main(["capacity", "--tp", "8", "--gpu-mem-gib", "80", "--weights-gib", "640", "--reserve-gib", "8"]) == 0
    out = capsys.readouterr().out
    assert "no memory left for a KV cache at TP 8" in out and "room from TP 11 on" in out  # 640 / (72 - 8) = 10
    assert main(["capacity", "--tp", "8", "--gpu-mem-gib", "80", "--weights-gib", "640", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["min_tp"] == 9 and all(f["tokens_per_gpu"] == 0 for f in c["formats"])


def test_capacity_counts_the_indexer_cache_of_the_preset(capsys):
    assert main(["capacity", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["indexer_bytes"] == 132
    f = {x["format"]: x for x in c["formats"]}["fp8_ds_mla"]
    assert f["bytes_per_token_model"] == 61 * (656 + 132)
    assert main(["capacity", "--json", "--indexer-bytes", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["indexer_bytes"] == 0


def test_capacity_bad_flag(capsys):
    assert main(["capacity", "--utilization", "1.5"]) == 2
    assert "--utilization" in capsys.readouterr().err


def test_python_dash_m_sparsemla():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "sparsemla", "capacity", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "deepseek-v3.2"


def test_own_backends_are_not_peers():
    from sparsemla.bench import backends as B
    for name in ("triton", "triton-portable", "triton-fp8qk", "triton-staged", "reference"):
        assert not B.is_peer(name), name
    for name in ("flashmla", "flashinfer", "torch-gather"):
        assert B.is_peer(name), name


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "python" in out
    assert "flash_mla" in out and "flashinfer" in out
    assert "backends (probe on this machine):" in out
    assert "reference" in out
    assert "for a decode of fp8_ds_mla, 128 tokens x 16 heads, top-k 2048" in out
    assert 'backend="auto" chooses: ' in out
    if not torch.cuda.is_available():
        assert "GPU: none" in out
        # Peers never run on CPU, and info says why.
        assert "not flashmla: it runs on" in out


def test_info_json(capsys):
    assert main(["info", "--json", "--format", "nvfp4_ds_mla", "--heads", "128"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["registry"] == "ok"
    assert "reference" in info["backends"] and info["backends"]["reference"]["probe"] is None
    ex = info["example"]
    assert "nvfp4_ds_mla" in ex["call"] and "128 heads" in ex["call"]
    assert ex["chosen"] in info["backends"]
    assert ex["why_not"][ex["chosen"]] is None


def test_demo_cpu(tmp_path, capsys, no_interpreter):
    path = tmp_path / "demo.json"
    rc = main(["demo", "--cpu", "--requests", "2", "--context", "256", "--topk", "64", "--heads", "4",
               "--formats", "bf16,fp8,fp8_ds_mla,nvfp4_ds_mla", "--no-progress", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "CPU version" in out and "float64 reference" in out and "nothing is timed" in out
    rows = {r["format"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"}
    for fmt, bpt in (("bf16", 1152), ("fp8", 576), ("fp8_ds_mla", 656), ("nvfp4_ds_mla", 352)):
        assert rows[fmt]["bytes_per_token"] == bpt
        assert rows[fmt]["tokens_per_gib"] == 2 ** 30 // bpt
        assert f"{2 ** 30 // bpt:,}" in out
    # bf16 is exact; the quantized formats lose something, nvfp4 most.
    assert rows["bf16"]["round_trip_err"] == 0 and rows["bf16"]["attn_err"] == 0
    for fmt in ("fp8", "fp8_ds_mla"):
        assert 1e-3 < rows[fmt]["round_trip_err"] < 0.05
    assert rows["fp8_ds_mla"]["round_trip_err"] < rows["nvfp4_ds_mla"]["round_trip_err"] < 0.2
    assert 0 < rows["fp8_ds_mla"]["attn_err"] < rows["nvfp4_ds_mla"]["attn_err"] < 0.5


def test_demo_rejects_bad_sizes(capsys):
    assert main(["demo", "--cpu", "--heads", "0"]) == 2
    assert "--heads" in capsys.readouterr().err


def test_bench_list(capsys):
    assert main(["bench", "--list", "--configs", "D-small", "--kinds", "decode"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 6 and all(line.startswith("D-small-b") for line in out)


def test_bench_unknown_config(capsys):
    assert main(["bench", "--configs", "D-h7"]) == 2
    assert "D-h7" in capsys.readouterr().err


def test_bench_cpu_writes_results(tmp_path, capsys, no_interpreter):
    out_dir = tmp_path / "b"
    rc = main(["bench", "--configs", "D-h16,W", "--formats", "bf16,fp8_ds_mla", "--backends", "torch-gather",
               "--reps", "2", "--warmup", "0", "--out", str(out_dir), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "scaled-down" in out and "%SOL" in out and "vs best peer" in out
    assert any(line.split()[:3] == ["D-h16", "bf16", "torch-gather"] for line in out.splitlines())
    assert (out_dir / "bench.json").exists() and (out_dir / "bench.svg").exists()
    rows = list(csv.DictReader(open(out_dir / "bench.csv")))
    got = {(r["config"], r["format"], r["backend"], r["status"]) for r in rows}
    assert ("D-h16", "bf16", "torch-gather", "ok") in got
    assert ("W", "fp8_ds_mla", "cache.write", "ok") in got
    assert ("D-h16", "fp8_ds_mla", "torch-gather", "skipped") in got
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(float(r["time_us"]) > 0 and float(r["pct_sol"]) > 0 for r in ok)


def test_check_reference_passes(tmp_path, capsys, no_interpreter):
    path = tmp_path / "check.json"
    rc = main(["check", "--backends", "reference", "--formats", "bf16,nvfp4_ds_mla-nope", "--quick",
               "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out
    res = json.loads(path.read_text())["results"]
    assert {(r["format"], r["status"]) for r in res} == {("bf16", "PASS"), ("nvfp4_ds_mla-nope", "PASS")}



def test_check_fails_on_a_wrong_backend(capsys, no_interpreter):
    from sparsemla.backends import registry as reg

    class Broken(reg.Backend):
        name = "broken-for-test"
        device_types = ("cuda", "cpu")

        def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
            out.fill_(0.5)
            lse.fill_(1.0)
            return out, lse

    reg.register(Broken(), replace_existing=True)
    try:
        rc = main(["check", "--backends", "broken-for-test", "--formats", "bf16", "--quick"])
    finally:
        reg._BACKENDS.pop("broken-for-test", None)
        reg.clear_selection_cache()
    assert rc == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "out rel err" in out and "no valid entry" in out
    assert "0 passed, 1 failed" in out


def test_check_list(capsys):
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "prefill" in out


def test_demo_prints_the_accuracy_table(capsys, no_interpreter):
    rc = main(["demo", "--cpu", "--requests", "2", "--context", "256", "--topk", "64", "--heads", "4",
               "--formats", "bf16", "--no-progress", "--accuracy"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Accuracy per KV format through a DSA layer" in out and "sanity check" in out
    table = [ln for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| format")]
    fmts = [ln.split("|")[1].strip() for ln in table]
    assert fmts == ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16-nope", "fp8-nope", "fp8_ds_mla-nope",
                    "nvfp4_ds_mla-nope"]
    # bf16 against itself is exact; every quantized format has a positive error vs the bf16 cache.
    errs = {f: float(ln.split("|")[3]) for f, ln in zip(fmts, table)}
    assert errs["bf16"] == 0 and all(errs[f] > 0 for f in fmts if not f.startswith("bf16"))
