"""Data-movement kernels as achieved bandwidth against the copy bandwidth measured in the same process.

    python3 benchmarks/movement.py --results benchmarks/results/h200.jsonl
    python3 benchmarks/movement.py --only write --formats nvfp4_ds_mla,nvfp4_ds_mla-nope
    python3 benchmarks/movement.py --dry-run --results /tmp/r.jsonl                # CPU check

* ``W-scatter`` / ``W-prefill``: ``PagedKVCache.write`` of 65,536 tokens (bf16 kv_c + k_pe in, 64-token
  blocks) with every slot shuffled (decode-like) or whole blocks of consecutive slots, the blocks shuffled
  (prefill); bytes = input read (kv_c, k_pe, slots) + rows written.
* ``G-fp8``: the top-k gather to FP8 rows (``triton-staged``'s first step), b 128 query tokens x top-k 2048
  over 32K-token contexts; bytes = valid rows read + indices and counts read + staged rows written.
* ``U-bf16``: the context upconvert to a bf16 workspace (the prefill input), 4 requests x 32K tokens;
  bytes = rows read + block table read + workspace written.
* ``I-convert``: index conversion, b 128 x 2048, compacted, with valid counts.

Each call is timed by CUDA-graph replay, the L2 flushed before each, median of ``--reps``; the row's
``sol_pct`` is achieved GB/s over the copy ceiling.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
from sparsemla.bench.drivers import prepare_environment  # noqa: E402

prepare_environment()

import torch  # noqa: E402

from sparsemla.bench import drivers as D  # noqa: E402
from sparsemla.bench.workload import heavy_tailed  # noqa: E402

BS = 64
ALL = "bf16,fp8,fp8_ds_mla,nvfp4_ds_mla,bf16-nope,fp8-nope,fp8_ds_mla-nope,nvfp4_ds_mla-nope"


def sizes(dry: bool) -> dict:
    if dry:
        return dict(write=1024, b=2, topk=64, ctx=512, up_req=2, up_ctx=512)
    return dict(write=65536, b=128, topk=2048, ctx=32768, up_req=4, up_ctx=32768)


def gen(dev, seed):
    return torch.Generator(device=dev).manual_seed(seed)


def bf16(n, d, dev, seed):
    return heavy_tailed((n, d), generator=gen(dev, seed), device=dev)


def filled_cache(fmt, num_blocks, dev, seed):
    from sparsemla.cache import PagedKVCache
    cache = PagedKVCache(fmt, num_blocks, BS, dev)
    chunk = 1 << 20
    for s0 in range(0, cache.num_slots, chunk):
        n = min(chunk, cache.num_slots - s0)
        pe = bf16(n, fmt.rope_dim, dev, seed + s0 + 1) if fmt.rope_dim else None
        cache.write(bf16(n, 512, dev, seed + s0), pe, torch.arange(s0, s0 + n, dtype=torch.int32, device=dev),
                    check=False)
    return cache


def record(rec, cfg, fmt_id, call, nbytes, batch, topk=0):
    us, timing = rec.time(call)
    gbps = nbytes / (us * 1e-6) / 1e9
    row = rec.add(config=cfg, kind="movement", fmt=fmt_id, heads=0, batch=batch, s_q=1, topk=topk, impl="sparsemla",
                  timing=timing, value=us, gbps=gbps, sol_pct=100 * gbps * 1e9 / rec.ceilings.copy_bytes_per_s,
                  bytes=nbytes)
    D.print_row(row, f"  {gbps:.0f} GB/s")


def write(rec, fmt, n, pattern):
    from sparsemla.cache import PagedKVCache
    dev = rec.device
    num_blocks = 2 * n // BS
    cache = PagedKVCache(fmt, num_blocks, BS, dev)
    g = gen(dev, 3)
    if pattern == "scatter":
        slots = torch.randperm(cache.num_slots, generator=g, device=dev)[:n].to(torch.int32)
    else:
        blocks = torch.randperm(num_blocks, generator=g, device=dev)[:n // BS]
        slots = (blocks[:, None] * BS + torch.arange(BS, device=dev)[None, :]).flatten().to(torch.int32)
    kv = bf16(n, 512, dev, 1)
    pe = bf16(n, fmt.rope_dim, dev, 2) if fmt.rope_dim else None
    nbytes = n * (512 * 2 + fmt.rope_dim * 2 + 4 + fmt.bytes_per_token)
    record(rec, f"W-{pattern}", fmt.id, lambda: cache.write(kv, pe, slots, check=False), nbytes, n)


def decode_positions(dev, b, topk, ctx):
    g = gen(dev, 0)
    nblk = ctx // BS
    table = torch.randperm(b * nblk, generator=g, device=dev).reshape(b, nblk).to(torch.int32)
    pos = torch.argsort(torch.rand(b, ctx, generator=g, device=dev), dim=1)[:, :topk].to(torch.int32)
    return pos, torch.arange(b, dtype=torch.int32, device=dev), table


def gather(rec, fmt, s):
    from sparsemla.indices import convert_indices_torch
    from sparsemla.kernels.staging import gather_topk_fp8
    dev = rec.device
    pos, req, table = decode_positions(dev, s["b"], s["topk"], s["ctx"])
    cache = filled_cache(fmt, table.numel(), dev, 5)
    rows, counts = convert_indices_torch(pos, req, table, BS, BS, True)
    out = torch.empty(*rows.shape, fmt.head_dim, dtype=torch.float8_e4m3fn, device=dev)
    nbytes = int((rows >= 0).sum()) * fmt.bytes_per_token + rows.numel() * 4 + counts.numel() * 4 + out.numel()
    record(rec, "G-fp8", fmt.id, lambda: gather_topk_fp8(cache.rows, fmt, rows, counts, out=out, check=False),
           nbytes, s["b"], s["topk"])


def upconvert(rec, fmt, s):
    from sparsemla.kernels.staging import upconvert_context
    dev = rec.device
    n_req, ctx = s["up_req"], s["up_ctx"]
    nblk = ctx // BS
    cache = filled_cache(fmt, n_req * nblk, dev, 7)
    table = torch.randperm(n_req * nblk, generator=gen(dev, 7), device=dev).reshape(n_req, nblk).to(torch.int32)
    seq = torch.full((n_req,), ctx, dtype=torch.int32, device=dev)
    starts = (torch.arange(n_req, device=dev) * ctx).to(torch.int32)
    out = torch.empty(n_req * ctx, fmt.head_dim, dtype=torch.bfloat16, device=dev)
    nbytes = n_req * ctx * fmt.bytes_per_token + table.numel() * 4 + out.numel() * 2
    record(rec, "U-bf16", fmt.id, lambda: upconvert_context(cache.rows, fmt, table, seq, BS, BS, out=out,
                                                            workspace_start=starts, check=False), nbytes, n_req)


def convert(rec, s):
    from sparsemla.indices import convert_indices
    pos, req, table = decode_positions(rec.device, s["b"], s["topk"], s["ctx"])
    nbytes = pos.numel() * 8 + s["b"] * 4
    record(rec, "I-convert", "-", lambda: convert_indices(pos, req, table, BS, BS, True, compact=True, check=False),
           nbytes, s["b"], s["topk"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    D.common_args(ap, formats=ALL)
    ap.add_argument("--only", default="write,gather,upconvert,convert", help="comma list of kernels")
    a = ap.parse_args(argv)
    from sparsemla.formats import get_format
    rec = D.Recorder(a)
    s = sizes(rec.dry)
    only = set(a.only.split(","))
    fmts = [get_format(f) for f in D.fmt_list(a.formats)]
    for fmt in fmts:
        if "write" in only:
            for pattern in ("scatter", "prefill"):
                rec.attempt(f"W-{pattern} {fmt.id}", lambda: write(rec, fmt, s["write"], pattern))
        if "gather" in only:
            rec.attempt(f"G-fp8 {fmt.id}", lambda: gather(rec, fmt, s))
        if "upconvert" in only:
            rec.attempt(f"U-bf16 {fmt.id}", lambda: upconvert(rec, fmt, s))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "convert" in only:
        rec.attempt("I-convert", lambda: convert(rec, s))
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
