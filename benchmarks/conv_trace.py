"""The per-block timeline of the ``sm90-conv`` kernel on one decode or prefill call of the tables (its trace build).

    python3 benchmarks/conv_trace.py --config D-h64 --format fp8_ds_mla --out $OUT/trace
    python3 benchmarks/conv_trace.py --config D-h128 --format nvfp4_ds_mla --meta idx_ahead=1 --meta named=1
    python3 benchmarks/conv_trace.py --config P-32k --format bf16     # prefill: P-32k (128 heads) or P-h<H>
    python3 benchmarks/conv_trace.py --dry-run                  # CPU: the analysis on a synthetic trace

The trace build (``conv.meta(trace=True)``) has thread 0 of each of the kernel's three partitions write the SM clock
(``%clock64``) at every hand-off into ``trace[item, event, block]`` (int64; the events are listed in
``kernels/sm90/conv.py`` beside ``TRACE_EVENTS``).  This driver builds the decode table's workload (b requests of
32,768-token contexts in shuffled 64-token blocks, ``sparsemla.bench.workload``; for ``P-32k`` / ``P-h<H>`` the
prefill table's: 4,096 queries over one 32,768-token context, native reads), plans the call with the kernel
forced to ``sm90-conv`` and one split (each work item is a token's whole top-k), and launches the trace build
with the trace buffer as the final-out argument (only the FUSED variants read it).  A persistent plan (bf16 rows
with more items than SMs, or ``--meta persist=1``) is traced as it runs: at most one program per SM, each serving
its items in turn, every item's stamps in its own row of the buffer (the clock is the SM's, so an item's intervals
are comparable with the one-item grid's, and its start-up overlaps the previous item's end).  The traced call's output is
checked against float64 before anything is read.  ``--meta key=value`` builds a variant of the kernel
(``conv.meta``'s options: ``idx_ahead``, ``named``, ``early``, ...), repeatable.

Printed (and written to ``--out`` as JSON with the raw trace): medians over work items and inner blocks (the first
and last block of each item left out) of the intervals that make up a block's period, in SM cycles:

- ``period``: warpgroup 0's ready wait returning for block i + 1 minus for block i;
- producer: ``fill`` (its free wait returned -> its ready arrival: the block's loads, conversion, stores and
  fence), ``fence`` (the proxy fence alone), ``wait_free`` (its ready arrival -> the next free wait returned) and
  its three parts: ``next_rows`` (-> the next block's rows looked up: the index load's latency), ``loads`` (-> its
  free wait begun: the loads issued before it), ``wait`` (the free wait itself);
- warpgroup 0: ``wait_ready``, ``qk`` (ready -> QK done), ``softmax`` (QK done -> P and alpha handed over),
  ``pv_next`` (P handed over -> this block's PV done, with the next block's ready wait and QK issue inside);
- warpgroup 1: ``wait_p`` (its ready wait returned -> P received), ``pv`` (P received -> its PV done);
- per item: ``q_staged`` (producer start -> q staged) and ``wg0_total`` (warpgroup 0's start -> end).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # decode.py: the options' parser, the output check

# the events of conv.py's trace build (TRACE_EVENTS): name -> index
EVENTS = dict(free_done=0, ready_arrive=1, prod_start=2, q_staged=3, qk_done=4, p_handed=5, wait_ready=6,
              ready_done=7, pv_done=8, wg0_start=9, wg0_end=10, p_received=11, wg1_pv_done=12, wg1_ready_done=13,
              fence_start=14, fence_end=15, ptrs_done=16, wait_start=17)
# per-block intervals: name -> (event at the start, its block offset, event at the end, its block offset)
BLOCK_INTERVALS = {
    "period": ("ready_done", 0, "ready_done", 1),
    "producer fill": ("free_done", 0, "ready_arrive", 0),
    "producer fence": ("fence_start", 0, "fence_end", 0),
    "producer wait_free": ("ready_arrive", 0, "free_done", 1),
    "producer next_rows": ("ready_arrive", 0, "ptrs_done", 1),
    "producer loads": ("ptrs_done", 0, "wait_start", 0),
    "producer wait": ("wait_start", 0, "free_done", 0),
    "wg0 wait_ready": ("wait_ready", 0, "ready_done", 0),
    "wg0 qk": ("ready_done", 0, "qk_done", 0),
    "wg0 softmax": ("qk_done", 0, "p_handed", 0),
    "wg0 pv_next": ("p_handed", 0, "pv_done", 0),
    "wg1 wait_p": ("wg1_ready_done", 0, "p_received", 0),
    "wg1 pv": ("p_received", 0, "wg1_pv_done", 0),
}
PROGRAM_INTERVALS = {"q_staged": ("prod_start", "q_staged"), "wg0_total": ("wg0_start", "wg0_end")}
# the programs whose raw trace --out writes (a prefill call has thousands)
RAW_PROGRAMS = 512


def analyze(trace, n_blocks: int) -> dict:
    """Medians in cycles of :data:`BLOCK_INTERVALS` over programs and the inner blocks 1 .. n_blocks - 2 (the
    first and last of each program left out: start-up and drain), and of :data:`PROGRAM_INTERVALS` over programs.
    ``trace``: int64 ``[programs, events, blocks]`` (nested lists or an array), ``n_blocks``: blocks per program
    (at most the trace's block dim)."""
    out = {}
    inner = range(1, max(n_blocks - 1, 1))
    for name, (e0, d0, e1, d1) in BLOCK_INTERVALS.items():
        vals = []
        for p in trace:
            for i in inner:
                if i + max(d0, d1) >= n_blocks:
                    continue
                a, b = int(p[EVENTS[e0]][i + d0]), int(p[EVENTS[e1]][i + d1])
                if a and b:  # 0: not written (a program with fewer blocks, e.g. a short valid count)
                    vals.append(b - a)
        out[name] = statistics.median(vals) if vals else None
    for name, (e0, e1) in PROGRAM_INTERVALS.items():
        vals = [int(p[EVENTS[e1]][0]) - int(p[EVENTS[e0]][0]) for p in trace]
        out[name] = statistics.median(vals) if vals else None
    return out


def format_analysis(res: dict, n_blocks: int) -> str:
    lines = [f"  {name:<22} {('%9.0f' % v) if v is not None else '        -'} cycles" for name, v in res.items()]
    if res.get("period") and res.get("wg0_total"):
        lines.append(f"  ({n_blocks} blocks a program: {n_blocks} x period = {n_blocks * res['period']:.0f} "
                     f"of warpgroup 0's {res['wg0_total']:.0f})")
    return "\n".join(lines)


def synthetic_trace(programs: int, n_blocks: int, steps: dict, blocks: int = 64) -> list:
    """A trace with known intervals (``steps``: cycles of producer fill, producer wait_free, wg0 wait_ready, qk,
    softmax, wg1 pv), for the analysis's CPU check."""
    p_fill, p_wait, w_ready, qk, sm, pv1 = (steps[k] for k in ("fill", "wait_free", "wait_ready", "qk", "softmax",
                                                               "pv"))
    period = p_fill + p_wait
    tr = []
    for p in range(programs):
        ev = [[0] * blocks for _ in range(len(EVENTS))]
        t0 = 1000 * p
        ev[EVENTS["prod_start"]][0], ev[EVENTS["q_staged"]][0] = t0, t0 + 500
        ev[EVENTS["wg0_start"]][0] = t0
        for i in range(n_blocks):
            f = t0 + 600 + i * period
            ev[EVENTS["free_done"]][i] = f
            ev[EVENTS["ptrs_done"]][i], ev[EVENTS["wait_start"]][i] = f - p_wait + 700, f - 300
            ev[EVENTS["fence_start"]][i], ev[EVENTS["fence_end"]][i] = f + p_fill - 150, f + p_fill - 50
            ev[EVENTS["ready_arrive"]][i] = f + p_fill
            r = f + p_fill + 40
            ev[EVENTS["wait_ready"]][i], ev[EVENTS["ready_done"]][i] = r - w_ready, r
            ev[EVENTS["qk_done"]][i] = r + qk
            ev[EVENTS["p_handed"]][i] = r + qk + sm
            ev[EVENTS["pv_done"]][i] = r + period + 100
            ev[EVENTS["wg1_ready_done"]][i] = r + 10
            ev[EVENTS["p_received"]][i] = r + qk + sm + 20
            ev[EVENTS["wg1_pv_done"]][i] = r + qk + sm + 20 + pv1
        ev[EVENTS["wg0_end"]][0] = t0 + 600 + n_blocks * period + 900
        tr.append(ev)
    return tr


def _parse_meta(items) -> dict:
    """``key=value`` strings (each may hold several, comma-separated) -> conv.meta keyword arguments (1 / 0 /
    true / false as booleans), as ``decode.py --conv-variant`` reads them."""
    import decode
    out = {}
    for item in items or ():
        out.update(decode.parse_options(item))
    return out


def traced_call(wl, meta: dict):
    """Launch the trace build of ``sm90-conv`` (one split, ``meta`` as extra ``conv.meta`` options) on workload
    ``wl``; returns (trace [programs, events, blocks] int64, out, blocks per program)."""
    from dataclasses import replace

    import torch

    from sparsemla.kernels import attention as A
    from sparsemla.kernels.sm90 import conv

    q, rows, idx, vc = wl.q, wl.cache.rows, wl.indices, wl.valid_counts
    t, h, _ = q.shape
    k = idx.shape[1]
    plan = A.plan_for(q, rows, wl.fmt, k, kernel="sm90-conv", num_splits=1)
    # (the launcher's own lookup refuses the trace build: the normal launch passes the output as the final out)
    launch = A._sm90_launch(replace(plan, variant=tuple(sorted(dict(meta, trace=True).items()))), wl.fmt, True, False)
    out = torch.full((t, h, A.V_DIM), float("nan"), dtype=torch.bfloat16, device=q.device)  # poisoned
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=q.device)
    programs = t * plan.grid  # work items; a persistent build runs at most one program per SM over them
    grid = A.programs(launch, programs, q.device)
    trace = torch.zeros(programs, conv.TRACE_EVENTS.value, conv.TRACE_BLOCKS.value, dtype=torch.int64,
                        device=q.device)
    qr = q[..., A.V_DIM:] if wl.fmt.rope_dim else q
    qs, os_, ls_ = q.stride(), out.stride(), lse.stride()
    args = (q, qs[0], qs[1], qr, qs[0], qs[1], rows, idx, idx.stride(0), vc, out, os_[0], 0, os_[1], lse, ls_[0], 0,
            ls_[1], float(wl.sm_scale) * A.LOG2E, float(wl.k_scale), h, k, plan.rows_per_split, 1,
            trace, 0, 0, lse, 0, 0, programs)
    launch((grid,), args)
    torch.cuda.synchronize()
    return trace.cpu().tolist(), out, -(-min(k, plan.rows_per_split) // 64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="D-h64",
                    help="a decode configuration (D-h<H>: 33-128 heads) or a prefill one (P-32k, P-h<H>)")
    ap.add_argument("--format", default="fp8_ds_mla")
    ap.add_argument("--meta", action="append", help="key=value: an option of conv.meta for the traced variant")
    ap.add_argument("--out", default=None, help="folder for the summary and the raw trace (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="the analysis on a synthetic trace, on the CPU")
    a = ap.parse_args(argv)
    meta = _parse_meta(a.meta)
    if a.dry_run:
        steps = dict(fill=3600, wait_free=2150, wait_ready=2900, qk=1270, softmax=1200, pv=1200)
        n = 32
        trace = synthetic_trace(4, n, steps)
        name = "synthetic"
    else:
        import torch

        from sparsemla.bench import drivers as D
        from sparsemla.bench.workload import build_workload
        from sparsemla.formats import get_format
        import decode

        D.prepare_environment()
        wl = build_workload(D.config_named(a.config), get_format(a.format), device=torch.device("cuda"))
        trace, out, n = traced_call(wl, meta)  # (the first launch compiles; the trace is this launch's)
        trace, out, n = traced_call(wl, meta)
        err = decode.check_against_reference(wl, lambda: None, out)
        name = f"{a.config}-{a.format}" + "".join(f"-{k}={v}" for k, v in sorted(meta.items()))
        print(f"traced: {a.config} {a.format} sm90-conv {meta or ''}; output within {err:.1e} of float64")
    res = analyze(trace, n)
    text = format_analysis(res, n)
    print(f"{name}: medians over {len(trace)} work items, blocks 1..{n - 2} of {n}\n{text}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"trace-{name}.json"), "w") as f:
            json.dump({"name": name, "meta": meta, "blocks": n, "medians": res, "programs": len(trace),
                       "trace": trace[:RAW_PROGRAMS]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
