"""The results file: one JSON object per line, one line per measurement.

The files ``benchmarks/results/<gpu>.jsonl`` (one per GPU: ``h200.jsonl``, ``h100.jsonl``) hold the figures that
BENCHMARKS.md and the README's table are rendered from (``benchmarks/render.py``), so that the documents cannot
drift from the data.  Every benchmark driver in ``benchmarks/`` appends rows to a file its caller names
(``--results PATH``).

A row (:data:`REQUIRED` keys always, :data:`OPTIONAL` keys where they apply):

==========  =====================================================================================
config      standard configuration id (``D-h16``, ``D-small-b1-h128``, ``P-32k``, ``W-scatter``, ``H-decode``)
kind        ``decode`` | ``prefill`` | ``movement`` | ``host``
format      KV format id (``fp8_ds_mla``, ``bf16-nope``, ...)
heads       query heads; ``batch`` requests; ``s_q`` query tokens per request; ``topk`` indices per token
impl        who ran it: ``sparsemla`` (default backend), ``sparsemla-fp8qk`` (backend ``triton-fp8qk``),
            ``sparsemla-conv`` (the opt-in sm90-conv kernel, forced), ``sparsemla-cluster`` (sm90-cluster, forced),
            ``sparsemla-fused`` (the plan's kernel merging its splits in the kernel), ``flashmla``, ``flashinfer``,
            ``torch-gather`` (the PyTorch floor)
timing      ``graph`` (CUDA-graph replay), ``eager`` (one direct call between CUDA events),
            ``host`` (host time of one call, ``time.perf_counter`` over many back-to-back calls)
value       the measurement, in ``unit`` (``us``, ``TFLOP/s`` or ``GB/s``)
sol_pct     speed-of-light time / measured time, in percent (``docs/benchmarking.md``)
gpu, torch, triton, python, cuda, commit, date, command   where, with what, and how it was measured
==========  =====================================================================================

Rows are never edited: a newer measurement of the same key (:func:`row_key`) is appended and wins.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Dict, Iterable, List, Optional, Sequence

KINDS = ("decode", "prefill", "movement", "host")
TIMINGS = ("graph", "eager", "host")
UNITS = ("us", "TFLOP/s", "GB/s")
IMPLS = ("sparsemla", "sparsemla-fp8qk", "sparsemla-conv", "sparsemla-cluster", "sparsemla-bf16", "sparsemla-fused", "flashmla",
         "flashinfer", "torch-gather")

REQUIRED = ("config", "kind", "format", "heads", "batch", "s_q", "topk", "impl", "timing", "value", "unit",
            "gpu", "torch", "triton", "python", "cuda", "commit", "date", "command")
OPTIONAL = (
    "sol_pct",        # percent of speed-of-light
    "sol_us",         # speed-of-light time, us
    "tflops",         # achieved TFLOP/s (attention)
    "gbps",           # achieved GB/s, bytes read + written (data movement)
    "bytes",          # bytes the accounting counts
    "ceil_copy_tbps", "ceil_mm_tflops",  # ceilings measured in the same process
    "context",        # tokens per request
    "variant",        # what distinguishes rows of one impl: "heads padded to 64", "bf16 workspace", ...
    "kernel",         # the kernel the plan chose, when known
    "rel_err",        # relative error of the timed call against float64
    "reps",           # timed runs behind the median
    "source",         # where a row that was not written by a driver came from
)
_NUMERIC = {"heads", "batch", "s_q", "topk", "value", "sol_pct", "sol_us", "tflops", "gbps", "bytes",
            "ceil_copy_tbps", "ceil_mm_tflops", "context", "rel_err", "reps"}


class SchemaError(ValueError):
    pass


def validate_row(row: dict) -> dict:
    """Return ``row`` if it follows the schema, else raise :class:`SchemaError` naming the key."""
    if not isinstance(row, dict):
        raise SchemaError(f"row: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise SchemaError(f"row {row.get('config')!r}: missing keys {missing}")
    unknown = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise SchemaError(f"row {row['config']!r}: unknown keys {unknown} (known: {REQUIRED + OPTIONAL})")
    for key, allowed in (("kind", KINDS), ("timing", TIMINGS), ("unit", UNITS), ("impl", IMPLS)):
        if row[key] not in allowed:
            raise SchemaError(f"row {row['config']!r}: {key} must be one of {allowed}, got {row[key]!r}")
    for k in _NUMERIC & set(row):
        v = row[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
            raise SchemaError(f"row {row['config']!r}: {k} must be a number, got {v!r}")
    if row["value"] <= 0:
        raise SchemaError(f"row {row['config']!r}: value must be > 0, got {row['value']}")
    for k in ("config", "format", "gpu", "torch", "triton", "python", "commit", "date", "command"):
        if not isinstance(row[k], str) or not row[k]:
            raise SchemaError(f"row {row['config']!r}: {k} must be a non-empty string, got {row[k]!r}")
    try:
        datetime.date.fromisoformat(row["date"][:10])
    except ValueError:
        raise SchemaError(f"row {row['config']!r}: date must start with YYYY-MM-DD, got {row['date']!r}") from None
    return row


def row_key(row: dict) -> tuple:
    """What one measurement measures; a later row with the same key replaces an earlier one."""
    return (row["config"], row["format"], row["impl"], row["timing"], row.get("variant", ""), row["triton"],
            row["gpu"])


def load(path: str) -> List[dict]:
    """Every row of ``path``, validated, in file order (blank lines skipped)."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{path}:{n}: not JSON ({e})") from None
            try:
                rows.append(validate_row(row))
            except SchemaError as e:
                raise SchemaError(f"{path}:{n}: {e}") from None
    return rows


def latest(rows: Iterable[dict]) -> List[dict]:
    """One row per :func:`row_key`, the last in file order, kept in the order of first appearance."""
    out: Dict[tuple, dict] = {}
    for r in rows:
        k = row_key(r)
        out.pop(k, None)
        out[k] = r
    return list(out.values())


def append(path: str, rows: Sequence[dict]) -> None:
    """Validate and append ``rows`` to ``path`` (created with its folder if missing)."""
    for r in rows:
        validate_row(r)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=False) + "\n")


def environment_fields(device=None) -> dict:
    """The environment keys of a row for a measurement taken now, in this process (``SPARSEMLA_COMMIT``, when
    set, names the commit of a tree that has no git history)."""
    import torch

    from .env import git_commit
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "none",
        # A copy of the tree without its git history (a GPU machine) gets the commit from the caller.
        "commit": os.environ.get("SPARSEMLA_COMMIT") or git_commit() or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python3"] + [os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""]
                            + sys.argv[1:]),
    }


def make_row(env: dict, *, config: str, kind: str, fmt: str, heads: int, batch: int, s_q: int, topk: int,
             impl: str, timing: str, value: float, unit: str = "us", **extra) -> dict:
    """One validated row: the measurement, its shape and the environment ``env`` (``environment_fields``).

    ``extra`` holds :data:`OPTIONAL` keys; those given as None are left out.
    """
    row = {"config": config, "kind": kind, "format": fmt, "heads": int(heads), "batch": int(batch),
           "s_q": int(s_q), "topk": int(topk), "impl": impl, "timing": timing, "value": float(value),
           "unit": unit}
    row.update({k: env[k] for k in ("gpu", "torch", "triton", "python", "cuda", "commit", "date", "command")})
    for k, v in extra.items():
        if v is not None:
            row[k] = round(v, 4) if isinstance(v, float) else v
    row["value"] = round(row["value"], 3)
    return validate_row(row)


__all__ = ["KINDS", "TIMINGS", "UNITS", "IMPLS", "REQUIRED", "OPTIONAL", "SchemaError", "validate_row", "row_key",
           "load", "latest", "append", "environment_fields", "make_row"]
