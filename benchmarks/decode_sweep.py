"""Decode kernel tuning sweep on the GPU: variants x block sizes x warps x splits, per format and config.

Times each variant (L2 flushed, median of N, CUDA events, every launch of the call included), checks it
against the float64 reference on a few tokens, and reports % of speed-of-light with ceilings measured
in the same run.  Used to choose the kernels' defaults; the published figures come from `sparsemla bench`.

    python benchmarks/decode_sweep.py --out sweep.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools", "exp"))

from sparsemla.bench.ceilings import measure_copy_bandwidth, measure_matmul  # noqa: E402
from sparsemla.bench.timing import time_fn as _time  # noqa: E402
from sparsemla.cache import PagedKVCache  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import sparse_attention as sa  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

def time_fn(fn, reps=20, warmup=2):
    """Median microseconds per call, L2 flushed before each (sparsemla.bench.timing)."""
    return _time(fn, device="cuda", reps=reps, warmup=warmup).median_us


def ceilings():
    """(copy bytes/s read + written, bf16 matmul FLOP/s), measured now."""
    return measure_copy_bandwidth("cuda"), measure_matmul("cuda")[0]


def heavy(*shape, device="cuda"):
    return torch.randn(*shape, device=device) * torch.exp(0.5 * torch.randn(*shape, device=device))


def build(fmt, b, ctx=32768, topk=2048, block=64, s_q=1, pool=65536, seed=0, sort=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = ctx // block
    cache = PagedKVCache(fmt, b * nblk, block, "cuda")
    kv = heavy(pool, 512)
    kv[:, 7] *= 20  # an outlier channel
    pe = heavy(pool, fmt.rope_dim) if fmt.rope_dim else None
    enc = fmt.encode(kv, pe)
    rows = cache.rows
    n = rows.shape[0]
    for s0 in range(0, n, pool):
        m = min(pool, n - s0)
        rows[s0:s0 + m] = enc[torch.randperm(pool, device="cuda", generator=g)[:m]]
    bt = torch.randperm(b * nblk, device="cuda", generator=g).view(b, nblk).to(torch.int32)
    pos = torch.rand(b * s_q, ctx, device="cuda", generator=g).argsort(dim=1)[:, :topk]
    if sort:
        pos = pos.sort(dim=1).values
    req = torch.arange(b, device="cuda").repeat_interleave(s_q)
    idx = bt[req[:, None], pos // block].to(torch.int64) * block + pos % block
    return cache, idx.to(torch.int32).contiguous()


def unique_bytes(cache, idx, h, t):
    u = torch.unique(idx[idx >= 0]).numel()
    return u * cache.fmt.bytes_per_token + t * h * (cache.fmt.head_dim + 512) * 2 + t * h * 4


def _plan_s3b():
    """The library's wide kernel (every format) at 64/128 heads and prefill, block sizes and stages."""
    c = []
    for fname in ("bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"):
        for cid, b, h in (("D-h64", 128, 64), ("D-h128", 128, 128), ("P-2k", 1, 128)):
            for bn, w, st in ((64, 8, 2), (32, 8, 2), (32, 8, 3), (64, 8, 3)):
                c.append((cid, fname, b, h, "base", bn, w, st, None, 64, None))
    return c


def _plan_dense():
    """Room for a dense shortcut: the sparse kernel over a 2K context with every token selected, rows in
    random vs ascending order (a dense kernel would read them in order, without indices)."""
    return [(cid, f, 1, h, "base", None, None, None, None, None, None)
            for cid in ("PD-2k", "PDs-2k") for f in ("bf16", "fp8_ds_mla") for h in (128, 16)]


def _plan_h32():
    """20 and 32 heads: the few-heads kernels (32 heads per program) against the wide kernel (64)."""
    c = []
    for f in ("nvfp4_ds_mla", "fp8_ds_mla", "fp8"):
        for cid, h in (("D-h20", 20), ("D-h32", 32)):
            c.append((cid, f, 128, h, "base", 32, 4, 3, None, 32, None))
            c.append((cid, f, 128, h, "base", 64, 8, 2, None, 64, None))
    return c


def _plan_stages():
    """The wide kernel with 2 or 3 stages (3: the indices are prefetched two tiles ahead), twice over."""
    return [(cid, f, b, h, "base", 64, 8, st, None, 64, None)
            for rep in range(2) for cid, b, h in (("D-h64", 128, 64), ("D-h128", 128, 128), ("P-2k", 1, 128))
            for f in ("bf16", "fp8_ds_mla", "nvfp4_ds_mla") for st in (2, 3)]


def _plan_dsv2():
    """fp8_ds_mla few-heads kernel: the current library ("base") against an older version ("old-fp8", from
    SMLA_OLD_SRC, see tools/exp/variants.py), alternating."""
    c = []
    for cid, h, f, reps in (("D-h16", 16, "fp8_ds_mla", 3), ("D-h32", 32, "fp8_ds_mla", 2), ("D-h16", 16, "fp8", 1)):
        for rep in range(reps):
            for var in ("base", "old-fp8"):
                c.append((cid, f, 128, h, var, None, None, None, None, None, None))
    return c


def _plan_occ():
    """Few-heads FP8/FP4 kernels at D-h16 with a register cap and more splits (3-4 programs per SM)."""
    c = []
    for f in ("fp8_ds_mla", "fp8", "nvfp4_ds_mla"):
        c.append(("D-h16", f, 128, 16, "base", None, None, None, None, None, None))
        for sp, mr in ((3, 168), (3, 160), (4, 128), (2, 168)):
            c.append(("D-h16", f, 128, 16, "base", 32, 4, 3, sp, None, mr))
        c.append(("D-h16", f, 128, 16, "base", None, None, None, None, None, None))
    return c


PLANS = {"occ": _plan_occ, "dsv2": _plan_dsv2, "s3b": _plan_s3b, "dense": _plan_dense, "h32": _plan_h32, "stages": _plan_stages}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="comma list of formats to run")
    ap.add_argument("--variants", action="store_true", help="time the tools/exp design variants instead")
    ap.add_argument("--plan", default=None, help="a named case list instead (see PLANS)")
    ap.add_argument("--jobs", type=int, default=1, help="compile the cases in this many processes first")
    ap.add_argument("--warm-shard", default=None, help=argparse.SUPPRESS)  # i/N: compile only (internal)
    a = ap.parse_args()
    if a.warm_shard is None:
        copy_bw, mm = ceilings()
    else:
        copy_bw, mm = 1.0, 1.0
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 mm {mm / 1e12:.0f} TFLOP/s", flush=True)
    results = {"copy_bw": copy_bw, "mm": mm, "rows": []}
    variants = {"base": None}
    cases = []
    # (case id, format, b, h, variant, BN, warps, stages, splits, head block, maxnreg)
    fmts = ["fp8_ds_mla", "nvfp4_ds_mla", "bf16", "fp8"]
    for fmt in fmts:
        for bn, w, st, mr in [(32, 4, 2, None), (32, 4, 3, None), (64, 4, 3, None), (32, 4, 2, 168),
                              (64, 4, 2, 168), (32, 4, 3, 128)]:
            for sp in [1, 2, 3, 4]:
                cases.append(("D-h16", fmt, 128, 16, "base", bn, w, st, sp, None, mr))
    for fmt in fmts:
        for hb, bn, w, st, mr in [(16, 32, 4, 2, None), (16, 64, 4, 3, None), (16, 32, 4, 2, 168),
                                  (32, 32, 4, 2, None), (64, 64, 8, 2, None)]:
            cases.append(("D-h128", fmt, 128, 128, "base", bn, w, st, 1, hb, mr))
    if a.variants:
        import variants as V
        built_variants = V.build()
        variants.update({k: v for k, v in built_variants.items()})
        cases = []
        # (case, format, b, h, variant, BN, warps, stages, splits, head block, maxnreg)
        for var, cfgs in [("base", [(32, 4, 3), (64, 4, 3), (64, 8, 2), (32, 8, 3), (64, 8, 3)]),
                          ("impure-nv", [(32, 4, 3), (32, 8, 3), (64, 8, 2), (32, 4, 2)])]:
            for bn, w, st in cfgs:
                cases.append(("D-h16", "nvfp4_ds_mla", 128, 16, var, bn, w, st, None, None, None))
        for var in ("base", "impure-nv"):
            for h in (64, 128):
                cases.append((f"D-h{h}", "nvfp4_ds_mla", 128, h, var, 64, 8, 2, None, 64, None))
    if a.plan:
        import variants as V
        variants.update(V.build())
        cases = PLANS[a.plan]()
    if a.only:
        keep = set(a.only.split(","))
        cases = [c for c in cases if c[1] in keep]
    if a.quick:
        cases = cases[:4]

    if a.warm_shard is not None:
        i, n = (int(x) for x in a.warm_shard.split("/"))
        cases = cases[i::n]
    elif a.jobs > 1:
        # Compile every case first in parallel processes (Triton's disk cache), then time one at a time.
        import subprocess
        argv = [sys.executable, __file__] + [x for x in sys.argv[1:]]
        procs = [subprocess.Popen(argv + ["--warm-shard", f"{i}/{a.jobs}", "--out", f"{a.out}.warm{i}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(a.jobs)]
        for pr in procs:
            pr.wait()
        print(f"compiled in {a.jobs} processes", flush=True)

    built = {}
    for (cid, fname, b, h, var, bn, w, st, sp, hb, mr) in cases:
        fmt = get_format(fname)
        # "P-2k": one request, 2048 queries, 32K context; "PD-2k" / "PDs-2k": a 2K context with every token
        # selected (what a dense shortcut would compute), in random / ascending order
        s_q = int(cid.split("-")[1][:-1]) * 1024 if cid.startswith("P") else 1
        ctx = 2048 if cid.startswith("PD") else 32768
        key = (fname, b, s_q, cid[:3])
        if key not in built:
            built[key] = build(fmt, b, ctx=ctx, s_q=s_q, sort=cid.startswith("PDs"))
        cache, idx = built[key]
        t = idx.shape[0]
        q = (heavy(t, h, fmt.head_dim)).to(torch.bfloat16)
        out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty((t, h), dtype=torch.float32, device="cuda")
        kern = variants[var] if var != "base" else None

        def call():
            if kern is not None and fname in ("fp8", "fp8_ds_mla"):  # fp8-family signature
                return sa._launch(fname, q, cache.rows, fmt, idx, 0.04, None, 1.0, out, lse, sp, None, bn, w, st,
                                  head_block_size=hb, kernel=kern, fp8_family=True, maxnreg=mr)
            return sa._launch(fname, q, cache.rows, fmt, idx, 0.04, None, 1.0, out, lse, sp, None, bn, w, st,
                              head_block_size=hb, kernel=kern, maxnreg=mr)
        row = dict(case=cid, fmt=fname, b=b, h=h, variant=var, bn=bn, warps=w, stages=st, splits=sp, hb=hb, maxnreg=mr)
        try:
            t0 = time.time()
            call()
            torch.cuda.synchronize()
            row["compile_s"] = round(time.time() - t0, 2)
            if a.warm_shard is not None:
                continue
            ro, rl = sparse_mla(q[:4].double(), cache, idx[:4], 0.04)
            row["rel_err"] = ((out[:4].double() - ro).norm() / ro.norm()).item()  # diag-* variants are wrong on purpose
            row["lse_err"] = (lse[:4] - rl).abs().max().item()
            us = time_fn(call)
            nbytes = unique_bytes(cache, idx, h, t)
            flops = 2 * h * (idx >= 0).sum().item() * (fmt.head_dim + 512)
            sol = max(nbytes / copy_bw, flops / mm) * 1e6
            row.update(us=us, sol_us=sol, pct_sol=100 * sol / us, tbps=nbytes / us / 1e6, tflops=flops / us / 1e6)
            print(f"{cid:7s} {fname:13s} {var:10s} hb={hb} BN={bn} w={w} st={st} sp={sp} mr={mr}: {us:8.1f} us "
                  f"({row['pct_sol']:5.1f}% SOL, {row['tbps']:.2f} TB/s, {row['tflops']:.0f} TF/s) err={row['rel_err']:.1e}",
                  flush=True)
        except Exception as e:  # keep sweeping
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{cid} {fname} {var} BN={bn} w={w} st={st} sp={sp}: ERROR {row['error']}", flush=True)
        results["rows"].append(row)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
