"""The attention launcher: executes a :class:`~sparsemla.plan.KernelPlan` (no policy here).

Math, per query token ``t`` and head ``h`` over the valid entries ``r`` of ``indices[t]``::

    s_r = sm_scale * q[t, h, :D] . K[r, :D]      lse = log sum_r exp(s_r)      out = sum_r exp(s_r - lse) V[r]

with ``V[r] = K[r, :512]`` (one KV head; absorbed MLA).  Rows are read straight out of the paged cache
(``PagedKVCache.rows``, uint8 ``[num_rows, bytes_per_token]``) and dequantized in the kernel.

Every kernel takes the same runtime arguments (``k_scale`` only where the rows can be plain fp8)::

    q, stride_qt, stride_qh, q_rope, stride_rt, stride_rh, rows, indices, stride_it, valid_counts,
    o, stride_ot, stride_os, stride_oh, lse, stride_lt, stride_ls, stride_lh,
    sm_scale * log2(e), [k_scale,] H, K, rows_per_split, num_splits,
    [out, stride_ft, stride_fh, lse, stride_gt, stride_gh]      # the sm_90 kernels: the final outputs

and runs ``tokens * num_splits * num_groups`` programs (head groups fastest, so programs reading the same rows run
side by side).  ``q_rope`` is the RoPE part of the query (``q[..., 512:]`` or an engine's separate ``q_pe``:
the kernels read it through its own pointer, so a query in two tensors needs no copy).  With more than one split
the kernel writes normalized fp32 partials ``[T, S, H, 512]`` /
``[T, S, H]`` and :mod:`.combine` merges them into ``out`` / ``lse`` -- or, where the plan says
``fused_combine``, the kernel's own programs merge them after a grid barrier (one launch; the sm_90 kernels'
``FUSED`` variants, launched cooperatively).  The partials live in a buffer whose first :data:`HEADER` fp32 words
are that barrier's (zeroed when the buffer is first used, left zero by every barrier): the launcher's
scratch, or a runner's ``split_buffers``; a call whose partials are a fresh allocation merges them by the combine
kernel.

A Hopper (Gluon) kernel that fails to build on the installed Triton is recorded
(:func:`sparsemla.plan.unavailable_kernels`) and the call, and every later one, runs the portable kernels.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from .. import host_entry
from .. import plan as _plan
from .._device import capability, interpreting, num_sms, stream_capturing as _capturing
from ..formats import get_format
from .combine import combine_kernel
from .launch import Launch, direct_context
from .portable.bf16_few import bf16_few_kernel
from .portable.fp8_few import fp8_few_kernel
from .portable.nvfp4_few import nvfp4_few_kernel
from .portable.wide import KIND_OF, wide_kernel

LOG2E = 1.4426950408889634
V_DIM = 512

# Kernels whose runtime arguments include k_scale (rows that may be plain fp8, which hold value / k_scale).
_TAKES_K_SCALE = ("portable-fp8", "portable-wide", "sm90-few", "sm90-wide", "sm90-conv", "sm90-cluster")
# Kernels whose runtime arguments end with the call's work-item count (tokens x splits x head groups), after the
# final out / lse: its persistent variant's programs loop over the items
_TAKES_ITEMS = ("sm90-conv", "sm90-cluster")
# fp32 words at the start of every split-partials buffer: the in-kernel merge's grid barrier (count, generation)
HEADER = 4

_LAUNCHES: dict = {}


def _sm90_launch(plan, fmt, has_vc: bool, fused: bool) -> Launch:
    # Imported on first use: the Gluon modules need triton.experimental.gluon, and a Triton without it must still
    # serve every call with the portable kernels.  The plan's ``variant``: further options of ``conv.meta`` or
    # ``bf16.meta``, a build the plan never chooses (sm90-conv and sm90-bf16 only; sm90-conv's trace build is
    # launched by benchmarks/conv_trace.py alone)
    meta = dict(plan.variant)
    if meta and plan.kernel not in ("sm90-conv", "sm90-bf16"):
        raise ValueError(f"plan.variant: options for sm90-conv or sm90-bf16 only, the plan's kernel is {plan.kernel}")
    lay = fmt.layout
    common = dict(bytes_per_row=fmt.bytes_per_token, rope_dim=fmt.rope_dim, rope_offset=max(lay.rope_offset, 0),
                  num_groups=plan.num_groups, has_valid_counts=has_vc)
    if fused:  # only the plan's FUSED_KERNELS have the variant
        common["fused"] = True
    if plan.kernel == "sm90-few":
        from .sm90 import few
        return Launch(few.few_kernel, few.meta(kind=plan.kind, scale_offset=max(lay.scale_offset, 0),
                                               fp8_qk=plan.fp8_qk, **common), {})
    if plan.kernel == "sm90-wide":
        from .sm90 import wide
        return Launch(wide.wide_kernel, wide.meta(kind=plan.kind, scale_offset=max(lay.scale_offset, 0),
                                                  fp8_qk=plan.fp8_qk, **common), {})
    if plan.kernel in ("sm90-conv", "sm90-cluster"):
        from .sm90 import conv
        if plan.persistent and meta.get("persist", True):  # (a variant may turn it off: an A/B)
            meta = dict(conv.PERSISTENT, **meta)
        return Launch(conv.conv_kernel, conv.meta(kind=plan.kind, scale_offset=max(lay.scale_offset, 0),
                                                  cluster=plan.kernel == "sm90-cluster", **common, **meta), {})
    from .sm90 import bf16
    return Launch(bf16.bf16_kernel, bf16.meta(**common, **meta), {})


def _portable_launch(plan, fmt, has_vc: bool, interp: bool) -> Launch:
    lay = fmt.layout
    offs = dict(SCALE_OFF=max(lay.scale_offset, 0), ROPE_OFF=max(lay.rope_offset, 0))
    common = dict(HB=plan.heads_per_program, BN=plan.block_n, NG=plan.num_groups, HAS_VC=has_vc, INTERP=interp)
    options = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    k, staged = plan.kernel, plan.kind == "staged"
    if k == "portable-wide":
        return Launch(wide_kernel, dict(BPT=fmt.bytes_per_token, KIND=KIND_OF[plan.kind], STAGED=staged,
                                        ROPE=fmt.rope_dim, **offs, **common), options)
    if k == "portable-fp8":
        return Launch(fp8_few_kernel, dict(BPT=fmt.bytes_per_token, DS=plan.kind == "fp8_ds_mla", STAGED=staged,
                                           ROPE=fmt.rope_dim, **offs, **common), options)
    if k == "portable-nvfp4":
        return Launch(nvfp4_few_kernel, dict(BPT=fmt.bytes_per_token, ROPE=fmt.rope_dim, **offs, **common), options)
    return Launch(bf16_few_kernel, dict(ROPE=fmt.rope_dim, **common), options)


def _launch_for(plan, fmt, has_vc: bool, fused: bool = False) -> Launch:
    """The launch of ``plan``'s kernel; ``fused``: its variant that merges the splits itself."""
    # Plans are cached objects: look them up by identity first (hashing a plan hashes all of its fields).
    hit = _BY_PLAN.get((id(plan), fmt, has_vc, fused))
    if hit is not None and hit[0] is plan:
        return hit[1]
    key = (plan.kernel, plan.kind, plan.heads_per_program, plan.num_groups, plan.block_n, plan.num_warps,
           plan.num_stages, plan.fp8_qk, fmt.id, has_vc, fused, plan.persistent, plan.variant)
    if any(name == "trace" for name, _ in plan.variant):
        raise ValueError("plan.variant: the trace build writes into the final-out argument; "
                         "benchmarks/conv_trace.py launches it")
    launch = _LAUNCHES.get(key)
    if launch is None:
        if plan.kernel in _plan.SM90_KERNELS:
            launch = _sm90_launch(plan, fmt, has_vc, fused)
        else:
            launch = _portable_launch(plan, fmt, has_vc, interpreting())
        _LAUNCHES[key] = launch
    _BY_PLAN[(id(plan), fmt, has_vc, fused)] = (plan, launch)
    return launch


_BY_PLAN: dict = {}


def _combine_launch(num_splits: int, pdl: bool) -> Launch:
    sp = 1 << max(0, (num_splits - 1).bit_length())
    warps = 4 if num_splits > 8 else 2
    key = ("combine", sp, pdl, warps)
    launch = _LAUNCHES.get(key)
    if launch is None:
        options = dict(num_warps=warps)
        if pdl:
            options["launch_pdl"] = True
        launch = _LAUNCHES[key] = Launch(combine_kernel, dict(SP=sp, PDL=pdl), options)
    return launch


def plan_for(q: torch.Tensor, rows: torch.Tensor, fmt, topk: int, *, fp8_qk: bool = False, portable: bool = False,
             staged: bool = False, kernel: Optional[str] = None, num_splits: Optional[int] = None,
             q_pe: Optional[torch.Tensor] = None, fused_combine: Optional[bool] = None) -> _plan.KernelPlan:
    """The plan of a call on these tensors: :func:`sparsemla.plan.plan_attention` with the device's facts, the
    tensors' alignment and the kernels unavailable here (``kernel`` / ``num_splits`` / ``fused_combine``: forced,
    for tests and benchmarks; ``q_pe``: the query's RoPE part in its own tensor, as :func:`attention_fwd` takes
    it)."""
    facts = _device_facts(q.device)
    shape = q.shape
    q_aligned = _rows_aligned(q) and (q_pe is None or _rows_aligned(q_pe))
    return _plan._plan("staged" if staged else fmt.name, shape[0], shape[1], topk, facts[0], facts[1], fp8_qk,
                       portable, interpreting(), q_aligned, not (rows.data_ptr() & 15), kernel, None,
                       _plan._UNAVAILABLE_SET, num_splits, fused_combine)


def _rows_aligned(t: torch.Tensor) -> bool:
    """16-byte aligned bf16 rows: the address and the token / head strides (what the sm_90 kernels' 16-byte q
    loads need)."""
    s = t.stride()
    return not ((t.data_ptr() & 15) or (s[0] & 7) or (s[1] & 7))


def _device_facts(dev: torch.device):
    """(capability, SM count) of a device, cached ((0, 0) and 132 for the CPU interpreter)."""
    facts = _FACTS.get(dev)
    if facts is None:
        facts = _FACTS[dev] = (capability(dev), num_sms(dev)) if dev.type == "cuda" else ((0, 0), 132)
    return facts


_FACTS: dict = {}


def attention_fwd(q: torch.Tensor, rows: torch.Tensor, fmt, indices: torch.Tensor, sm_scale: float, *,
                  plan: Optional[_plan.KernelPlan] = None, valid_counts: Optional[torch.Tensor] = None,
                  k_scale: float = 1.0, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                  split_buffers: Optional[torch.Tensor] = None, staged: bool = False,
                  q_pe: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA forward over rows of any KV format (arguments are not checked here: the public API does that).

    Args:
        q: bf16 ``[T, H, D]`` (D = ``fmt.head_dim``), last dim contiguous; or, with ``q_pe``, its first 512 dims.
        rows: uint8 ``[num_rows, fmt.bytes_per_token]`` (``PagedKVCache.rows``; a bf16 workspace ``[rows, D]`` as
            ``ws.view(torch.uint8)`` with the ``bf16`` format), or with ``staged`` the FP8 rows ``[T, K, D]`` viewed
            as uint8 ``[T * K, D]`` (``fmt`` then the ``fp8`` format).
        fmt: the rows' :class:`~sparsemla.formats.KVFormat` (or id).
        indices: int32 ``[T, K]`` rows, -1 = no token, contiguous rows; entries at or past ``valid_counts[t]`` are
            never read.
        sm_scale: softmax scale; k_scale: the plain ``fp8`` format's per-tensor scale (others ignore it).
        plan: the call's plan (default: :func:`plan_for`).
        valid_counts: optional int32 ``[T]``.
        out, lse: bf16 ``[T, H, 512]`` (last dim contiguous) and fp32 ``[T, H]``; allocated when None.
        split_buffers: a flat fp32 buffer of at least :func:`split_elements` elements for the split partials (a
            runner's, for CUDA-graph capture; its first :data:`HEADER` words are zeroed at its first use and
            belong to the launcher from then on); the launcher's scratch when None and the plan splits.
        q_pe: optional bf16 ``[T, H, fmt.rope_dim]`` with a contiguous last dim: the query's RoPE part in a tensor
            of its own (an engine's ``(q_nope, q_pe)`` pair, read in place: no copy); ``q`` is then ``[T, H, 512]``.

    Returns ``(out, lse)``: lse is the natural log including sm_scale; an empty row gives 0 / -inf.
    """
    fmt = get_format(fmt)
    if out is None or lse is None:
        t, h = q.shape[0], q.shape[1]
        if out is None:
            out = torch.empty((t, h, V_DIM), dtype=q.dtype, device=q.device)
        if lse is None:
            lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    if not out.shape[0]:
        return out, lse
    if plan is None:
        plan = plan_for(q, rows, fmt, indices.shape[1], staged=staged, q_pe=q_pe)
    _run(plan, q, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, split_buffers, q_pe)
    return out, lse


def _scratch(q: torch.Tensor, n_o: int, n_all: int, ctx=None):
    """(out partials, lse partials, whether they may be merged in the kernel) for a call on ``q`` without a runner
    (see :func:`_partials`): views of one grow-only fp32 buffer per (device, stream), reused call after call (a
    call's merge reads its partials before the next call on that stream writes them).  Under CUDA-graph capture,
    and for a large buffer, views of a fresh allocation instead, which nothing keeps alive past the call (a graph
    pool must hold no tensor that is not an output: torch.compile's CUDA-graph trees check it); its barrier words
    are not zeroed (that would be a launch more), so the combine kernel merges those.  ``ctx``: the launch's
    (device, stream) when the caller has read it (:func:`~sparsemla.kernels.launch.direct_context`; used when it
    is q's device, the buffer's)."""
    if not q.is_cuda or n_all > _SCRATCH_MAX or _capturing() or getattr(_LOCAL, "per_call", False):
        buf = torch.empty(n_all + HEADER, dtype=torch.float32, device=q.device)
        return buf[HEADER:HEADER + n_o], buf[HEADER + n_o:], False
    idx = q.get_device()
    key = ctx if ctx is not None and ctx[0] == idx else (idx, torch._C._cuda_getCurrentRawStream(idx))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n_all + HEADER:  # (its header is zeroed by _partials at its first use)
        if buf is not None:
            host_entry.clear()  # (its records keep the old buffer alive: let it go)
        buf = _SCRATCH[key] = torch.empty(max(n_all + HEADER, 1 << 20), dtype=torch.float32, device=q.device)
    return (*_partials(buf, n_o, n_all), True)


@contextlib.contextmanager
def per_call_partials():
    """Inside this context split partials are a per-call allocation, never the cached scratch.  The custom ops
    run in it: torch.compile's CUDA-graph trees route a warm-up run's allocations to the graph's memory pool and
    then require every live tensor there to be an output, which a grow-only scratch created there is not."""
    prev = getattr(_LOCAL, "per_call", False)
    _LOCAL.per_call = True
    try:
        yield
    finally:
        _LOCAL.per_call = prev


_LOCAL = host_entry.LAUNCHER_STATE  # (a threading.local the compiled host entry reads too)
_SCRATCH: dict = {}
_SCRATCH_MAX = 1 << 24  # fp32 elements (64 MB); a call needing more allocates its own


def _partials(buf: torch.Tensor, n_o: int, n_all: int):
    """(out partials, lse partials): after the :data:`HEADER` words, the first ``n_o`` and the next ``n_all - n_o``
    elements of ``buf``.  The views live on the buffer (the scratch, or a runner's): slicing a tensor costs more
    host time than the rest of a launch's arguments, and the buffers are long-lived (the views and the buffer keep
    each other alive: never for a per-call buffer).  A buffer's header is zeroed at its first use here (the grid
    barrier of the in-kernel merge counts from zero, and leaves it zero)."""
    try:
        views = buf._sparsemla_partials
    except AttributeError:
        buf[:HEADER].zero_()
        views = buf._sparsemla_partials = {}
    v = views.get((n_o, n_all))
    if v is None:
        v = views[(n_o, n_all)] = (buf[HEADER:HEADER + n_o], buf[HEADER + n_o:HEADER + n_all])
    return v


class _Bound:
    """What a launch of one plan takes that stays fixed while the tensors' shapes and strides do: the kernel (and
    its variant that merges the splits itself, where the plan says so), the grid, the integer arguments, the split
    partials' sizes and the combine's launch (host time: building these on every call costs more than the launch
    itself)."""

    __slots__ = ("plan", "fmt", "launch", "fused", "final", "gx", "o_strides", "l_strides", "tail", "items", "key",
                 "takes_k_scale", "n_o", "n_all", "combine", "cgrid", "cints")

    def __init__(self, plan, fmt, has_vc: bool, t: int, h: int, k_width: int, qs, rs, is0: int, os_, ls_, device):
        ns = plan.num_splits
        self.n_o = self.n_all = 0
        self.plan, self.fmt = plan, fmt
        self.launch = _launch_for(plan, fmt, has_vc)
        self.fused = _launch_for(plan, fmt, has_vc, True) if plan.fused_combine else None
        # the sm_90 kernels also take the final out / lse and their strides (read by the FUSED variants only)
        self.final = (os_[0], os_[1], ls_[0], ls_[1]) if plan.kernel in _plan.SM90_KERNELS else None
        items = t * plan.grid
        self.gx = programs(self.launch, items, device)
        if ns > 1:
            self.n_o = t * ns * h * V_DIM
            self.n_all = self.n_o + t * ns * h
            self.o_strides = (ns * h * V_DIM, h * V_DIM, V_DIM)
            self.l_strides = (ns * h, h, 1)
        else:
            self.o_strides = (os_[0], 0, os_[1])
            self.l_strides = (ls_[0], 0, ls_[1])
        self.tail = (h, k_width, plan.rows_per_split, ns)
        self.items = (items,) if plan.kernel in _TAKES_ITEMS else ()
        # Every pointer 16-byte aligned: the integers alone decide Triton's specialization (the pointers' dtypes
        # are fixed: q bf16, rows uint8, indices / counts int32, out bf16 or fp32 partials as ns says, lse fp32).
        self.key = (qs[0], qs[1], rs[0], rs[1], is0, *self.o_strides, *self.l_strides, *self.tail,
                    *(self.final or ()), *self.items)
        self.takes_k_scale = plan.kernel in _TAKES_K_SCALE
        self.combine = self.cgrid = self.cints = None
        if ns > 1:
            # programmatic dependent launch on sm_90+: the combine's launch overlaps the attention kernel's tail
            pdl = device.type == "cuda" and not interpreting() and _device_facts(device)[0] >= (9, 0)
            self.combine = _combine_launch(ns, pdl)
            self.cgrid = (t, h, V_DIM // 128)
            self.cints = (os_[0], os_[1], ls_[0], ls_[1], h, ns)


def programs(launch: Launch, items: int, device) -> int:
    """The grid of ``launch`` over ``items`` work items: a program each, or for a persistent build (``PS``) at most
    one per SM, each serving items in turn."""
    if getattr(launch, "meta", {}).get("PS"):
        return min(items, _device_facts(device)[1])
    return items


_BOUND: dict = {}
_MAX_BOUND = 4096


def launch_call(q: torch.Tensor, rows: torch.Tensor, fmt, indices: torch.Tensor, sm_scale: float,
                valid_counts: Optional[torch.Tensor], k_scale: float, out: torch.Tensor, lse: torch.Tensor,
                split_buffers: Optional[torch.Tensor] = None, *, fp8_qk: bool = False, portable: bool = False) -> None:
    """:func:`plan_for` and :func:`attention_fwd` in one step, for a backend's calls: the plan is looked up together
    with the launch's bound arguments, from the tensors' shapes, strides and alignment (one lookup, each tensor
    property read once).  ``fmt``: a :class:`~sparsemla.formats.KVFormat`; ``out`` / ``lse`` given; arguments not
    checked (the public API has)."""
    _run(None, q, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, split_buffers, None,
         (fp8_qk, portable))


def _run(plan, q, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, split_buffers, q_pe=None,
         choice=None) -> None:
    """Launch ``plan`` (None: the plan :func:`plan_for` gives with ``choice`` = (fp8_qk, portable), cached with the
    bound arguments) on these tensors."""
    qs, os_, ls_ = q.stride(), out.stride(), lse.stride()
    pq = q.data_ptr()
    if q_pe is None:  # the RoPE part is q[..., 512:] (bf16: 1024 bytes in); NoPE: never read, q stands in
        rs, pqr = qs, (pq + 2 * V_DIM if fmt.rope_dim else pq)
    else:
        rs, pqr = q_pe.stride(), q_pe.data_ptr()
    ishape = indices.shape
    if not ishape[0]:
        return
    is0 = indices.stride()[0]
    has_vc = valid_counts is not None
    pr = rows.data_ptr()
    if plan is None:
        # what the plan depends on beyond the launch's key: the options, q's and the rows' alignment, the device and
        # the kernels found unavailable so far
        sig = (choice, id(fmt), has_vc, ishape, qs, rs, is0, os_, ls_, lse.shape[1], (pq | pqr) & 15, pr & 15,
               q.device, _plan._UNAVAILABLE_SET)
        b = _BOUND.get(sig)
        if b is None or b.fmt is not fmt:
            plan = plan_for(q, rows, fmt, ishape[1], fp8_qk=choice[0], portable=choice[1])
            b = _bind(sig, plan, fmt, has_vc, ishape, lse, qs, rs, is0, os_, ls_, q.device)
        plan = b.plan
    else:
        # keyed by the plan's and the format's identity (hashing them hashes their fields), checked on a hit
        sig = (id(plan), id(fmt), has_vc, ishape, qs, rs, is0, os_, ls_, lse.shape[1])
        b = _BOUND.get(sig)
        if b is None or b.plan is not plan or b.fmt is not fmt:
            b = _bind(sig, plan, fmt, has_vc, ishape, lse, qs, rs, is0, os_, ls_, q.device)
    vc = valid_counts if has_vc else indices  # a dummy pointer when absent
    # the device, stream and launch hooks read once for the launches (the combine's too) and the scratch
    ctx = direct_context() if b.launch.direct else None
    fused = cached = False
    if b.n_all:
        if split_buffers is None:
            o_dst, l_dst, fused = _scratch(q, b.n_o, b.n_all, ctx)
            cached = fused  # (the partials are the cached scratch exactly where they may be merged in the kernel)
        elif split_buffers.numel() < b.n_all + HEADER:
            raise ValueError(f"split_buffers: {split_buffers.numel()} fp32 elements, this call needs "
                             f"{b.n_all + HEADER}")
        else:
            o_dst, l_dst = _partials(split_buffers, b.n_o, b.n_all)
            fused = True
    else:
        o_dst, l_dst = out, lse
    # (a FUSED variant that failed to build is recorded as the pseudo-kernel FUSED_COMBINE: its kernel still serves)
    fused = fused and b.fused is not None and _plan.FUSED_COMBINE not in _plan._UNAVAILABLE_SET
    # The launcher takes tensors as addresses; read once, they also give the alignment check.
    pi, pv, po, pl = indices.data_ptr(), vc.data_ptr(), o_dst.data_ptr(), l_dst.data_ptr()
    # the final outputs' addresses: the partials' own without splits (read once either way)
    p_out, p_lse = (out.data_ptr(), lse.data_ptr()) if b.n_all else (po, pl)
    scale = float(sm_scale) * LOG2E
    o0, o1, o2 = b.o_strides
    l0, l1, l2 = b.l_strides
    if b.takes_k_scale:
        addrs = (pq, qs[0], qs[1], pqr, rs[0], rs[1], pr, pi, is0, pv, po, o0, o1, o2, pl, l0, l1, l2, scale,
                 float(k_scale), *b.tail)
    else:
        addrs = (pq, qs[0], qs[1], pqr, rs[0], rs[1], pr, pi, is0, pv, po, o0, o1, o2, pl, l0, l1, l2, scale, *b.tail)
    f = b.final
    finals = 0
    if f is not None:
        addrs = (*addrs, p_out, f[0], f[1], p_lse, f[2], f[3], *b.items)
        finals = p_out | p_lse
    aligned = not (pq | pqr | pr | pi | pv | po | pl | finals) & 15
    launch = b.fused if fused else b.launch
    direct = aligned and launch.launch_in(ctx, b.gx, 1, 1, b.key, addrs)
    if not direct:
        qr = q_pe if q_pe is not None else (q[..., V_DIM:] if fmt.rope_dim else q)
        args = (q, *addrs[1:3], qr, *addrs[4:6], rows, indices, is0, vc, o_dst, *addrs[11:14], l_dst, *addrs[15:])
        if f is not None:  # the final outputs as tensors
            args = (*args[:-6 - len(b.items)], out, f[0], f[1], lse, f[2], f[3], *b.items)
        key = b.key if aligned else None
        if launch.built:
            launch((b.gx,), args, key, addrs)
        else:
            try:
                launch((b.gx,), args, key, addrs)
            except Exception as exc:  # a first launch that raises did not build: fall back, remember why
                if plan.kernel not in _plan.SM90_KERNELS:
                    raise
                if fused:  # only the in-kernel merge: the same plan again, merged by the combine kernel
                    _plan.mark_unavailable(_plan.FUSED_COMBINE, f"{type(exc).__name__}: {_first_line(exc)}")
                    _run(plan, q, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, split_buffers, q_pe)
                    return
                _plan.mark_unavailable(plan.kernel, f"{type(exc).__name__}: {_first_line(exc)}")
                fallback = _plan.plan_attention(fmt, ishape[0], lse.shape[1], ishape[1],
                                                capability=capability(q.device), num_sms=num_sms(q.device),
                                                unavailable=_plan.unavailable_set(), staged=plan.kind == "staged")
                _run(fallback, q, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, split_buffers, q_pe)
                return
    caddrs = None
    if b.combine is not None and not fused:
        c = b.cints
        caddrs = (po, pl, p_out, c[0], c[1], p_lse, c[2], c[3], c[4], c[5])
        # the partials' lse part starts n_o (a multiple of 512) elements into the buffer: aligned with it
        caligned = not (po | p_out | p_lse) & 15
        if not (caligned and b.combine.launch_in(ctx, *b.cgrid, c, caddrs)):
            b.combine(b.cgrid, (o_dst, l_dst, out, c[0], c[1], lse, c[2], c[3], c[4], c[5]),
                      c if caligned else None, caddrs)
            direct = False
    rec = host_entry.active()
    if rec is not None:
        # a call the compiled host entry may replay (sparsemla.host_entry): only direct launches, the partials (if
        # any) in a buffer that outlives the call (the cached scratch, a runner's), q in one tensor (or a pair where
        # the recording takes q_pe's address per call)
        if direct and (q_pe is not None) == rec.qr_own and (not b.n_all or cached or split_buffers is not None):
            if q_pe is None:
                rec.qr_offset = pqr - pq
            # (the partials' buffer, which the record's constants point into; never the call's own outputs)
            rec.keep += (b.fmt, o_dst, l_dst) if b.n_all else (b.fmt,)
            _record(rec, b, launch, ctx, addrs, caddrs,
                    dict(q=pq, q_rope=pqr, rows=pr, indices=pi, valid_counts=pv, out=p_out, lse=p_lse, scale=scale,
                         k_scale=float(k_scale)))
        else:
            rec.ok = False


def _record(rec, b: "_Bound", launch: Launch, ctx, addrs: tuple, caddrs, values: dict) -> None:
    """Add this call's launches to the host entry's recording ``rec``, with the positions of the per-call values in
    the kernels' argument list (module docstring) and the combine's."""
    pos = {0: "q", 3: "q_rope", 6: "rows", 7: "indices", 9: "valid_counts", 18: "scale"}
    n = len(addrs)
    if not b.n_all:  # the kernel writes out / lse itself
        pos.update({10: "out", 14: "lse"})
    if b.takes_k_scale:
        pos[19] = "k_scale"
    if b.final is not None:  # the sm_90 kernels' final out / lse (six arguments, before the item count if any)
        n -= len(b.items)
        pos.update({n - 6: "out", n - 3: "lse"})
    rec.add(launch.compiled(ctx, b.key), (b.gx, 1, 1), ctx[1], addrs, pos, values)
    if caddrs is not None:
        rec.add(b.combine.compiled(ctx, b.cints), b.cgrid, ctx[1], caddrs, {2: "out", 5: "lse"}, values)


def _bind(sig, plan, fmt, has_vc, ishape, lse, qs, rs, is0, os_, ls_, device) -> "_Bound":
    if len(_BOUND) >= _MAX_BOUND:
        _BOUND.clear()
    b = _BOUND[sig] = _Bound(plan, fmt, has_vc, ishape[0], lse.shape[1], ishape[1], qs, rs, is0, os_, ls_, device)
    return b


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else ""


def split_elements(plan: _plan.KernelPlan, num_tokens: int, num_heads: int) -> int:
    """fp32 elements of the split-partials buffer a call of this plan needs (0 without splits): the partials and
    the :data:`HEADER` words before them."""
    if plan.num_splits <= 1:
        return 0
    return HEADER + num_tokens * plan.num_splits * num_heads * (V_DIM + 1)


def runner_split_elements(fmt, max_tokens: int, num_heads: int, topk: int, device, *, fp8_qk: bool = False,
                          portable: bool = False, staged: bool = False) -> int:
    """fp32 elements that cover the split partials of every call of up to ``max_tokens`` tokens on ``device``:
    the Hopper plans and the portable ones (a Gluon kernel may turn out unavailable at its first launch), q
    aligned or not.  Past two programs per SM no plan splits, so the scan stops there."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    cap = capability(device) if cuda else (0, 0)
    sms = num_sms(device) if cuda else 132
    variants = [dict(portable=True, fp8_qk=False)]
    if not portable:
        variants += [dict(portable=False, fp8_qk=fp8_qk, q_aligned=a) for a in (True, False)]
    best = 0
    for v in variants:
        for t in range(1, max_tokens + 1):
            try:
                p = _plan.plan_attention(fmt, t, num_heads, topk, capability=cap, num_sms=sms,
                                         interpret=interpreting(), staged=staged, **v)
            except ValueError:  # fp8_qk where it cannot apply: that call raises, it needs no buffer
                break
            best = max(best, split_elements(p, t, num_heads))
            if t * p.num_groups > 2 * sms:
                break
    return best


def probe_builds(device=None) -> Optional[dict]:
    """Build and run each Hopper kernel once on a tiny call (every variant a serving call needs is built at its
    first launch anyway; this finds the ones the installed Triton cannot build, ahead of time).  Returns
    :func:`sparsemla.plan.unavailable_kernels` afterwards, or None without a Hopper GPU."""
    if not torch.cuda.is_available() or interpreting():
        return None
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if capability(dev) != (9, 0):
        return None
    for kernel, fid, heads in (("sm90-few", "fp8_ds_mla", 16), ("sm90-wide", "fp8_ds_mla", 64),
                               ("sm90-conv", "nvfp4_ds_mla", 64), ("sm90-bf16", "bf16", 64)):
        fmt = get_format(fid)
        rows = torch.zeros((64, fmt.bytes_per_token), dtype=torch.uint8, device=dev)
        q = torch.zeros((1, heads, fmt.head_dim), dtype=torch.bfloat16, device=dev)
        idx = torch.arange(64, dtype=torch.int32, device=dev).view(1, 64)
        try:
            plan = plan_for(q, rows, fmt, 64, kernel=kernel)
        except ValueError:
            continue  # already recorded as unavailable
        attention_fwd(q, rows, fmt, idx, 0.1, plan=plan)
    torch.cuda.synchronize(dev)
    return _plan.unavailable_kernels()


__all__ = ["HEADER", "attention_fwd", "launch_call", "per_call_partials", "plan_for", "probe_builds",
           "runner_split_elements", "split_elements"]
