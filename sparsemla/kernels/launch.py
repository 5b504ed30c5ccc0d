"""Kernel launches with little host time.

``kernel[grid](*args, **meta)`` binds and specializes every argument in Python on every call: for the attention
kernels (~21 runtime arguments, ~10 compile-time ones) that is most of a call's host time.  :class:`Launch`
holds one kernel with its compile-time arguments fixed.  Its first call for a given specialization goes through
Triton (compiling if needed) and keeps the compiled kernel; later calls compute the specialization key the way
Triton does -- per pointer its dtype and whether it is 16-byte aligned, per integer whether it is 1, divisible
by 16 and within int32 -- and call the compiled kernel's launcher directly.

The direct path is used only where it is the same launch Triton would make: not under the interpreter, not while
a launch hook is installed (profilers), and only for kernels whose compile-time parameters all come after the
runtime ones (so the launcher's argument list is ``args`` followed by those values).

A caller on a hot path can pass its own ``key``: any hashable value that determines Triton's specialization of
``args`` (the launchers pass the integer arguments themselves when every pointer is 16-byte aligned and the
pointer dtypes are fixed by those integers).  It costs a tuple instead of a walk over every argument.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from .._device import interpreting


class Launch:
    """One Triton / Gluon kernel with fixed compile-time arguments.

    Args:
        fn: the ``@triton.jit`` / ``@gluon.jit`` function.
        constexprs: its compile-time arguments by name (those not given take their defaults).
        options: launch options (``num_warps``, ``num_stages``, ``maxnreg``, ``launch_pdl``).
    """

    def __init__(self, fn, constexprs: Dict[str, object], options: Dict[str, object]):
        self.fn = fn
        self.meta = dict(constexprs, **options)
        self._compiled: dict = {}
        self.built = False  # a launch went through (the kernel compiled on this Triton)
        self._direct = not interpreting() and _direct_ok()
        params = getattr(fn, "params", None)
        if self._direct and params is not None:
            flags = [p.is_constexpr for p in params]
            n_rt = flags.index(True) if True in flags else len(flags)
            if any(not f for f in flags[n_rt:]):
                self._direct = False  # a runtime parameter after a compile-time one: no fixed argument order
            self._n_runtime = n_rt
            self._tail = tuple(constexprs.get(p.name, p.default) for p in params[n_rt:])
        else:
            self._direct = False

    def __call__(self, grid: Sequence[int], args: Sequence[object], key=None, addrs=None) -> bool:
        """Launch on ``grid`` with the runtime ``args``; ``key``: optional specialization key (see the module
        docstring), None to derive it from ``args``; ``addrs``: optional ``args`` with every tensor replaced by
        its address (a caller that read the addresses for its alignment check passes them on).  True when the
        launch took the direct path (the compiled kernel kept for ``key``), False when it went through Triton."""
        if not self._direct or _hooks():
            self.fn[grid](*args, **self.meta)
            self.built = True
            return False
        if key is None:
            key = _spec_key(args)
        # Tensors go to the launcher as their addresses: given a tensor it calls ``data_ptr()`` through Python
        # and asks the driver whether the address is device memory (cuPointerGetAttribute), per pointer and
        # launch; the callers have checked every tensor's device already.
        if addrs is None:
            addrs = [a.data_ptr() if isinstance(a, _Tensor) else a for a in args]
        n = len(grid)
        if self.launch_known(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, key, addrs):
            return True
        k = self.fn[grid](*args, **self.meta)  # the first launch of this specialization: through Triton
        self.built = True
        if len(args) == self._n_runtime and k is not None and hasattr(k, "packed_metadata"):
            if len(self._compiled) >= _MAX_KEYS:
                self._compiled.clear()  # bounded: a caller whose integers keep changing recompiles nothing
            self._compiled[(_device(), key)] = _direct_launch(k, self._tail)
        return False

    @property
    def direct(self) -> bool:
        """Whether this kernel's launches can take the direct path (see :func:`direct_context`)."""
        return self._direct

    def launch_in(self, ctx, gx: int, gy: int, gz: int, key, addrs: Sequence[int]) -> bool:
        """Launch on ``(gx, gy, gz)`` on the device and stream of ``ctx`` (:func:`direct_context`, which callers
        read once for launches made back to back) if this specialization (``key``, as in :meth:`__call__`) was
        compiled there and the direct path applies; False when it did nothing (the caller then makes the regular
        call).  The least host time a launch can take here: one dictionary lookup and Triton's C launch function."""
        if ctx is None or not self._direct:
            return False
        go = self._compiled.get((ctx[0], key))
        if go is None:
            return False
        go(gx, gy, gz, ctx[1], addrs)
        return True

    def compiled(self, ctx, key):
        """The direct launch :meth:`launch_in` makes for ``key`` on ``ctx``'s device (see :func:`_direct_launch`), or
        None."""
        return self._compiled.get((ctx[0], key)) if ctx is not None and self._direct else None

    def launch_known(self, gx: int, gy: int, gz: int, key, addrs: Sequence[int]) -> bool:
        """:meth:`launch_in` on the current device and stream."""
        return self._direct and self.launch_in(direct_context(), gx, gy, gz, key, addrs)


def direct_context():
    """``(device, stream)`` for :meth:`Launch.launch_in` now, or None while a launch hook is installed (every launch
    then goes through Triton).  Call it only where some launch is ``direct``: it reads the CUDA device."""
    if _hooks():
        return None
    dev = _device()
    return dev, _stream(dev)


def _direct_launch(k, tail: tuple):
    """``go(gx, gy, gz, stream, addrs)``: one launch of the compiled kernel ``k`` with the runtime arguments
    ``addrs`` (tensors as addresses) and the compile-time ``tail``.

    Where the kernel needs no global or profiling scratch and no sanitizer instrumentation, Triton's Python
    launcher (``CudaLauncher.__call__``) only defines two closures and forwards to its C function; ``go`` calls
    that C function itself, in the argument order of the installed release (3.6; 3.8 and 3.9).  Anything else
    goes through ``k.run``.  ``go.parts``: ``(function, head, tail, packed)``, what ``go`` calls: ``function(gx, gy,
    gz, stream, *head, *addrs, *tail)``, or with ``packed`` ``function(gx, gy, gz, stream, *head, (*addrs, *tail))``
    (the compiled host entry replays launches from it)."""
    run = k.run
    fn, meta = k.function, k.packed_metadata
    plain = (type(run).__name__ == "CudaLauncher" and getattr(run, "global_scratch_size", 1) == 0
             and getattr(run, "profile_scratch_size", 1) == 0 and not getattr(run, "gsan_enabled", False))
    params = _call_params(type(run)) if plain else ()
    if plain and params == _PARAMS_36:
        c, head, packed = run.launch, (fn, run.launch_cooperative_grid, run.launch_pdl, None, None, meta, None, None,
                                       None), False
    elif plain and params == _PARAMS_38 and hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature"):
        c, head, packed = run.launch, (fn, run.launch_cooperative_grid, run.launch_pdl, meta, None, None, None, None,
                                       None, run.arg_annotations, run.kernel_signature), True
    else:
        c, head, packed = run, (fn, meta, None, None, None), False
    if packed:
        def go(gx, gy, gz, stream, addrs):
            return c(gx, gy, gz, stream, *head, (*addrs, *tail))
    else:
        def go(gx, gy, gz, stream, addrs):
            return c(gx, gy, gz, stream, *head, *addrs, *tail)
    go.parts = (c, head, tail, packed)
    return go


# CudaLauncher.__call__'s parameters: Triton 3.6 forwards (metadata, hooks, arguments) as one *args; 3.8 and 3.9
# name the metadata and hooks and pass the arguments to the C function as one tuple after the scratch pointers.
_PARAMS_36 = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
_PARAMS_38 = ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
              "launch_enter_hook", "launch_exit_hook", "args")
_PARAMS: dict = {}


def _call_params(cls) -> tuple:
    params = _PARAMS.get(cls)
    if params is None:
        import inspect
        params = _PARAMS[cls] = tuple(inspect.signature(cls.__call__).parameters)
    return params


_MAX_KEYS = 4096  # compiled kernels are Triton's (cached by it); this holds only the lookups
_Tensor = torch.Tensor


def _spec_key(args) -> tuple:
    """What Triton specializes a compiled kernel on (``native_specialize_impl``): pointers by dtype and 16-byte
    alignment, integers by ``== 1``, divisibility by 16 and the int32 range; floats and bools not at all."""
    key = []
    for a in args:
        if type(a) is int:
            key.append(1 if a == 1 else (2 if -0x80000000 <= a <= 0x7FFFFFFF else 4) + ((a & 15) == 0))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, (a.data_ptr() & 15) == 0))
        else:
            key.append(0)
    return tuple(key)


# --- Triton's runtime, bound once -------------------------------------------------------------------------------
def _direct_ok() -> bool:
    try:
        from triton.runtime.driver import driver  # noqa: F401
        from triton import knobs  # noqa: F401
    except Exception:  # an older Triton without these: always the regular launch
        return False
    return torch.cuda.is_available()


def _device() -> int:
    """The current CUDA device (a compiled kernel is loaded per device, so it is part of every key)."""
    global _device
    get = getattr(torch._C, "_cuda_getDevice", None)  # what torch.cuda.current_device() returns, without its checks
    if get is None:
        from triton.runtime.driver import driver
        get = driver.active.get_current_device
    _device = get
    return get()


def _stream(dev: int):
    """The current stream's handle, as Triton's launch takes it."""
    global _stream
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is None:
        from triton.runtime.driver import driver
        get = driver.active.get_current_stream
    _stream = get
    return get(dev)


def _hooks() -> bool:
    """Whether a launch hook is installed (a profiler's): then every launch goes through Triton."""
    from triton import knobs
    rt = knobs.runtime

    def hooks() -> bool:
        # a HookChain (Triton >= 3.5: never None, empty when nothing is installed) or a plain callable / None
        e, x = rt.launch_enter_hook, rt.launch_exit_hook
        return bool(e.calls if hasattr(e, "calls") else e is not None) or \
            bool(x.calls if hasattr(x, "calls") else x is not None)

    global _hooks
    _hooks = hooks
    return hooks()
