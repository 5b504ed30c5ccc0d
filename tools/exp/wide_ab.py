"""A/B of ws_wide kernel versions in one process (eighth session): each version's ws_wide_kernel is launched
through sparse_attention._launch (dispatch, split plan and combine unchanged) on the peers' decode cache.
A version is a module name or ``git:REV`` (sparsemla/kernels/ws_wide.py as committed at REV, written to a
temporary module: the first version is 52f8a4c, the second 1275410).

    python tools/exp/wide_ab.py --mods sparsemla.kernels.ws_wide,git:1275410 --heads 64,128
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from decode_sweep import build, ceilings, heavy, time_fn, unique_bytes  # noqa: E402
from few_sweep import spin  # noqa: E402

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import ws_attention  # noqa: E402
from sparsemla.kernels.sparse_attention import _launch  # noqa: E402


def _module(spec, stem="ws_wide"):
    """A module name, or git:REV -> sparsemla/kernels/<stem>.py at REV as an importable module (relative
    imports made absolute)."""
    if not spec.startswith("git:"):
        return importlib.import_module(spec)
    rev = spec[4:]
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    src = subprocess.run(["git", "show", f"{rev}:sparsemla/kernels/{stem}.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from .ws_", "from sparsemla.kernels.ws_")
    d = tempfile.mkdtemp(prefix=stem + "_")
    name = f"{stem}_{rev}"
    with open(os.path.join(d, name + ".py"), "w") as f:
        f.write(src)
    sys.path.insert(0, d)
    return importlib.import_module(name)


def patched(mod):
    kern = _module(mod).ws_wide_kernel

    def launch(grid, args, bpt, kind, rope, ng, has_vc):
        kern[grid](*args, BPT=bpt, DS=kind == "fp8_ds_mla", ROPE=rope, NG=ng, HAS_VC=has_vc, num_warps=4, maxnreg=168)
    return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mods", default="sparsemla.kernels.ws_wide")
    ap.add_argument("--formats", default="fp8_ds_mla,fp8")
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--batches", default="128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw, _ = ceilings()
    rows = []
    mods = a.mods.split(",")
    for name in a.formats.split(","):
        fmt = get_format(name)
        for b in map(int, a.batches.split(",")):
            cache, idx = build(fmt, b)
            for h in map(int, a.heads.split(",")):
                q = heavy(b, h, fmt.head_dim).to(torch.bfloat16)
                out = torch.empty(b, h, 512, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(b, h, dtype=torch.float32, device="cuda")
                sm = fmt.head_dim ** -0.5
                sol_us = unique_bytes(cache, idx, h, b) / bw * 1e6
                ref = None
                for rnd in range(a.rounds):
                    for m in mods:
                        ws_attention.launch_wide_q = patched(m)
                        fn = lambda: _launch(fmt.name, q, cache.rows, fmt, idx, sm, None, 1.0, out, lse,  # noqa: E731
                                             None, None, None, None, None)
                        o = fn()[0].float().clone()
                        err = None if ref is None else round(((o - ref).norm() / ref.norm()).item(), 6)
                        ref = o if ref is None else ref
                        spin()
                        us = time_fn(fn, reps=a.reps)
                        r = dict(fmt=fmt.id, b=b, h=h, mod=m, round=rnd, us=round(us, 2),
                                 sol_pct=round(100 * sol_us / us, 1), rel_err=err)
                        rows.append(r)
                        print(json.dumps(r), flush=True)
            del cache, idx
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
