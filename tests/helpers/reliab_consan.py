"""Triton's concurrency sanitizer (ConSan) over the sm_90 Gluon kernels, on the GPU machine.

    python3 tests/helpers/reliab_consan.py [--variants NAME,...] [--splits 2] [--jobs N] [--timeout S] [--list]

compute-sanitizer's racecheck sees the kernels' shared-memory accesses but not the order their mbarriers, wgmma
groups and warp partitions give them (docs/reliability.md): it follows per-thread arrivals and hardware barriers
only, and it reports Triton's own start-up of the warp partitions.  ConSan is Triton's instrumentation for exactly
these pipelines (``TRITON_INSTRUMENTATION_MODE=consan``): the compiler adds, around every shared-memory access,
cp.async, wgmma, mbarrier operation and partition, a record of which buffers each one reads or writes and which
arrivals order them, and a device-side assertion fires on an access to a buffer with an unordered write or read
outstanding ("outstanding writes" / "outstanding reads"), or on a wait that can never complete ("Deadlock").

Each variant (a kernel, a row format, a head count, the FP8-QK mode or not) runs in a process of its own: an
assertion ends that process's CUDA context.  A variant makes one call per entry of ``--splits`` (default 2: the rows
split over two programs and their combine; 1: one program per token) on three tokens with -1 padding, garbage past
a valid count and an empty row, and checks the output against the float64 reference (the instrumentation must not
change what the kernel computes).  The split count changes only where the output goes (bf16 out or fp32
partials), not the pipeline ConSan checks, but each is a build of its own: ConSan builds take minutes a variant
(the instrumented PTX is ~50x longer, and on the H200 with 16 at once 2-4 minutes each), so the default makes one,
and the variants run ``--jobs`` at a time.

Prints one line per variant (ok; FAIL: an assertion or a wrong result; TIMEOUT: not finished within ``--timeout``)
and a summary; writes ``consan.json`` under ``$RELIAB_OUT`` (or ``$OUT/reliability``).  Exit status 1 when a
variant did not come out clean.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)  # the parent imports sparsemla too (whether sm90-cluster builds), run from anywhere

# name -> (plan kernel, row format, heads, FP8-QK mode): every sm_90 kernel over every kind of row it reads, with
# and without a rope part where that changes the pipeline (fp8_ds_mla's bf16 rope is copied, the others converted)
VARIANTS = {
    "few-fp8": ("sm90-few", "fp8", 16, False),
    "few-fp8_ds_mla": ("sm90-few", "fp8_ds_mla", 32, False),
    "few-fp8_ds_mla-nope": ("sm90-few", "fp8_ds_mla-nope", 16, False),
    "few-nvfp4_ds_mla": ("sm90-few", "nvfp4_ds_mla", 16, False),
    "few-fp8-fp8qk": ("sm90-few", "fp8", 16, True),
    "few-fp8_ds_mla-fp8qk": ("sm90-few", "fp8_ds_mla", 16, True),
    "conv-fp8": ("sm90-conv", "fp8", 64, False),
    "conv-fp8_ds_mla": ("sm90-conv", "fp8_ds_mla", 128, False),
    "conv-nvfp4_ds_mla": ("sm90-conv", "nvfp4_ds_mla", 64, False),
    "conv-nvfp4_ds_mla-nope": ("sm90-conv", "nvfp4_ds_mla-nope", 48, False),
    "conv-bf16": ("sm90-conv", "bf16", 64, False),
    "wide-fp8_ds_mla": ("sm90-wide", "fp8_ds_mla", 64, False),
    "wide-fp8-fp8qk": ("sm90-wide", "fp8", 64, True),
    "wide-fp8_ds_mla-fp8qk": ("sm90-wide", "fp8_ds_mla", 128, True),
    "bf16-bf16": ("sm90-bf16", "bf16", 128, False),
    "bf16-bf16-nope": ("sm90-bf16", "bf16-nope", 64, False),
    "cluster-fp8_ds_mla": ("sm90-cluster", "fp8_ds_mla", 128, False),
}


def run_one(name: str, splits=(2,)) -> int:
    """One variant in this process (ConSan is switched on by the parent's environment, before Triton loads)."""
    import torch
    import triton

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from attn_cases import make_case
    from sm90_gpu import check_reference, plan_for, run

    from sparsemla.plan import unavailable_kernels

    assert os.environ.get("TRITON_INSTRUMENTATION_MODE") == "consan"
    # the instrumented kernels keep their records in a global scratch buffer, which Triton allocates per launch
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    kernel, fmt, heads, fp8_qk = VARIANTS[name]
    k_scale = 0.5 if fmt.split("-")[0] == "fp8" else 1.0
    c = make_case(fmt, 3, heads, 320, ctx=1024, block_size=64, device="cuda", k_scale=k_scale)
    sm_scale = 1.0 / 24
    for ns in splits:
        plan = plan_for(c, kernel, ns, fp8_qk=fp8_qk)
        out, lse = run(c, sm_scale, plan, k_scale)
        torch.cuda.synchronize()
        assert kernel not in unavailable_kernels(), unavailable_kernels()
        # the FP8-QK mode's outputs are bounded only where max |lse| <= 1,000 (docs/reliability.md): finite, empty
        # rows exact
        inf = float("inf")
        check_reference(c, sm_scale, out, lse, k_scale, o_tol=inf if fp8_qk else 1e-2, lse_tol=inf if fp8_qk else 1e-2)
        print(f"{name}: {ns} split(s) ok", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (default: all)")
    # ptxas needs several GB for an instrumented kernel (sm90-wide's PTX is about a million lines on Triton 3.6)
    ap.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per variant, its builds included")
    ap.add_argument("--splits", default="2", help="comma-separated split counts, one call (and build) each")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        splits = tuple(int(x) for x in a.splits.split(",") if x)
    except ValueError:
        splits = ()
    if not splits or min(splits) < 1:
        ap.error(f"--splits: expected comma-separated counts >= 1, got {a.splits!r}")
    if a.one:
        return run_one(a.one, splits)
    if a.list:
        print("\n".join(VARIANTS))
        return 0
    names = [n for n in a.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    from sparsemla.plan import cluster_builds
    if not cluster_builds():  # sm90-cluster does not build here: said, not run
        skipped = [n for n in names if VARIANTS[n][0] == "sm90-cluster"]
        names = [n for n in names if n not in skipped]
        if skipped:
            print(f"skipped (sm90-cluster needs Triton >= 3.8): {', '.join(skipped)}", flush=True)
    env = dict(os.environ, TRITON_INSTRUMENTATION_MODE="consan", CUDA_LAUNCH_BLOCKING="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def child(name):
        t0 = time.time()
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--splits", a.splits]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        verdict = "ok" if rc == 0 else ("TIMEOUT" if rc == "timeout" else "FAIL")
        # ConSan's assertion messages, else the last lines of the output
        found = [ln for ln in text.splitlines() if "outstanding" in ln or "Deadlock" in ln or "Assertion" in ln]
        detail = (found or text.strip().splitlines()[-3:] or [""])[:5]
        row = dict(variant=name, verdict=verdict, rc=rc, seconds=round(time.time() - t0, 1), detail=detail)
        print(f"{verdict:7s} {name:26s} {row['seconds']:7.1f} s  {'' if rc == 0 else ' | '.join(detail)[-600:]}",
              flush=True)
        return row

    t0 = time.time()
    with ThreadPoolExecutor(max(1, a.jobs)) as ex:
        rows = list(ex.map(child, names))
    failed = [r["variant"] for r in rows if r["verdict"] == "FAIL"]
    unfinished = [r["variant"] for r in rows if r["verdict"] == "TIMEOUT"]
    import triton
    summary = dict(tool="ConSan (TRITON_INSTRUMENTATION_MODE=consan)", triton=triton.__version__, splits=list(splits),
                   variants=len(rows), failed=failed, unfinished=unfinished, seconds=round(time.time() - t0, 1),
                   rows=rows)
    print(f"consan: {len(rows) - len(failed) - len(unfinished)} of {len(rows)} variants clean, {len(failed)} failed, "
          f"{len(unfinished)} unfinished ({summary['seconds']} s, Triton {triton.__version__})")
    sys.path.insert(0, HERE)
    from reliab_property import write_summary
    write_summary(summary, "consan.json")
    return 1 if failed or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
