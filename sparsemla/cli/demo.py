"""``sparsemla demo``: the main job — one serving batch in every KV format, decoded, in one table.

On a GPU: 64 requests with 32K-token contexts (2M tokens, pages shuffled) are written into a cache of
every format; a decode step (one query token per request, top-k 2048, 16 and 128 heads) runs
through the backend ``backend="auto"`` picks; the table gives, per format, its size (bytes/token,
tokens per GiB), how well the cache keeps the data (round-trip error) and the attention output
(error against float64 attention over the exact data), and its speed: the kernel time of the decode
call by CUDA-graph replay (no host launch cost: what a captured decode step costs on the GPU), effective
TB/s, % of speed-of-light, speed-up over the bf16 cache.

Without a GPU: the same steps at a scaled-down size on the CPU path; attention is computed by the
float64 reference (no kernels, no timings), and the output says so.
"""
from __future__ import annotations

import json
import time
from typing import List

import torch

from ..bench import backends as B
from ..bench.accounting import achieved, attention_work
from ..bench.ceilings import format_ceilings, measure_ceilings
from ..bench.configs import BenchConfig
from ..bench.progress import progress
from ..bench.runner import DEFAULT_FORMATS, resolve_formats
from ..bench.timing import graph_replay, time_fn
from ..bench.workload import build_cache, build_queries, make_layout, source_tokens
from ..formats import get_format
from ..reference import sparse_mla as reference_sparse_mla

GIB = 2 ** 30
GPU_DEFAULTS = {"requests": 64, "context": 32768, "heads": "16,128", "topk": 2048}
CPU_DEFAULTS = {"requests": 4, "context": 2048, "heads": "16", "topk": 256}
ROUND_TRIP_TOKENS = 1 << 16  # tokens sampled for the round-trip error


def add_parser(sub, name, help_):
    p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, help="requests in the batch (GPU 64, CPU 4)")
    p.add_argument("--context", type=int, help="tokens per request (GPU 32768, CPU 2048)")
    p.add_argument("--heads", help="query head counts, comma-separated (GPU 16,128; CPU 16)")
    p.add_argument("--topk", type=int, help="top-k width (GPU 2048, CPU 256)")
    p.add_argument("--formats", help=f"formats, comma-separated or 'all' (default {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--cpu", action="store_true", help="run the scaled-down CPU version even when a GPU is present")
    p.add_argument("--reps", type=int, default=30, help="timed runs per measurement (GPU; default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--accuracy", action="store_true",
                   help="also print the per-format accuracy report of a DSA layer and a small model "
                        "(sparsemla.layer.accuracy; tiny sizes on the CPU, DeepSeek geometry on a GPU: minutes)")
    p.set_defaults(run=run)
    return p


def _sizes(args, gpu: bool):
    d = GPU_DEFAULTS if gpu else CPU_DEFAULTS
    requests = args.requests if args.requests is not None else d["requests"]
    context = args.context if args.context is not None else d["context"]
    topk = args.topk if args.topk is not None else d["topk"]
    heads = [int(h) for h in str(args.heads if args.heads is not None else d["heads"]).split(",") if h.strip()]
    for name, v in (("requests", requests), ("context", context), ("topk", topk)):
        if v < 1:
            raise ValueError(f"--{name}: expected a positive integer, got {v}")
    if not heads or any(not 1 <= h <= 128 for h in heads):
        raise ValueError(f"--heads: expected head counts in 1..128, got {heads}")
    return requests, context, heads, topk


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b (float64)."""
    a, b = a.double(), b.double()
    d = b.norm()
    return float((a - b).norm() / d) if d > 0 else float((a - b).norm())


def round_trip_error(cache, layout, seed: int, device) -> float:
    """Relative error of decode(encode(x)) over the first tokens written (their full key: latent + rope)."""
    kv, slots = source_tokens(layout, device=device, seed=seed, max_tokens=ROUND_TRIP_TOKENS)
    got = cache.read(cache.slot_to_row(slots))
    return _rel(got, kv[:, :cache.fmt.head_dim])


def _reference_chunked(q, cache, indices, sm_scale, bar=None):
    """The float64 reference over all tokens, in pieces (progress and bounded memory)."""
    outs, lses = [], []
    step = 8
    for t0 in range(0, q.shape[0], step):
        o, l = reference_sparse_mla(q[t0:t0 + step], cache, indices[t0:t0 + step], sm_scale)
        outs.append(o)
        lses.append(l)
        if bar is not None:
            bar.update(min(step, q.shape[0] - t0))
    return torch.cat(outs), torch.cat(lses)


def run(args) -> int:
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    requests, context, heads, topk = _sizes(args, gpu)
    fmt_ids = resolve_formats(args.formats)
    show = not args.no_progress
    api_reason = None
    if gpu:
        ok, msg = B.registry_status()
        try:
            B.attention_api()
        except B.Unavailable as e:
            ok, msg = False, str(e)
        if not ok:
            api_reason = msg
    t_start = time.perf_counter()
    ntok = requests * context
    if gpu:
        p = torch.cuda.get_device_properties(device)
        print(f"sparsemla demo on {p.name} (compute capability {p.major}.{p.minor}): {requests} requests x "
              f"{context}-token contexts = {ntok:,} tokens in 64-token pages (shuffled); one decode step, "
              f"top-k {topk}, heads {', '.join(map(str, heads))}")
        if api_reason:
            print(f"note: the attention API is not usable ({api_reason}); showing sizes and float64-reference "
                  f"errors only, no kernel timings")
    else:
        why = "--cpu given" if args.cpu else "no GPU found"
        print(f"sparsemla demo — CPU version ({why}): scaled down to {requests} requests x {context}-token "
              f"contexts = {ntok:,} tokens, top-k {topk}, heads {', '.join(map(str, heads))}.")
        print("Attention here is the float64 reference (sparsemla.reference.sparse_mla), not the GPU kernels, "
              "and nothing is timed. Run on a CUDA GPU for the real demo.")
    timed = gpu and api_reason is None
    ceilings = measure_ceilings(device) if timed else None
    if ceilings is not None:
        print(format_ceilings(ceilings))

    # Every format's cache holds the same tokens; bf16 (exact for bf16 data) is the accuracy and speed baseline.
    layout = make_layout([context] * requests, device=device, seed=args.seed)
    needed = list(fmt_ids)
    for base in {("bf16" if get_format(f).rope_dim else "bf16-nope") for f in fmt_ids}:
        if base not in needed:
            needed.append(base)
    caches = {}
    for f in needed:
        with progress(layout.num_tokens, f"write {f}", enabled=show) as bar:
            caches[f] = build_cache(f, layout, device=device, seed=args.seed, bar=bar)

    rows: List[dict] = []
    for h in heads:
        cfg = BenchConfig("demo", f"demo-h{h}", "decode", batch=requests, s_q=1, num_heads=h, topk=topk,
                          context=context)
        wl = build_queries(cfg, caches[needed[0]], layout, seed=args.seed)
        q576 = wl.q if wl.q.shape[-1] == 576 else None
        if q576 is None:  # the first cache was a NoPE one; rebuild queries on a rope cache for full-width q
            wl = build_queries(cfg, caches["bf16"] if "bf16" in caches else caches[needed[0]], layout, seed=args.seed)
        q_full, indices, sm_scale = wl.q, wl.indices, wl.sm_scale
        exact = {}
        for f in fmt_ids:
            fmt = get_format(f)
            q = q_full[..., :fmt.head_dim].contiguous()
            base = "bf16" if fmt.rope_dim else "bf16-nope"
            if base not in exact:
                with progress(q.shape[0], f"float64 reference h={h} {base}", enabled=show) as bar:
                    exact[base] = _reference_chunked(q, caches[base], indices, sm_scale, bar)
            ref_out, _ = exact[base]
            row = {"heads": h, "format": fmt.id, "bytes_per_token": fmt.bytes_per_token,
                   "tokens_per_gib": GIB // fmt.bytes_per_token}
            cache = caches[f]
            row["round_trip_err"] = round_trip_error(cache, layout, args.seed, device)
            if timed:
                row.update(_measure_gpu(cache, q, indices, sm_scale, ceilings, args.reps, ref_out))
            else:
                out, _ = _reference_chunked(q, cache, indices, sm_scale)
                row["attn_err"] = _rel(out, ref_out)
            rows.append(row)
        # Speed-up over the bf16 cache of the same geometry and head count.
        for r in rows:
            if r["heads"] == h and r.get("kernel_us"):
                base = "bf16" if not r["format"].endswith("-nope") else "bf16-nope"
                b = next((x for x in rows if x["heads"] == h and x["format"] == base and x.get("kernel_us")), None)
                if b is not None:
                    r["vs_bf16"] = b["kernel_us"] / r["kernel_us"]
        del wl
    print()
    print(render(rows, timed))
    print(f"\n(done in {time.perf_counter() - t_start:.1f} s)")
    if args.json:
        with open(args.json, "w") as fjs:
            json.dump({"device": str(device), "requests": requests, "context": context, "topk": topk, "rows": rows},
                      fjs, indent=1)
    if args.accuracy:
        from ..layer.accuracy import accuracy_report, format_table
        print("\nAccuracy per KV format through a DSA layer and a small model"
              + ("" if gpu else " (tiny CPU sizes: a sanity check, not the published figures)") + ":")
        acc_rows = accuracy_report(quick=not gpu, device=device)
        print(format_table(acc_rows))
    bad = [r for r in rows if r.get("error")]
    return 1 if bad else 0


def _measure_gpu(cache, q, indices, sm_scale, ceilings, reps, ref_out) -> dict:
    """Decode through backend="auto", compare with float64, time the chosen backend's call by CUDA-graph replay
    (kernel time: a direct call's host launch cost would dominate at these sizes)."""
    problem = B.make_problem("decode", cache.fmt, q.shape[1], indices.shape[1], q.shape[0], q.device)
    chosen, _, err = B.select(problem)
    if chosen is None:
        return {"backend": "-", "error": err}
    try:
        out, _ = B.auto_call("decode", q, cache, indices, sm_scale)()
        own_ref, _ = _reference_chunked(q, cache, indices, sm_scale)
        call, path = B.make_call(chosen, "decode", q, cache, indices, sm_scale)
        t = time_fn(graph_replay(call), device=q.device, reps=reps, warmup=5)
    except Exception as e:
        msg = str(e).strip().splitlines()
        return {"backend": chosen, "error": f"{type(e).__name__}: {msg[0][:160] if msg else ''}"}
    work = attention_work(q, indices, cache.fmt.bytes_per_token)
    a = achieved(t.median_s, work, ceilings)
    return {"backend": chosen, "attn_err": _rel(out, ref_out), "kernel_err": _rel(out, own_ref),
            "kernel_us": a["time_us"], "timing": "CUDA-graph replay", "tbps": a["tbps"], "pct_sol": a["pct_sol"],
            "call": path}


def render(rows: List[dict], timed: bool) -> str:
    if timed:
        head = (f"{'heads':>5}  {'format':<18} {'B/token':>7} {'tokens/GiB':>11} {'backend':<14} {'round-trip':>10} "
                f"{'attn err':>9} {'kernel err':>10} {'kernel us':>10} {'TB/s':>6} {'%SOL':>6} {'vs bf16':>8}")
    else:
        head = (f"{'heads':>5}  {'format':<18} {'B/token':>7} {'tokens/GiB':>11} {'round-trip':>10} "
                f"{'attn err vs bf16':>16}")
    lines = [head, "-" * len(head)]
    for r in rows:
        s = f"{r['heads']:>5}  {r['format']:<18} {r['bytes_per_token']:>7} {r['tokens_per_gib']:>11,} "
        if timed:
            if r.get("error"):
                s += f"{r.get('backend', '-'):<14} {r['round_trip_err']:>10.2e} error: {r['error']}"
            else:
                vs = f"{r['vs_bf16']:.2f}x" if r.get("vs_bf16") else "-"
                s += (f"{r['backend']:<14} {r['round_trip_err']:>10.2e} {r['attn_err']:>9.2e} {r['kernel_err']:>10.2e} "
                      f"{r['kernel_us']:>10.1f} {r['tbps']:>6.2f} {r['pct_sol']:>5.1f}% {vs:>8}")
        else:
            s += f"{r['round_trip_err']:>10.2e} {r['attn_err']:>16.2e}"
        lines.append(s)
    lines.append("")
    lines.append("round-trip: relative L2 error of the cache's decoded rows vs the values written.")
    if timed:
        lines.append("attn err: relative L2 error of the decode output vs float64 attention over the exact (bf16) "
                     "data; kernel err: vs float64 over this cache's own rows.")
        lines.append("kernel us: GPU time of one decode call of the chosen backend (planned once, as a runner does) "
                     "by CUDA-graph replay, L2 flushed, median; host time is not included. TB/s and %SOL use unique "
                     "bytes read (docs/benchmarking.md).")
    else:
        lines.append("attn err vs bf16: relative L2 error of float64 attention over this cache vs over the bf16 cache "
                     "(the exact data).")
    return "\n".join(lines)
