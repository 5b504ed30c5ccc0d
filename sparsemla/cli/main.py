"""``sparsemla`` — the command line.

    sparsemla info        what this machine has, and which backend a call would get (and why not the others)
    sparsemla demo        the main job: a serving batch in every KV format, decoded, in one table
    sparsemla bench       the standard benchmark configurations, peers side by side; JSON, CSV, chart
    sparsemla check       every backend x format x representative shape against the float64 reference
    sparsemla capacity    KV-cache tokens per format for a model geometry

Subcommand modules are imported only when chosen, so ``check`` can switch on the Triton interpreter on a
machine without a GPU before anything imports Triton.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

COMMANDS = {
    "info": "GPU, versions, installed peers, backend probes and the choice for a default call",
    "demo": "decode a realistic serving batch in every KV format and compare size, error and speed",
    "bench": "run the standard benchmark configurations (ours and installed peers); write JSON, CSV, chart",
    "check": "check every backend x format x representative shape against the float64 reference",
    "capacity": "KV-cache tokens per format for a model geometry (layers, TP, GPU memory)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsemla", description="Sparse MLA over paged, quantized KV caches "
                                "(DeepSeek Sparse Attention) — tools.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        mod = importlib.import_module(f"sparsemla.cli.{name}")
        mod.add_parser(sub, name, help_)
    return p


def _no_gpu() -> bool:
    try:
        import torch
        return not torch.cuda.is_available()
    except Exception:
        return True


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before any module imports Triton: with no GPU, `check` runs the Triton kernels in the interpreter.
    if argv[:1] == ["check"] and _no_gpu() and "TRITON_INTERPRET" not in os.environ:
        # Triton picks interpreter or compiler when a kernel is defined (module import), so this only
        # helps if no kernel module was imported yet; say so rather than fail obscurely later.
        early = [m for m in sys.modules if m.startswith("sparsemla.kernels.")]
        if early:
            print("note: Triton kernels were imported before `check` could switch on the interpreter; run "
                  "`TRITON_INTERPRET=1 sparsemla check` to check the Triton backends on this CPU", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError) as e:  # bad flags found after parsing (unknown format, config, ...)
        print(f"sparsemla {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
