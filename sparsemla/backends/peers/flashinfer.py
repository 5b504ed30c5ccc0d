"""``flashinfer``: FlashInfer's Hopper MLA kernel (``BatchMLAPagedAttentionWrapper``, ``backend="fa3"``), optional.

Sparse attention through a dense paged kernel: with page size 1, every query token is its own "request"
whose page table is its top-k rows (valid entries first), causal off.  Reads bf16 rows or plain fp8 rows
(per-tensor k_scale), with RoPE or NoPE.

FlashInfer plans on the host: each request's length is fixed when ``plan`` runs.  So
- the functional path compacts each row's valid entries on the device, reads the counts back to the host
  (one sync), plans and runs: eager only, never under capture;
- inside a :class:`SparseMLA` runner, ``plan`` happens on the host from the lengths the host knows
  (exact ones: with only upper bounds, asynchronous scheduling, this backend declines), and ``run``
  only compacts on the device and launches: capturable.  The device clamps every page-table entry to a
  real row (-1 -> 0) so that whatever the lengths, FlashInfer never reads outside the cache.
A query with no valid entry is planned with one dummy page and its output is then set to 0 / -inf.

fp8: FlashInfer has no k_scale argument.  The plan holds ``sm_scale``; q is multiplied by ``k_scale`` (the
QK scale ``sm_scale * k_scale``) and the output by ``k_scale`` (the PV scale), as kv-formats.md §2 says.
In the runner the scaled q is a small temporary (PyTorch's graph pool serves it under capture).
Whether ``run`` returns a natural or base-2 lse is detected by a tiny call, not from a version.
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, Optional

import torch

from ...cache import PagedKVCache
from ...reference import sparse_mla
from .._common import device_index, ensure_outputs, kv_rows
from ..registry import AttentionConfig, Backend

LN2 = math.log(2.0)
FLOAT_WORKSPACE_BYTES = 128 * 2 ** 20


def _compact(indices: torch.Tensor, valid_counts: Optional[torch.Tensor]):
    """(rows int32 [T, K] with each row's valid entries first and 0 elsewhere, counts int32 [T])."""
    k = indices.shape[1]
    valid = indices >= 0
    if valid_counts is not None:
        ar = torch.arange(k, device=indices.device, dtype=torch.int32)
        valid &= ar[None, :] < valid_counts[:, None]
    # A stable sort on "is invalid" keeps the valid entries' order and moves them to the front.
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    rows = torch.gather(torch.where(valid, indices, torch.zeros_like(indices)), 1, order)
    return rows.to(torch.int32).contiguous(), valid.sum(dim=1, dtype=torch.int32)


def _kv_views(kv):
    """(ckv [R, 1, 512], kpe [R, 1, rope], kv dtype, is_fp8) of a bf16/fp8 cache or a bf16 workspace."""
    rows, fmt = kv_rows(kv)
    dtype = torch.float8_e4m3fn if fmt.name == "fp8" else torch.bfloat16
    vals = rows.view(dtype)  # [R, head_dim]
    return vals[:, :512].unsqueeze(1), vals[:, 512:].unsqueeze(1), dtype, fmt.name == "fp8"


class _RunnerState:
    """Per-runner buffers: one CUDA-graph wrapper per token count (FlashInfer fixes the batch size of a
    graph-mode wrapper), a shared float workspace, and the compacted page table."""

    def __init__(self, spec):
        self.spec = spec
        dev = spec.device
        self.float_ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # Dense page table (query i owns entries kv_indptr[i] .. kv_indptr[i+1]); one extra dump slot at
        # the end receives the scatter of invalid entries, so run() needs no data-dependent shapes.
        self.flat_pages = torch.zeros(spec.max_tokens * spec.topk + 1, dtype=torch.int32, device=dev)
        self.indptr = torch.zeros(spec.max_tokens + 1, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(spec.max_tokens, dtype=torch.int32, device=dev)
        self.empty = torch.zeros(spec.max_tokens, dtype=torch.bool, device=dev)
        self.wrappers: Dict[int, object] = {}
        self.planned_tokens: Optional[int] = None


class FlashInferPeer(Backend):
    name = "flashinfer"
    description = "FlashInfer fa3 MLA kernel, page size 1 (top-k rows as the page table)"
    device_types = ("cuda",)
    min_capability = (9, 0)
    max_capability = (9, 0)  # the fa3 MLA kernel is Hopper-only
    formats = ("bf16", "bf16-nope", "fp8", "fp8-nope")
    graph_safe = True  # the runner path; the functional path declines capture in _extra_why_not
    device_valid_counts = False
    mixed_batches = True
    needs_host_counts = True

    def __init__(self):
        super().__init__()
        self._probe_device = None  # the device tiny calls run on (None: the current CUDA device)
        self._lse_scale: Dict[object, float] = {}
        self._eager_wrappers: Dict[int, object] = {}

    def _extra_why_not(self, c: AttentionConfig):
        if c.graph_capture and not c.runner:
            return ("outside a SparseMLA runner it reads the row lengths back to the host to plan, which cannot "
                    "happen during CUDA-graph capture")
        return None

    def probe_key(self, config):
        if config is None:
            return None
        return (config.fmt.id, device_index(self._probe_device))

    def _module(self):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
        return BatchMLAPagedAttentionWrapper

    def _probe(self, config):
        try:
            cls = self._module()
        except Exception as exc:
            return f"flashinfer.mla.BatchMLAPagedAttentionWrapper is not importable ({type(exc).__name__}: {exc})"
        for attr in ("plan", "run"):
            if not callable(getattr(cls, attr, None)):
                return f"the installed BatchMLAPagedAttentionWrapper has no {attr}()"
        if config is None:
            return None
        if self._probe_device is None and not torch.cuda.is_available():
            return "no CUDA device"
        return self._tiny_call(config)

    def _tiny_call(self, config: AttentionConfig, device=None) -> Optional[str]:
        device = self._probe_device if device is None else device
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        g = torch.Generator(device="cpu").manual_seed(4321)
        fmt = config.fmt
        cache = PagedKVCache(fmt, 2, 64, dev)
        n = cache.num_slots
        kv_c = torch.randn(n, 512, generator=g).to(dev)
        k_pe = torch.randn(n, fmt.rope_dim, generator=g).to(dev) if fmt.rope_dim else None
        cache.write(kv_c, k_pe, torch.arange(n, device=dev, dtype=torch.int32), k_scale=0.5)
        q = (torch.randn(3, 16, fmt.head_dim, generator=g) * 0.5).to(dev, torch.bfloat16)
        idx = torch.randperm(n, generator=g)[:96].view(3, 32).to(dev, torch.int32)
        idx[1, 20:] = -1
        idx[2, :] = -1
        sm_scale = fmt.head_dim ** -0.5
        key = self.probe_key(config)
        self._lse_scale[key] = 1.0
        try:
            out, lse = self.forward("decode", q, cache, idx, sm_scale, None, 0.5, None, None)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:
            return f"a tiny call failed ({type(exc).__name__}: {exc})"
        ref_o, ref_l = sparse_mla(q, cache, idx, sm_scale, k_scale=0.5)
        err = ((out.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
        if not err < 2e-2:
            return f"a tiny call disagreed with the float64 reference (relative error {err:.3g})"
        fin = torch.isfinite(ref_l)
        if torch.allclose(lse[fin], ref_l[fin], atol=1e-2, rtol=1e-3):
            return None
        if torch.allclose(lse[fin] * LN2, ref_l[fin], atol=1e-2, rtol=1e-3):
            self._lse_scale[key] = LN2
            return None
        return "a tiny call returned an lse that is neither the natural nor the base-2 log of the reference"

    # --- shared pieces ----------------------------------------------------------------------------
    def _run_kwargs(self, is_fp8: bool):
        names = set(inspect.signature(self._module().run).parameters)
        kw = {"return_lse_base_on_e": True} if "return_lse_base_on_e" in names else {}
        if is_fp8 and "ckv_scale" in names:
            # Builds with a per-tensor KV-scale mode (0.7.2) require these for FP8 caches.  We pass 1 and
            # keep applying k_scale ourselves (q and out), so the result does not depend on how a build
            # interprets the scale.
            kw.update(ckv_scale=1.0, kpe_scale=1.0)
        return kw

    def _plan(self, wrapper, qo_indptr, kv_indptr, kv_indices, lens, h, rope, sm_scale, kv_dtype):
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens, h, 512, rope, 1, False, sm_scale,
                     torch.bfloat16, kv_dtype)

    def _launch(self, wrapper, q, kv, out, lse, k_scale, is_fp8, key, empty_mask):
        ckv, kpe, _, _ = _kv_views(kv)
        # Separate contiguous halves: the kernel takes q_nope and q_pe as two tensors.
        q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True, **self._run_kwargs(is_fp8))
        if is_fp8 and k_scale != 1.0:
            out.mul_(k_scale)  # values were stored divided by k_scale
        scale = self._lse_scale.get(key, 1.0)
        if scale != 1.0:
            lse.mul_(scale)
        out.masked_fill_(empty_mask[:, None, None], 0.0)
        lse.masked_fill_(empty_mask[:, None], float("-inf"))

    # --- functional path --------------------------------------------------------------------------
    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        if workspace is not None:
            return self._runner_forward(workspace, q, kv, indices, valid_counts, k_scale, out, lse)
        out, lse = ensure_outputs(q, out, lse)
        t, h, d = q.shape
        if t == 0:
            return out, lse
        dev = q.device
        k = indices.shape[1]
        _, _, kv_dtype, is_fp8 = _kv_views(kv)
        rows, counts = _compact(indices, valid_counts)
        lens = counts.clamp(min=1)  # an empty query is planned with one dummy page (row 0), then zeroed
        keep = torch.arange(k, device=dev)[None, :] < lens[:, None]
        pages = rows[keep]  # dense CSR page table (a host sync: this eager path plans on the host anyway)
        idx = device_index(dev)
        if idx not in self._eager_wrappers:
            ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            self._eager_wrappers[idx] = self._module()(ws, backend="fa3")
        wrapper = self._eager_wrappers[idx]
        qo_indptr = torch.arange(t + 1, dtype=torch.int32, device=dev)
        kv_indptr = torch.zeros(t + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(lens, 0)
        self._plan(wrapper, qo_indptr, kv_indptr, pages.to(torch.int32).contiguous(), lens, h, d - 512, sm_scale,
                   kv_dtype)
        key = (kv_rows(kv)[1].id, idx)
        if is_fp8 and k_scale != 1.0:
            q = q * k_scale  # same convention as the runner path: the plan holds sm_scale, q carries k_scale
        self._launch(wrapper, q, kv, out, lse, k_scale, is_fp8, key, counts == 0)
        return out, lse

    # --- runner path --------------------------------------------------------------------------------
    def make_workspace(self, spec):
        return _RunnerState(spec)

    def plan(self, state: _RunnerState, host) -> None:
        if host.host_counts is None:
            raise ValueError("backend 'flashinfer' plans each query's length on the host, and the host knows only "
                             "upper bounds (seq_lens_upper_bound was given): use backend 'triton'")
        spec = state.spec
        t = host.padded_num_tokens
        counts = list(host.host_counts) + [0] * (t - len(host.host_counts))
        lens = torch.tensor([max(1, min(c, spec.topk)) for c in counts], dtype=torch.int32)
        if t not in state.wrappers:
            dev = spec.device
            state.wrappers[t] = self._module()(
                state.float_ws, use_cuda_graph=True,
                qo_indptr=torch.empty(t + 1, dtype=torch.int32, device=dev),
                kv_indptr=torch.empty(t + 1, dtype=torch.int32, device=dev),
                # run() reads the page table from this buffer: make it ours, so the device-side compaction
                # of each step lands where the captured kernel looks.
                kv_indices=state.flat_pages,
                kv_len_arr=torch.empty(t, dtype=torch.int32, device=dev), backend="fa3")
        kv_dtype = torch.float8_e4m3fn if spec.fmt.name == "fp8" else torch.bfloat16
        # The page table itself is written on the device by run(); plan() fixes only the lengths.
        host_qo = torch.arange(t + 1, dtype=torch.int32)  # host tensors: planning reads them without a sync
        # FlashInfer's CSR: query i's pages are kv_indptr[i] .. kv_indptr[i+1] and that count must equal
        # its kv length, so the page table is dense and the offsets come from the host's counts.
        host_indptr = torch.zeros(t + 1, dtype=torch.int32)
        host_indptr[1:] = torch.cumsum(lens, 0)
        state.indptr[: t + 1].copy_(host_indptr, non_blocking=False)
        state.lens[:t].copy_(lens, non_blocking=False)
        self._plan(state.wrappers[t], host_qo, host_indptr, state.flat_pages, lens, spec.num_heads,
                   spec.fmt.rope_dim, spec.sm_scale, kv_dtype)
        state.planned_tokens = t

    def _runner_forward(self, state, q, kv, indices, valid_counts, k_scale, out, lse):
        t = q.shape[0]
        if state.planned_tokens != t:
            raise RuntimeError(f"flashinfer: run() got {t} tokens but plan() planned {state.planned_tokens}")
        is_fp8 = state.spec.fmt.name == "fp8"
        rows, counts = _compact(indices, valid_counts)
        # Scatter each query's valid rows (a prefix after compaction) to its dense segment; entries past
        # the planned length go to the dump slot.  An empty query keeps one dummy page (row 0), zeroed later.
        k = rows.shape[1]
        ar = torch.arange(k, device=rows.device, dtype=torch.int32)
        lens = state.lens[:t]
        dest = state.indptr[:t, None] + ar[None, :]
        keep = ar[None, :] < lens[:, None]
        dump = state.flat_pages.numel() - 1
        dest = torch.where(keep, dest, torch.full_like(dest, dump))
        state.flat_pages.scatter_(0, dest.reshape(-1).long(), rows.reshape(-1))
        torch.eq(counts, 0, out=state.empty[:t])
        if is_fp8 and k_scale != 1.0:
            # The plan holds sm_scale only; the fp8 score scale sm_scale * k_scale goes into q instead.
            q = q * k_scale
        key = (state.spec.fmt.id, device_index(q.device))
        self._launch(state.wrappers[t], q, kv, out, lse, k_scale, is_fp8, key, state.empty[:t])
        return out, lse

