"""``sparsemla bench``: the standard configurations of docs/benchmarking.md, ours and installed peers side by side.

One process: ceilings measured first, the L2 flushed before every timed call, unique-byte accounting,
each backend's output checked against the float64 reference before it is timed.  Writes
``bench.json``, ``bench.csv``, ``bench.svg`` (and ``bench.png`` with matplotlib) to ``--out``, and
prints % of speed-of-light and the speed-up over the best peer.  With no GPU it runs scaled-down
configurations on the CPU path (the numbers then describe only that path).
"""
from __future__ import annotations

import sys

from ..bench.configs import KINDS, QUICK_NAMES, select_configs
from ..bench.runner import ALL_FORMATS, DEFAULT_FORMATS, format_table, resolve_formats, run_benchmarks


def add_parser(sub, name, help_):
    p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", help="configurations: ids, variant names or wildcards, comma-separated "
                   "(e.g. D-h16,D-small,P-*; default all; see --list)")
    p.add_argument("--kinds", help=f"only these kinds, comma-separated ({', '.join(KINDS)})")
    p.add_argument("--formats", help=f"formats, comma-separated, wildcards or 'all' (default {','.join(DEFAULT_FORMATS)}; "
                   f"all = {','.join(ALL_FORMATS)})")
    p.add_argument("--backends", help="backends, comma-separated or wildcards (default: every registered one but "
                   "'reference', plus torch-gather)")
    p.add_argument("--out", default="bench-out", help="output folder (default ./bench-out)")
    p.add_argument("--quick", action="store_true", help=f"the quick set ({', '.join(QUICK_NAMES)}), 30 runs each")
    p.add_argument("--reps", type=int, help="timed runs per measurement (default 50; 30 with --quick)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    p.add_argument("--call", choices=("runner", "api"), default="runner",
                   help="time backends as a runner calls them (planned once; default) or through the functional API")
    p.add_argument("--no-verify", action="store_true", help="skip the float64 check of each backend's output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the selected configurations and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    try:
        resolve_formats(args.formats)
    except ValueError as e:
        print(f"sparsemla bench: --{e}", file=sys.stderr)
        return 2
    kinds = [k for k in (args.kinds or "").split(",") if k.strip()] or None
    configs = select_configs(args.configs, kinds=kinds, quick=args.quick)
    if args.list:
        for c in configs:
            print(f"{c.describe():<70} {c.note}")
        return 0
    reps = args.reps if args.reps is not None else (30 if args.quick else 50)
    if reps < 1:
        raise ValueError(f"--reps: expected >= 1, got {reps}")
    report = run_benchmarks(configs, args.formats, args.backends, out_dir=args.out, reps=reps, warmup=args.warmup,
                            verify=not args.no_verify, seed=args.seed, show_progress=not args.no_progress,
                            call_path=args.call)
    print()
    print(format_table(report["results"]))
    print()
    for kind, path in report["files"].items():
        print(f"wrote {kind}: {path}")
    bad = [r for r in report["results"] if r.get("status") in ("error", "mismatch")]
    if bad:
        print(f"{len(bad)} measurement(s) failed or disagreed with the float64 reference (see above)")
        return 1
    if not any(r.get("status") == "ok" for r in report["results"]):
        print("nothing was measured: no selected backend serves the selected configurations here")
        return 1
    return 0
