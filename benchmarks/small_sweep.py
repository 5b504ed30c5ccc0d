"""Small-batch decode latency (D-small) over launch shapes, each call replayed from a CUDA graph (H200).

For b = 1..4 the kernel's shape decides the latency: how many programs (head groups x splits) share the
2048 rows, how many tiles each walks, and how many split partials the combine step merges.  This times
the library's default against other head blocks, tile sizes and split counts, L2 flushed before each replay.

    python benchmarks/small_sweep.py --out small_sweep.json
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import build, heavy, time_fn  # noqa: E402

from sparsemla.bench.timing import graph_replay  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import sparse_attention as sa  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

SM = 576 ** -0.5

# (head block, BLOCK_N, warps, stages, splits); None = the library default
SHAPES = {
    16: [None, (16, 32, 4, 3, 16), (16, 32, 4, 3, 64), (16, 16, 4, 3, 64), (16, 16, 4, 3, 128), (16, 64, 4, 3, 32)],
    128: [None, (64, 64, 8, 2, 32), (64, 32, 8, 2, 32), (64, 32, 8, 2, 64), (32, 32, 4, 3, 16), (32, 32, 4, 3, 32),
          (16, 32, 4, 3, 16), (16, 32, 4, 3, 32)],
}


def graph_call(fmt, cache, idx, h, shape):
    t = idx.shape[0]
    q = heavy(t, h, fmt.head_dim).to(torch.bfloat16)
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(t, h, dtype=torch.float32, device="cuda")
    if shape is None:
        def fn():
            sa.sparse_mla_fwd(q, cache.rows, fmt, idx, SM, out=out, lse=lse)
    else:
        hb, bn, w, st, sp = shape

        def fn():
            sa._launch(fmt.name, q, cache.rows, fmt, idx, SM, None, 1.0, out, lse, sp, None, bn, w, st,
                       head_block_size=hb)
    return graph_replay(fn), q, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="small_sweep.json")
    ap.add_argument("--formats", default="bf16,fp8,fp8_ds_mla,nvfp4_ds_mla")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--default-only", action="store_true", help="time only the library's default shape")
    ap.add_argument("--compile-only", action="store_true", help="run each shape once (fills Triton's disk cache; "
                    "start one such process per format in parallel before the timed run)")
    a = ap.parse_args()
    rows = []
    for fname in a.formats.split(","):
        fmt = get_format(fname)
        for b in (int(x) for x in a.batches.split(",")):
            cache, idx = build(fmt, b)
            for h, shapes in SHAPES.items():
                for shape in shapes[:1] if a.default_only else shapes:
                    row = dict(fmt=fname, b=b, h=h, shape=shape)
                    try:
                        if a.compile_only:
                            graph_call(fmt, cache, idx[:1], h, shape)
                            continue
                        fn, q, out = graph_call(fmt, cache, idx, h, shape)
                        ro, _ = sparse_mla(q[:1].double(), cache, idx[:1], SM)
                        row["rel_err"] = ((out[:1].double() - ro).norm() / ro.norm()).item()
                        row["us"] = time_fn(fn, reps=50, warmup=3)
                        print(f"{fname:13s} b={b} h={h:3d} shape={shape}: {row['us']:6.1f} us err={row['rel_err']:.1e}",
                              flush=True)
                    except Exception as e:  # noqa: BLE001 - keep sweeping
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        print(f"{fname} b={b} h={h} shape={shape}: ERROR {row['error']}", flush=True)
                    rows.append(row)
            del cache
            torch.cuda.empty_cache()
    if not a.compile_only:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
