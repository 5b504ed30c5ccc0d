"""Eleventh session: the FP8-arithmetic mode of the few-heads kernel (``sparse_mla_fwd(..., fp8_arith=True)``:
q in e4m3, QK on e4m3 wgmma straight from shared memory) against the default path, same process, alternating
rounds.  Error against the float64 reference over the same decoded rows (``sparsemla.reference``, on a
subset of tokens), CUDA-graph replay, L2 flushed, decode_sweep's cache (heavy-tailed, an outlier channel).

    python tools/exp/s11_f8.py --formats fp8_ds_mla,fp8 --configs 128x16,128x32,1x128 --rounds 2
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
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402
from sparsemla.reference.attention import sparse_mla as reference  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--formats", default="fp8_ds_mla,fp8")
ap.add_argument("--configs", default="128x16,128x32,1x128,4x128,16x128")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--reps", type=int, default=30)
ap.add_argument("--ref-tokens", type=int, default=4)
ap.add_argument("--out", default=None)
a = ap.parse_args()

rows = []
for name in a.formats.split(","):
    fmt = get_format(name)
    for cfg in a.configs.split(","):
        b, h = map(int, cfg.split("x"))
        cache, idx = build(fmt, b)
        q = heavy(b, h, fmt.head_dim).to(torch.bfloat16)
        sm = fmt.head_dim ** -0.5
        nt = min(b, a.ref_tokens)
        ro, rl = reference(q[:nt].double(), cache, idx[:nt], sm)
        res = {}
        for r in range(a.rounds):
            for f8 in (False, True):
                out = torch.full((b, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                lse = torch.full((b, h), float("nan"), dtype=torch.float32, device="cuda")
                fn = (lambda out=out, lse=lse, f8=f8: sparse_mla_fwd(q, cache.rows, fmt, idx, sm, out=out, lse=lse,
                                                                    fp8_arith=f8))
                try:
                    replay = graph_replay(fn)
                    torch.cuda.synchronize()
                    o = out[:nt].double()
                    err = ((o - ro.double()).norm() / ro.double().norm()).item()
                    lerr = (lse[:nt].double() - rl.double()).abs().max().item()
                    us = time_fn(replay, reps=a.reps)
                    d = res.setdefault(f8, dict(fmt=fmt.id, b=b, h=h, fp8_arith=f8, us=[], rel_err=err, lse_err=lerr,
                                                finite=bool(torch.isfinite(out).all())))
                    d["us"].append(round(us, 2))
                except Exception as e:  # noqa: BLE001
                    res[f8] = dict(fmt=fmt.id, b=b, h=h, fp8_arith=f8, error=repr(e)[:400])
                    print(json.dumps(res[f8]), flush=True)
        for d in res.values():
            rows.append(d)
            print(json.dumps(d), flush=True)
        if True in res and False in res and "us" in res[True] and "us" in res[False]:
            print(f"## {fmt.id} b{b} h{h}: default {min(res[False]['us'])} us, fp8_arith {min(res[True]['us'])} us "
                  f"(x{min(res[False]['us']) / min(res[True]['us']):.3f}); err {res[False]['rel_err']:.2e} -> "
                  f"{res[True]['rel_err']:.2e}, lse {res[False]['lse_err']:.2e} -> {res[True]['lse_err']:.2e}", flush=True)
        del cache, idx, q
        torch.cuda.empty_cache()
if a.out:
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
