"""Kernel-only timings of our decode and the peers' in one process (H200), for the headline configurations.

Unlike `sparsemla bench` (which times every backend the way the runner calls it, glue included: index
compaction for FlashInfer's page table, -1 masking and head padding for FlashMLA), this times only each
library's attention call on prepared inputs: FlashInfer's `run()` after one `plan()`, FlashMLA's
`flash_mla_with_kvcache` with its metadata made once (q already padded to 64 heads), our `sparse_mla_fwd`.

    python benchmarks/peer_kernels.py --out peers.json
"""
import argparse
import inspect
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import build, ceilings, heavy, time_fn, unique_bytes  # noqa: E402

from sparsemla.bench.timing import graph_replay  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402

SM = 576 ** -0.5


def ours(fmt, cache, idx, h, fp8_arith=False):
    q = heavy(idx.shape[0], h, fmt.head_dim).to(torch.bfloat16)
    out = torch.empty(idx.shape[0], h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(idx.shape[0], h, dtype=torch.float32, device="cuda")
    return lambda: sparse_mla_fwd(q, cache.rows, fmt, idx, SM, out=out, lse=lse, fp8_arith=fp8_arith)


def ours_graph(fmt, cache, idx, h):
    """``ours`` replayed from a CUDA graph (``graph_replay``)."""
    return graph_replay(ours(fmt, cache, idx, h))


def ours_f8_graph(fmt, cache, idx, h):
    """Our opt-in FP8-arithmetic mode (``fp8_arith=True``, backend ``triton-fp8``), replayed from a CUDA graph."""
    return graph_replay(ours(fmt, cache, idx, h, fp8_arith=True))


def flashinfer_call(fmt, cache, idx, h):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    t, k = idx.shape
    dtype = torch.float8_e4m3fn if fmt.name == "fp8" else torch.bfloat16
    vals = cache.rows.view(dtype)
    ckv, kpe = vals[:, :512].unsqueeze(1), vals[:, 512:].unsqueeze(1)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    qo = torch.arange(t + 1, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(t + 1, dtype=torch.int32, device="cuda") * k
    lens = torch.full((t,), k, dtype=torch.int32, device="cuda")
    w.plan(qo, kv_indptr, idx.reshape(-1).contiguous(), lens, h, 512, fmt.rope_dim, 1, False, SM, torch.bfloat16,
           dtype)
    q = heavy(t, h, fmt.head_dim).to(torch.bfloat16)
    qn, qp = q[..., :512].contiguous(), q[..., 512:].contiguous()
    kw = {}
    if fmt.name == "fp8" and "ckv_scale" in inspect.signature(w.run).parameters:
        kw = {"ckv_scale": 1.0, "kpe_scale": 1.0}  # this build's FP8 plans require the per-tensor scales
    return lambda: w.run(qn, qp, ckv, kpe, return_lse=True, **kw)


def flashmla_call(fmt, cache, idx, h):
    import flash_mla
    t, k = idx.shape
    hp = 64 if h <= 64 else 128
    rows = cache.rows
    k_cache = rows.view(rows.shape[0] // 64, 64, 1, rows.shape[1])
    from sparsemla.backends.peer_flashmla import _takes_no_required_args
    gm = flash_mla.get_mla_metadata
    if _takes_no_required_args(gm):
        meta, splits = gm()
    else:  # the older interface plans from per-batch lengths and the head layout
        meta, splits = gm(torch.full((t,), k, dtype=torch.int32, device="cuda"), hp, 1, hp, True, k)
    q = heavy(t, hp, fmt.head_dim).to(torch.bfloat16).view(t, 1, hp, fmt.head_dim)
    ind = idx.view(t, 1, k).contiguous()
    return lambda: flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, splits, SM, False,
                                                    is_fp8_kvcache=True, indices=ind, use_legacy=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="peers.json")
    ap.add_argument("--formats", default="bf16,fp8,fp8_ds_mla,nvfp4_ds_mla", help="comma list of formats")
    ap.add_argument("--batches", default="128", help="comma list of batch sizes (D-small: 1,4,16)")
    ap.add_argument("--heads", default="16,64,128", help="comma list of head counts")
    ap.add_argument("--graph", action="store_true", help="also time our call replayed from a CUDA graph")
    ap.add_argument("--fp8-arith", action="store_true", help="also time our FP8-arithmetic mode (fp8 / fp8_ds_mla "
                    "rows, CUDA graph)")
    a = ap.parse_args()
    copy_bw, mm = ceilings()
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 mm {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for fname, peers in [("bf16", ["flashinfer"]), ("fp8", ["flashinfer"]), ("fp8_ds_mla", ["flashmla"]),
                         ("nvfp4_ds_mla", []), ("bf16-nope", []), ("fp8-nope", []), ("fp8_ds_mla-nope", []),
                         ("nvfp4_ds_mla-nope", [])]:
        if fname not in a.formats.split(","):
            continue
        fmt = get_format(fname)
        for b in [int(x) for x in a.batches.split(",")]:
            torch.cuda.empty_cache()
            cache, idx = build(fmt, b)
            for h in [int(x) for x in a.heads.split(",")]:
                nbytes = unique_bytes(cache, idx, h, idx.shape[0])
                flops = 2 * h * idx.numel() * (fmt.head_dim + 512)
                sol = max(nbytes / copy_bw, flops / mm) * 1e6
                f8 = ["ours-f8-graph"] if a.fp8_arith and fmt.name in ("fp8", "fp8_ds_mla") else []
                for who in ["ours"] + (["ours-graph"] if a.graph else []) + f8 + peers:
                    r = dict(fmt=fname, b=b, h=h, backend=who, sol_us=sol)
                    try:
                        fn = {"ours": ours, "ours-graph": ours_graph, "ours-f8-graph": ours_f8_graph,
                              "flashinfer": flashinfer_call,
                              "flashmla": flashmla_call}[who](fmt, cache, idx, h)
                        r["us"] = time_fn(fn, reps=30)
                        r["pct_sol"] = 100 * sol / r["us"]
                        print(f"{fname:13s} b={b:3d} h={h:3d} {who:13s} {r['us']:8.1f} us  {r['pct_sol']:5.1f}% SOL",
                              flush=True)
                    except Exception as e:
                        r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        print(f"{fname:13s} b={b:3d} h={h:3d} {who:10s} ERROR {r['error']}", flush=True)
                    rows.append(r)
            del cache, idx
    json.dump(dict(copy_bw=copy_bw, mm=mm, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
