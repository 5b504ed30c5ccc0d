"""Ninth session: A/B of ws_wide versions by their cost per program and per pair of blocks (one program per
SM: b 132, 64 heads, one split; top-k 128 = one pair, 2048 = 16 pairs; CUDA-graph replay, L2 flushed), and of
ws_few versions at D-h16 (b 128, 16 heads, top-k 2048).

    python tools/exp/s9_ab.py --wide git:17284d2,sparsemla.kernels.ws_wide --few git:17284d2,sparsemla.kernels.ws_few
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import build, heavy, time_fn  # noqa: E402
from wide_ab import _module, patched  # noqa: E402

from sparsemla.bench.timing import graph_replay  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import ws_attention  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402


def few_patched(spec):
    kern = _module(spec, "ws_few").ws_few_kernel

    def launch(grid, args, bpt, kind, rope, ng, has_vc):
        kern[grid](*args, BPT=bpt, DS=kind == "fp8_ds_mla", FP4=kind == "nvfp4_ds_mla", ROPE=rope, NG=ng,
                   HAS_VC=has_vc, num_warps=4, maxnreg=168)
    return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wide", default="")
    ap.add_argument("--few", default="")
    ap.add_argument("--few-formats", default="fp8_ds_mla,fp8,nvfp4_ds_mla")
    ap.add_argument("--wide-formats", default="fp8_ds_mla,fp8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    ws_attention.FEW_WAVES = dict.fromkeys(ws_attention.FEW_WAVES, 0)
    for name in a.wide_formats.split(","):
        fmt = get_format(name)
        for topk in (128, 2048):
            cache, idx = build(fmt, 132, topk=topk)
            q = heavy(132, 64, fmt.head_dim).to(torch.bfloat16)
            out = torch.empty(132, 64, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(132, 64, dtype=torch.float32, device="cuda")
            for rnd in range(a.rounds):
                for m in filter(None, a.wide.split(",")):
                    ws_attention.launch_wide_q = patched(m)
                    fn = graph_replay(lambda: sparse_mla_fwd(q, cache.rows, fmt, idx, 0.04, out=out, lse=lse, num_splits=1))
                    r = dict(kernel="wide", fmt=name, b=132, h=64, topk=topk, mod=m, round=rnd,
                             us=round(time_fn(fn, reps=40), 2))
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            del cache, idx
    for name in a.few_formats.split(","):
        fmt = get_format(name)
        cache, idx = build(fmt, 128)
        q = heavy(128, 16, fmt.head_dim).to(torch.bfloat16)
        out = torch.empty(128, 16, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(128, 16, dtype=torch.float32, device="cuda")
        ref = None
        for rnd in range(a.rounds):
            for m in filter(None, a.few.split(",")):
                ws_attention.launch_few = few_patched(m)
                out.fill_(float("nan"))
                fn = graph_replay(lambda: sparse_mla_fwd(q, cache.rows, fmt, idx, 0.04, out=out, lse=lse))
                o = out.float()
                err = None if ref is None else round(((o - ref).norm() / ref.norm()).item(), 6)
                ref = o.clone() if ref is None else ref
                r = dict(kernel="few", fmt=name, b=128, h=16, topk=2048, mod=m, round=rnd, rel_err_vs_first=err,
                         us=round(time_fn(fn, reps=40), 2))
                rows.append(r)
                print(json.dumps(r), flush=True)
        del cache, idx
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
