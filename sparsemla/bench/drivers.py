"""What every benchmark driver in ``benchmarks/`` shares: arguments, ceilings, timing, and rows.

A driver builds its problems, times each implementation with :meth:`Recorder.time` and records one row per
measurement with :meth:`Recorder.add`; rows are appended to the results file as they come (``--results``),
so a run cut short by a time limit keeps what it measured.

``--dry-run`` runs the same code on the CPU with shapes scaled down (``BenchConfig.scaled_down``): the
Triton kernels run in the interpreter (``TRITON_INTERPRET=1`` is set before any kernel module is imported),
timings use ``time.perf_counter`` and say nothing about kernels.  It exists so that CI and a reader without
a GPU can check that a driver runs end to end and writes valid rows.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, List, Optional

DRY_RUN_FLAG = "--dry-run"


def prepare_environment(argv=None) -> bool:
    """Call before importing torch-side modules: under ``--dry-run`` the Triton interpreter must be chosen
    before any kernel is decorated.  Returns whether this is a dry run."""
    argv = sys.argv[1:] if argv is None else argv
    dry = DRY_RUN_FLAG in argv
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    return dry


def common_args(ap: argparse.ArgumentParser, *, formats: str, reps: int = 30) -> argparse.ArgumentParser:
    ap.add_argument("--results", default=None,
                    help="append one JSON row per measurement to this file (e.g. benchmarks/results/h200.jsonl)")
    ap.add_argument("--formats", default=formats, help=f"comma list of KV formats (default {formats})")
    ap.add_argument("--reps", type=int, default=reps, help="timed calls per measurement (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true", help="time sparsemla only")
    ap.add_argument("--verbose", action="store_true", help="print the traceback of a failed measurement")
    ap.add_argument(DRY_RUN_FLAG, action="store_true",
                    help="CPU, interpreter, tiny shapes: checks that the driver runs and writes valid rows")
    return ap


class Recorder:
    """Ceilings, environment and rows of one driver run (one process, one device)."""

    def __init__(self, args):
        import torch

        from . import results
        from .ceilings import format_ceilings, measure_ceilings
        self.args = args
        self.dry = bool(getattr(args, "dry_run", False))
        if not self.dry and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run for the CPU check")
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.env = results.environment_fields(self.device)
        self.ceilings = measure_ceilings(self.device, quick=self.dry)
        print(format_ceilings(self.ceilings), flush=True)
        self.rows: List[dict] = []
        self.skipped: List[str] = []
        self._results = results

    # --- timing ------------------------------------------------------------------------------------
    def time(self, fn: Callable[[], object], graph: bool = True):
        """(median us, timing) of ``fn``: CUDA-graph replay when ``graph`` and the call can be captured,
        else one direct call between CUDA events; L2 flushed before each timed call (CPU: perf_counter)."""
        return self.time_many([fn], graph)[0]

    def time_many(self, fns: List[Callable[[], object]], graph: bool = True):
        """[(median us, timing)] of several calls timed interleaved (``timing.time_fns``), each as ``time``
        times one."""
        from .timing import graph_replay, time_fns
        reps, warmup = (3, 1) if self.dry else (self.args.reps, self.args.warmup)
        calls, kinds = [], []
        for fn in fns:
            timing = "eager"
            if graph and self.device.type == "cuda":
                try:
                    fn = graph_replay(fn)
                    timing = "graph"
                except Exception as e:  # a call that cannot be captured is timed directly, and says so
                    print(f"    (graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}; eager)")
                    import torch
                    torch.cuda.synchronize()
            calls.append(fn)
            kinds.append(timing)
        ts = time_fns(calls, device=self.device, reps=reps, warmup=warmup)
        return [(t.median_us, k) for t, k in zip(ts, kinds)]

    # --- rows --------------------------------------------------------------------------------------
    def add(self, *, flush: bool = True, **fields) -> dict:
        """Record one measurement (``results.make_row`` fields); append it to ``--results`` at once."""
        c = self.ceilings
        fields.setdefault("ceil_copy_tbps", c.copy_bytes_per_s / 1e12)
        if c.matmul_flop_per_s:
            fields.setdefault("ceil_mm_tflops", c.matmul_flop_per_s / 1e12)
        if self.dry:
            fields["variant"] = ((fields.get("variant") or "") + " (dry run, CPU)").strip()
        fields.setdefault("reps", 3 if self.dry else self.args.reps)
        row = self._results.make_row(self.env, **fields)
        self.rows.append(row)
        if flush and self.args.results:
            self._results.append(self.args.results, [row])
        return row

    def skip(self, what: str, reason: str) -> None:
        msg = f"{what}: {reason}"
        self.skipped.append(msg)
        print(f"    skipped {msg}", flush=True)

    def attempt(self, what: str, fn: Callable[[], None]) -> bool:
        """Run one measurement; an exception is reported (with its type) and the driver goes on."""
        from .peers import PeerUnavailable
        try:
            fn()
            return True
        except PeerUnavailable as e:
            self.skip(what, str(e))
        except Exception as e:
            self.skip(what, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            if getattr(self.args, "verbose", False):
                traceback.print_exc()
        return False

    def finish(self) -> int:
        where = f" -> {self.args.results}" if self.args.results else " (no --results: nothing written)"
        print(f"{len(self.rows)} rows{where}; {len(self.skipped)} skipped", flush=True)
        return 0 if self.rows else 1


def fmt_list(spec: str) -> List[str]:
    from ..formats import get_format
    out = []
    for name in [s.strip() for s in spec.split(",") if s.strip()]:
        get_format(name)  # raises with the known ids
        out.append(name)
    return out


def int_list(spec: str) -> List[int]:
    return [int(s) for s in str(spec).split(",") if s.strip()]


def scaled(config, dry: bool):
    """The standard configuration, or its tiny CPU copy under ``--dry-run``."""
    return config.scaled_down() if dry else config


def config_named(variant: str, **override):
    """A standard configuration by variant name (``D-h16``, ``D-small-b1-h128``, ``P-32k``; ``D-h<H>`` and
    ``P-h<H>``, P-32k at H heads as ``benchmarks/prefill.py`` names it, for any H), optionally with fields replaced
    (``batch=``, ``num_heads=``, ``name=``)."""
    from dataclasses import replace

    from .configs import BenchConfig, list_configs
    for c in list_configs():
        if c.name == variant:
            return replace(c, **override) if override else c
    if variant.startswith("D-h") and variant[3:].isdigit():
        c = BenchConfig(variant, variant, "decode", batch=128, s_q=1, num_heads=int(variant[3:]), topk=2048)
        return replace(c, **override) if override else c
    if variant.startswith("P-h") and variant[3:].isdigit():
        return replace(config_named("P-32k"), id=variant, name=variant, num_heads=int(variant[3:]), **override)
    raise KeyError(f"unknown configuration {variant!r}")


def print_row(row: dict, extra: str = "") -> None:
    pct = f" {row['sol_pct']:5.1f} % SOL" if row.get("sol_pct") is not None else ""
    var = f" [{row['variant']}]" if row.get("variant") else ""
    print(f"  {row['config']:16s} {row['format']:18s} {row['impl']:16s} {row['timing']:5s} "
          f"{row['value']:9.1f} us{pct}{var}{extra}", flush=True)


__all__ = ["prepare_environment", "common_args", "Recorder", "fmt_list", "int_list", "scaled", "config_named",
           "print_row", "DRY_RUN_FLAG"]
