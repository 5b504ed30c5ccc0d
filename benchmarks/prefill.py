"""H200: sparse prefill through the ``SparseMLA`` runner, per format, with and without the bf16 workspace.

    python3 benchmarks/prefill_runner.py --out prefill_runner.json [--heads 128 16]

P-32k geometry (benchmarking guide): one request with a 32,768-token context, its last 4,096 tokens as
query tokens, top-k 2048 distinct positions per token (random), block size 64, blocks shuffled.  Timed:
``runner.run`` (index conversion + [upconvert] + attention), L2 flushed before each call, median of
``--reps``.  TFLOP/s = 2 * h * valid pairs * (576 + 512) / time.  ``native`` reads the quantized cache in
the attention kernel; ``workspace`` upconverts the context to bf16 first (``prefill_workspace_tokens``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sparsemla.bench.timing import time_fn  # noqa: E402
from sparsemla.cache import PagedKVCache  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402
from sparsemla.indices import convert_indices_torch  # noqa: E402
from sparsemla.runner import BatchMetadata, SparseMLA  # noqa: E402

BS, CTX, SQ, TOPK = 64, 32768, 4096, 2048


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_runner.json")
    ap.add_argument("--heads", nargs="+", type=int, default=[128, 16])
    ap.add_argument("--formats", default="bf16,fp8,fp8_ds_mla,nvfp4_ds_mla")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    nblk = CTX // BS
    table = torch.randperm(nblk + 16, generator=g, device="cuda")[:nblk].to(torch.int32)
    md = BatchMetadata.from_lists([SQ], [CTX], [table.tolist()], block_size=BS, device="cuda")
    ctx = torch.tensor(md.context_lens_host(), device="cuda")
    # distinct random positions below each token's causal limit (all of them when the context is shorter)
    keys = torch.rand(SQ, CTX, generator=g, device="cuda")
    keys[torch.arange(CTX, device="cuda")[None, :] >= ctx[:, None]] = 2.0
    topk_local = keys.argsort(dim=1)[:, :TOPK].to(torch.int32)
    topk_local[torch.arange(TOPK, device="cuda")[None, :] >= ctx[:, None]] = -1
    del keys
    pairs = int((topk_local >= 0).sum())
    rows = []
    for fname in a.formats.split(","):
        cache = PagedKVCache(fname, nblk + 16, BS, "cuda")
        n = cache.num_slots
        kv = torch.randn(n, 512, generator=g, device="cuda") * torch.exp(0.5 * torch.randn(n, 1, generator=g, device="cuda"))
        cache.write(kv, torch.randn(n, 64, generator=g, device="cuda"), torch.arange(n, dtype=torch.int32, device="cuda"))
        del kv
        for h in a.heads:
            q = (torch.randn(SQ, h, 576, generator=g, device="cuda")).to(torch.bfloat16)
            flops = 2 * h * pairs * (576 + 512)
            for mode in (["native", "workspace"] if fname != "bf16" else ["native"]):
                r = dict(format=fname, heads=h, mode=mode)
                try:
                    runner = SparseMLA(SQ, 1, nblk, h, 576, TOPK, fname, backend="triton", block_size=BS,
                                       sm_scale=576 ** -0.5, device="cuda",
                                       prefill_workspace_tokens=CTX if mode == "workspace" else 0)
                    runner.plan(md)
                    out, lse = runner.run(q, cache, topk_local)
                    sel = torch.arange(0, SQ, SQ // 8, device="cuda")  # a few tokens against float64
                    rr = convert_indices_torch(topk_local[sel], md.req_id_per_token[sel], md.block_table, BS)
                    ro, _ = sparse_mla(q[sel], cache, rr, 576 ** -0.5)
                    r["rel_err"] = ((out[sel].double() - ro).norm() / ro.norm()).item()
                    us = time_fn(lambda: runner.run(q, cache, topk_local), device="cuda", reps=a.reps,
                                 warmup=2).median_us
                    r.update(us=us, tflops=flops / us / 1e6)
                    print(f"{fname:13s} h={h:3d} {mode:9s} {us / 1e3:8.2f} ms  {r['tflops']:6.1f} TFLOP/s  "
                          f"err {r['rel_err']:.1e}", flush=True)
                except Exception as e:  # report, go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{fname} h={h} {mode}: ERROR {r['error']}", flush=True)
                rows.append(r)
                del runner
        del cache
        torch.cuda.empty_cache()
    json.dump(dict(pairs=pairs, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
