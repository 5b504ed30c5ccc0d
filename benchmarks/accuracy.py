"""Per-format accuracy report: DSA layer-output error (vs a bf16 cache and vs float64), the fp8 indexer's
top-k overlap with float64, and the small model's greedy-token agreement with its bf16-cache run.

On the H200 (DeepSeek-V3.2 layer geometry, 32K-token contexts, 256 generated tokens):

    python3 benchmarks/accuracy.py --out $OUT/accuracy.json --md $OUT/accuracy.md

On a CPU, ``--quick`` runs tiny shapes in about a minute.  The JSON holds the rows, the sizes and the
environment; the markdown file holds the table (for docs/accuracy.md).  What each column means is in
``sparsemla/layer/accuracy.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sparsemla.layer.accuracy import accuracy_report, default_sizes, format_table  # noqa: E402


def _environment(device):
    try:
        from sparsemla.bench.env import environment
        return environment(device)
    except Exception as e:  # the report is still useful without it
        return {"torch": torch.__version__, "error": f"sparsemla.bench.env unavailable: {e}"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU-sized)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default="accuracy.json", help="JSON output path")
    p.add_argument("--md", default=None, help="markdown table output path (default: next to --out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kpool", type=int, default=1, help="indexer pool size (1, or 4 for GLM-5.3-Flash style)")
    p.add_argument("--formats", nargs="*", default=None, help="format names or ids (default: all 8)")
    p.add_argument("--k-scale", type=float, default=1.0, help="per-tensor k_scale of the plain fp8 format")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly instead of replaying a graph")
    for k, v in default_sizes(False).items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"default {v} ({default_sizes(True)[k]} with --quick)")
    a = p.parse_args(argv)
    sizes = {k: getattr(a, k) for k in default_sizes(False) if getattr(a, k) is not None}
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    rows = accuracy_report(a.quick, device, seed=a.seed, formats=a.formats, kpool=a.kpool, k_scale=a.k_scale,
                           cuda_graph=False if a.no_cuda_graph else None, log=lambda m: print(m, flush=True),
                           **sizes)
    elapsed = time.time() - t0
    used = default_sizes(a.quick)
    used.update(sizes)
    table = format_table(rows)
    result = dict(rows=rows, sizes=used, quick=a.quick, kpool=a.kpool, k_scale=a.k_scale, seed=a.seed,
                  cuda_graph=not a.no_cuda_graph and device.startswith("cuda"), elapsed_s=elapsed,
                  environment=_environment(device), command=" ".join(sys.argv))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    md = a.md or os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        geometry = ("tiny CPU geometry" if a.quick else
                    "DeepSeek-V3.2 layer geometry (hidden 7168, 128 heads, top-k 2048); model: 4 layers, width 1024, "
                    "16 heads, top-k 2048")
        f.write(f"Contexts of {used['context_len']} tokens (layer, last {used['num_eval']} tokens compared), "
                f"{used['gen_tokens']} greedy tokens after {used['prompt_len']}-token prompts (model); {geometry}; "
                f"device {device}; index kpool {a.kpool}; fp8 k_scale {a.k_scale}.\n\n")
        f.write(table + "\n")
    print(table)
    print(f"\nwrote {a.out} and {md} ({elapsed:.0f} s)")
    return result


if __name__ == "__main__":
    main()
