"""Tenth session: quantized rows at more than 32 heads and small batches -- the current dispatch (Triton wide
kernel below 64 programs of 64 heads, ws_wide above; since the change, ws_few in 16-head groups -- 8 programs a
token at 128 heads, reading the same rows from L2 -- while they fit in ws_attention.FEW_WAVES waves) against each
kernel forced: few, wide, triton (SPARSEMLA_WS=0).  CUDA-graph replay, L2 flushed, decode_sweep's cache.

    python tools/exp/s10_small.py --formats fp8_ds_mla,fp8,nvfp4_ds_mla --heads 64,128 --batches 1,2,4,8,16,32
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
from sparsemla.kernels import ws_attention as ws  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--formats", default="fp8_ds_mla,fp8,nvfp4_ds_mla")
ap.add_argument("--heads", default="64,128")
ap.add_argument("--batches", default="1,2,4,8,16,32")
ap.add_argument("--modes", default="default,few,wide,triton", help="default / few (ws_few, 16-head groups) / wide (ws_wide) / triton")
ap.add_argument("--few-splits", default="0", help="split counts for the few mode (0 = its plan)")
ap.add_argument("--reps", type=int, default=30)
ap.add_argument("--out", default=None)
a = ap.parse_args()
WAVES0 = dict(ws.FEW_WAVES)


def mode(m):
    ws.FEW_WAVES = dict.fromkeys(WAVES0, 10 ** 6) if m == "few" else (dict.fromkeys(WAVES0, 0) if m == "wide" else dict(WAVES0))
    os.environ["SPARSEMLA_WS"] = "0" if m == "triton" else "1"


rows = []
for name in a.formats.split(","):
    fmt = get_format(name)
    for b in map(int, a.batches.split(",")):
        cache, idx = build(fmt, b)
        for h in map(int, a.heads.split(",")):
            q = heavy(b, h, fmt.head_dim).to(torch.bfloat16)
            ref = None
            for m in a.modes.split(","):
                if m == "wide" and name.split("-")[0] not in ws.WIDE_Q_KINDS:
                    continue
                for sp in (map(int, a.few_splits.split(",")) if m == "few" else [0]):
                    mode(m)
                    out = torch.full((b, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                    lse = torch.empty(b, h, dtype=torch.float32, device="cuda")
                    fn = (lambda out=out, lse=lse, sp=sp: sparse_mla_fwd(q, cache.rows, fmt, idx, fmt.head_dim ** -0.5,
                                                                       out=out, lse=lse, num_splits=sp or None))
                    try:
                        replay = graph_replay(fn)
                        torch.cuda.synchronize()
                        o = out.float()
                        err = None if ref is None else round(((o - ref).norm() / ref.norm()).item(), 6)
                        if ref is None:
                            ref = o.clone()
                        us = time_fn(replay, reps=a.reps)
                        r = dict(fmt=fmt.id, b=b, h=h, mode=m, splits=sp, us=round(us, 2), rel_err_vs_first=err,
                                 finite=bool(torch.isfinite(o).all()))
                    except Exception as e:  # noqa: BLE001
                        r = dict(fmt=fmt.id, b=b, h=h, mode=m, splits=sp, error=repr(e)[:300])
                    mode("default")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            del q
        del cache, idx
        torch.cuda.empty_cache()
if a.out:
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
