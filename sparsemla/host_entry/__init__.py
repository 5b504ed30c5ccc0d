"""The compiled host entry of ``sparse_mla_decode`` / ``sparse_mla_prefill`` over a :class:`~sparsemla.PagedKVCache`
and of :meth:`SparseMLA.run <sparsemla.SparseMLA.run>`.

An engine that runs attention eagerly (vLLM's piecewise CUDA graphs: prefill and mixed steps) pays a call's host
time on every layer.  In Python that time is mostly the interpreter's: checking about 30 tensor properties,
allocating ``out`` / ``lse`` and building the launches' argument lists.  ``entry.cpp`` does the same for a call
whose configuration the Python path has served before.  The first call of a configuration goes through Python --
every argument checked, the backend chosen, the plan made, the kernels compiled -- and, where it made only direct
launches (:mod:`sparsemla.kernels.launch`), the launch sites record them (:class:`Recording`); later calls check
what the host knows in C++, allocate, and call Triton's launch functions with the same arguments the Python path
would pass.

- Functional calls: the configuration is the mode, the format, the backend argument (``"auto"``, a name or a
  backend object, by identity), q's shape and strides, the indices' width and row stride, which of valid_counts /
  out / lse are given and their strides, the device and the stream.
- ``SparseMLA.run``: the runner and its planned step, q's shape and strides, topk_local's width and strides, the
  given out / lse strides, the cache's format and geometry, the device and the stream.  A step is recorded at its
  first layer and replayed at the others (a mixed step's two attention calls too: the prefill tokens' call reads
  q and the outputs at a fixed offset, recorded where those rows are 16-byte aligned); a step that upconverts
  into a bf16 workspace takes the Python path.
  :meth:`SparseMLA.plan` drops the previous step's records.
- The vLLM plugin's ``LayerAttention.forward`` (native backend): the workspace, the layers' shared settings, the
  token count, q's form (one tensor or the ``(ql_nope, q_pe)`` pair) and strides, the indices' width and row stride,
  the cache tensor's geometry, the device and the stream; the first layer of a step records, the others replay,
  and the workspace's output views are returned.

A call the entry does not handle (a wrong argument, ``check=True``, a backend other than the library's kernels, a
bf16 workspace, a CUDA-graph capture, a profiler's launch hook, an unaligned tensor, ...) takes the Python path,
which raises where the arguments are wrong: the behaviour is the Python path's in every case.

The entry is a CPython extension built against the installed torch with the machine's C++ compiler and cached
(``~/.cache/sparsemla/host_entry``, per source digest, torch version and Python).  The first call on a CUDA tensor
loads a cached build, or starts the build (about 15 s) in a background thread: no call waits for the compiler, and
the calls made meanwhile take the Python path.  Where it cannot be built, every call takes the Python path and :func:`status` says why.
``SPARSEMLA_HOST_ENTRY=0`` in the environment (read when the entry is first loaded), or :func:`disable`, keeps every
call on the Python path; ``sparsemla info`` shows the state (and on a CUDA machine builds the entry first);
:func:`build` builds it ahead of time.
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Optional

# What a template slot of a recorded launch takes per call (entry.cpp: enum Slot, the same order).
SLOTS = ("const", "q", "q_rope", "rows", "indices", "valid_counts", "out", "lse", "scale", "k_scale", "topk")
SLOT = {name: i for i, name in enumerate(SLOTS)}
# The per-call values of each entry: the functional calls', and SparseMLA.run's (its indices, counts and scale are
# the runner's own, fixed for a planned step; its topk_local is per call).
CALL_SLOTS = frozenset(("q", "q_rope", "rows", "indices", "valid_counts", "out", "lse", "scale", "k_scale"))
RUN_SLOTS = frozenset(("q", "q_rope", "rows", "out", "lse", "k_scale", "topk"))
# A vLLM layer's call takes the functional call's values (its outputs are the workspace's views for its token count).
LAYER_SLOTS = CALL_SLOTS
ENV = "SPARSEMLA_HOST_ENTRY"

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "entry.cpp")
_lock = threading.Lock()
_module = None
_reason: Optional[str] = "not loaded yet (the first call on a CUDA tensor loads it, or starts its build)"
_disabled = False
_start_lock = threading.Lock()
_builder: Optional[threading.Thread] = None  # the background build started by a first call (see _ready)


def _after_fork_in_child() -> None:
    """A process forked while the build ran has no builder thread, and its locks may be held by it: start afresh
    (the next call starts the build again, or loads what the parent built meanwhile)."""
    global _lock, _start_lock, _builder
    _lock, _start_lock, _builder = threading.Lock(), threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_pending = threading.local()  # the recording of the call the Python path serves (see :func:`begin`)
# The launcher's per-thread state (sparsemla.kernels.attention; ``per_call``: split partials per call, the custom
# ops), here so that the entry reads it without importing the launcher.
LAUNCHER_STATE = threading.local()


def _first_call(mode, q, *rest):
    """``call`` until the entry is loaded: a call on a CUDA tensor loads it and uses it, or, where it must be
    compiled first, starts that in the background and takes the Python path meanwhile."""
    if getattr(q, "is_cuda", False) is not True or not _ready():
        return None  # CPU calls (the interpreter) never need the entry
    return call(mode, q, *rest)


def _first_run(runner, q, *rest):
    """``run`` until the entry is loaded (as :func:`_first_call`)."""
    if getattr(q, "is_cuda", False) is not True or not _ready():
        return None
    return run(runner, q, *rest)


def _first_layer(ws, config, q, *rest):
    """``layer`` until the entry is loaded (as :func:`_first_call`; q may be a pair)."""
    q0 = q[0] if type(q) is tuple and q else q
    if getattr(q0, "is_cuda", False) is not True or not _ready():
        return None
    return layer(ws, config, q, *rest)


def _ready() -> bool:
    """Whether the entry points are installed now.  A built entry (cached) loads here, in milliseconds; one that must
    be compiled first (about 15 s) is built by a background thread, which installs it when done: no call waits for
    the compiler, the calls meanwhile take the Python path."""
    global _builder
    if _builder is not None or _disabled:  # being built (the builder installs it)
        return False
    if _module is not None or _env_off() or os.path.exists(_path()):
        _install(load())
        return _module is not None
    with _start_lock:  # (not _lock: the build holds that one while it compiles)
        if _builder is None:
            _builder = threading.Thread(target=_build_in_background, name="sparsemla-host-entry", daemon=True)
            _builder.start()
    return False


def _build_in_background() -> None:
    global _builder
    m = load()
    with _lock:
        if not _disabled:
            _install(m)  # (None: it could not be built; every call takes the Python path, status() says why)
        _builder = None


def _env_off() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no")


def _install(m) -> None:
    global call, run, layer
    call, run, layer = (m.call, m.run, m.layer) if m is not None else (_no_entry, _no_entry, _no_entry)


def _no_entry(*args):
    return None


# call(mode, q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check): (out, lse) when the call
# was replayed; bytes (the configuration's key) when the Python path must serve it and may record it; None when
# the Python path serves it.  mode: 0 decode, 1 prefill.
call = _first_call
# run(runner, q, cache, topk_local, k_scale, out, lse): the same for SparseMLA.run.
run = _first_run
# layer(workspace, config, q, kv_cache, indices, valid_counts, sm_scale, k_scale): the same for one vLLM layer's call
# (sparsemla.integrations.vllm.LayerAttention, native backend); q: a tensor or the (ql_nope, q_pe) pair.
layer = _first_layer


def _name() -> str:
    import torch
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
    return f"sparsemla_host_entry_{digest}"


def load():
    """The extension module, built first if needed; None where it is disabled or cannot be built (:func:`status`
    says why)."""
    global _module, _reason
    with _lock:
        if _module is not None or _disabled:
            return _module
        if _env_off():
            _reason = f"disabled ({ENV}={os.environ[ENV]})"
            return None
        try:
            m = _build()
            _configure(m, allow_cpu=False)
        except Exception as exc:  # no compiler, headers missing: the Python path serves every call
            text = str(exc).strip().splitlines()
            _reason = f"could not be built: {type(exc).__name__}: {text[-1][:300] if text else ''}"
            return None
        _module, _reason = m, None
        return m


def _path() -> str:
    """Where the extension of this source and torch build is cached."""
    import sysconfig
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                          "sparsemla", "host_entry")
    return os.path.join(folder, _name() + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _build():
    """Compile entry.cpp into the cache folder (once per source digest and torch build) and import it."""
    import importlib.util
    import shutil
    import subprocess
    import sys
    import sysconfig
    import tempfile

    import torch
    from torch.utils import cpp_extension

    name = _name()
    path = _path()
    folder = os.path.dirname(path)
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), "c++")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", _SOURCE, "-o", tmp,
               f"-DTORCH_EXTENSION_NAME={name}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               f"-I{sysconfig.get_paths()['include']}", *(f"-I{p}" for p in cpp_extension.include_paths()),
               f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]  # (loaded by `import torch` first)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, path)  # atomic: processes building side by side each install a whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    sys.modules.setdefault(name, m)
    return m


def _configure(m, *, allow_cpu: bool = False, **probes) -> None:
    """Give the entry what it reads of the process: torch's current device, stream and capture state, Triton's
    launch hooks, the launcher's thread-local state (``probes``: stand-ins, in tests)."""
    import torch
    from triton import knobs

    from .._device import current_cuda_index, stream_capturing
    from .._validate import SCALE_MAX, SCALE_MIN
    from ..cache import PagedKVCache
    p = dict(get_device=current_cuda_index,
             get_stream=getattr(torch._C, "_cuda_getCurrentRawStream", None) or _raw_stream,
             capturing=stream_capturing, runtime=knobs.runtime, local=LAUNCHER_STATE)
    p.update(probes)
    m.configure(PagedKVCache, p["get_device"], p["get_stream"], p["capturing"], p["runtime"], p["local"],
                float(SCALE_MIN), float(SCALE_MAX), allow_cpu)


def _raw_stream(index: int) -> int:
    import torch
    return torch.cuda.current_stream(index).cuda_stream


def build():
    """Build (or load) the entry now, e.g. in a container image, so that no serving process builds it."""
    return load()


def disable() -> None:
    """Every later call takes the Python path (recorded configurations are dropped)."""
    global _disabled, _reason
    with _lock:
        _disabled = True
        _install(None)
        _reason = "disabled (sparsemla.host_entry.disable())"
        if _module is not None:
            _module.clear()


def enable() -> None:
    """Undo :func:`disable` (the entry loads at the next call on a CUDA tensor)."""
    global _disabled, call, run, layer, _reason
    with _lock:
        _disabled = False
        if _module is not None:
            _install(_module)
        else:
            call, run, layer = _first_call, _first_run, _first_layer
            _reason = "not loaded yet (the first call on a CUDA tensor loads it, or starts its build)"


def status() -> str:
    """One line: whether calls use the entry, or why not."""
    if _module is not None and not _disabled:
        return f"in use ({_module.size()} recorded configurations)"
    if _builder is not None:
        return "being built in the background (calls take the Python path meanwhile)"
    return _reason or "not loaded"


def clear() -> None:
    """Forget every recorded configuration (the plan's inputs changed: a kernel found unavailable, the backends or
    the selection cache changed, a split-partials buffer replaced)."""
    if _module is not None:
        _module.clear()


def forget(owner) -> None:
    """Forget the records of a :class:`~sparsemla.SparseMLA` (its next step is planned, or it is gone) or of a vLLM
    workspace (it is gone)."""
    forget_id(id(owner))


def forget_id(owner_id: int) -> None:
    if _module is not None:
        _module.forget(owner_id)


# --- recording (the Python path's side) --------------------------------------------------------------------------
class Recording:
    """The launches of one call the Python path serves, for the entry to replay under ``key``: each launch site
    adds its launch with the positions of its per-call values (:meth:`add`); a launch that cannot be recorded (one
    through Triton's regular path, a value not where its site says) spoils the recording, and nothing is kept.
    ``bases``: the call's own addresses that a launch's values may lie at an offset from (a runner's mixed step
    launches its prefill tokens' call on q's and the outputs' later rows); a value without a base is the slot's.
    ``qr_own``: q's RoPE part is a tensor of its own (a vLLM layer's (ql_nope, q_pe) pair), whose address the entry
    takes per call; otherwise it lies ``qr_offset`` bytes after q's."""

    __slots__ = ("key", "slots", "launches", "keep", "qr_offset", "ok", "bases", "qr_own")

    def __init__(self, key: bytes, slots: frozenset, qr_own: bool = False):
        self.key, self.slots = key, slots
        self.launches: list = []
        self.keep: list = []
        self.qr_offset = 0
        self.ok = True
        self.bases: dict = {}
        self.qr_own = qr_own

    def add(self, go, grid, stream, addrs: tuple, positions: dict, values: dict) -> None:
        """One direct launch (``go`` of :mod:`sparsemla.kernels.launch`, on ``grid`` and ``stream`` with ``addrs``):
        ``positions`` maps argument positions to slot names, ``values`` the slots to this call's values.  Slots
        this recording does not take per call are constants.  In the record a slot's position holds its offset
        from the slot's value (entry.cpp adds it)."""
        parts = getattr(go, "parts", None)
        if parts is None or not self.ok:
            self.ok = False
            return
        kinds = [0] * len(addrs)
        vals = list(addrs)
        for i, name in positions.items():
            if name in self.slots:
                v = values[name]
                if not (type(addrs[i]) is type(v) and addrs[i] == v):
                    self.ok = False
                    return
                kinds[i] = SLOT[name]
                vals[i] = v - self.bases[name] if name in self.bases else 0
        fn, head, tail, packed = parts
        lead = (*grid, stream, *head)
        if packed:
            self.launches.append((fn, lead, (0,) * len(lead), (*vals, *tail), (*kinds, *(0,) * len(tail))))
        else:
            self.launches.append((fn, (*lead, *vals, *tail), (*(0,) * len(lead), *kinds, *(0,) * len(tail)),
                                  None, None))


def begin(key: bytes, slots: frozenset = CALL_SLOTS, qr_own: bool = False) -> Recording:
    """The Python path serves a call the entry may record under ``key``; the launch sites add to the recording."""
    rec = _pending.rec = Recording(key, slots, qr_own)
    return rec


def active() -> Optional[Recording]:
    """The recording of the call being served on this thread, if any."""
    return getattr(_pending, "rec", None)


def commit(rec: Recording, out=None, lse=None, max_block: int = -1) -> None:
    """Keep ``rec`` if every launch of its call was recorded (``out`` / ``lse``: a runner's own outputs or a vLLM
    workspace's views, returned by a replayed call that passes none; ``max_block``: a runner's largest planned
    block id)."""
    if rec.ok and rec.launches and _module is not None:
        try:
            _module.record(rec.key, rec.qr_offset, tuple(rec.keep), tuple(rec.launches), out, lse, max_block)
        except (TypeError, ValueError):  # a launch the entry cannot hold: later calls take the Python path too
            pass


def end() -> None:
    _pending.rec = None


__all__ = ["SLOTS", "Recording", "build", "call", "clear", "disable", "enable", "layer", "load", "run", "status"]
