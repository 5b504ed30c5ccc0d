"""The tools' view of the backend registry (``sparsemla.backends``) and of the public attention API.

The CLI and the benchmark runner reach backends only through this module, so a registry or API that
is missing (or broken) on some machine degrades to a clear one-line message instead of a traceback.

Two ways to time a backend (``make_call``):

* ``"runner"`` (default): the way an engine's ``SparseMLA`` runner calls it — ``make_workspace`` once,
  ``plan`` on the host, then the timed call is ``backend.forward(..., workspace)`` with preallocated
  outputs.  One-time host work (buffers, peers' plans) stays outside the timed region, as in serving.
* ``"api"``: the public functional API, ``sparse_mla_decode(..., backend=name, out=out, check=False)`` /
  ``sparse_mla_prefill`` (argument checks and backend selection on every call; the index-range check,
  which reads indices on the host, is off).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..formats import KVFormat, get_format

# Our own backends; anything else in the registry is a peer unless its ``is_peer`` says otherwise.
OWN_BACKENDS = ("triton", "triton-portable", "triton-fp8qk", "triton-staged", "reference")
PEER_BACKENDS = ("flashmla", "flashinfer")  # third-party kernels behind the same interface
# Not performance paths: timed only when asked for by name.
NOT_TIMED = ("reference",)
# The PyTorch floor of benchmarking.md, provided by bench/baseline.py, not by the registry.
TORCH_BASELINE = "torch-gather"
CALL_PATHS = ("runner", "api")


class Unavailable(RuntimeError):
    """A part of the library the tools need is not importable (yet); the message says which."""


@dataclass(frozen=True)
class Problem:
    """One attention call as the tools describe it: kind (``decode``/``prefill``), format, H, K, T, device."""

    kind: str
    fmt: KVFormat
    num_heads: int
    topk: int
    num_tokens: int
    device: torch.device

    def describe(self) -> str:
        return (f"{self.kind} of {self.fmt.id}, {self.num_tokens} tokens x {self.num_heads} heads, "
                f"top-k {self.topk}, on {self.device}")


def make_problem(kind: str, fmt, num_heads: int, topk: int, num_tokens: int = 1, device=None) -> Problem:
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    return Problem(kind, get_format(fmt), int(num_heads), int(topk), int(num_tokens), device)


# --- importing -----------------------------------------------------------------------------------------

def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or an error inside a half-written module
        raise Unavailable(f"{name} is not available ({type(e).__name__}: {e})") from e


def registry():
    """The ``sparsemla.backends`` module, or :class:`Unavailable`."""
    return _import("sparsemla.backends")


def attention_api():
    """The ``sparsemla.attention`` module, or :class:`Unavailable`."""
    return _import("sparsemla.attention")


def registry_status() -> Tuple[bool, str]:
    """(usable, a line saying what is missing when not)."""
    try:
        reg = registry()
        missing = [n for n in ("list_backends", "get_backend", "select", "AttentionConfig") if not hasattr(reg, n)]
        if missing:
            return False, f"sparsemla.backends has no {', '.join(missing)}"
        reg.list_backends()
    except Exception as e:
        return False, str(e) if isinstance(e, Unavailable) else f"sparsemla.backends failed: {type(e).__name__}: {e}"
    return True, "sparsemla.backends"


# --- what the registry knows ---------------------------------------------------------------------------

def backend_names() -> List[str]:
    """Every registered backend (ours and peers, installed or not), in the registry's order."""
    return list(registry().list_backends().keys())


def get_backend(name: str):
    return registry().get_backend(name)


def is_peer(name: str) -> bool:
    """True for the third-party backends (FlashMLA, FlashInfer, or one that declares ``is_peer = True``) and
    the PyTorch floor; the library's own backends (every ``triton*`` one, ``reference``) are not peers."""
    if name == TORCH_BASELINE or name in PEER_BACKENDS:
        return True
    if name in OWN_BACKENDS or name.startswith("triton"):
        return False
    try:
        return getattr(get_backend(name), "is_peer", False) is True
    except Exception:
        return False


def describe(name: str) -> str:
    if name == TORCH_BASELINE:
        return "PyTorch gather + two bmm (the floor of docs/benchmarking.md; bf16 caches)"
    try:
        return str(getattr(get_backend(name), "description", "")) or name
    except Exception:
        return name


def to_registry_config(problem: Problem):
    """The registry's ``AttentionConfig`` for ``problem`` (paged cache, not under graph capture)."""
    reg = registry()
    dev = problem.device
    cap = None
    if dev.type == "cuda":
        cap = tuple(torch.cuda.get_device_capability(dev))
    return reg.AttentionConfig(mode=problem.kind, fmt=problem.fmt, num_heads=problem.num_heads, topk=problem.topk,
                               device_type=dev.type, capability=cap)


def probe(name: str) -> Optional[str]:
    """None when backend ``name``'s code is usable on this machine, else why not."""
    if name == TORCH_BASELINE:
        return None
    try:
        return get_backend(name).probe(None)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def why_not(name: str, problem: Problem) -> Optional[str]:
    """None when backend ``name`` can serve ``problem`` here, else its one-sentence reason."""
    if name == TORCH_BASELINE:
        from .baseline import why_not as baseline_why_not
        return baseline_why_not(problem)
    try:
        return get_backend(name).why_not(to_registry_config(problem)) or None
    except Exception as e:
        return str(e) if isinstance(e, Unavailable) else f"why_not failed: {type(e).__name__}: {e}"


def select(problem: Problem) -> Tuple[Optional[str], Dict[str, Optional[str]], Optional[str]]:
    """(auto-selected backend or None, {backend: None if it could serve else why not}, error of select or None)."""
    cfg = to_registry_config(problem)
    reg = registry()
    reasons = dict(reg.list_backends(cfg))
    try:
        return reg.select(cfg).name, reasons, None
    except Exception as e:
        return None, reasons, f"{type(e).__name__}: {e}"


def priority(problem: Problem) -> Tuple[str, ...]:
    """The registry's priority order for ``problem`` (empty when it has none to show)."""
    reg = registry()
    fn = getattr(reg, "priority_for", None) or getattr(getattr(reg, "registry", None), "priority_for", None)
    try:
        return tuple(fn(to_registry_config(problem))) if callable(fn) else ()
    except Exception:
        return ()


# Output tolerances against float64 over the cache's own rows: (relative L2 error of out, max |lse error|).
EXACT_TOLERANCE = (1e-2, 1e-2)
# A path that re-quantizes rows (the FP8 staging gather) is exact only for rows that already hold e4m3
# values; for bf16 and nvfp4 rows its error is the e4m3 rounding (~2.6 % per value), so it is only
# checked against gross errors here (its precision is tested against an fp8-requantized reference).
# With heavy-tailed queries a 2-3 % change of the values moves the lse by whole units, so a lossy path's
# lse is reported, not bounded (staged nvfp4 rows move it by 0.3-1.4 on the bench workload).
LOSSY_TOLERANCE = (1.5e-1, float("inf"))
# fp8_ds_mla rows are e4m3 times a power of two: staging them to plain e4m3 is exact only where the
# product stays in e4m3's range, and tiles with small scales fall below its subnormals.
_E4M3_EXACT = ("fp8",)
# The PyTorch floor computes in bf16: its lse carries bf16 rounding of the scores.
TORCH_TOLERANCE = (1e-2, 1e-1)


def tolerance(name: str, fmt) -> tuple:
    """(out relative error, lse error) a backend must meet on ``fmt`` rows vs the float64 reference.

    A backend may declare its own with ``tolerance(fmt) -> (rel, lse)``."""
    fmt = get_format(fmt)
    if name != TORCH_BASELINE:
        try:
            fn = getattr(get_backend(name), "tolerance", None)
            if callable(fn):
                return tuple(fn(fmt))
        except Exception:
            pass
    if name == "triton-staged" and fmt.name not in _E4M3_EXACT:
        return LOSSY_TOLERANCE
    if name == TORCH_BASELINE:
        return TORCH_TOLERANCE
    return EXACT_TOLERANCE


# --- calling -------------------------------------------------------------------------------------------

def make_call(name: str, kind: str, q, cache, indices, sm_scale: float, valid_counts=None, k_scale: float = 1.0,
              *, path: str = "runner") -> Tuple[Callable[[], Tuple[torch.Tensor, torch.Tensor]], str]:
    """(a zero-argument callable returning ``(out, lse)``, the path it uses).

    ``path="runner"`` falls back to ``"api"`` for a backend without runner hooks; the returned path
    says which one was taken.
    """
    if path not in CALL_PATHS:
        raise ValueError(f"path: expected one of {CALL_PATHS}, got {path!r}")
    if name == TORCH_BASELINE:
        from .baseline import torch_gather_attention
        return (lambda: torch_gather_attention(q, cache, indices, sm_scale, valid_counts, k_scale)), "torch"
    t, h = q.shape[0], q.shape[1]
    # Poisoned (NaN) so that the first call's output, which the runner verifies, cannot pass by leftovers.
    out = torch.full((t, h, 512), float("nan"), dtype=q.dtype, device=q.device)
    if path == "runner":
        b = get_backend(name)
        if callable(getattr(b, "forward", None)) and callable(getattr(b, "make_workspace", None)):
            reg = registry()
            lse = torch.full((t, h), float("nan"), dtype=torch.float32, device=q.device)
            if valid_counts is None:
                valid_counts = (indices >= 0).sum(dim=1).to(torch.int32)  # the workloads' indices are prefix-valid
            known = dict(max_tokens=t, num_tokens=t, padded_num_tokens=t, num_heads=h, topk=indices.shape[1],
                         fmt=cache.fmt, device=q.device, block_size=cache.block_size, head_dim=q.shape[2],
                         block_stride_rows=cache.block_stride_rows, sm_scale=sm_scale, k_scale=k_scale,
                         num_decode_tokens=t if kind == "decode" else 0, host_counts=valid_counts.tolist(),
                         valid_counts=valid_counts, mode=kind)
            ws = b.make_workspace(_build(reg.RunnerSpec, known))
            b.plan(ws, _build(reg.HostPlan, known))
            return (lambda: b.forward(kind, q, cache, indices, sm_scale, valid_counts, k_scale, out, lse, ws)), "runner"
    api = attention_api()
    fn = api.sparse_mla_decode if kind == "decode" else api.sparse_mla_prefill
    # check=False: the index-range check reads the indices on the host (a device sync) on every call;
    # an engine validates once, so the timed call skips it.
    return (lambda: fn(q, cache, indices, sm_scale, valid_counts, k_scale, backend=name, out=out,
                       check=False)), "api"


def _build(cls, known: dict):
    """Construct the registry's dataclass ``cls`` from the values we know, by field name (the runner
    hooks' records may grow fields; a required one we cannot fill is reported, not guessed)."""
    kwargs, missing = {}, []
    for f in dataclasses.fields(cls):
        if f.name in known:
            kwargs[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    if missing:
        raise Unavailable(f"cannot build sparsemla.backends.{cls.__name__} for timing: no value for {missing}")
    return cls(**kwargs)


def auto_call(kind: str, q, cache, indices, sm_scale: float, valid_counts=None, k_scale: float = 1.0):
    """The public API with ``backend="auto"`` (what a user gets)."""
    api = attention_api()
    fn = api.sparse_mla_decode if kind == "decode" else api.sparse_mla_prefill
    return lambda: fn(q, cache, indices, sm_scale, valid_counts, k_scale, backend="auto")


__all__ = ["Problem", "make_problem", "Unavailable", "registry", "attention_api", "registry_status",
           "backend_names", "get_backend", "is_peer", "describe", "why_not", "probe", "select", "priority",
           "make_call", "auto_call", "tolerance", "EXACT_TOLERANCE", "LOSSY_TOLERANCE", "OWN_BACKENDS", "PEER_BACKENDS", "NOT_TIMED", "TORCH_BASELINE", "CALL_PATHS"]
