"""The compiled host entry of ``sparse_mla_decode`` / ``sparse_mla_prefill`` over a :class:`~sparsemla.PagedKVCache`.

An engine that runs attention eagerly (vLLM's piecewise CUDA graphs: prefill and mixed steps) pays a call's host
time on every layer.  In Python that time is mostly the interpreter's: checking about 30 tensor properties,
allocating ``out`` / ``lse`` and building the launches' argument lists.  ``entry.cpp`` does the same for a call
whose configuration (mode, format, q's shape and strides, the indices' width and row stride, which optional
tensors are given and their strides, device, stream) the Python path has served before: the first call of a
configuration goes through Python -- every argument checked, the backend chosen, the plan made, the kernels
compiled -- and, where it made only direct launches (:mod:`sparsemla.kernels.launch`), records them; later calls
check what the host knows in C++, allocate, and call Triton's launch functions with the same arguments the Python
path would pass.  A call the entry does not handle (a wrong argument, ``check=True``, a named backend, a bf16
workspace, a CUDA-graph capture, a profiler's launch hook, an unaligned tensor, ...) takes the Python path, which
raises where the arguments are wrong: the behaviour is the Python path's in every case.

The entry is a CPython extension built against the installed torch (``torch.utils.cpp_extension``: a C++ compiler
and ninja) the first time a call on a CUDA tensor needs it, and cached by torch (its extension directory, per torch
build; the name carries the source's digest).  Where it cannot be built, every call takes the Python path and
:func:`status` says why.  ``SPARSEMLA_HOST_ENTRY=0`` in the environment (read when the entry is first loaded), or
:func:`disable`, keeps every call on the Python path; ``sparsemla info`` shows the state (and on a CUDA machine
builds the entry first); :func:`build` builds it ahead of time.
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Optional

# What a template slot of a recorded launch takes per call (entry.cpp: enum Slot, the same order).
SLOTS = ("const", "q", "q_rope", "rows", "indices", "valid_counts", "out", "lse", "scale", "k_scale")
SLOT = {name: i for i, name in enumerate(SLOTS)}
ENV = "SPARSEMLA_HOST_ENTRY"

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "entry.cpp")
_lock = threading.Lock()
_module = None
_reason: Optional[str] = "not loaded yet (the first call on a CUDA tensor loads it)"
_disabled = False
_pending = threading.local()  # the key of a call the Python path serves and may record (see :func:`begin`)
# The launcher's per-thread state (sparsemla.kernels.attention; ``per_call``: split partials per call, the custom
# ops), here so that the entry reads it without importing the launcher.
LAUNCHER_STATE = threading.local()


def _first_call(mode, q, *rest):
    """``call`` until the entry is loaded: a call on a CUDA tensor loads (or builds) it, then uses it."""
    global call
    if getattr(q, "is_cuda", False) is not True:
        return None  # CPU calls (the interpreter) never need the entry
    m = load()
    call = m.call if m is not None else _no_entry
    return call(mode, q, *rest)


def _no_entry(*args):
    return None


# call(mode, q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check): (out, lse) when the call
# was replayed; bytes (the configuration's key) when the Python path must serve it and may record it; None when
# the Python path serves it.  mode: 0 decode, 1 prefill.
call = _first_call


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
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
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
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                          "sparsemla", "host_entry")
    path = os.path.join(folder, name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
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

    from .._validate import SCALE_MAX, SCALE_MIN
    from ..cache import PagedKVCache
    p = dict(get_device=getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device),
             get_stream=getattr(torch._C, "_cuda_getCurrentRawStream", None) or _raw_stream,
             capturing=getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing),
             runtime=knobs.runtime, local=LAUNCHER_STATE)
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
    global _disabled, call, _reason
    with _lock:
        _disabled = True
        call = _no_entry
        _reason = "disabled (sparsemla.host_entry.disable())"
        if _module is not None:
            _module.clear()


def enable() -> None:
    """Undo :func:`disable` (the entry loads at the next call on a CUDA tensor)."""
    global _disabled, call, _reason
    with _lock:
        _disabled = False
        call = _module.call if _module is not None else _first_call
        if _module is None:
            _reason = "not loaded yet (the first call on a CUDA tensor loads it)"


def status() -> str:
    """One line: whether calls use the entry, or why not."""
    if _module is not None and not _disabled:
        return f"in use ({_module.size()} recorded configurations)"
    return _reason or "not loaded"


def clear() -> None:
    """Forget every recorded configuration (the plan's inputs changed: a kernel found unavailable, the backends or
    the selection cache changed, a split-partials buffer replaced)."""
    if _module is not None:
        _module.clear()


# --- recording (the Python path's side) --------------------------------------------------------------------------
def begin(key: bytes) -> None:
    """The Python path serves a call the entry may record under ``key`` (the launcher records it if the call makes
    only direct launches, see :func:`take`)."""
    _pending.key = key


def take() -> Optional[bytes]:
    """The key of the call being served, once (None when it is not to be recorded)."""
    key = getattr(_pending, "key", None)
    if key is not None:
        _pending.key = None
    return key


def end() -> None:
    _pending.key = None


def record(key: bytes, qr_offset: int, keep, launches) -> None:
    """Record a configuration's launches: ``launches`` a tuple of ``(fn, outer_values, outer_kinds, inner_values,
    inner_kinds)`` (see entry.cpp); ``keep``: objects the constants point into, kept alive with the record."""
    if _module is not None:
        _module.record(key, qr_offset, keep, launches)


__all__ = ["SLOTS", "build", "call", "clear", "disable", "enable", "load", "status"]
