"""``sparsemla check``: every backend x format x representative shape on this device vs the float64 reference.

Each case is a fresh heavy-tailed batch in shuffled pages, with -1 padding (short contexts), a token
whose valid count stops early while real rows follow it (they must be ignored) and a token with
no valid entry (out must be exactly 0, lse -inf).  Outputs are poisoned (NaN) before each call.
A backend that does not serve a case is skipped with its reason; any failure makes the exit code 1.

On a GPU the shapes are realistic (4K-token contexts, top-k up to 2048, 16..128 heads); with no GPU
they are tiny and the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set by the
command itself when no GPU is present).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..bench import backends as B
from ..bench.configs import BenchConfig
from ..bench.runner import compare_to_reference, resolve_formats
from ..bench.workload import build_cache, build_queries, make_layout
from .._device import interpreting
from ..reference import sparse_mla as reference_sparse_mla

TOLERANCE, LSE_TOLERANCE = B.EXACT_TOLERANCE  # an exact path's bounds; a lossy path gets B.tolerance(...)


@dataclass(frozen=True)
class Shape:
    """A representative case: kind, heads, top-k, tokens per request and each request's context."""

    name: str
    kind: str
    num_heads: int
    topk: int
    s_q: int
    contexts: tuple

    def config(self) -> BenchConfig:
        return BenchConfig("check", self.name, self.kind, batch=len(self.contexts), s_q=self.s_q,
                           num_heads=self.num_heads, topk=self.topk, context=max(self.contexts), scaled=True)


GPU_SHAPES = (
    Shape("decode-h16-k2048", "decode", 16, 2048, 1, (4096, 4096, 3000, 1500, 4096, 2048, 4096, 100)),
    Shape("decode-h128-k2048", "decode", 128, 2048, 1, (4096, 1000, 4096, 4096)),
    Shape("decode-h20-k1024-mtp", "decode", 20, 1024, 2, (4096, 700, 2048)),
    Shape("decode-h1-k64", "decode", 1, 64, 1, (512, 40, 512)),
    Shape("prefill-h16-k2048", "prefill", 16, 2048, 64, (4096,)),
    Shape("prefill-h64-k512-short", "prefill", 64, 512, 48, (300, 4096)),
)
CPU_SHAPES = (
    Shape("decode-h2-k64", "decode", 2, 64, 1, (256, 40, 200)),
    Shape("decode-h16-k128-mtp", "decode", 16, 128, 2, (300, 90)),
    Shape("prefill-h2-k64", "prefill", 2, 64, 4, (100,)),
)


def add_parser(sub, name, help_):
    p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", help="backends, comma-separated or wildcards (default: all registered)")
    p.add_argument("--formats", help="formats, comma-separated, wildcards or 'all' (default all: rope and NoPE)")
    p.add_argument("--shapes", help="shape names, comma-separated (see --list)")
    p.add_argument("--quick", action="store_true", help="the first shape only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(run=run)
    return p


def _select_shapes(all_shapes: Sequence[Shape], spec: Optional[str], quick: bool) -> List[Shape]:
    shapes = list(all_shapes)
    if spec:
        names = [s.strip() for s in spec.split(",") if s.strip()]
        unknown = [n for n in names if n not in {s.name for s in shapes}]
        if unknown:
            raise ValueError(f"shapes: unknown {unknown}; known: {[s.name for s in shapes]}")
        shapes = [s for s in shapes if s.name in names]
    return shapes[:1] if quick else shapes


def _backends(spec: Optional[str]) -> List[str]:
    import fnmatch
    names = B.backend_names()
    if not spec:
        return names
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        hits = [n for n in names if fnmatch.fnmatchcase(n, item)]
        if not hits:
            raise ValueError(f"backends: {item!r} matches no backend; registered: {names}")
        out += [h for h in hits if h not in out]
    return out


def _edge_counts(valid_counts: torch.Tensor) -> torch.Tensor:
    """Valid counts with two edge cases planted: token 1 stops halfway (real rows follow, to be ignored),
    token 2 has none (exactly 0 / -inf expected)."""
    vc = valid_counts.clone()
    if vc.numel() > 1:
        vc[1] = vc[1] // 2
    if vc.numel() > 2:
        vc[2] = 0
    return vc


def _call(name, kind, q, cache, indices, sm_scale, vc, out, lse):
    try:
        api = B.attention_api()
    except B.Unavailable:
        api = None
    if api is not None:
        fn = api.sparse_mla_decode if kind == "decode" else api.sparse_mla_prefill
        return fn(q, cache, indices, sm_scale, vc, 1.0, backend=name, out=out, lse=lse)
    return B.get_backend(name).forward(kind, q, cache, indices, sm_scale, vc, 1.0, out, lse)


def check_case(name: str, kind: str, q, cache, indices, sm_scale, vc, ref) -> dict:
    """Run one backend on one case and judge it; returns a result dict with ``status`` PASS/FAIL."""
    tol, lse_tol = B.tolerance(name, cache.fmt)
    t, h = q.shape[0], q.shape[1]
    out = torch.full((t, h, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=q.device)
    try:
        got_out, got_lse = _call(name, kind, q, cache, indices, sm_scale, vc, out, lse)
        if q.device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        msg = str(e).strip().splitlines()
        return {"status": "FAIL", "detail": f"raised {type(e).__name__}: {msg[0][:200] if msg else ''}"}
    ref_out, ref_lse = ref
    rel, lse_err = compare_to_reference(got_out, got_lse, ref_out, ref_lse)
    res = {"rel_err": rel, "lse_err": lse_err, "tolerance": tol}
    problems = []
    if not rel <= tol:
        problems.append(f"out rel err {rel:.3g} > {tol:g}")
    if not lse_err <= lse_tol:
        problems.append(f"lse err {lse_err:.3g} > {lse_tol:g}")
    empty = vc == 0
    if empty.any():
        if not (got_out[empty] == 0).all():
            problems.append("a query with no valid entry did not give out = 0")
        if not torch.isneginf(got_lse[empty]).all():
            problems.append("a query with no valid entry did not give lse = -inf")
    res["status"] = "FAIL" if problems else "PASS"
    if problems:
        res["detail"] = "; ".join(problems)
    return res


def run(args) -> int:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    shapes_all = GPU_SHAPES if gpu else CPU_SHAPES
    if args.list:
        for s in shapes_all:
            print(f"{s.name:<24} {s.kind:<8} h={s.num_heads:<4} top-k={s.topk:<5} s_q={s.s_q:<3} contexts={list(s.contexts)}")
        return 0
    shapes = _select_shapes(shapes_all, args.shapes, args.quick)
    fmt_ids = resolve_formats(args.formats or "all")
    ok, msg = B.registry_status()
    if not ok:
        print(f"sparsemla check: the backend registry is not usable: {msg}", file=sys.stderr)
        return 2
    names = _backends(args.backends)
    if gpu:
        where = f"GPU {torch.cuda.get_device_name(device)}"
    else:
        where = "CPU (no GPU: tiny shapes; " + ("Triton kernels in the interpreter)" if interpreting() else
                                                "Triton interpreter off, so no Triton backend runs)")
    print(f"sparsemla check on {where}: {len(names)} backends x {len(fmt_ids)} formats x {len(shapes)} shapes; "
          f"tolerance: out rel err <= {TOLERANCE:g}, lse err <= {LSE_TOLERANCE:g} "
          f"(lossy paths: {B.LOSSY_TOLERANCE[0]:g} / {B.LOSSY_TOLERANCE[1]:g})")
    results = []
    for shape in shapes:
        cfg = shape.config()
        layout = make_layout(list(shape.contexts), device=device, seed=args.seed)
        for f in fmt_ids:
            cache = build_cache(f, layout, device=device, seed=args.seed)
            wl = build_queries(cfg, cache, layout, seed=args.seed)
            vc = _edge_counts(wl.valid_counts)
            ref = reference_sparse_mla(wl.q, cache, wl.indices, wl.sm_scale, vc)
            problem = B.make_problem(shape.kind, cache.fmt, shape.num_heads, shape.topk, wl.q.shape[0], device)
            for name in names:
                rec = {"shape": shape.name, "format": cache.fmt.id, "backend": name}
                reason = B.why_not(name, problem)
                if reason:
                    rec.update(status="SKIP", detail=reason)
                else:
                    rec.update(check_case(name, shape.kind, wl.q, cache, wl.indices, wl.sm_scale, vc, ref))
                results.append(rec)
                _print(rec)
            del cache, wl
    n = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped")
    if args.json:
        with open(args.json, "w") as fjs:
            json.dump({"device": str(device), "results": results}, fjs, indent=1, default=str)
    if n["FAIL"]:
        return 1
    if not n["PASS"]:
        print("nothing was checked: no selected backend serves any selected case on this machine")
        return 1
    return 0


def _print(r: dict) -> None:
    if r["status"] == "SKIP":
        print(f"SKIP {r['shape']:<24} {r['format']:<18} {r['backend']:<14} {r['detail']}")
    elif r["status"] == "PASS":
        print(f"PASS {r['shape']:<24} {r['format']:<18} {r['backend']:<14} rel err {r['rel_err']:.2e}, "
              f"lse err {r['lse_err']:.2e}")
    else:
        print(f"FAIL {r['shape']:<24} {r['format']:<18} {r['backend']:<14} {r.get('detail', '')}")
