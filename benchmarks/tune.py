"""Check the dispatch on a grid: every backend that can serve a call, timed on the same call, per format x batch x
heads, so that a plan that does not pick the fastest kernel shows up.

    python3 benchmarks/tune.py --results lab/tune.jsonl                                # the default grid
    python3 benchmarks/tune.py --formats fp8_ds_mla --batches 1,8,32,128 --heads 32,64,128
    python3 benchmarks/tune.py --dry-run --formats bf16 --batches 2 --heads 4

Rows have configuration ids ``T-b<B>-h<H>`` and ``variant`` = the backend, so they never mix with the
standard tables; write them to a file of your own (an ignored folder such as ``lab/``), not to the results
file the documents are rendered from.  Timing as in ``benchmarks/decode.py`` (graph replay, L2 flushed).
The last column of the printout marks where the default (``auto``) is more than 3 % slower than the
fastest backend of the same call.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
from sparsemla.bench.drivers import prepare_environment  # noqa: E402

prepare_environment()

import torch  # noqa: E402

import decode  # noqa: E402

from sparsemla.bench import drivers as D  # noqa: E402
from sparsemla.bench.accounting import achieved, attention_work  # noqa: E402

BACKENDS = ("auto", "triton", "triton-portable", "triton-fp8qk", "triton-staged")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    D.common_args(ap, formats="bf16,fp8,fp8_ds_mla,nvfp4_ds_mla", reps=20)
    ap.add_argument("--batches", default="1,4,16,32,64,128")
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    a = ap.parse_args(argv)
    from sparsemla.bench.workload import build_queries, build_workload
    from sparsemla.formats import get_format
    rec = D.Recorder(a)
    backends = a.backends.split(",")
    for fname in D.fmt_list(a.formats):
        fmt = get_format(fname)
        for b in D.int_list(a.batches):
            base_cfg = D.scaled(D.config_named("D-h16", batch=b, name=f"T-b{b}"), rec.dry)
            base = build_workload(base_cfg, fmt, device=rec.device)
            for h in D.int_list(a.heads):
                cfg = replace(base_cfg, name=f"T-b{b}-h{h}", num_heads=min(h, base_cfg.num_heads) if rec.dry else h)
                wl = build_queries(cfg, base.cache, base.layout)
                times = {}
                for be in backends:
                    def one(be=be):
                        call, out = decode.ours_call(wl, be)
                        decode.check_against_reference(wl, call, out)
                        us, timing = rec.time(call)
                        work = attention_work(wl.q, wl.indices, fmt.bytes_per_token, wl.valid_counts)
                        ach = achieved(us * 1e-6, work, rec.ceilings)
                        rec.add(config=cfg.name, kind="decode", fmt=fname, heads=cfg.num_heads, batch=cfg.batch,
                                s_q=1, topk=cfg.topk, impl="sparsemla", timing=timing, value=us,
                                sol_pct=ach["pct_sol"], variant=f"backend {be}", context=cfg.context)
                        times[be] = us
                    rec.attempt(f"{cfg.name} {fname} {be}", one)
                if times:
                    best = min(times, key=times.get)
                    flag = "  <- auto is slower" if "auto" in times and times["auto"] > 1.03 * times[best] else ""
                    cells = "  ".join(f"{k} {v:.1f}" for k, v in times.items())
                    print(f"  {fname:14s} b={cfg.batch:4d} h={cfg.num_heads:4d}  {cells}  (best {best}){flag}",
                          flush=True)
            del base
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
