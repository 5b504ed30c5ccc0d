"""Time the warp-specialized bf16 kernel (every ws_attention.CONFIGS entry) against the Triton wide kernel
in one process: P-32k (s_q 4096, h 128, top-k 2048 of a 32K context), P-h64, and decode at b 128 with
h 64 / 128.  Median of --reps calls, L2 flushed (sparsemla.bench.timing).

    python benchmarks/ws_sweep.py [--reps 20] [--out ws.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsemla.bench.timing import time_fn  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import ws_attention as ws  # noqa: E402
from sparsemla.kernels.sparse_attention import _launch, plan_splits  # noqa: E402


def case(tokens, heads, topk, rows, rope=64, per_token_rows=None, seed=0):
    """bf16 rows [rows, 512 + rope] and random distinct indices per token (within its own request's
    per_token_rows rows when given, else within all rows)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = 512 + rope
    kv = (torch.randn(rows, d, device="cuda", generator=g)).to(torch.bfloat16)
    q = torch.randn(tokens, heads, d, device="cuda", generator=g).to(torch.bfloat16)
    span = per_token_rows or rows
    idx = torch.rand(tokens, span, device="cuda", generator=g).topk(topk, dim=1).indices
    if per_token_rows:
        idx = idx + torch.arange(tokens, device="cuda")[:, None] * per_token_rows
    return q, kv.view(torch.uint8), idx.to(torch.int32).contiguous()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", nargs="+", default=sorted(ws.CONFIGS), help="also: " + ", ".join(ws.PROBES))
    ap.add_argument("--shapes", nargs="+", default=None, help="P-32k P-32k-seq P-h64 D-h128 D-h64")
    a = ap.parse_args(argv)
    # P-32k-seq: every token reads the same 2048 consecutive rows (a locality probe, not a standard shape)
    shapes = [("P-32k", 4096, 128, 2048, 32768, None), ("P-32k-seq", 4096, 128, 2048, 2048, None),
              ("P-h64", 4096, 64, 2048, 32768, None),
              ("D-h128", 128, 128, 2048, 128 * 8192, 8192), ("D-h64", 128, 64, 2048, 128 * 8192, 8192),
              # the cache and queries of benchmarks/peer_kernels.py (32K-token contexts, heavy-tailed values)
              ("D-h128-peers", 128, 128, 2048, None, None), ("D-h64-peers", 128, 64, 2048, None, None),
              ("D-h128-peers-randn-q", 128, 128, 2048, None, None)]
    if a.shapes:
        shapes = [s for s in shapes if s[0] in a.shapes]
    results = []
    for name, t, h, k, rows, ptr in shapes:
        for rope in (64, 0):
            if rope == 0 and name != "P-32k":
                continue
            if "-peers" in name:
                from decode_sweep import build, heavy
                cache, idx = build(get_format("bf16", rope), t)
                kv = cache.rows
                q = heavy(t, h, 512 + rope).to(torch.bfloat16)
                if name.endswith("randn-q"):
                    q = torch.randn(t, h, 512 + rope, device="cuda").to(torch.bfloat16)
            else:
                q, kv, idx = case(t, h, k, rows, rope, ptr)
            fmt = get_format("bf16", rope)
            sm = (512 + rope) ** -0.5
            splits = plan_splits(t, h, k, q.device)
            flops = 2.0 * t * h * k * (512 + rope + 512)
            ref = None
            for cfg in ["triton"] + a.configs:
                wk = False if cfg == "triton" else cfg
                fn = lambda: _launch("bf16", q, kv, fmt, idx, sm, None, 1.0, None, None, splits, None, None, None,  # noqa
                                     None, ws_kernel=wk)
                try:
                    o, l = fn()
                    torch.cuda.synchronize()
                    if cfg in ws.PROBES:
                        err = float("nan")
                    elif ref is None:
                        ref = (o.float(), l)
                        err = 0.0
                    else:
                        err = ((o.float() - ref[0]).norm() / ref[0].norm()).item()
                    tm = time_fn(fn, device="cuda", reps=a.reps, warmup=3)
                    us = tm.median_s * 1e6
                    row = dict(shape=name, rope=rope, config=cfg, splits=splits, us=round(us, 1),
                               tflops=round(flops / tm.median_s / 1e12, 1), rel_diff_vs_triton=err)
                except Exception as e:  # keep going: one failing configuration should not hide the others
                    row = dict(shape=name, rope=rope, config=cfg, error=repr(e)[:400])
                results.append(row)
                print(json.dumps(row), flush=True)
            del q, kv, idx
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
