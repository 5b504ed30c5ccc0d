"""Backend registry: what each backend serves, and which one a call gets.

A *backend* is one way to compute sparse MLA attention (the native Triton kernels, the FP8-staged path,
the float64 reference, optional peers such as FlashMLA or FlashInfer).  Each declares what it can serve
(device and compute capability, KV formats, head dims, head counts, top-k widths, decode/prefill, cache
or bf16 workspace, CUDA-graph capture) and answers ``why_not(config)`` with ``None`` or one sentence.

``select(config, prefer=None)`` walks a priority list for the GPU generation (``sm90`` Hopper,
``sm100+``, another CUDA GPU, or ``cpu``) and the KV format, and returns the first backend that serves
the call.  A forced backend (``prefer="flashmla"``) that cannot serve raises ``ValueError`` quoting its
reason.  Each distinct choice is logged once (``logging``, logger ``sparsemla.backends``).

Probes (can a peer be imported, does a tiny call work) run once per process and device, and never
parse version strings: a feature is detected by using it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .. import host_entry
from ..cache import PagedKVCache
from ..formats import KVFormat, get_format

logger = logging.getLogger("sparsemla.backends")

MODES = ("decode", "prefill")
KV_SOURCES = ("cache", "workspace")
MAX_HEADS = 128


# --------------------------------------------------------------------------------------------------------
# the description of one call
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Everything a backend needs to know to say whether it can serve a call.

    mode: ``"decode"`` or ``"prefill"``.
    fmt: the KV format of the rows read (``bf16`` for a bf16 workspace).
    num_heads: query heads H (1..128).
    topk: K, the width of the index rows.
    device_type: ``"cuda"`` or ``"cpu"``; capability: ``(major, minor)`` on CUDA, else ``None``.
    kv_source: ``"cache"`` (a :class:`PagedKVCache`) or ``"workspace"`` (a bf16 ``[rows, head_dim]`` tensor).
    graph_capture: the caller will capture the call in a CUDA graph (the runner on CUDA).
    exact_host_lengths: the host knows each query's exact valid count when planning (False under
        asynchronous scheduling, when only upper bounds are known on the host).
    runner: the call comes from a :class:`SparseMLA` runner (planned on the host beforehand, buffers
        owned by the runner), not from the functional API.
    """

    mode: str
    fmt: KVFormat
    num_heads: int
    topk: int
    device_type: str = "cuda"
    capability: Optional[Tuple[int, int]] = None
    kv_source: str = "cache"
    graph_capture: bool = False
    exact_host_lengths: bool = True
    runner: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.kv_source not in KV_SOURCES:
            raise ValueError(f"kv_source: expected one of {KV_SOURCES}, got {self.kv_source!r}")
        object.__setattr__(self, "fmt", get_format(self.fmt))

    @property
    def head_dim(self) -> int:
        return self.fmt.head_dim

    @property
    def generation(self) -> str:
        return generation_of(self.device_type, self.capability)

    def describe(self) -> str:
        where = self.device_type if self.capability is None else f"sm{self.capability[0]}{self.capability[1]}"
        src = "" if self.kv_source == "cache" else " (bf16 workspace)"
        extra = " under CUDA-graph capture" if self.graph_capture else ""
        return (f"{self.mode} of {self.fmt.id}{src} on {where}, H={self.num_heads}, "
                f"head_dim={self.head_dim}, top-k={self.topk}{extra}")


def device_capability(device) -> Tuple[str, Optional[Tuple[int, int]]]:
    """(device type, compute capability or None) of a device."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda", _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())
    return device.type, None


_CAPS: Dict[int, Tuple[int, int]] = {}


def _cuda_capability(index: int) -> Tuple[int, int]:
    if index not in _CAPS:
        _CAPS[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPS[index]


def generation_of(device_type: str, capability: Optional[Tuple[int, int]]) -> str:
    """``sm90`` (Hopper), ``sm100+`` (Blackwell and later), ``cuda`` (other CUDA GPUs) or ``cpu``."""
    if device_type != "cuda" or capability is None:
        return "cpu"
    if capability[0] == 9:
        return "sm90"
    if capability[0] >= 10:
        return "sm100+"
    return "cuda"


def make_config(mode: str, q: torch.Tensor, kv, indices: torch.Tensor, *, graph_capture: Optional[bool] = None,
                exact_host_lengths: bool = True) -> AttentionConfig:
    """The config of a call on tensors (no checks beyond what the config needs; no device sync)."""
    if isinstance(kv, PagedKVCache):
        fmt, source = kv.fmt, "cache"
    else:
        fmt, source = get_format("bf16", int(kv.shape[-1]) - 512), "workspace"
    dev_type, cap = device_capability(q.device)
    if graph_capture is None:
        graph_capture = dev_type == "cuda" and torch.cuda.is_current_stream_capturing()
    return AttentionConfig(mode, fmt, int(q.shape[1]), int(indices.shape[1]), dev_type, cap, source,
                           bool(graph_capture), exact_host_lengths)


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner is sized for; given to :meth:`Backend.make_workspace` once, at construction."""

    max_tokens: int
    num_heads: int
    topk: int
    fmt: KVFormat
    device: torch.device
    block_size: int
    block_stride_rows: int
    sm_scale: float


@dataclass
class HostPlan:
    """One step as the host sees it; given to :meth:`Backend.plan` (never during capture).

    num_tokens: real query tokens (decode first, then prefill); padded_num_tokens: the token count
    ``run`` will be called with (>= num_tokens; tokens past num_tokens have no valid entry).
    num_decode_tokens: the first tokens that are decode tokens.
    host_counts: each real token's valid count (a list of ints) when the host knows them exactly,
        else None (asynchronous scheduling: only the device knows them).
    valid_counts: the runner's int32 device buffer ``[max_tokens]`` that holds the exact counts.
    """

    num_tokens: int
    padded_num_tokens: int
    num_decode_tokens: int
    host_counts: Optional[List[int]]
    valid_counts: torch.Tensor


# --------------------------------------------------------------------------------------------------------
# the backend interface
# --------------------------------------------------------------------------------------------------------
class Backend:
    """Base class of every backend.  Subclasses set the capability attributes and implement ``_run``.

    Capability attributes (checked by :meth:`why_not`, in this order):
        device_types: device types served (``("cuda",)``, ``("cuda", "cpu")``).
        min_capability / max_capability: inclusive compute-capability range on CUDA (None = open).
        formats: format ids served (``"fp8_ds_mla"``, ``"bf16-nope"``, ...); None = every format.
        modes: ``"decode"`` and/or ``"prefill"``.
        kv_sources: ``"cache"`` and/or ``"workspace"``.
        head_counts: (lowest, highest) H served.
        topk_multiple, max_topk: K must be a multiple of ``topk_multiple`` and at most ``max_topk``.
        graph_safe: a call launches only device work, with no host sync and no allocation when the
            runner passes its buffers (so a CUDA graph can capture it).
        device_valid_counts: can apply per-query valid counts that only the device knows.
        mixed_batches: one call serves decode and prefill tokens alike (the runner then makes one call).
        needs_host_counts: its :meth:`plan` needs each query's exact valid count on the host.
    """

    name: str = ""
    description: str = ""
    device_types: Tuple[str, ...] = ("cuda",)
    min_capability: Optional[Tuple[int, int]] = None
    max_capability: Optional[Tuple[int, int]] = None
    formats: Optional[Tuple[str, ...]] = None
    modes: Tuple[str, ...] = MODES
    kv_sources: Tuple[str, ...] = KV_SOURCES
    head_counts: Tuple[int, int] = (1, MAX_HEADS)
    topk_multiple: int = 1
    max_topk: Optional[int] = None
    graph_safe: bool = False
    device_valid_counts: bool = True
    mixed_batches: bool = False
    needs_host_counts: bool = False  # its plan() needs each query's valid count on the host

    def __init__(self):
        self._probe_lock = threading.Lock()
        self._probe_cache: Dict[object, Optional[str]] = {}

    # --- availability ------------------------------------------------------------------------
    def probe(self, config: Optional[AttentionConfig] = None) -> Optional[str]:
        """None when the backend's code is usable for ``config`` (imports, features, a tiny call), else why not.
        Cached per :meth:`probe_key`."""
        key = self.probe_key(config)
        with self._probe_lock:
            if key not in self._probe_cache:
                try:
                    self._probe_cache[key] = self._probe(config)
                except Exception as exc:  # a probe must never take the caller down
                    self._probe_cache[key] = f"its probe failed: {type(exc).__name__}: {exc}"
            return self._probe_cache[key]

    def probe_key(self, config: Optional[AttentionConfig]):
        return None

    def _probe(self, config: Optional[AttentionConfig]) -> Optional[str]:
        return None

    # --- capability ----------------------------------------------------------------------------
    def why_not(self, config: AttentionConfig) -> Optional[str]:
        """None when this backend serves ``config``, else one sentence saying why it does not."""
        reason = self._declared_why_not(config)
        if reason is None:
            reason = self._extra_why_not(config)
        if reason is None:
            reason = self.probe(config)
        return reason

    def serves(self, config: AttentionConfig) -> bool:
        return self.why_not(config) is None

    def _declared_why_not(self, c: AttentionConfig) -> Optional[str]:
        if c.device_type not in self.device_types:
            names = " or ".join(_DEVICE_NAMES.get(d, d) for d in self.device_types)
            return f"it runs on {names} devices, not {_DEVICE_NAMES.get(c.device_type, c.device_type)}"
        if c.device_type == "cuda" and c.capability is not None:
            cap = tuple(c.capability)
            if self.min_capability is not None and cap < tuple(self.min_capability):
                return f"it needs compute capability >= {_cap(self.min_capability)}, this GPU is {_cap(cap)}"
            if self.max_capability is not None and cap > tuple(self.max_capability):
                return f"it needs compute capability <= {_cap(self.max_capability)}, this GPU is {_cap(cap)}"
        if self.formats is not None and c.fmt.id not in self.formats:
            return f"it reads only {', '.join(self.formats)} rows, not {c.fmt.id}"
        if c.mode not in self.modes:
            return f"it has no {c.mode} kernel"
        if c.kv_source not in self.kv_sources:
            what = "a bf16 workspace" if c.kv_source == "workspace" else "a paged cache"
            return f"it cannot read {what}"
        lo, hi = self.head_counts
        if not lo <= c.num_heads <= hi:
            return f"it serves {lo}..{hi} query heads, not {c.num_heads}"
        if c.topk < 1:
            return f"it needs a top-k width >= 1, got {c.topk}"
        if c.topk % self.topk_multiple:
            return f"it needs a top-k width that is a multiple of {self.topk_multiple}, got {c.topk}"
        if self.max_topk is not None and c.topk > self.max_topk:
            return f"it serves top-k widths up to {self.max_topk}, got {c.topk}"
        if c.graph_capture and not self.graph_safe:
            return "it cannot be captured in a CUDA graph (it syncs with the host or allocates)"
        if not c.exact_host_lengths and not self.device_valid_counts:
            return ("it needs each query's exact length on the host when planning, and only upper bounds "
                    "are known (asynchronous scheduling)")
        return None

    def _extra_why_not(self, config: AttentionConfig) -> Optional[str]:
        """Backend-specific rules beyond the declared attributes."""
        return None

    # --- running --------------------------------------------------------------------------------
    def forward(self, mode: str, q: torch.Tensor, kv, indices: torch.Tensor, sm_scale: float,
                valid_counts: Optional[torch.Tensor], k_scale: float, out: Optional[torch.Tensor],
                lse: Optional[torch.Tensor], workspace=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Compute attention for validated arguments (see ``sparsemla.attention``).

        q bf16 ``[T, H, D]``; kv a PagedKVCache or a bf16 ``[rows, D]`` workspace; indices int32 ``[T, K]``;
        valid_counts int32 ``[T]`` or None; out bf16 ``[T, H, 512]`` / lse fp32 ``[T, H]`` or None;
        workspace: what :meth:`make_workspace` returned, when called by the runner.
        Returns ``(out, lse)``.
        """
        raise NotImplementedError

    # --- runner hooks ---------------------------------------------------------------------------
    def make_workspace(self, spec) -> object:
        """Allocate the device buffers this backend needs inside a :class:`SparseMLA` runner (``spec``: a
        ``RunnerSpec``).  Called once, at construction."""
        return None

    def plan(self, workspace, host) -> None:
        """Host-side planning for one step (``host``: a :class:`HostPlan`).  Never called during capture."""
        return None

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"


_DEVICE_NAMES = {"cuda": "CUDA", "cpu": "CPU"}


def _cap(c) -> str:
    return f"{c[0]}.{c[1]}"


# --------------------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------------------
_BACKENDS: Dict[str, Backend] = {}
BUILTIN = ("triton", "triton-portable", "triton-staged", "reference", "flashmla", "flashinfer", "triton-fp8qk")  # list order

# Priority per GPU generation; a format may override it.  Backends left out of a list are never chosen
# automatically there (they can still be forced).  Native first: it reads every format in registers;
# peers next (optional installs, each serves a narrow slice); the FP8-staged path is our compatibility
# route; the float64 reference is the last resort (correct everywhere, slow).
PRIORITY: Dict[str, Tuple[str, ...]] = {
    "sm90": ("triton", "flashmla", "flashinfer", "triton-staged", "reference"),
    "sm100+": ("triton", "flashinfer", "triton-staged", "reference"),
    "cuda": ("triton", "triton-staged", "reference"),
    # On CPU the Triton kernels run only in the (slow) interpreter: the reference is the right default.
    "cpu": ("reference", "triton", "triton-staged"),
}
FORMAT_PRIORITY: Dict[Tuple[str, str], Tuple[str, ...]] = {
    # FlashInfer is the strongest peer on a bf16 or plain fp8 cache, FlashMLA on fp8_ds_mla.
    ("sm90", "bf16"): ("triton", "flashinfer", "flashmla", "triton-staged", "reference"),
    ("sm90", "fp8"): ("triton", "flashinfer", "triton-staged", "reference"),
    ("sm90", "fp8_ds_mla"): ("triton", "flashmla", "triton-staged", "reference"),
    ("sm90", "nvfp4_ds_mla"): ("triton", "triton-staged", "reference"),
}

_select_lock = threading.Lock()
_selected: Dict[Tuple[AttentionConfig, Optional[str]], Backend] = {}
_logged: set = set()


def register(backend: Backend, *, replace_existing: bool = False) -> Backend:
    """Add a backend to the registry (names are unique)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend: expected a Backend instance, got {type(backend).__name__}")
    if not backend.name:
        raise ValueError("backend: its name must be a non-empty string")
    if backend.name in _BACKENDS and not replace_existing:
        raise ValueError(f"backend: a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    host_entry.clear()  # "auto" may now choose it
    with _select_lock:
        _selected.clear()
        _calls.clear()
    return backend


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``."""
    if isinstance(name, Backend):
        return name
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name (str), got {type(name).__name__}")
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; known: {sorted(_BACKENDS)} or 'auto'")
    return _BACKENDS[name]


def list_backends(config: Optional[AttentionConfig] = None) -> Dict[str, Optional[str]]:
    """Every registered backend (the built-in ones first, then others in registration order), mapped to None when it serves ``config`` (or,
    with no config, when its code is usable on this machine) and otherwise to the reason it does not."""
    names = [n for n in BUILTIN if n in _BACKENDS] + [n for n in _BACKENDS if n not in BUILTIN]
    if config is None:
        return {name: _BACKENDS[name].probe(None) for name in names}
    return {name: _BACKENDS[name].why_not(config) for name in names}


def priority_for(config: AttentionConfig) -> Tuple[str, ...]:
    gen = config.generation
    return FORMAT_PRIORITY.get((gen, config.fmt.name), PRIORITY[gen])


def select(config: AttentionConfig, prefer=None) -> Backend:
    """The backend to use for ``config``.

    prefer: None or ``"auto"`` (walk the priority order), a backend name or a :class:`Backend` (forced:
    raises ``ValueError`` quoting its reason when it cannot serve ``config``).
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config: expected an AttentionConfig, got {type(config).__name__}")
    forced = None
    if prefer is not None and not (isinstance(prefer, str) and prefer == "auto"):
        forced = get_backend(prefer)
    key = (config, None if forced is None else forced.name)
    with _select_lock:
        hit = _selected.get(key)
    if hit is not None:
        return hit
    if forced is not None:
        reason = forced.why_not(config)
        if reason is not None:
            raise ValueError(f"backend {forced.name!r} cannot serve this call ({config.describe()}): {reason}")
        chosen = forced
    else:
        chosen = None
        reasons: List[str] = []
        for name in priority_for(config):
            b = _BACKENDS.get(name)
            if b is None:
                continue
            reason = b.why_not(config)
            if reason is None:
                chosen = b
                break
            reasons.append(f"{name}: {reason}")
        if chosen is None:
            raise ValueError(f"no backend serves {config.describe()}; " + "; ".join(reasons))
    with _select_lock:
        _selected[key] = chosen
        if key not in _logged:
            _logged.add(key)
            how = "forced" if forced is not None else "auto"
            logger.info("sparsemla: %s -> backend %r (%s)", config.describe(), chosen.name, how)
    return chosen


_calls: Dict[tuple, Tuple[KVFormat, Backend]] = {}


def select_call(mode: str, fmt: KVFormat, num_heads: int, topk: int, device: torch.device, kv_source: str,
                capturing: bool, prefer) -> Backend:
    """:func:`select` for a functional call, cached on plain values (no config object on a repeated call)."""
    # the format by identity (hashing a format is a Python call), checked on a hit; a backend object by identity
    key = (mode, id(fmt), num_heads, topk, device, kv_source, capturing,
           prefer if type(prefer) is str or prefer is None else id(prefer))
    hit = _calls.get(key)
    if hit is None or hit[0] is not fmt:
        dev_type, cap = device_capability(device)
        config = AttentionConfig(mode, fmt, num_heads, topk, dev_type, cap, kv_source, capturing, True)
        hit = (fmt, select(config, prefer))
        with _select_lock:
            _calls[key] = hit
    return hit[1]


def clear_selection_cache() -> None:
    """Forget cached choices and probe results (tests; after installing a peer in a running process)."""
    with _select_lock:
        _selected.clear()
        _logged.clear()
        _calls.clear()
    host_entry.clear()
    for b in _BACKENDS.values():
        with b._probe_lock:
            b._probe_cache.clear()
