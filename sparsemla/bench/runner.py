"""Run configurations x formats x backends; write JSON, CSV and a chart; print % of SOL and the ratio to the best peer.

One process does everything, so every figure shares the same ceilings, data and clocks:

1. measure the ceilings (copy bandwidth, matmul) on this device;
2. for each format and each (batch, context) group, build the paged cache once, then per configuration
   build queries and indices (the same for every format and backend: seeded by the config's name);
3. per backend: ask the registry whether it serves the case (the reason is recorded when not), call it
   once and compare the first tokens with the float64 reference (a wrong backend is flagged, never
   silently reported as fast), then time it (median of ``reps``, L2 flushed, after warm-up);
4. configuration ``W`` times ``PagedKVCache.write`` per format (bytes read + written) after
   checking its bytes against the format's encoder.

Backends are the registry's (ours and installed peers) plus the PyTorch floor (``torch-gather``).
On a machine with no GPU the configurations are scaled down (``BenchConfig.scaled_down``) and the
figures only describe the CPU path.
"""
from __future__ import annotations

import csv
import fnmatch
import gc
import json
import math
import os
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..formats import FORMAT_NAMES
from ..reference import sparse_mla as reference_sparse_mla
from . import backends as B
from .accounting import Ceilings, achieved, attention_work, cache_write_work
from .ceilings import format_ceilings, measure_ceilings
from .chart import write_png, write_svg
from .configs import BenchConfig
from .env import environment
from .progress import progress
from .timing import time_fn
from .workload import build_cache, build_queries, build_write_workload, make_layout

DEFAULT_FORMATS = tuple(FORMAT_NAMES)                                # rope 64
ALL_FORMATS = DEFAULT_FORMATS + tuple(f"{n}-nope" for n in FORMAT_NAMES)
TOLERANCE = B.EXACT_TOLERANCE[0]  # default out tolerance (per backend and format: bench/backends.tolerance)
CSV_FIELDS = ("config", "kind", "format", "backend", "peer", "call", "status", "time_us", "p20_us", "p80_us", "sol_us",
              "pct_sol", "bound", "tflops", "tbps", "vs_best_peer", "best_peer", "rel_err", "lse_err", "flops",
              "bytes", "valid_pairs", "unique_rows", "batch", "s_q", "num_heads", "topk", "context", "reason")


# --- resolving what to run --------------------------------------------------------------------------------

def resolve_formats(spec=None) -> List[str]:
    """Format ids from ``None`` (the four rope formats), ``"all"`` (with NoPE), or comma-separated names/globs."""
    if spec is None or spec == "" or spec == []:
        return list(DEFAULT_FORMATS)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: List[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        if item == "all":
            hits = list(ALL_FORMATS)
        else:
            hits = [f for f in ALL_FORMATS if fnmatch.fnmatchcase(f, item)]
            if not hits:
                raise ValueError(f"formats: {item!r} matches no format; expected some of {list(ALL_FORMATS)} or 'all'")
        out += [h for h in hits if h not in out]
    return out


def resolve_backends(spec=None, *, log: Callable[[str], None] = print) -> List[str]:
    """Backend names to run: the registry's (minus the float64 reference) plus the PyTorch floor.

    ``spec``: comma-separated names or globs (``triton*``); naming ``reference`` includes it.
    """
    ok, msg = B.registry_status()
    names = []
    if ok:
        names = B.backend_names()
    else:
        log(f"note: {msg}; only the PyTorch floor ({B.TORCH_BASELINE}) can be measured")
    names = names + [B.TORCH_BASELINE]
    if spec is None or spec == "" or spec == []:
        return [n for n in names if n not in B.NOT_TIMED]
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: List[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        hits = [n for n in names if fnmatch.fnmatchcase(n, item)]
        if not hits:
            raise ValueError(f"backends: {item!r} matches no backend; available: {names}")
        out += [h for h in hits if h not in out]
    return out


# --- one measurement ----------------------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200] if s else ''}"


def compare_to_reference(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor):
    """(relative L2 error of out, max |lse - ref| over entries where ref is finite) — NaN-aware."""
    o = out.double()
    r = ref_out.double()
    if not torch.isfinite(o).all():
        return float("nan"), float("nan")
    denom = r.norm()
    rel = float((o - r).norm() / denom) if denom > 0 else float((o - r).norm())
    fin = torch.isfinite(ref_lse)
    if (torch.isfinite(lse) != fin).any():
        return rel, float("inf")
    lse_err = float((lse[fin].double() - ref_lse[fin].double()).abs().max()) if fin.any() else 0.0
    return rel, lse_err


def _base_record(cfg: BenchConfig, fmt_id: str, backend: str) -> dict:
    return {"config": cfg.name, "config_id": cfg.id, "kind": cfg.kind, "format": fmt_id, "backend": backend,
            "peer": B.is_peer(backend) if backend != "cache.write" else False, "batch": cfg.batch, "s_q": cfg.s_q,
            "num_heads": cfg.num_heads, "topk": cfg.topk, "context": cfg.context, "scaled": cfg.scaled}


def _measure_attention(cfg, wl, backend, ceilings, device, reps, warmup, verify, verify_tokens, ref_cache, call_path):
    rec = _base_record(cfg, wl.fmt.id, backend)
    problem = B.make_problem(cfg.kind, wl.fmt, cfg.num_heads, cfg.topk, wl.q.shape[0], device)
    reason = B.why_not(backend, problem)
    if reason:
        rec.update(status="skipped", reason=reason)
        return rec
    try:
        call, path = B.make_call(backend, cfg.kind, wl.q, wl.cache, wl.indices, wl.sm_scale, None, wl.k_scale,
                                 path=call_path)
        rec["call"] = path
        out, lse = call()
        if verify:
            n = min(verify_tokens, wl.q.shape[0])
            if "ref" not in ref_cache:
                ref_cache["ref"] = reference_sparse_mla(wl.q[:n], wl.cache, wl.indices[:n], wl.sm_scale,
                                                        None, wl.k_scale)
            ref_out, ref_lse = ref_cache["ref"]
            rel, lse_err = compare_to_reference(out[:n], lse[:n], ref_out, ref_lse)
            rec.update(rel_err=rel, lse_err=lse_err)
        t = time_fn(call, device=device, reps=reps, warmup=warmup)
    except Exception as e:
        rec.update(status="error", reason=_first_line(e))
        return rec
    work = attention_work(wl.q, wl.indices, wl.fmt.bytes_per_token)
    rec.update(achieved(t.median_s, work, ceilings))
    rec.update(status="ok", p20_us=t.p20_s * 1e6, p80_us=t.p80_s * 1e6, reps=t.reps, timing=t.method,
               l2_flushed=t.l2_flushed, flops=work.flops, bytes=work.nbytes, valid_pairs=work.valid_pairs,
               unique_rows=work.unique_rows)
    if verify:
        tol, lse_tol = B.tolerance(backend, wl.fmt)
        rec["tolerance"] = tol
        if not (rec["rel_err"] <= tol and rec["lse_err"] <= lse_tol):
            rec.update(status="mismatch", reason=f"differs from the float64 reference: rel err {rec['rel_err']:.3g}, "
                                                 f"lse err {rec['lse_err']:.3g} (tolerance {tol:g} / {lse_tol:g})")
    return rec


def _measure_write(cfg, fmt_id, ceilings, device, reps, warmup, seed):
    rec = _base_record(cfg, fmt_id, "cache.write")
    try:
        ww = build_write_workload(cfg, fmt_id, device=device, seed=seed)
        ww.run()
        fmt = ww.cache.fmt
        # Check the bytes of a sample against the format's PyTorch encoder (the contract).
        n = min(256, cfg.tokens)
        rows = ww.cache.slot_to_row(ww.slots[:n])
        want = fmt.encode(ww.kv_c[:n], None if ww.k_pe is None else ww.k_pe[:n])
        if not torch.equal(ww.cache.rows[rows], want):
            rec.update(status="mismatch", reason="written bytes differ from the format's encoder")
        t = time_fn(ww.run, device=device, reps=reps, warmup=warmup)
    except Exception as e:
        rec.update(status="error", reason=_first_line(e))
        return rec
    work = cache_write_work(cfg.tokens, fmt.head_dim, fmt.bytes_per_token,
                            slot_elem_size=ww.slots.element_size())
    rec.update(achieved(t.median_s, work, ceilings))
    rec.setdefault("status", "ok")
    rec.update(p20_us=t.p20_s * 1e6, p80_us=t.p80_s * 1e6, reps=t.reps, timing=t.method, l2_flushed=t.l2_flushed,
               flops=0, bytes=work.nbytes, gbps=work.nbytes / t.median_s / 1e9)
    return rec


# --- the run ---------------------------------------------------------------------------------------------

def run_benchmarks(configs: Sequence[BenchConfig], formats=None, backends=None, *, device=None,
                   out_dir: Optional[str] = None, reps: int = 50, warmup: int = 5, verify: bool = True,
                   verify_tokens: int = 8, seed: int = 0, show_progress: bool = True, call_path: str = "runner",
                   ceilings: Optional[Ceilings] = None, log: Callable[[str], None] = print) -> dict:
    """Measure and return ``{"environment", "ceilings", "results", "files"}``.

    Args:
        configs: from :func:`~sparsemla.bench.configs.select_configs` (scaled down automatically on CPU).
        formats: format ids or a spec for :func:`resolve_formats`.
        backends: names or a spec for :func:`resolve_backends`.
        out_dir: where to write ``bench.json``, ``bench.csv``, ``bench.svg`` (and ``bench.png`` with matplotlib).
        reps, warmup: timing (the benchmark standard is reps >= 30).
        verify: compare the first ``verify_tokens`` query tokens of each call with the float64 reference.
        call_path: ``"runner"`` (plan once, time the backend's forward, as an engine runs it) or ``"api"``
            (time the public functional API, argument checks included); see ``bench/backends.py``.
        ceilings: reuse measured ceilings (default: measure now).
    """
    if call_path not in B.CALL_PATHS:
        raise ValueError(f"call_path: expected one of {B.CALL_PATHS}, got {call_path!r}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    fmt_ids = resolve_formats(formats)
    names = resolve_backends(backends, log=log)
    configs = list(configs)
    if device.type != "cuda" and any(not c.scaled for c in configs):
        log("note: no GPU — running scaled-down configurations on the CPU path; these figures say nothing "
            "about GPU kernels")
        configs = [c if c.scaled else c.scaled_down() for c in configs]
    env = environment(device)
    if ceilings is None:
        ceilings = measure_ceilings(device, quick=device.type != "cuda")
    log(format_ceilings(ceilings))

    results: List[dict] = []
    attn = [c for c in configs if c.kind in ("decode", "prefill")]
    groups: Dict[tuple, List[BenchConfig]] = {}
    for c in attn:
        groups.setdefault((c.batch, c.context), []).append(c)
    for fmt_id in fmt_ids:
        for (batch, context), cfgs in groups.items():
            layout = make_layout([context] * batch, device=device, seed=seed)
            with progress(layout.num_tokens, f"write {batch}x{context} tokens as {fmt_id}",
                          enabled=show_progress) as bar:
                cache = build_cache(fmt_id, layout, device=device, seed=seed, bar=bar)
            for cfg in cfgs:
                wl = build_queries(cfg, cache, layout, seed=seed)
                ref_cache: dict = {}
                for name in names:
                    rec = _measure_attention(cfg, wl, name, ceilings, device, reps, warmup, verify, verify_tokens,
                                             ref_cache, call_path)
                    results.append(rec)
                    _log_line(rec, log)
                del wl, ref_cache
            del cache
            _free(device)
    for cfg in (c for c in configs if c.kind == "write"):
        for fmt_id in fmt_ids:
            rec = _measure_write(cfg, fmt_id, ceilings, device, reps, warmup, seed)
            results.append(rec)
            _log_line(rec, log)
            _free(device)

    add_peer_ratios(results)
    report = {"environment": env, "ceilings": ceilings.as_dict(), "results": results, "files": {}}
    if out_dir:
        report["files"] = write_outputs(report, out_dir)
    return report


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _log_line(rec: dict, log) -> None:
    if rec["status"] in ("ok", "mismatch"):
        log(f"  {rec['config']:<16} {rec['format']:<18} {rec['backend']:<14} {rec['time_us']:9.1f} us  "
            f"{rec['pct_sol']:5.1f}% SOL" + ("" if rec["status"] == "ok" else "  MISMATCH"))
    elif rec["status"] == "error":
        log(f"  {rec['config']:<16} {rec['format']:<18} {rec['backend']:<14} error: {rec['reason']}")


def add_peer_ratios(results: List[dict]) -> None:
    """Per configuration, the fastest peer over every format (``best_peer``) and each row's speed-up
    over it (``vs_best_peer`` = peer time / this time; > 1 means faster than the best peer)."""
    best: Dict[str, dict] = {}
    for r in results:
        if r.get("peer") and r.get("status") == "ok":
            b = best.get(r["config"])
            if b is None or r["time_us"] < b["time_us"]:
                best[r["config"]] = r
    for r in results:
        b = best.get(r["config"])
        if b is not None and r.get("status") in ("ok", "mismatch"):
            r["best_peer"] = f"{b['backend']} ({b['format']})"
            r["vs_best_peer"] = b["time_us"] / r["time_us"]


# --- output ------------------------------------------------------------------------------------------------

def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_outputs(report: dict, out_dir: str, stem: str = "bench") -> Dict[str, str]:
    """Write ``{stem}.json``, ``{stem}.csv``, ``{stem}.svg`` and, with matplotlib, ``{stem}.png``."""
    os.makedirs(out_dir, exist_ok=True)
    files = {}
    p = os.path.join(out_dir, f"{stem}.json")
    with open(p, "w") as f:
        json.dump(_json_safe(report), f, indent=1)
    files["json"] = p
    p = os.path.join(out_dir, f"{stem}.csv")
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in report["results"]:
            w.writerow({k: _csv_value(r.get(k)) for k in CSV_FIELDS})
    files["csv"] = p
    env = report.get("environment", {})
    title = f"sparse MLA on {env.get('name', '?')} ({env.get('date_utc', '')}): us per call, log scale"
    svg = write_svg(report["results"], os.path.join(out_dir, f"{stem}.svg"), title)
    if svg:
        files["svg"] = svg
    png = write_png(report["results"], os.path.join(out_dir, f"{stem}.png"), title)
    if png:
        files["png"] = png
    # The JSON lists the files too.
    report["files"] = files
    with open(files["json"], "w") as f:
        json.dump(_json_safe(report), f, indent=1)
    return files


def _csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def format_table(results: Sequence[dict]) -> str:
    """The human-readable summary: measured rows, then one line per distinct skip reason."""
    head = (f"{'config':<16} {'format':<18} {'backend':<14} {'time us':>9} {'SOL us':>8} {'%SOL':>6} "
            f"{'TFLOP/s':>8} {'TB/s':>6} {'vs best peer':>12}  {'err':>8}  note")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.get("status") not in ("ok", "mismatch"):
            continue
        vs = f"{r['vs_best_peer']:.2f}x" if r.get("vs_best_peer") else "-"
        err = f"{r['rel_err']:.1e}" if isinstance(r.get("rel_err"), float) else "-"
        note = "" if r["status"] == "ok" else "MISMATCH: " + r.get("reason", "")
        if r["kind"] == "write":
            note = (note + f" {r['gbps']:.0f} GB/s").strip()
        lines.append(f"{r['config']:<16} {r['format']:<18} {r['backend']:<14} {r['time_us']:9.1f} {r['sol_us']:8.1f} "
                     f"{r['pct_sol']:5.1f}% {r['tflops']:8.1f} {r['tbps']:6.2f} {vs:>12}  {err:>8}  {note}")
    seen = {}
    for r in results:
        if r.get("status") in ("skipped", "error"):
            key = (r["backend"], r["status"], r.get("reason", ""))
            seen.setdefault(key, []).append(f"{r['config']}/{r['format']}")
    if seen:
        lines.append("")
        for (backend, status, reason), where in seen.items():
            lines.append(f"{status}: {backend} on {len(where)} case(s) (e.g. {where[0]}): {reason}")
    return "\n".join(lines)


__all__ = ["run_benchmarks", "resolve_formats", "resolve_backends", "format_table", "write_outputs",
           "add_peer_ratios", "compare_to_reference", "DEFAULT_FORMATS", "ALL_FORMATS", "TOLERANCE"]
