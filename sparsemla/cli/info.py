"""``sparsemla info``: what this machine has, and which backend a call would get.

Prints the GPU and its compute capability, the versions of Python / PyTorch / Triton, the optional
peers found, each backend's probe on this machine, the kernels that cannot be built here and why
(``sparsemla.plan.unavailable_kernels``; on a Hopper GPU each Gluon kernel is built and run once on a tiny
call first, ``--no-build`` skips that), and for one call (default: the D-h16 decode of an
fp8_ds_mla cache) the backend ``backend="auto"`` picks, the plan it runs (``sparsemla.plan.explain``) and, for
every other backend, why not; and the compiled host entry's state (``sparsemla.host_entry``; built first on a CUDA
machine unless ``--no-build``).
"""
from __future__ import annotations

import json
import sys
from typing import Optional

from ..bench import backends as B
from ..bench.env import PEER_PACKAGES, environment
from ..formats import get_format


def add_parser(sub, name, help_):
    p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="fp8_ds_mla", help="KV format of the example call (default fp8_ds_mla)")
    p.add_argument("--heads", type=int, default=16, help="query heads of the example call (default 16)")
    p.add_argument("--topk", type=int, default=2048, help="top-k width of the example call (default 2048)")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode", help="kind of call (default decode)")
    p.add_argument("--tokens", type=int, default=128, help="query tokens of the example call (default 128)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-build", action="store_true",
                   help="do not build the Hopper kernels to find those the installed Triton cannot build, nor the "
                        "compiled host entry")
    p.set_defaults(run=run)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("sparsemla")
    except Exception:
        try:
            import sparsemla
            return str(getattr(sparsemla, "__version__", "source checkout"))
        except Exception:
            return "source checkout"


def gather(args) -> dict:
    """Everything ``info`` reports, as a dict (also the ``--json`` output)."""
    env = environment()
    info = {"sparsemla": _version(), **env, "backends": {}, "example": None}
    ok, msg = B.registry_status()
    info["registry"] = "ok" if ok else msg
    if not ok:
        return info
    for name in B.backend_names():
        info["backends"][name] = {"probe": B.probe(name), "peer": B.is_peer(name), "description": B.describe(name)}
    problem = B.make_problem(args.mode, args.format, args.heads, args.topk, args.tokens)
    chosen, reasons, err = B.select(problem)
    info["example"] = {"call": problem.describe(), "chosen": chosen, "select_error": err,
                       "priority": list(B.priority(problem)), "why_not": reasons, "plan": _plan(args)}
    info["unavailable_kernels"] = _unavailable_kernels(build=not getattr(args, "no_build", False))
    info["host_entry"] = _host_entry(build=not getattr(args, "no_build", False))
    info["example"]["plan"] = _plan(args)  # after the build probe: the plan skips kernels that did not build
    return info


def _plan(args):
    """The plan's own explanation of the example call, as text (None where the library has no plan module)."""
    try:
        from .. import plan
    except ImportError:
        return None
    explain = getattr(plan, "explain", None)
    if explain is None:
        return None
    try:
        from .._device import capability, num_sms
        import torch
        facts = {}
        if torch.cuda.is_available():
            facts = dict(capability=capability("cuda"), num_sms=num_sms("cuda"))
        else:
            facts = dict(capability=(0, 0), interpret=True)  # on this CPU the Triton kernels run interpreted
        return str(explain(args.format, args.tokens, args.heads, args.topk, mode=args.mode,
                           unavailable=plan.unavailable_set(), **facts))
    except Exception as e:  # a device without the kernels, or an unservable call: say so
        return f"no plan: {type(e).__name__}: {e}"


def _unavailable_kernels(build: bool = True):
    """{kernel: reason} for kernels the installed Triton cannot build here (None where not known: no Hopper GPU
    to build them on, or ``build`` off)."""
    from .. import plan
    from ..kernels import attention
    if build:
        known = attention.probe_builds()
        if known is None:
            return None
    return {str(k): str(v) for k, v in plan.unavailable_kernels().items()}


def _host_entry(build: bool = True) -> str:
    """The compiled host entry's state (built first on a CUDA machine, unless ``build`` is off)."""
    from .. import host_entry
    import torch
    if build and torch.cuda.is_available():
        host_entry.build()
    return host_entry.status()


def render(info: dict) -> str:
    lines = [f"sparsemla {info['sparsemla']}" + (f" (commit {info['sparsemla_commit']})" if info.get("sparsemla_commit") else "")]
    lines.append(f"python {info['python']}, torch {info['torch']} (CUDA {info.get('cuda_runtime') or 'none'}), "
                 f"triton {info.get('triton') or 'not installed'}")
    if info.get("cuda"):
        lines.append(f"GPU: {info['name']}, compute capability {info['compute_capability']}, "
                     f"{info['sm_count']} SMs, {info['memory_gib']} GiB, L2 {info['l2_mib']} MiB")
    else:
        interp = " (Triton kernels run in the interpreter: TRITON_INTERPRET=1)" if info.get("triton_interpret") \
            not in ("", "0", None) else ""
        lines.append(f"GPU: none — CPU only{interp}")
    peers = info.get("peers", {})
    lines.append("peers: " + "; ".join(f"{n} {'(' + v + ')' if v else 'not installed'} — {PEER_PACKAGES[n]}"
                                        for n, v in peers.items()))
    if info["registry"] != "ok":
        lines.append(f"backends: unavailable — {info['registry']}")
        return "\n".join(lines)
    lines.append("backends (probe on this machine):")
    for name, b in info["backends"].items():
        state = "usable" if b["probe"] is None else f"unusable: {b['probe']}"
        tag = " [peer]" if b["peer"] else ""
        lines.append(f"  {name:<14}{tag:<7} {state}")
        if b["description"] and b["description"] != name:
            lines.append(f"  {'':<21} {b['description']}")
    un = info.get("unavailable_kernels")
    if un:
        lines.append("kernels this Triton cannot build here (their calls run the portable Triton kernels):")
        lines += [f"  {k}: {v}" for k, v in un.items()]
    elif un is not None:
        lines.append("kernels: every kernel builds here")
    if info.get("host_entry"):
        lines.append(f"host entry (compiled; calls of a configuration seen before skip Python): {info['host_entry']}")
    ex = info["example"]
    lines.append(f"for a {ex['call']}:")
    if ex["chosen"]:
        lines.append(f"  backend=\"auto\" chooses: {ex['chosen']}")
        if ex.get("plan"):
            lines += [f"  plan: {line}" for line in ex["plan"].splitlines()]
    else:
        lines.append(f"  backend=\"auto\" finds no backend: {ex['select_error']}")
    order = ex.get("priority") or []
    for name, reason in ex["why_not"].items():
        if name == ex["chosen"]:
            continue
        if reason is None:
            if name in order and ex["chosen"] in order and order.index(name) > order.index(ex["chosen"]):
                why = f"serves it, but comes after {ex['chosen']} in the priority order ({' > '.join(order)})"
            elif order and name not in order:
                why = "serves it, but is not in the automatic priority order here (it can be forced)"
            else:
                why = "serves it (not preferred)"
        else:
            why = reason
        lines.append(f"  not {name}: {why}")
    return "\n".join(lines)


def _bad_arg(args) -> Optional[str]:
    """The first example-call flag that is out of range, as a message naming it (None when all are fine)."""
    if not 1 <= args.heads <= 128:
        return f"--heads: expected 1..128, got {args.heads}"
    if args.topk < 1:
        return f"--topk: expected >= 1, got {args.topk}"
    if args.tokens < 0:
        return f"--tokens: expected >= 0, got {args.tokens}"
    try:
        get_format(args.format, arg="--format")
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def run(args) -> int:
    bad = _bad_arg(args)
    if bad is not None:
        print(f"sparsemla info: {bad}", file=sys.stderr)
        return 2
    info = gather(args)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        print(render(info))
    return 0
