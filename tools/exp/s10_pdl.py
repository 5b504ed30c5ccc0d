"""Tenth session: the split combine launched with programmatic dependent launch or in plain stream order
(sparse_attention.COMBINE_PDL), small batches, CUDA-graph replay, L2 flushed; the outputs must be identical.

    python tools/exp/s10_pdl.py --formats fp8_ds_mla,fp8,nvfp4_ds_mla,bf16 --batches 1,4 --heads 16,128
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from decode_sweep import build, heavy, time_fn  # noqa: E402

from sparsemla.bench.timing import graph_replay  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import sparse_attention as sa  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--formats", default="fp8_ds_mla,fp8,nvfp4_ds_mla,bf16")
ap.add_argument("--heads", default="16,128")
ap.add_argument("--batches", default="1,4")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--out", default=None)
a = ap.parse_args()
rows = []
for name in a.formats.split(","):
    fmt = get_format(name)
    for b in map(int, a.batches.split(",")):
        cache, idx = build(fmt, b)
        for h in map(int, a.heads.split(",")):
            q = heavy(b, h, fmt.head_dim).to(torch.bfloat16)
            outs = {}
            fns = {}
            for pdl in (False, True):
                sa.COMBINE_PDL = pdl
                out = torch.full((b, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(b, h, dtype=torch.float32, device="cuda")
                fns[pdl] = graph_replay(lambda out=out, lse=lse: sa.sparse_mla_fwd(q, cache.rows, fmt, idx, 0.04,
                                                                                   out=out, lse=lse))
                torch.cuda.synchronize()
                outs[pdl] = (out, lse)
            same = bool(torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1]))
            for rnd in range(a.rounds):
                for pdl in (False, True):
                    r = dict(fmt=name, b=b, h=h, pdl=pdl, round=rnd, us=round(time_fn(fns[pdl], reps=40), 2),
                             identical=same)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        del cache, idx
        torch.cuda.empty_cache()
if a.out:
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
