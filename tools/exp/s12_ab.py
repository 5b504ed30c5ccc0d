"""Twelfth session: ws_wide's FP8-arithmetic variant, versions side by side with the default kernel (same
process, rounds alternating, CUDA-graph replay, L2 flushed, decode_sweep's cache), b 128 at 64 / 128 heads.
A version is ``MODULE:F8``: MODULE a module name or ``git@REV`` (sparsemla/kernels/ws_wide.py as committed at
REV, through wide_ab._module), F8 0 or 1; the output of each is compared with the first.  The session's runs
compared the default kernel, the first F8 form (git@62bd07e, the calls' ws_wide_s12v1 module: log2 / exp2 / a
division per head in the q staging) and the final one:

    python tools/exp/s12_ab.py --versions sparsemla.kernels.ws_wide:0,git@62bd07e:1,sparsemla.kernels.ws_wide:1
"""
import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import build, heavy, time_fn  # noqa: E402
from wide_ab import _module  # noqa: E402

from sparsemla.bench.timing import graph_replay  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import ws_attention  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402


def launcher(spec):
    mod, f8 = spec.rsplit(":", 1)
    kern = (_module("git:" + mod[4:]) if mod.startswith("git@") else importlib.import_module(mod)).ws_wide_kernel

    def launch(grid, args, bpt, kind, rope, ng, has_vc, fp8_arith=False):
        kern[grid](*args, BPT=bpt, DS=kind == "fp8_ds_mla", ROPE=rope, NG=ng, HAS_VC=has_vc, F8=f8 == "1",
                   num_warps=4, maxnreg=168)
    return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", required=True)
    ap.add_argument("--formats", default="fp8_ds_mla,fp8")
    ap.add_argument("--configs", default="128x64,128x128",
                    help="BxH[:TOPK:SPLITS], e.g. 132x64:128:1 (one program per SM, one pair of blocks)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    specs = a.versions.split(",")
    for name in a.formats.split(","):
        fmt = get_format(name)
        for cfg in a.configs.split(","):
            shape, *rest = cfg.split(":")
            b, h = map(int, shape.split("x"))
            topk, splits = (int(rest[0]), int(rest[1])) if rest else (2048, None)
            cache, idx = build(fmt, b, topk=topk)
            q = heavy(b, h, fmt.head_dim).to(torch.bfloat16)
            sm = fmt.head_dim ** -0.5
            ref = None
            best = {}
            for rnd in range(a.rounds):
                for spec in specs:
                    ws_attention.launch_wide_q = launcher(spec)
                    out = torch.full((b, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                    lse = torch.full((b, h), float("nan"), dtype=torch.float32, device="cuda")
                    fn = graph_replay(lambda out=out, lse=lse: sparse_mla_fwd(q, cache.rows, fmt, idx, sm, out=out,
                                                                             lse=lse, num_splits=splits))
                    torch.cuda.synchronize()
                    o = out.double()
                    if ref is None:
                        ref = o.clone()
                    us = time_fn(fn, reps=a.reps)
                    r = dict(fmt=name, b=b, h=h, topk=topk, splits=splits, version=spec, round=rnd, us=round(us, 2),
                             finite=bool(torch.isfinite(o).all()),
                             diff_vs_first=round(((o - ref).norm() / ref.norm()).item(), 6))
                    best[spec] = min(best.get(spec, 1e9), r["us"])
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            print(f"## {name} {cfg}: " + ", ".join(f"{s} {u}" for s, u in best.items()), flush=True)
            del cache, idx, q
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
