"""Ninth session: the fixed cost of one ws_wide program.  One query token, 64 heads, one split (one program),
top-k chosen: a handful of launches (for Nsight Compute), or with --time a CUDA-graph timing per top-k.

    python tools/exp/wide_fixed.py --fmt fp8_ds_mla --topk 128
    python tools/exp/wide_fixed.py --time
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
from sparsemla.kernels import ws_attention  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fmt", default="fp8_ds_mla")
ap.add_argument("--heads", type=int, default=64)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--topk", type=int, default=128)
ap.add_argument("--time", action="store_true")
a = ap.parse_args()
ws_attention.FEW_WAVES = dict.fromkeys(ws_attention.FEW_WAVES, 0)
fmt = get_format(a.fmt)


def run(topk, b):
    cache, idx = build(fmt, b, topk=topk)
    q = heavy(b, a.heads, fmt.head_dim).to(torch.bfloat16)
    out = torch.empty(b, a.heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, a.heads, dtype=torch.float32, device="cuda")
    return lambda: sparse_mla_fwd(q, cache.rows, fmt, idx, 0.04, out=out, lse=lse, num_splits=1)


if a.time:
    for b in (1, 132):
        for topk in (128, 256, 512, 1024, 2048):
            replay = graph_replay(run(topk, b))
            print(json.dumps(dict(fmt=a.fmt, b=b, h=a.heads, topk=topk, us=round(time_fn(replay, reps=50), 2))),
                  flush=True)
else:
    fn = run(a.topk, a.batch)
    for _ in range(4):
        fn()
    torch.cuda.synchronize()
    print("done")
