"""One decode or prefill call of the tables under Nsight Compute: each kernel it launches profiled once, after a
warm-up, with the sections that say what bounds it; a one-screen summary, the report and its CSV pages under
``--out``.

    python3 benchmarks/ncu_profile.py --config D-h128 --format fp8_ds_mla --out $OUT/prof
    python3 benchmarks/ncu_profile.py --config D-h64 --format bf16 --kernel sm90-conv --out $OUT/prof    # a forced kernel
    python3 benchmarks/ncu_profile.py --config D-h128 --format nvfp4_ds_mla --set full --out $OUT/prof    # every section
    python3 benchmarks/ncu_profile.py --config P-32k --format bf16 --out $OUT/prof    # prefill, native reads
    python3 benchmarks/ncu_profile.py --config P-32k --format bf16 --peer flashmla --out $OUT/prof   # the peer's kernel
    python3 benchmarks/ncu_profile.py --dry-run --format fp8_ds_mla                                       # CPU check

The driver runs itself again under ``ncu --profile-from-start off`` (``NCU`` names the binary; default: on PATH,
else the newest ``/usr/local/cuda*/bin/ncu``).  That child builds the decode table's workload (b requests of
32,768-token contexts in shuffled 64-token blocks, ``sparsemla.bench.workload``; for ``P-32k`` / ``P-h<H>`` 4,096
queries over one 32,768-token context, through the functional API: native reads), calls once to compile and warm up,
then once between ``cudaProfilerStart`` and ``cudaProfilerStop``: only that call's kernels are profiled.  ``--peer
flashmla`` profiles FlashMLA's call on the same workload instead (decode: fp8_ds_mla rows; prefill: bf16 rows), so that
both kernels' figures come from the same sections.  The parent
then reads the report back (``ncu --import``: the details page and the raw metrics as CSV, both kept) and prints,
per kernel, its duration, grid, registers, shared memory, the throughput figures of Speed Of Light, issue-slot use,
warp cycles per issued instruction, the tensor pipes' activity, and the largest stall reasons per issued
instruction.  ``--dry-run`` runs the child's call on the CPU (interpreter, tiny shapes) without ncu.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
            "SchedulerStats", "WarpStateStats", "InstructionStats")
# Details-page metrics the summary shows (section display names, as ncu prints them), in this order.
DETAILS = ("Duration", "Grid Size", "Block Size", "Registers Per Thread", "Dynamic Shared Memory Per Block",
           "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "L2 Hit Rate", "Issue Slots Busy",
           "Executed Ipc Active", "Warp Cycles Per Issued Instruction", "Achieved Occupancy")
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
TENSOR_PREFIX = "sm__pipe_tensor"


def find_ncu() -> str:
    ncu = os.environ.get("NCU") or shutil.which("ncu")
    if not ncu:
        found = sorted(glob.glob("/usr/local/cuda*/bin/ncu"))
        ncu = found[-1] if found else None
    if not ncu:
        raise SystemExit("ncu not found: set NCU to Nsight Compute's command-line binary")
    return ncu


def summarize(details_csv: str, raw_csv: str, top_stalls: int = 6) -> list:
    """Per profiled kernel (in launch order): ``{"kernel", "id", "metrics": {name: "value unit"}, "stalls":
    [(reason, cycles per issued instruction)], "tensor": {metric: value}}`` from ncu's details and raw CSV pages."""
    kernels: dict = {}
    order = []
    for row in csv.DictReader(io.StringIO(details_csv)):
        kid = row.get("ID")
        if kid is None:
            continue
        if kid not in kernels:
            kernels[kid] = {"kernel": row.get("Kernel Name", "?"), "id": kid, "metrics": {}, "stalls": [],
                            "tensor": {}}
            order.append(kid)
        name = row.get("Metric Name", "")
        if name in DETAILS and name not in kernels[kid]["metrics"]:
            unit = row.get("Metric Unit", "")
            kernels[kid]["metrics"][name] = f"{row.get('Metric Value', '')} {unit}".strip()
    rows = list(csv.reader(io.StringIO(raw_csv)))
    if rows:
        head = rows[0]
        for r in rows[1:]:
            if not r or len(r) != len(head):
                continue
            rec = dict(zip(head, r))
            kid = rec.get("ID")
            if kid not in kernels:
                continue
            stalls = []
            for col, val in rec.items():
                try:
                    v = float(val.replace(",", ""))
                except ValueError:
                    continue
                if col.startswith(STALL_PREFIX) and col.endswith(STALL_SUFFIX):
                    stalls.append((col[len(STALL_PREFIX):-len(STALL_SUFFIX)], v))
                elif col.startswith(TENSOR_PREFIX) and "pct_of_peak" in col:
                    kernels[kid]["tensor"][col] = v
            kernels[kid]["stalls"] = sorted(stalls, key=lambda s: -s[1])[:top_stalls]
    return [kernels[k] for k in order]


def format_summary(kernels: list) -> str:
    lines = []
    for k in kernels:
        lines.append(f"== [{k['id']}] {k['kernel'][:100]}")
        for name in DETAILS:
            if name in k["metrics"]:
                lines.append(f"   {name:<36} {k['metrics'][name]}")
        for col, v in sorted(k["tensor"].items()):
            lines.append(f"   {col:<70} {v:8.2f}")
        if k["stalls"]:
            lines.append("   stalls (cycles per issued instruction): " +
                         ", ".join(f"{r} {v:.2f}" for r, v in k["stalls"]))
    return "\n".join(lines)


def child(a) -> int:
    """Build the workload, warm up, and make the one profiled call."""
    import torch

    from sparsemla.bench import drivers as D
    from sparsemla.bench.workload import build_workload
    from sparsemla.formats import get_format
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode  # the decode table's calls: the plan's choice, or the launcher on a forced kernel

    dev = torch.device("cpu" if a.dry_run else "cuda")
    cfg = D.scaled(D.config_named(a.config), a.dry_run)
    wl = build_workload(cfg, get_format(a.format), device=dev)
    if a.peer:
        from sparsemla.bench import peers as P
        prefill = a.config.startswith("P-")
        if a.format != ("bf16" if prefill else "fp8_ds_mla"):  # (argparse admits flashmla alone)
            raise SystemExit(f"--peer: flashmla reads bf16 rows in prefill and fp8_ds_mla rows in decode, got "
                             f"{a.peer!r} with {a.format!r} on {a.config}")
        call = P.flashmla_prefill(wl, wl.cache.rows.view(torch.bfloat16)) if prefill else P.flashmla_decode(wl)
        call()
        err = float("nan")  # (the peer's output is not ours to check here)
    else:
        call, out = decode.forced_call(wl, a.kernel) if a.kernel else decode.ours_call(wl)
        err = decode.check_against_reference(wl, call, out)  # (also the warm-up: compiles and launches once)
    for _ in range(2):
        call()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    call()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    what = a.peer or a.kernel or "the plan's kernels"
    print(f"profiled: {a.config} {a.format}, {what}; output within {err:.1e} of float64", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="D-h128",
                    help="a decode configuration (D-h<H>, D-small-b4-h128, ...) or a prefill one (P-32k, P-h<H>)")
    ap.add_argument("--format", default="fp8_ds_mla")
    ap.add_argument("--kernel", default=None, help="force a kernel of the plan (sm90-conv, sm90-cluster, ...)")
    ap.add_argument("--peer", default=None, choices=["flashmla"], help="profile the peer's call instead of ours")
    ap.add_argument("--out", default="./out/profile", help="folder for the report, its CSV pages and summary")
    ap.add_argument("--set", default=None, help="an ncu section set instead of the default sections (e.g. full)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="the child's call on the CPU, without ncu")
    a = ap.parse_args(argv)
    if a.child or a.dry_run:
        return child(a)
    ncu = find_ncu()
    os.makedirs(a.out, exist_ok=True)
    name = f"{a.config}-{a.format}" + (f"-{a.kernel}" if a.kernel else "") + (f"-{a.peer}" if a.peer else "")
    report = os.path.join(a.out, name)
    what = ["--set", a.set] if a.set else [x for s in SECTIONS for x in ("--section", s)]
    cmd = [ncu, "--profile-from-start", "off", "--target-processes", "all", *what, "--export", report,
           "--force-overwrite", sys.executable, os.path.abspath(__file__), "--child", "--config", a.config,
           "--format", a.format, *(["--kernel", a.kernel] if a.kernel else []),
           *(["--peer", a.peer] if a.peer else [])]
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        return done.returncode
    pages = {}
    for page in ("details", "raw"):
        text = subprocess.run([ncu, "--import", report + ".ncu-rep", "--page", page, "--csv"], capture_output=True,
                              text=True, check=True).stdout
        pages[page] = text
        with open(f"{report}.{page}.csv", "w") as f:
            f.write(text)
    kernels = summarize(pages["details"], pages["raw"])
    text = format_summary(kernels)
    with open(f"{report}.summary.txt", "w") as f:
        f.write(text + "\n")
    with open(f"{report}.summary.json", "w") as f:
        json.dump(kernels, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
