"""Time the warp-specialized kernels for quantized rows (sparsemla/kernels/ws_few.py at <= 32 heads,
ws_wide.py above; bf16 rows: ws_pair.py above 32 heads) against the Triton kernels in one process, on the peers' decode cache (benchmarks/decode_sweep.build: 32K-token contexts in
shuffled 64-row blocks, heavy-tailed values), b 128 and small batches, top-k 2048; bf16 rows alongside
(the format a quantized cache has to beat).  Median of --reps calls, L2 flushed; % of memory
speed-of-light with the copy ceiling measured in the same run.

    python benchmarks/few_sweep.py [--heads 16,32] [--batches 128] [--splits 0,1,2] [--out few.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import build, ceilings, heavy, time_fn, unique_bytes  # noqa: E402

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import ws_attention  # noqa: E402
from sparsemla.kernels.sparse_attention import _launch  # noqa: E402


def spin(seconds=0.05):
    """Keep the GPU busy for a moment so the timed calls do not start at idle clocks (the H200 drops to
    345 MHz between measurements; medians of back-to-back short kernels then swing 1.5-5x)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    while True:
        for _ in range(8):
            a @ a
        t1.record()
        t1.synchronize()
        if t0.elapsed_time(t1) > seconds * 1e3:
            return


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp8_ds_mla,fp8,nvfp4_ds_mla,fp8_ds_mla-nope,fp8-nope,nvfp4_ds_mla-nope,bf16")
    ap.add_argument("--heads", default="16,32")
    ap.add_argument("--batches", default="128")
    ap.add_argument("--splits", default="0,1,2", help="0 = the default plan")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton few-heads kernels")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    bw, _ = ceilings()
    print(f"copy ceiling {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
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

                def call(ws_kernel, splits, q=q, rows=cache.rows, idx=idx, out=out, lse=lse, fmt=fmt, sm=sm):
                    return lambda: _launch(fmt.name, q, rows, fmt, idx, sm, None, 1.0, out, lse,
                                           splits, None, None, None, None, ws_kernel=ws_kernel)
                variants = [] if a.no_triton and fmt.name != "bf16" else [("triton", False, None)]
                ws_kind = (fmt.name in ws_attention.FEW_KINDS if h <= ws_attention.FEW_MAX_HEADS
                           else fmt.name in ws_attention.WIDE_Q_KINDS + ("bf16",))
                if ws_kind:
                    variants += [(f"ws-s{s}" if s else "ws", None, s or None) for s in map(int, a.splits.split(","))]
                ref = None
                for tag, wk, sp in variants:
                    fn = call(wk, sp)
                    o, l = fn()
                    o = o.float().clone()
                    err = None if ref is None else round(((o - ref).norm() / ref.norm()).item(), 6)
                    ref = o if ref is None else ref
                    spin()
                    us = time_fn(fn, reps=a.reps)
                    r = dict(fmt=fmt.id, b=b, h=h, kernel=tag, us=round(us, 2), sol_pct=round(100 * sol_us / us, 1),
                             rel_err_vs_triton=err)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                del q, out, lse
            del cache, idx
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(copy_tbps=bw / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
