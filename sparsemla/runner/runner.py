"""``SparseMLA``: the stateful, CUDA-graph-safe runner an inference engine calls every step.

Split in two, as CUDA graphs need:

- ``plan(metadata)`` runs on the host, outside graph capture (it raises ``RuntimeError`` inside one).  It
  copies the batch (request boundaries, sequence lengths, block tables) into buffers the runner owns,
  and computes each query token's valid count on the device from the device's sequence lengths:
  ``min(context, index_topk)``, or ``index_topk + context % kpool`` for pooled indexers
  (kv-formats.md §7).  With asynchronous scheduling the host knows only upper bounds of the sequence
  lengths (``seq_lens_upper_bound``); the exact counts still come from the device tensors, and nothing
  is copied back to the host.
- ``run(q, cache, topk_local)`` converts request-local top-k positions to cache rows (into an owned
  buffer) and launches the decode and prefill kernels into owned output buffers: no host sync, no
  allocation (native backend), so a decode step can be captured once and replayed with new contents.

Every device buffer is allocated at construction, sized by the maxima given there.

Prefill over a quantized cache (``prefill_workspace_tokens > 0``): ``run`` first dequantizes the contexts of
the step's prefill requests into an owned bf16 workspace (``kernels.staging.upconvert_context``), points
their tokens' indices at it, and the prefill kernel reads bf16 rows.  A context is dequantized once per step
instead of once per query token that selects its rows, and the bf16 prefill kernel needs no conversions: the
workspace wins whenever a step has more than a handful of prefill tokens.  A step whose prefill contexts do not fit (or whose lengths the host does not know) reads the
cache natively.

Engine loop (sketch)::

    attn = SparseMLA(max_tokens=256, max_requests=256, max_blocks_per_request=512, num_heads=16,
                     head_dim=576, topk=2048, fmt="fp8_ds_mla", sm_scale=scale, device="cuda")  # the model's scale
    md = BatchMetadata.from_lists(query_lens, seq_lens, block_tables, device="cuda")
    attn.plan(md)                        # host side, every step, before the (captured) forward
    out, lse = attn.run(q, cache, topk)  # inside the model's forward, once per layer
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import List, Optional, Sequence

import torch

from .._validate import (SCALE_MAX, SCALE_MIN, check_block_geometry, check_current_device, check_k_scale,
                         check_positive_int, check_sm_scale, check_tensor)
from ..backends import registry
from ..backends.registry import AttentionConfig, HostPlan, RunnerSpec
from ..backends.triton_native import launches_only
from ..cache import PagedKVCache
from ..formats import KVFormat, get_format
from .. import host_entry
from .._device import current_cuda_index, triton_runs_on
from ..indices import convert_indices
from ..kernels.convert_indices import convert_indices_triton
from ..kernels.step_pack import step_pack
from ..kernels.staging import upconvert_context
from .metadata import BatchMetadata

V_DIM = 512
_BF16, _I32 = torch.bfloat16, torch.int32

SM_SCALE_HELP = ("sm_scale: the model's softmax scale is required (there is no safe default: a DSA model's scale "
                 "comes from its q/k head dim, not from the 576-dim absorbed key).  DeepSeek-V3.2: "
                 "qk_head_dim = 128 + 64 = 192 and yarn rope scaling (factor 40, mscale_all_dim 1), so "
                 "sm_scale = 192 ** -0.5 * (0.1 * ln(40) + 1) ** 2 ~= 0.1352; GLM-5.x: "
                 "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 from its config, times its rope-scaling mscale "
                 "squared if any.")


def _align4(n: int) -> int:
    """n rounded up to a multiple of 4 (int32 elements: 16 bytes)."""
    return (n + 3) & ~3


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SparseMLA:
    """Plan/run sparse MLA attention for batches of decode and prefill tokens.

    Args:
        max_tokens: most query tokens in one step (decode + prefill, padding included).
        max_requests: most requests in one step.
        max_blocks_per_request: width of the block table buffer.
        num_heads: query heads H (1..128); head_dim: 576 (RoPE) or 512 (NoPE).
        topk: width K of the top-k rows ``run`` receives.
        fmt: the cache's KV format (name or :class:`KVFormat`); a bare name takes its rope dim from head_dim.
        backend: ``"auto"`` or a backend name, for decode and prefill (``prefill_backend`` overrides prefill).
        block_size, block_stride_rows: the cache geometry (``PagedKVCache.block_size`` / ``.block_stride_rows``).
        device: where the buffers live.
        sm_scale: the model's softmax scale (required; see :data:`SM_SCALE_HELP`).
        index_topk: the indexer's top-k (default ``topk``); kpool: its pool size (1 = not pooled).
        num_blocks: the cache's number of blocks; when given, ``plan`` rejects block-table entries past it (for
            block tables the host knows), naming the request and the block.  ``run`` checks them against the
            cache it is given in any case (on the host, from what ``plan`` saw).
        graph_capture: whether ``run`` will be captured in CUDA graphs (default: on CUDA).  Only
            capturable backends are chosen then.
        prefill_workspace_tokens: the most context tokens of one step's prefill requests to dequantize into a
            bf16 workspace (quantized formats; 0 = read the cache natively).
    """

    def __init__(self, max_tokens: int, max_requests: int, max_blocks_per_request: int, num_heads: int,
                 head_dim: int, topk: int, fmt, backend="auto", block_size: int = 64, device=None, *,
                 sm_scale: Optional[float] = None, block_stride_rows: Optional[int] = None,
                 index_topk: Optional[int] = None, kpool: int = 1, prefill_backend=None,
                 num_blocks: Optional[int] = None, graph_capture: Optional[bool] = None,
                 prefill_workspace_tokens: int = 0):
        self.max_tokens = check_positive_int("max_tokens", max_tokens)
        self.max_requests = check_positive_int("max_requests", max_requests)
        self.max_blocks_per_request = check_positive_int("max_blocks_per_request", max_blocks_per_request)
        self.num_heads = check_positive_int("num_heads", num_heads)
        if num_heads > registry.MAX_HEADS:
            raise ValueError(f"num_heads: expected 1..{registry.MAX_HEADS}, got {num_heads}")
        check_positive_int("head_dim", head_dim)
        if head_dim not in (576, 512):
            raise ValueError(f"head_dim: expected 576 (RoPE) or 512 (NoPE), got {head_dim}")
        self.topk = check_positive_int("topk", topk)
        if isinstance(fmt, str) and not fmt.endswith("-nope") and "-nope-" not in fmt:
            fmt = get_format(fmt, head_dim - V_DIM, arg="fmt")
        self.fmt: KVFormat = get_format(fmt, arg="fmt")
        if self.fmt.head_dim != head_dim:
            raise ValueError(f"fmt: format {self.fmt.id} has head_dim {self.fmt.head_dim}, but head_dim is {head_dim}")
        self.head_dim = head_dim
        if sm_scale is None:
            raise TypeError(SM_SCALE_HELP)
        self.sm_scale = check_sm_scale(sm_scale)
        self.block_size = check_positive_int("block_size", block_size)
        self.block_stride_rows = block_stride_rows = check_block_geometry(block_size, block_stride_rows)
        self.index_topk = check_positive_int("index_topk", topk if index_topk is None else index_topk)
        self.kpool = check_positive_int("kpool", kpool)
        if self.index_topk % self.kpool:
            raise ValueError(f"index_topk: expected a multiple of kpool ({kpool}), got {self.index_topk}")
        if self.index_topk + self.kpool - 1 > topk:
            raise ValueError(f"topk: a row holds up to index_topk + kpool - 1 = {self.index_topk + self.kpool - 1} "
                             f"entries, so topk must be at least that, got {topk}")
        self.num_blocks = None if num_blocks is None else check_positive_int("num_blocks", num_blocks)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.graph_capture = (self.device.type == "cuda") if graph_capture is None else bool(graph_capture)

        # --- backends: chosen once, for this runner's shape --------------------------------------
        dev_type, cap = registry.device_capability(self.device)

        def config(mode):
            return AttentionConfig(mode, self.fmt, num_heads, topk, dev_type, cap, "cache", self.graph_capture,
                                   True, runner=True)
        self._decode_config = config("decode")
        self.decode_backend = registry.select(self._decode_config, backend)
        self.prefill_backend = registry.select(config("prefill"),
                                               backend if prefill_backend is None else prefill_backend)

        # --- device buffers, and their pinned host mirror --------------------------------------------
        # One int32 buffer holds the step's metadata, block table last, so that a host-known batch is one copy of
        # a prefix: [query_start_loc (R+1) | seq_lens (R) | req_id (T) | valid_counts (T) | block_table (R x B)].
        # Each part starts 16 bytes into the buffer times an integer: the kernels' launchers take the fast path
        # (a specialization key from the integers alone) only when every pointer is 16-byte aligned.
        r, t, b = max_requests, max_tokens, max_blocks_per_request
        self._o_seq = _align4(r + 1)
        self._o_req = _align4(self._o_seq + r)
        self._o_vc = _align4(self._o_req + t)
        self._o_bt = _align4(self._o_vc + t)
        n = self._o_bt + r * b
        self._meta = torch.zeros(n, dtype=_I32, device=self.device)
        self._query_start_loc = self._meta[: r + 1]
        self._seq_lens = self._meta[self._o_seq: self._o_seq + r]
        self._req_id = self._meta[self._o_req: self._o_req + t]
        self._valid_counts = self._meta[self._o_vc: self._o_vc + t]
        self._block_table = self._meta[self._o_bt:].view(r, b)
        self._block_table.fill_(-1)
        pinned = self.device.type == "cuda"
        # Two host buffers in turn: the host fills one while the previous step's copy may still be queued.
        self._host = [torch.zeros(n, dtype=_I32, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self._host_done = [None] * len(self._host)
        for h in self._host:
            h[self._o_bt:].fill_(-1)
        self._host_box = [(0, 0)] * len(self._host)
        self._turn = 0
        self._rows = torch.full((max_tokens, topk), -1, dtype=_I32, device=self.device)
        self._views: dict = {}  # token count -> the buffers' first rows (out, lse, rows, req_id, valid_counts)
        self._out = torch.zeros((max_tokens, num_heads, V_DIM), dtype=_BF16, device=self.device)
        self._lse = torch.zeros((max_tokens, num_heads), dtype=torch.float32, device=self.device)
        spec = RunnerSpec(max_tokens, num_heads, topk, self.fmt, self.device, block_size, block_stride_rows,
                          self.sm_scale)
        self._decode_ws = self.decode_backend.make_workspace(spec)
        self._prefill_ws = (self._decode_ws if self.prefill_backend is self.decode_backend
                            else self.prefill_backend.make_workspace(spec))
        self._planned: Optional[HostPlan] = None
        self._max_block = -1  # the largest block id of the planned batch's used blocks (-1: unknown to the host)
        self._max_block_at = None  # (request, block) where it is

        # --- the bf16 prefill workspace (quantized formats, native prefill backend only) ---------------
        ws_cap = check_positive_int("prefill_workspace_tokens", prefill_workspace_tokens, minimum=0)
        self.prefill_workspace_tokens = ws_cap if (self.fmt.name != "bf16"
                                                   and self.prefill_backend.name == "triton") else 0
        self._ws_rows = (torch.empty((self.prefill_workspace_tokens, head_dim), dtype=_BF16, device=self.device)
                         if self.prefill_workspace_tokens else None)
        self._ws_start = torch.full((max_requests,), -1, dtype=_I32, device=self.device)
        self._ws_plan: Optional[int] = None  # requests to upconvert this step (None: read the cache natively)
        self._convert = convert_indices_triton if triton_runs_on(self.device) else _convert_torch
        self._same_backend = (self.decode_backend is self.prefill_backend
                              and getattr(self.decode_backend, "mixed_batches", False))
        weakref.finalize(self, host_entry.forget_id, id(self))  # recorded runs point into this runner's buffers

    # ------------------------------------------------------------------------------------------------
    def plan(self, metadata: BatchMetadata, seq_lens_upper_bound: Optional[Sequence[int]] = None, *,
             num_tokens_padded: Optional[int] = None) -> None:
        """Prepare one step (host side; never inside CUDA-graph capture).

        Args:
            metadata: the step's :class:`BatchMetadata` (on the runner's device, or on the CPU: a CPU batch is
                packed on the host and sent in one asynchronous copy).
            seq_lens_upper_bound: with asynchronous scheduling, host upper bounds of ``seq_lens`` (R ints).
                The exact valid counts are then computed on the device from ``metadata.seq_lens`` (no
                device-to-host copy); backends that plan lengths on the host decline this.
            num_tokens_padded: the token count ``run`` will get when it exceeds the real one (a captured
                graph of a larger batch); the extra tokens have no valid entry.  Default: the real count.
        """
        if _capturing(self.device):
            raise RuntimeError("SparseMLA.plan() was called during CUDA-graph capture: plan on the host before "
                               "capturing or replaying; only run() may be captured")
        if not isinstance(metadata, BatchMetadata):
            raise TypeError(f"metadata: expected a BatchMetadata, got {type(metadata).__name__}")
        md = metadata
        t, r, width = md.num_tokens, md.num_requests, md.block_table.shape[1]
        if t > self.max_tokens:
            raise ValueError(f"metadata: {t} query tokens exceed max_tokens ({self.max_tokens})")
        if r > self.max_requests:
            raise ValueError(f"metadata: {r} requests exceed max_requests ({self.max_requests})")
        if width > self.max_blocks_per_request:
            raise ValueError(f"metadata: block_table has {width} columns, more than max_blocks_per_request "
                             f"({self.max_blocks_per_request})")
        md_dev = md.device
        if md_dev != self.device and md_dev.type != "cpu":
            raise ValueError(f"metadata: expected tensors on {self.device} or the CPU, got {md_dev}")
        padded = t if num_tokens_padded is None else check_positive_int("num_tokens_padded", num_tokens_padded,
                                                                        minimum=0)
        if not t <= padded <= self.max_tokens:
            raise ValueError(f"num_tokens_padded: expected {t}..{self.max_tokens} (real tokens..max_tokens), "
                             f"got {padded}")
        exact = seq_lens_upper_bound is None
        if not exact:
            bounds = _host_ints("seq_lens_upper_bound", seq_lens_upper_bound, r)
            if md.query_lens_host is not None and any(b < q for b, q in zip(bounds, md.query_lens_host)):
                raise ValueError("seq_lens_upper_bound: each bound must be >= its request's query length")
            for b in {id(self.decode_backend): self.decode_backend,
                      id(self.prefill_backend): self.prefill_backend}.values():
                reason = b.why_not(dataclasses.replace(self._decode_config, exact_host_lengths=False))
                if reason is not None:
                    raise ValueError(f"seq_lens_upper_bound: backend {b.name!r} cannot run from upper bounds: {reason}")
        host_lens = md.seq_lens_host if exact else (bounds if md.query_lens_host is not None else None)
        if host_lens is not None:
            need = max([-(-s // self.block_size) for s in host_lens] + [0])
            if need > self.max_blocks_per_request:
                raise ValueError(f"metadata: a context needs {need} blocks of {self.block_size} tokens, more than "
                                 f"max_blocks_per_request ({self.max_blocks_per_request})")

        counts = None
        if md_dev.type == "cpu" and exact and md.seq_lens_host is not None:
            counts = self._plan_from_host(md, t, r, width, padded)
        else:
            self._plan_on_device(md, t, r, width)
        self._ws_plan = self._plan_workspace(md, r) if (exact and self._ws_rows is not None) else None
        host_counts = None
        if exact and self._needs_host_counts():  # a backend that plans lengths on the host
            if counts is not None:
                host_counts = counts.tolist()
            elif md.context_lens_host() is not None:
                host_counts = self._counts(md.context_lens_host())
        host_entry.forget(self)  # the previous step's recorded runs
        plan = HostPlan(t, padded, md.num_decode_tokens, host_counts, self._valid_counts)
        self.decode_backend.plan(self._decode_ws, plan)
        if self.prefill_backend is not self.decode_backend:
            self.prefill_backend.plan(self._prefill_ws, plan)
        self._planned = plan

    def _needs_host_counts(self) -> bool:
        return self.decode_backend.needs_host_counts or self.prefill_backend.needs_host_counts

    def _counts(self, ctx: List[int]) -> List[int]:
        """Valid count of each token from its context length: min(ctx, index_topk), or index_topk + ctx % kpool
        past index_topk when pooled (kv-formats.md §7), at most topk."""
        itk, kp, k = self.index_topk, self.kpool, self.topk
        return [max(0, min(k, c if c <= itk else itk + c % kp)) for c in ctx]

    def _plan_from_host(self, md: BatchMetadata, t: int, r: int, width: int, padded: int) -> torch.Tensor:
        """A CPU batch: pack it into the pinned host buffer and send it in one copy.  Returns the valid counts
        (int32 CPU tensor ``[t]``)."""
        i = self._turn
        self._turn = (i + 1) % len(self._host)
        if self._host_done[i] is not None:
            self._host_done[i].synchronize()  # that buffer's copy (two steps back) has been read
        h = self._host[i]
        b = self.max_blocks_per_request
        h[: r + 1].copy_(md.query_start_loc)
        h[self._o_seq: self._o_seq + r].copy_(md.seq_lens)
        # every token slot past the real ones: request 0, no valid entry (a padded or larger run reads nothing)
        req = h[self._o_req: self._o_req + self.max_tokens]
        req[:t].copy_(md.req_id_per_token)
        req[t:].zero_()
        counts = self._device_counts(md.query_start_loc, md.seq_lens, md.req_id_per_token, t)
        vc = h[self._o_vc: self._o_vc + self.max_tokens]
        vc[:t].copy_(counts)
        vc[t:].zero_()
        bt = h[self._o_bt: self._o_bt + r * b].view(r, b)
        # (rows, columns): the box outside of which this host buffer's block table is -1
        box_r, box_c = self._host_box[i]
        if box_c > width:
            bt[: min(r, box_r), width:box_c].fill_(-1)
        bt[:, :width].copy_(md.block_table)
        self._host_box[i] = (r, width) if r >= box_r else (box_r, max(width, box_c))
        self._check_blocks(md.block_table, md.seq_lens, r)
        n = self._o_bt + r * b
        if self.device.type == "cuda":
            self._meta[:n].copy_(h[:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._host_done[i] = ev
        else:
            self._meta[:n].copy_(h[:n])
        return counts

    def _device_counts(self, query_start_loc, seq_lens, req_id, t: int) -> torch.Tensor:
        """Each token's valid count, on the tensors' device.  Token i of request q sees
        ctx = seq_len - (query_end - 1 - i) tokens; its row holds min(ctx, index_topk) entries, or
        index_topk + ctx % kpool past index_topk when pooled (kv-formats.md §7), at most topk."""
        req = req_id[:t].long()
        ctx = seq_lens[req] - (query_start_loc[1:][req] - 1 - torch.arange(t, device=req.device, dtype=torch.int32))
        counts = torch.where(ctx <= self.index_topk, ctx, self.index_topk + ctx % self.kpool)
        return counts.clamp_(0, self.topk).to(_I32)

    def _check_blocks(self, block_table: torch.Tensor, seq_lens: torch.Tensor, r: int) -> None:
        """Remember the largest block id the requests use (host values; no sync), and reject one past the cache
        when the runner knows the cache's size."""
        self._max_block, self._max_block_at = -1, None
        if not r or block_table.numel() == 0:
            return
        need = (seq_lens.to(torch.int64) + (self.block_size - 1)) // self.block_size
        cols = torch.arange(block_table.shape[1], dtype=torch.int64)
        inside = cols[None, :] < need[:, None]
        bt = block_table.to(torch.int64)
        missing = inside & (bt < 0)
        if bool(missing.any()):
            req, col = divmod(int(missing.view(-1).to(torch.int8).argmax()), block_table.shape[1])
            raise ValueError(f"metadata: request {req} has no block at block-table entry {col} (-1), inside its "
                             f"context of {int(seq_lens[req])} tokens")
        used = torch.where(inside, bt, torch.full_like(cols, -1))
        flat = int(used.argmax())
        self._max_block = int(used.view(-1)[flat])
        self._max_block_at = divmod(flat, block_table.shape[1])
        if self.num_blocks is not None:
            self._raise_past(self.num_blocks, "num_blocks")

    def _raise_past(self, num_blocks: int, what: str) -> None:
        if self._max_block >= num_blocks:
            req, col = self._max_block_at
            raise ValueError(f"metadata: request {req} maps block-table entry {col} to block {self._max_block}, "
                             f"past the cache's {num_blocks} blocks ({what})")

    def _plan_on_device(self, md: BatchMetadata, t: int, r: int, width: int) -> None:
        """A device batch (or asynchronous scheduling): copy on the device, valid counts from the device's
        sequence lengths; nothing is read back."""
        self._max_block, self._max_block_at = -1, None
        if md.device == self.device and self._convert is convert_indices_triton:
            # one launch instead of a dozen copies, fills and element-wise ops
            step_pack(_unit(md.query_start_loc), _unit(md.seq_lens), md.block_table, _unit(md.req_id_per_token), t,
                      out_query_start_loc=self._query_start_loc, out_seq_lens=self._seq_lens,
                      out_block_table=self._block_table, out_req_id=self._req_id, out_valid_counts=self._valid_counts,
                      index_topk=self.index_topk, kpool=self.kpool, topk=self.topk)
        else:
            self._pack_with_torch(md, t, r, width)
        if md.device.type == "cpu":
            self._check_blocks(md.block_table, md.seq_lens, r)

    def _pack_with_torch(self, md: BatchMetadata, t: int, r: int, width: int) -> None:
        self._block_table[:r].fill_(-1)
        self._block_table[:r, :width].copy_(md.block_table, non_blocking=True)
        self._query_start_loc[: r + 1].copy_(md.query_start_loc, non_blocking=True)
        self._seq_lens[:r].copy_(md.seq_lens, non_blocking=True)
        self._req_id.zero_()
        self._req_id[:t].copy_(md.req_id_per_token, non_blocking=True)
        self._valid_counts.zero_()
        if t:
            self._valid_counts[:t].copy_(self._device_counts(self._query_start_loc, self._seq_lens, self._req_id, t))

    def _plan_workspace(self, md: BatchMetadata, r: int) -> Optional[int]:
        """Workspace starts of the prefill requests (decode requests get -1) when their contexts fit."""
        if md.num_prefill_tokens == 0 or md.seq_lens_host is None:
            return None
        starts, used = [], 0
        for i, sl in enumerate(md.seq_lens_host):
            if i < md.num_decode_requests:
                starts.append(-1)
            else:
                starts.append(used)
                used += sl
        if used > self.prefill_workspace_tokens:
            return None
        self._ws_start.fill_(-1)
        src = torch.tensor(starts, dtype=_I32)
        self._ws_start[:r].copy_(src.pin_memory() if self.device.type == "cuda" else src, non_blocking=True)
        return r

    # ------------------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, cache: PagedKVCache, topk_local: torch.Tensor, k_scale: float = 1.0, *,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
        """Attention for the planned batch: device work only (capturable with the native backend); no
        allocation, no host sync.

        Args:
            q: bf16 ``[T, H, head_dim]`` (T = the planned token count, or ``num_tokens_padded``).
            cache: the layer's :class:`PagedKVCache` (this runner's format and geometry).
            topk_local: int32 ``[T, topk]`` request-local positions from the indexer, -1 padded.
            k_scale: the layer's per-tensor fp8 scale (a Python float).
            out, lse: optional destinations; default the runner's buffers (overwritten by the next run:
                consume the result, or pass your own per layer).

        Returns ``(out, lse)``: bf16 ``[T, H, 512]``, fp32 ``[T, H]``.

        A layer's call whose configuration an earlier layer of the step ran is replayed by the compiled host entry
        (:mod:`sparsemla.host_entry`): the same checks and launches, without Python.
        """
        r = host_entry.run(self, q, cache, topk_local, k_scale, out, lse)
        if r.__class__ is tuple:
            return r
        return self._run(q, cache, topk_local, k_scale, out, lse, r)

    def _run(self, q, cache, topk_local, k_scale, out, lse, entry_key):
        """:meth:`run` in Python (``entry_key``: the host entry's key for this call, when it may be recorded)."""
        plan = self._planned
        if plan is None:
            raise RuntimeError("SparseMLA.run() before plan(): plan the step first")
        dev = self.device
        qshape = q.shape if isinstance(q, torch.Tensor) else None
        if not (qshape is not None and q.dtype is _BF16 and len(qshape) == 3 and qshape[1] == self.num_heads
                and qshape[2] == self.head_dim and q.stride()[2] == 1 and q.device == dev):
            self._explain_q(q)
        if q.is_cuda and q.get_device() != current_cuda_index():
            check_current_device("q", q)
        t = qshape[0]
        if not plan.num_tokens <= t <= self.max_tokens:
            raise ValueError(f"q: expected {plan.num_tokens}..{self.max_tokens} tokens (the planned batch, or "
                             f"padded to a captured size), got {t}")
        if not (isinstance(cache, PagedKVCache) and cache.fmt == self.fmt and cache.block_size == self.block_size
                and cache.block_stride_rows == self.block_stride_rows and cache.rows.device == dev):
            self._explain_cache(cache)
        if self._max_block >= cache.num_blocks:
            self._raise_past(cache.num_blocks, "the cache given to run")
        if not (isinstance(topk_local, torch.Tensor) and topk_local.dtype is _I32
                and topk_local.shape == (t, self.topk) and topk_local.device == dev):
            check_tensor("topk_local", topk_local, dtype=_I32, shape=(t, self.topk), device=dev)
        if type(k_scale) is not float or not SCALE_MIN <= k_scale <= SCALE_MAX:
            if isinstance(k_scale, torch.Tensor):
                raise TypeError("k_scale: expected a Python float (reading a tensor would sync with the host)")
            k_scale = check_k_scale(k_scale)
        views = self._views.get(t)
        if views is None:
            views = self._views[t] = tuple(b[:t] for b in (self._out, self._lse, self._rows, self._req_id,
                                                            self._valid_counts))
        own_out, own_lse, rows, req, valid = views
        if out is None:
            out = own_out
        else:
            check_tensor("out", out, dtype=_BF16, shape=(t, self.num_heads, V_DIM), device=dev)
        if lse is None:
            lse = own_lse
        else:
            check_tensor("lse", lse, dtype=torch.float32, shape=(t, self.num_heads), device=dev)

        use_ws = self._ws_plan is not None
        # Decode tokens first; padding tokens (past the planned ones) join the last group.
        nd = plan.num_decode_tokens if plan.num_tokens > plan.num_decode_tokens else t
        one_call = nd == t or (self._same_backend and not use_ws)
        rec = None
        if (entry_key is not None and not use_ws and launches_only(self.decode_backend)
                and launches_only(self.prefill_backend)):
            # the compiled host entry records this layer's launches (the conversion, the attention call or calls) and
            # replays them at the step's other layers; the prefill tokens' call reads q and the outputs nd rows in
            rec = host_entry.begin(entry_key, host_entry.RUN_SLOTS)
            self._record_bases(rec, q, out, lse)
        try:
            self._attend(q, cache, topk_local, k_scale, out, lse, use_ws, nd, one_call, rows, req, valid)
            if rec is not None:
                rec.keep.append(plan)  # (its identity is in the key)
                host_entry.commit(rec, own_out if out is own_out else None, own_lse if lse is own_lse else None,
                                  self._max_block)
        finally:
            if rec is not None:
                host_entry.end()
        return out, lse

    def _record_bases(self, rec, q, out, lse) -> None:
        """The addresses a recording's per-call values are offsets from (q's RoPE part 1024 bytes into its rows)."""
        pq = q.data_ptr()
        rec.bases = dict(q=pq, q_rope=pq + (2 * V_DIM if self.fmt.rope_dim else 0), out=out.data_ptr(),
                         lse=lse.data_ptr())

    def _attend(self, q, cache, topk_local, k_scale, out, lse, use_ws, nd, one_call, rows, req, valid) -> None:
        ws_start = None
        if use_ws:
            # Prefill requests' contexts -> bf16 workspace; their tokens' indices -> workspace rows.
            nr = self._ws_plan
            upconvert_context(cache.rows, self.fmt, self._block_table[:nr], self._seq_lens[:nr], self.block_size,
                              self.block_stride_rows, k_scale, out=self._ws_rows, workspace_start=self._ws_start[:nr],
                              check=False)
            ws_start = self._ws_start  # one entry per block-table row (-1: read the cache)
        # the arguments were checked above and at construction: the conversion kernel directly
        self._convert(topk_local, req, self._block_table, self.block_size, self.block_stride_rows, False, False,
                      ws_start, rows)

        if one_call:
            self.decode_backend.forward("decode", q, cache, rows, self.sm_scale, valid, k_scale, out, lse,
                                        workspace=self._decode_ws)
            return
        if nd:
            self.decode_backend.forward("decode", q[:nd], cache, rows[:nd], self.sm_scale, valid[:nd], k_scale,
                                        out[:nd], lse[:nd], workspace=self._decode_ws)
        kv, ks = (self._ws_rows, 1.0) if use_ws else (cache, k_scale)  # the workspace holds dequantized values
        self.prefill_backend.forward("prefill", q[nd:], kv, rows[nd:], self.sm_scale, valid[nd:], ks, out[nd:],
                                     lse[nd:], workspace=self._prefill_ws)

    def _explain_q(self, q) -> None:
        check_tensor("q", q, dtype=_BF16, ndim=3, device=self.device)
        if q.shape[1] != self.num_heads or q.shape[2] != self.head_dim:
            raise ValueError(f"q: expected [T, {self.num_heads}, {self.head_dim}], got {tuple(q.shape)}")
        raise ValueError(f"q: the last dim must be contiguous (strides {q.stride()})")

    def _explain_cache(self, cache) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
        if cache.fmt != self.fmt:
            raise ValueError(f"cache: expected format {self.fmt.id} (this runner's), got {cache.fmt.id}")
        if (cache.block_size, cache.block_stride_rows) != (self.block_size, self.block_stride_rows):
            raise ValueError(f"cache: expected block_size {self.block_size} and block_stride_rows "
                             f"{self.block_stride_rows}, got {cache.block_size} and {cache.block_stride_rows}")
        raise ValueError(f"cache: expected it on {self.device}, got {cache.rows.device}")

    # ------------------------------------------------------------------------------------------------
    @property
    def valid_counts(self) -> torch.Tensor:
        """int32 ``[max_tokens]``: the planned step's valid count per token (0 past the planned tokens)."""
        return self._valid_counts

    @property
    def rows(self) -> torch.Tensor:
        """int32 ``[max_tokens, topk]``: cache rows of the last run's top-k."""
        return self._rows

    def __repr__(self) -> str:
        return (f"SparseMLA({self.fmt.id}, H={self.num_heads}, topk={self.topk}, max_tokens={self.max_tokens}, "
                f"decode={self.decode_backend.name}, prefill={self.prefill_backend.name}, device={self.device})")

def _convert_torch(topk_local, req, block_table, block_size, block_stride_rows, return_counts, compact, ws_start,
                   out):
    return convert_indices(topk_local, req, block_table, block_size, block_stride_rows, return_counts,
                           compact=compact, workspace_start=ws_start, out=out)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride (a 1-d int32 tensor of the batch metadata)."""
    return x if x.stride()[0] == 1 else x.contiguous()


def _host_ints(name: str, v, n: int) -> List[int]:
    if isinstance(v, torch.Tensor):
        if v.device.type != "cpu":
            raise ValueError(f"{name}: expected host values (a list or a CPU tensor), got a tensor on {v.device}")
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"{name}: expected a list of ints, got {type(v).__name__}")
    if len(v) != n:
        raise ValueError(f"{name}: expected {n} entries (one per request), got {len(v)}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}]: expected an int, got {type(x).__name__}")
        out.append(x)
    return out
