"""Small-batch decode latency (D-small: b 1 / 4 / 16 at 16 and 128 heads), sparsemla and the peers in one process.

    python3 benchmarks/small_batch.py --results benchmarks/results/h200.jsonl
    python3 benchmarks/small_batch.py --dry-run --formats fp8_ds_mla --results /tmp/r.jsonl     # CPU check

The same measurement as ``benchmarks/decode.py`` (CUDA-graph replay, L2 flushed, peers prepared once), on
the latency floor: at b 1 a call is a handful of programs plus the split combine, so what it shows is the
fixed cost of a launch and of one program, not bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
from sparsemla.bench.drivers import prepare_environment  # noqa: E402

prepare_environment()

import decode  # noqa: E402

from sparsemla.bench import drivers as D  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    D.common_args(ap, formats="bf16,fp8,fp8_ds_mla,nvfp4_ds_mla")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--no-fp8qk", action="store_true", help="leave out the FP8-QK mode")
    ap.add_argument("--fused", action="store_true", help="add the plan's kernel merging its splits in the kernel "
                    "(fused_combine, sm_90) as impl sparsemla-fused")
    a = ap.parse_args(argv)
    names = [f"D-small-b{b}-h{h}" for b in D.int_list(a.batches) for h in D.int_list(a.heads)]
    rec = D.Recorder(a)
    decode.run_decode(rec, names, D.fmt_list(a.formats), fp8qk=not a.no_fp8qk, peers=not a.no_peers, fused=a.fused)
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
