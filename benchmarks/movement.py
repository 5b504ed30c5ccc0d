"""H200 benchmark of the data-movement kernels, as achieved bandwidth against the copy bandwidth
measured in the same run.

    python3 benchmarks/bench_movement.py --out movement.json [--quick] [--sweep]

* cache write: 65,536 tokens per format (bf16 kv_c + k_pe in, 64-token blocks), two slot patterns:
  ``scatter`` (every slot shuffled: the worst case, decode-like) and ``prefill`` (whole blocks of
  consecutive slots, the blocks shuffled: what a prefill or chunked-prefill step writes); bytes = input
  read (kv_c, k_pe, slot mapping) + rows written.
* top-k gather to FP8: b 128 query tokens, top-k 2048, each of its own request with a 32K-token context
  (distinct random positions, block size 64, blocks shuffled), rows from ``convert_indices``;
  bytes = valid rows read + indices read + staged rows written.
* context upconvert to bf16: 4 requests x 32K tokens, shuffled blocks; bytes = rows read + table read
  + bf16 workspace written.
* index conversion (b 128 x 2048, compact + counts), for information.

Timing: CUDA events around each call, the L2 flushed before every call (a 256 MB write), median of
``--reps`` (>= 30; 5 with --quick) after warm-up.  Copy ceiling: a 1 GiB device-to-device ``copy_``,
bytes read + written.  ``--sweep`` also times other tilings of each kernel and reports the best (used to
choose the defaults).  Writes JSON to --out and prints a table with % of copy bandwidth (target >= 70 %).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sparsemla.bench.ceilings import measure_copy_bandwidth  # noqa: E402
from sparsemla.bench.timing import time_fn as _time  # noqa: E402
from sparsemla.cache import PagedKVCache  # noqa: E402
from sparsemla.formats import all_formats  # noqa: E402
from sparsemla.indices import convert_indices_torch  # noqa: E402
from sparsemla.kernels import cache_write as cw  # noqa: E402
from sparsemla.kernels import staging as st  # noqa: E402
from sparsemla.kernels.convert_indices import convert_indices_triton  # noqa: E402

DEV = "cuda"
BS = 64


def time_us(fn, reps, warmup=3):
    """Median time of ``fn`` in microseconds, L2 flushed before each call (sparsemla.bench.timing)."""
    return _time(fn, device=DEV, reps=reps, warmup=warmup).median_us


def copy_bandwidth(reps):
    """Device-to-device copy of 1 GiB, bytes read + written per second."""
    return measure_copy_bandwidth(DEV, reps=reps)


def heavy(n, d, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, d, generator=g, device=DEV) * torch.exp(torch.randn(n, 1, generator=g, device=DEV))
    x[:, 7] *= 20
    return x.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# workloads: each returns (label, bytes moved, {config name: callable})
# ------------------------------------------------------------------------------------------------
WRITE_CONFIGS = {"default": None, "tok4_w4": {"TOK": 4, "num_warps": 4}, "tok8_w8": {"TOK": 8, "num_warps": 8},
                 "tok16_w4": {"TOK": 16, "num_warps": 4}, "tok16_w8": {"TOK": 16, "num_warps": 8},
                 "tok32_w8": {"TOK": 32, "num_warps": 8}, "tok2_w4": {"TOK": 2, "num_warps": 4},
                 "tok8_w4": {"TOK": 8, "num_warps": 4}, "tok8_w2": {"TOK": 8, "num_warps": 2},
                 "tok4_w2": {"TOK": 4, "num_warps": 2}}
GATHER_CONFIGS = {"default": None, "bk8_w4": {"BK": 8, "num_warps": 4}, "bk16_w8": {"BK": 16, "num_warps": 8},
                  "bk32_w4": {"BK": 32, "num_warps": 4}, "bk32_w8": {"BK": 32, "num_warps": 8}}
UPCONVERT_CONFIGS = {"default": None, "bp8_w4": {"BP": 8, "num_warps": 4}, "bp16_w8": {"BP": 16, "num_warps": 8},
                     "bp32_w4": {"BP": 32, "num_warps": 4}, "bp32_w8": {"BP": 32, "num_warps": 8}}


def write_workload(fmt, n=65536, seed=0, pattern="scatter"):
    num_blocks = 2 * n // BS
    cache = PagedKVCache(fmt, num_blocks, BS, DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    if pattern == "scatter":
        slots = torch.randperm(cache.num_slots, generator=g, device=DEV)[:n].to(torch.int32)
    else:  # prefill: consecutive slots in shuffled blocks
        blocks = torch.randperm(num_blocks, generator=g, device=DEV)[:n // BS]
        slots = (blocks[:, None] * BS + torch.arange(BS, device=DEV)[None, :]).flatten().to(torch.int32)
    kv = heavy(n, 512, seed + 1)
    pe = heavy(n, fmt.rope_dim, seed + 2) if fmt.rope_dim else None
    nbytes = n * (512 * 2 + fmt.rope_dim * 2 + 4 + fmt.bytes_per_token)

    def run(cfg):
        return lambda: cw.cache_write(cache.rows, fmt, kv, pe, slots, BS, BS, 1.0, _config=cfg)
    extra = {}
    if fmt.name == "nvfp4_ds_mla":     # the other NVFP4 paths and tilings, for comparison
        extra["fp32_path"] = lambda: cw.cache_write(cache.rows, fmt, kv, pe, slots, BS, BS, 1.0,
                                                    _config={"pairs": False})
        extra["int_path"] = lambda: cw.cache_write(cache.rows, fmt, kv, pe, slots, BS, BS, 1.0, _emulate=True)
        for tok, w in ((8, 4), (8, 2), (32, 8), (16, 8), (16, 4), (16, 2), (4, 1), (4, 2), (8, 1)):
            extra[f"cvt_tok{tok}_w{w}"] = (lambda tok=tok, w=w: cw.cache_write(
                cache.rows, fmt, kv, pe, slots, BS, BS, 1.0, _emulate=False, _config={"TOK": tok, "num_warps": w}))
        extra["no_hint"] = lambda: cw.cache_write(cache.rows, fmt, kv, pe, slots, BS, BS, 1.0,
                                                  _config={"aligned": False})
        extra["mask_path"] = lambda: cw.cache_write(cache.rows, fmt, kv, pe, slots, BS, BS, 1.0,
                                                    _config={"fma": False})
    return nbytes, run, extra


def decode_rows(b=128, topk=2048, ctx=32768, seed=0):
    """Distinct random positions of b requests with ctx-token contexts in shuffled blocks -> cache rows."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    max_blocks = ctx // BS
    table = torch.randperm(b * max_blocks, generator=g, device=DEV).reshape(b, max_blocks).to(torch.int32)
    pos = torch.argsort(torch.rand(b, ctx, generator=g, device=DEV), dim=1)[:, :topk].to(torch.int32)
    req = torch.arange(b, dtype=torch.int32, device=DEV)
    return pos, req, table


def filled_cache(fmt, num_blocks, seed):
    cache = PagedKVCache(fmt, num_blocks, BS, DEV)
    chunk = 1 << 20
    for s0 in range(0, cache.num_slots, chunk):
        n = min(chunk, cache.num_slots - s0)
        kv = heavy(n, 512, seed + s0)
        pe = heavy(n, fmt.rope_dim, seed + s0 + 1) if fmt.rope_dim else None
        cache.write(kv, pe, torch.arange(s0, s0 + n, dtype=torch.int32, device=DEV), check=False)
    return cache


def gather_workload(fmt, pos, req, table):
    cache = filled_cache(fmt, table.numel(), seed=5)
    rows, counts = convert_indices_torch(pos, req, table, BS, BS, True)
    out = torch.empty(*rows.shape, fmt.head_dim, dtype=torch.float8_e4m3fn, device=DEV)
    n_valid = int((rows >= 0).sum())
    nbytes = n_valid * fmt.bytes_per_token + rows.numel() * 4 + counts.numel() * 4 + out.numel()

    def run(cfg):
        return lambda: st.gather_topk_fp8(cache.rows, fmt, rows, counts, 1.0, out=out, check=False, _config=cfg)
    return nbytes, run, cache


def upconvert_workload(fmt, n_req=4, ctx=32768, seed=7):
    max_blocks = ctx // BS
    cache = filled_cache(fmt, n_req * max_blocks, seed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    table = torch.randperm(n_req * max_blocks, generator=g, device=DEV).reshape(n_req, max_blocks).to(torch.int32)
    seq = torch.full((n_req,), ctx, dtype=torch.int32, device=DEV)
    starts = (torch.arange(n_req, device=DEV) * ctx).to(torch.int32)
    out = torch.empty(n_req * ctx, fmt.head_dim, dtype=torch.bfloat16, device=DEV)
    nbytes = n_req * ctx * fmt.bytes_per_token + table.numel() * 4 + out.numel() * 2

    def run(cfg):
        return lambda: st.upconvert_context(cache.rows, fmt, table, seq, BS, BS, 1.0, out=out,
                                            workspace_start=starts, check=False, _config=cfg)
    return nbytes, run, cache


def measure(results, kernel, fmt_id, nbytes, run, configs, reps, copy_bw, sweep, extra=None):
    """Time the default tiling (and the others with --sweep); a failing variant is recorded, not fatal."""
    best = None
    names = list(configs) if sweep else ["default"]
    fns = [(name, run(configs[name])) for name in names] + list((extra or {}).items())
    entries = []
    for name, fn in fns:
        try:
            entries.append((name, time_us(fn, reps)))
        except Exception as e:  # noqa: BLE001 - keep the other results of a one-shot GPU run
            results.append({"kernel": kernel, "format": fmt_id, "config": name, "error": f"{type(e).__name__}: {e}"[:300]})
    for name, t in entries:
        gbps = nbytes / (t * 1e-6) / 1e9
        rec = {"kernel": kernel, "format": fmt_id, "config": name, "time_us": round(t, 2), "bytes": nbytes,
               "GBps": round(gbps, 1), "pct_copy": round(100 * gbps * 1e9 / copy_bw, 1)}
        results.append(rec)
        if name == "default":
            best = rec
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="5 timed runs, smaller gather/upconvert (smoke test)")
    ap.add_argument("--sweep", action="store_true", help="also time other tilings of each kernel")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--only", default=None, help="comma list of kernels: write,gather,upconvert,convert")
    ap.add_argument("--formats", default=None, help="comma list of format ids (default: all)")
    args = ap.parse_args()
    reps = 5 if args.quick else max(args.reps, 30)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(reps)
    results = []
    fmts = all_formats()
    if args.formats:
        fmts = [f for f in fmts if f.id in args.formats.split(",")]

    only = set(args.only.split(",")) if args.only else {"write", "gather", "upconvert", "convert"}
    for fmt in fmts if "write" in only else []:
        for pattern in ("scatter", "prefill"):
            nbytes, run, extra = write_workload(fmt, n=65536, pattern=pattern)
            name = "cache_write_65536" + ("" if pattern == "scatter" else "_prefill")
            measure(results, name, fmt.id, nbytes, run, WRITE_CONFIGS, reps, copy_bw, args.sweep, extra)
            torch.cuda.empty_cache()

    b = 16 if args.quick else 128
    pos, req, table = decode_rows(b=b)
    for fmt in fmts if "gather" in only else []:
        nbytes, run, cache = gather_workload(fmt, pos, req, table)
        measure(results, f"gather_topk_b{b}_k2048", fmt.id, nbytes, run, GATHER_CONFIGS, reps, copy_bw, args.sweep)
        del cache
        torch.cuda.empty_cache()

    n_req = 1 if args.quick else 4
    for fmt in fmts if "upconvert" in only else []:
        nbytes, run, cache = upconvert_workload(fmt, n_req=n_req)
        measure(results, f"upconvert_{n_req}x32k", fmt.id, nbytes, run, UPCONVERT_CONFIGS, reps, copy_bw, args.sweep)
        del cache
        torch.cuda.empty_cache()

    pos, req, table = decode_rows(b=128)
    t = time_us(lambda: convert_indices_triton(pos, req, table, BS, BS, True, True), reps)
    nbytes = pos.numel() * 8 + 128 * 4
    if "convert" in only:
            results.append({"kernel": "convert_indices_b128_k2048_compact", "format": "-", "config": "default",
                        "time_us": round(t, 2), "bytes": nbytes, "GBps": round(nbytes / (t * 1e-6) / 1e9, 1),
                        "pct_copy": round(100 * nbytes / (t * 1e-6) / copy_bw, 1)})

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "copy_GBps": round(copy_bw / 1e9, 1),
              "reps": reps, "quick": args.quick, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    print(f"\n{report['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write), median of {reps}")
    print(f"{'kernel':36s} {'format':18s} {'config':10s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s}")
    for r in results:
        if "error" in r:
            print(f"{r['kernel']:36s} {r['format']:18s} {r['config']:10s} ERROR {r['error'][:60]}")
            continue
        flag = "" if r["config"] != "default" or r["pct_copy"] >= 70 or r["kernel"].startswith("convert") else "  < 70%"
        print(f"{r['kernel']:36s} {r['format']:18s} {r['config']:10s} {r['time_us']:9.1f} {r['GBps']:8.0f} "
              f"{r['pct_copy']:6.1f}%{flag}")


if __name__ == "__main__":
    main()
