"""Host time of one call (what an engine pays per layer when a step is not one CUDA graph), sparsemla and the
peers in one process, and the GPU time of the same call by graph replay.

    python3 benchmarks/host_overhead.py --results benchmarks/results/h200.jsonl
    python3 benchmarks/host_overhead.py --dry-run --results /tmp/r.jsonl           # CPU check

Host time: ``--calls`` back-to-back calls between two ``time.perf_counter`` reads, with no synchronization
after the last call (a launch returns when it is queued), divided by the count; the median of ``--reps``
such loops, after a synchronization and a warm-up.  The loops are short enough that the launch queue never
fills, so the GPU's speed does not enter.  Measured (aims in parentheses):

* ``H-decode-b1`` / ``H-decode-b128``: ``sparse_mla_decode(q, cache, indices, sm_scale)``, default arguments,
  fp8_ds_mla, 16 heads (25 us): replayed by the compiled host entry (``sparsemla.host_entry``) where it is in use
  (the row's variant says); ``-python``: the same call's Python path, measured in turns with it;
* ``H-prefill`` / ``H-prefill-python``: ``sparse_mla_prefill`` with default arguments, 128 query tokens of one
  request (25 us);
* ``H-run`` / ``H-run-python``: ``SparseMLA.run`` of one layer, b 128 (25 us), and its Python path;
* ``H-plan``: ``SparseMLA.plan`` of a 128-request decode step (100 us);
* ``H-metadata``: ``BatchMetadata.from_tensors`` of 128 requests whose tensors are on the GPU (100 us);
* ``H-launch``: the attention kernel of the b 128 call alone through the launcher (``attention_fwd`` with its plan
  and outputs given): the floor under the calls above;
* ``H-launch-b1`` / ``H-launch-b1-fused``: the same for the b 1 call, whose plan splits: its kernel and the combine
  kernel, and the kernel merging the splits itself (``fused_combine``: one launch), measured in turns, the
  partials in one buffer (a runner's) for both;
* ``H-vllm-bare`` / ``H-vllm-tensor`` / ``H-vllm-pair``: the vLLM plugin's per-layer call against the bare launch of
  its plan (aim: at most 10 us more; see ``vllm_contract_rows``), the three measured in turns;
* peers: FlashMLA ``flash_mla_with_kvcache`` (fp8_ds_mla, q padded to 64 heads) and FlashInfer's ``run()``
  after one ``plan()`` (bf16), b 1 and b 128.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
from sparsemla.bench.drivers import prepare_environment  # noqa: E402

prepare_environment()

import torch  # noqa: E402

from sparsemla.bench import drivers as D  # noqa: E402

HEADS = 16


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_us(fn, dev, calls: int, reps: int) -> float:
    """Median over ``reps`` loops of the host time per call of ``calls`` back-to-back calls, no final sync."""
    return host_us_interleaved({"call": fn}, dev, calls, reps)["call"]


def host_us_interleaved(fns: dict, dev, calls: int, reps: int) -> dict:
    """:func:`host_us` of several calls measured in turns (one loop of each per round, the order alternating), so
    that a difference between them is not a drift of the host between their measurements."""
    names = list(fns)
    for f in fns.values():
        f()
    sync(dev)
    per_call = {n: [] for n in names}
    for r in range(reps):
        for n in (names if r % 2 == 0 else names[::-1]):
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[n]()
            per_call[n].append((time.perf_counter() - t0) / calls * 1e6)
    sync(dev)
    return {n: statistics.median(v) for n, v in per_call.items()}


def record(rec, cfg, fmt, batch, s_q, topk, impl, fn, *, graph=True, variant=None, us=None):
    dev = rec.device
    calls, reps = (1, 1) if rec.dry else (rec.args.calls, rec.args.reps)
    if us is None:
        us = host_us(fn, dev, calls, reps)
    common = dict(config=cfg, kind="host", fmt=fmt, heads=HEADS, batch=batch, s_q=s_q, topk=topk, impl=impl,
                  variant=variant)
    row = rec.add(timing="host", value=us, **common)
    D.print_row(row)
    if graph and dev.type == "cuda":
        g, timing = rec.time(fn)
        if timing == "graph":
            D.print_row(rec.add(timing="graph", value=g, **common))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    D.common_args(ap, formats="fp8_ds_mla", reps=15)
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per timed loop")
    a = ap.parse_args(argv)
    from sparsemla import BatchMetadata, SparseMLA
    from sparsemla.bench import peers as P
    from sparsemla.bench.workload import build_workload
    from sparsemla.formats import get_format
    rec = D.Recorder(a)
    dev = rec.device
    fname = D.fmt_list(a.formats)[0]
    fmt = get_format(fname)
    if dev.type == "cuda":  # (a first call would start the build in the background and time the Python path)
        from sparsemla import host_entry
        host_entry.build()
    for b in (1, 128):
        cfg = D.scaled(D.config_named("D-h16", batch=b, name=f"D-b{b}-h{HEADS}"), rec.dry)
        wl = build_workload(cfg, fmt, device=dev)
        name = f"H-decode-b{b}"
        rec.attempt(name, lambda: entry_and_python(rec, name, fname, cfg.batch, 1, cfg.topk, "decode", wl))
        if not a.no_peers:
            rec.attempt(f"{name} flashmla", lambda: record(rec, name, fname, cfg.batch, 1, cfg.topk, "flashmla",
                                                           P.flashmla_decode(wl), variant="heads padded to 64"))
            wlb = build_workload(cfg, get_format("bf16"), device=dev)
            rec.attempt(f"{name} flashinfer", lambda: record(rec, name, "bf16", cfg.batch, 1, cfg.topk, "flashinfer",
                                                             P.flashinfer_attention(wlb), variant="fa3, page size 1"))
            del wlb
        if b == 1 and dev.type == "cuda":
            rec.attempt("H-launch-b1", lambda: launch_pair(rec, wl, fmt, fname, cfg))
        if b == 128:
            # the floor under every call: the attention kernel's launch alone (arguments prepared, no checks, no
            # allocation, no planning; Triton's launcher and the library's key lookup)
            from sparsemla.kernels import attention as A
            out = torch.empty(cfg.batch, cfg.num_heads, 512, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(cfg.batch, cfg.num_heads, dtype=torch.float32, device=dev)
            plan = A.plan_for(wl.q, wl.cache.rows, fmt, cfg.topk)
            rec.attempt("H-launch", lambda: record(rec, "H-launch", fname, cfg.batch, 1, cfg.topk, "sparsemla", lambda: (
                A.attention_fwd(wl.q, wl.cache.rows, fmt, wl.indices, wl.sm_scale, plan=plan, out=out, lse=lse)),
                graph=False))
            nb, lay = cfg.batch, wl.layout        # 128 requests (2 under --dry-run)
            qsl = torch.arange(nb + 1, dtype=torch.int32, device=dev)
            seq = lay.context_lens.to(dev)
            table = lay.block_table.to(dev)

            def metadata():
                return BatchMetadata.from_tensors(qsl, seq, table, num_tokens=nb, num_decode_tokens=nb,
                                                  num_decode_requests=nb)
            md = metadata()
            rec.attempt("H-metadata", lambda: record(rec, "H-metadata", fname, nb, 1, cfg.topk, "sparsemla",
                                                     metadata, graph=False))
            attn = SparseMLA(nb, nb, table.shape[1], cfg.num_heads, fmt.head_dim, cfg.topk, fmt, sm_scale=wl.sm_scale,
                             device=dev)
            rec.attempt("H-plan", lambda: record(rec, "H-plan", fname, nb, 1, cfg.topk, "sparsemla",
                                                 lambda: attn.plan(md), graph=False))
            attn.plan(md)
            rec.attempt("H-run", lambda: run_and_python(rec, fname, nb, cfg.topk, attn, wl))
        del wl
    pcfg = D.scaled(D.config_named("P-h16", s_q=128, name="P-h16-q128"), rec.dry)
    wl = build_workload(pcfg, fmt, device=dev)
    rec.attempt("H-prefill", lambda: entry_and_python(rec, "H-prefill", fname, 1, pcfg.s_q, pcfg.topk, "prefill", wl))
    rec.attempt("H-vllm", lambda: vllm_contract_rows(rec, fname))
    return rec.finish()


def entry_and_python(rec, name: str, fname: str, batch: int, s_q: int, topk: int, mode: str, wl) -> None:
    """``name``: the public call with default arguments (replayed by the compiled host entry where it is in use);
    ``name-python``: the same call's Python path (what the public function runs when the entry does not replay
    it), measured in turns with it."""
    import sparsemla
    from sparsemla import attention as A, host_entry
    fn = sparsemla.sparse_mla_decode if mode == "decode" else sparsemla.sparse_mla_prefill
    calls = {name: lambda: fn(wl.q, wl.cache, wl.indices, wl.sm_scale),
             f"{name}-python": lambda: A._call(mode, wl.q, wl.cache, wl.cache.fmt, wl.cache.rows, "cache",
                                               wl.indices, wl.sm_scale, None, 1.0, "auto", None, None, False)}
    calls[name]()  # the first call of the configuration loads the entry and is recorded
    n, reps = (1, 1) if rec.dry else (rec.args.calls, 2 * rec.args.reps + 1)
    measured = host_us_interleaved(calls, rec.device, n, reps)
    state = host_entry.status()
    record(rec, name, fname, batch, s_q, topk, "sparsemla", calls[name], us=measured[name],
           variant="host entry" if state.startswith("in use") else f"Python path: host entry {state}")
    record(rec, f"{name}-python", fname, batch, s_q, topk, "sparsemla", calls[f"{name}-python"],
           us=measured[f"{name}-python"], graph=False)


def run_and_python(rec, fname: str, batch: int, topk: int, attn, wl) -> None:
    """``H-run``: ``SparseMLA.run`` of one layer (replayed by the compiled host entry where it is in use, as at
    every layer of a step after its first); ``H-run-python``: its Python path, measured in turns with it."""
    from sparsemla import host_entry
    calls = {"H-run": lambda: attn.run(wl.q, wl.cache, wl.topk_local),
             "H-run-python": lambda: attn._run(wl.q, wl.cache, wl.topk_local, 1.0, None, None, None)}
    calls["H-run"]()
    n, reps = (1, 1) if rec.dry else (rec.args.calls, 2 * rec.args.reps + 1)
    measured = host_us_interleaved(calls, rec.device, n, reps)
    state = host_entry.status()
    record(rec, "H-run", fname, batch, 1, topk, "sparsemla", calls["H-run"], us=measured["H-run"],
           variant="host entry" if state.startswith("in use") else f"Python path: host entry {state}")
    record(rec, "H-run-python", fname, batch, 1, topk, "sparsemla", calls["H-run-python"],
           us=measured["H-run-python"], graph=False)


def launch_pair(rec, wl, fmt, fname: str, cfg) -> None:
    """``H-launch-b1`` and ``H-launch-b1-fused``: the b 1 call's plan through the launcher with the combine kernel
    and with the splits merged in the kernel, host time in turns, GPU time by graph replay."""
    from sparsemla.kernels import attention as A
    dev = rec.device
    t, h = cfg.batch, cfg.num_heads
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(t, h, dtype=torch.float32, device=dev)
    plans = {"H-launch-b1": A.plan_for(wl.q, wl.cache.rows, fmt, cfg.topk, fused_combine=False),
             "H-launch-b1-fused": A.plan_for(wl.q, wl.cache.rows, fmt, cfg.topk, fused_combine=True)}
    if not plans["H-launch-b1-fused"].fused_combine:
        raise RuntimeError(f"the b {t} plan does not merge in the kernel: {plans['H-launch-b1-fused']}")
    split = torch.empty(A.split_elements(plans["H-launch-b1"], t, h), dtype=torch.float32, device=dev)
    calls = {name: (lambda p=p: A.attention_fwd(wl.q, wl.cache.rows, fmt, wl.indices, wl.sm_scale, plan=p, out=out,
                                                lse=lse, split_buffers=split)) for name, p in plans.items()}
    n, reps = (1, 1) if rec.dry else (rec.args.calls, 2 * rec.args.reps + 1)
    measured = host_us_interleaved(calls, dev, n, reps)
    for name, fn in calls.items():
        record(rec, name, fname, t, 1, cfg.topk, "sparsemla", fn, us=measured[name],
               variant="splits merged in the kernel" if name.endswith("fused") else "split + combine kernel")


def vllm_contract_rows(rec, fname: str) -> None:
    """The vLLM plugin's per-layer call (``integrations.vllm.contract.LayerAttention.forward``, what the plugin's
    ``_forward_mqa_kernel`` runs; no vLLM needed) against the bare launch of the same plan: one decode token with
    64 valid rows of a 2048-wide top-k row, three layers interleaved per block as vLLM lays them out.
    ``H-vllm-bare``: ``attention_fwd`` with the plan, the query and the buffers prepared; ``H-vllm-tensor``: the
    contract with one query tensor; ``H-vllm-pair``: with vLLM's (ql_nope, q_pe) pair (q_pe a strided view)."""
    from sparsemla.integrations.vllm.contract import LayerAttention, Workspace, resolve_format
    from sparsemla.integrations.vllm.testing import layered_caches
    from sparsemla.kernels.attention import attention_fwd
    dev = rec.device
    name, head, width, scale = fname.split("-")[0], 576, 2048, 0.0723
    fmt = resolve_format(name, head)
    num_blocks = 4 if rec.dry else 96
    caches = layered_caches(fmt, name, num_blocks, 64, 3, 1.0, dev, seed=10)
    ws = Workspace(fmt, 8, HEADS, width, dev)
    layer = LayerAttention(ws, name, head, scale)
    gen = torch.Generator().manual_seed(0)
    ql = torch.randn(1, HEADS, 512, generator=gen).to(torch.bfloat16).to(dev)
    proj = torch.randn(1, HEADS, 128 + fmt.rope_dim, generator=gen).to(torch.bfloat16).to(dev)
    q_pe = proj[..., 128:]
    slots = torch.randperm(num_blocks * 64, generator=gen)[:64].to(dev)
    idx = torch.full((1, width), -1, dtype=torch.int32, device=dev)
    idx[0, :64] = caches[0].slot_rows(slots).to(torch.int32)
    vc = torch.full((1,), 64, dtype=torch.int32, device=dev)
    q = torch.cat((ql, q_pe), -1) if fmt.rope_dim else ql
    rows = layer.cache_view(caches[0].view).rows
    plan = ws.plan(1)
    out, lse = ws.out[:1], ws.lse[:1]
    cache = caches[0].view
    calls = {"H-vllm-bare": lambda: attention_fwd(q, rows, fmt, idx, scale, plan=plan, valid_counts=vc, k_scale=1.0,
                                                  out=out, lse=lse, split_buffers=ws.split),
             "H-vllm-tensor": lambda: layer.forward(q, cache, idx, vc, 1.0),
             "H-vllm-pair": lambda: layer.forward((ql, q_pe), cache, idx, vc, 1.0)}
    n, reps = (1, 1) if rec.dry else (rec.args.calls, 2 * rec.args.reps + 1)
    measured = host_us_interleaved(calls, dev, n, reps)  # the differences are the figures: measured in turns
    for cfg, fn in calls.items():
        record(rec, cfg, fmt.id, 1, 1, width, "sparsemla", fn, graph=False, us=measured[cfg])


if __name__ == "__main__":
    sys.exit(main())
