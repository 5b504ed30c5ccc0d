"""sparsemla over vLLM's own tensors: the contract between the vLLM backend and the library (no vLLM import).

What vLLM (0.33) hands the kernel call of a sparse MLA backend (``SparseMLACommonImpl._forward_mqa_kernel``):

- ``q``: the pair ``(ql_nope [T, H, 512], q_pe [T, H, R])`` -- the absorbed query with any token / head strides
  and a contiguous last dim, and the RoPE part, ``R = 64`` (a strided view of the projected query) or ``R = 0``
  for a NoPE model -- or, after a gather across ranks, one tensor ``[T, H, 512 + R]``.  bf16.
- ``kv_cache``: one layer's view ``[num_blocks, block_size, E]`` (or ``[num_blocks, block_size, 1, E]``) in its
  storage dtype: bf16 for ``auto`` / ``bfloat16``, fp8 e4m3 (or uint8) for ``fp8``, uint8 for ``fp8_ds_mla`` and
  ``nvfp4_ds_mla``.  Tokens are packed inside a block; blocks may sit further apart than ``block_size`` rows
  (a layout that interleaves the layers' pages per block), a whole number of rows apart.
- ``topk_indices``: int32 ``[T, K]`` rows of the flat view, ``row = block * (stride(0) / E) + offset``, already
  converted from request-local positions, -1 = no token, the valid entries compacted to the front;
  ``valid_counts``: int32 ``[T]``, how many.  ``K`` is the indexer's buffer width (2048, or 2176 for a pooled
  indexer: ``index_topk + kpool - 1`` rounded up to 128).
- the model's softmax scale (the layer's, YaRN factor included) and the layer's ``k_scale`` (a float).

It wants ``(out bf16 [T, H, 512], lse)`` back.  Here ``lse`` is fp32 ``[T, H]``, natural log, scale included.

The row size vLLM gives a cache comes from the dtype name alone (:func:`vllm_row_bytes`), so a NoPE model on
``fp8_ds_mla`` keeps the 656-byte row with a zero RoPE slot, read here with a 512-dim query and no padding (format
``fp8_ds_mla-nope``; ``nvfp4_ds_mla-nope`` likewise at 352 B).  A fork may reuse a name for another size: the
format is chosen by name *and* the cache's actual bytes per token (``formats.from_vllm``), and a size that is not
vLLM's is refused with the reason.

:class:`Workspace` owns every device buffer a call needs (outputs, the assembled query, split-KV partials), sized
once, so that a call launches kernels only: no allocation, no device-to-host read, and the same addresses on every
call -- what a captured CUDA graph needs.  The kernel plan of a call is a pure host function of the token count
(the valid counts are read on the device by the kernel, which clamps them to ``[0, K]``), so it is known before
capture and every replay of a graph of ``T`` tokens runs the plan of ``T`` tokens.  :class:`LayerAttention` is one
layer: its softmax scale, its cache view (checked once per cache tensor), and the call.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple, Union

import torch

from ... import host_entry
from ...formats import KVFormat, from_vllm
from ...plan import plan_attention, unavailable_set

V_DIM = 512
ROPE_DIM = 64
MAX_HEADS = 128

# vLLM's row size of the DS formats, whatever the head size (MLAAttention.get_kv_cache_spec)
_DS_ROW_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
# cache dtype names vLLM stores one byte per element for (uint8 or fp8 storage)
_ONE_BYTE_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
_TWO_BYTE_NAMES = ("bfloat16", "float16", "half")

Query = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# ------------------------------------------------------------------------------------------------------------
# sparsemla internals used by the contract (the only place that names them)
# ------------------------------------------------------------------------------------------------------------
def _device_facts(device: torch.device):
    """(compute capability, SM count, interpreter) of the device the kernels run on."""
    from ..._device import capability, interpreting, num_sms

    if device.type == "cuda":
        return capability(device), num_sms(device), interpreting()
    return (0, 0), 132, interpreting()


def _plan(fmt: KVFormat, num_tokens: int, num_heads: int, topk: int, facts, q_aligned: bool, kv_aligned: bool):
    """The kernel plan of one call (pure and cached: ``sparsemla.plan.plan_attention``)."""
    cap, sms, interp = facts
    return plan_attention(fmt, num_tokens, num_heads, topk, capability=cap, num_sms=sms, interpret=interp,
                          q_aligned=q_aligned, kv_aligned=kv_aligned, unavailable=unavailable_set())


def _split_elements(fmt: KVFormat, max_tokens: int, num_heads: int, topk: int, device: torch.device) -> int:
    """fp32 elements of split partials that cover every plan of up to ``max_tokens`` tokens."""
    from ...kernels.attention import runner_split_elements

    return runner_split_elements(fmt, max_tokens, num_heads, topk, device)


def _launch(plan, q, q_pe, rows, fmt, indices, sm_scale, valid_counts, k_scale, out, lse, split) -> None:
    """Run one planned call into the given buffers (kernel launches only; ``q_pe``: the RoPE part in a tensor of
    its own, or None)."""
    global _attention_fwd
    if _attention_fwd is None:  # the kernels' module on first use (it imports Triton); an import statement per
        from ...kernels.attention import attention_fwd as _attention_fwd  # call would cost ~1 us of host time
    _attention_fwd(q, rows, fmt, indices, sm_scale, plan=plan, valid_counts=valid_counts, k_scale=k_scale,
                   out=out, lse=lse, split_buffers=split, q_pe=q_pe)


_attention_fwd = None


def _wrap_cache(fmt: KVFormat, kv_cache: torch.Tensor):
    """A :class:`~sparsemla.cache.PagedKVCache` over one layer's tensor (no copy); ``.rows`` is the flat view."""
    from ...cache import PagedKVCache

    return PagedKVCache.from_tensor(fmt, kv_cache)


def _functional(mode: str, q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse) -> None:
    """One call through the functional API with a named backend (eager use: it may allocate)."""
    from ... import attention

    fn = attention.sparse_mla_decode if mode == "decode" else attention.sparse_mla_prefill
    fn(q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse=lse)


# ------------------------------------------------------------------------------------------------------------
# formats
# ------------------------------------------------------------------------------------------------------------
def _dtype_size(model_dtype) -> int:
    if isinstance(model_dtype, torch.dtype):
        return torch.empty((), dtype=model_dtype).element_size()
    return 2 if str(model_dtype).replace("torch.", "") in ("bfloat16", "bf16", "float16", "half") else 4


def vllm_row_bytes(kv_cache_dtype: str, head_size: int, model_dtype=torch.bfloat16) -> int:
    """The bytes per token vLLM 0.33 gives one MLA cache row of ``kv_cache_dtype``.

    ``fp8_ds_mla`` 656 and ``nvfp4_ds_mla`` 352 whatever the head size; otherwise ``head_size`` elements of the
    storage dtype (the model dtype for ``auto``, one byte for the fp8 names, two for ``bfloat16`` / ``float16``).
    This is what an unmodified vLLM allocates; :class:`LayerAttention` checks the actual tensor.
    """
    if kv_cache_dtype in _DS_ROW_BYTES:
        return _DS_ROW_BYTES[kv_cache_dtype]
    if kv_cache_dtype in _ONE_BYTE_NAMES:
        return head_size
    if kv_cache_dtype in _TWO_BYTE_NAMES:
        return 2 * head_size
    if kv_cache_dtype == "auto":
        return head_size * _dtype_size(model_dtype)
    return head_size


def resolve_format(kv_cache_dtype: str, head_size: int, bytes_per_token: Optional[int] = None,
                   model_dtype=torch.bfloat16) -> KVFormat:
    """The sparsemla format that reads a vLLM cache byte for byte.

    ``bytes_per_token`` is the cache's actual row size (default: :func:`vllm_row_bytes`).  Raises
    ``formats.UnsupportedFormat`` (a ``ValueError``) with the reason when no format matches.
    """
    if bytes_per_token is None:
        bytes_per_token = vllm_row_bytes(kv_cache_dtype, head_size, model_dtype)
    return from_vllm(kv_cache_dtype, head_size, int(bytes_per_token), model_dtype=model_dtype)


# ------------------------------------------------------------------------------------------------------------
# buffers
# ------------------------------------------------------------------------------------------------------------
class Workspace:
    """Capture-stable device buffers for every layer of one attention shape.

    Args:
        fmt: the cache format (:func:`resolve_format`).
        max_tokens: most query tokens of one call (vLLM: ``max_num_batched_tokens``).
        num_heads: query heads per call (1..128).
        topk: the widest index row (vLLM: the top-k buffer's width).
        device: where the buffers live.

    Buffers (allocated here, never again):
        out bf16 ``[max_tokens, H, 512]`` and lse fp32 ``[max_tokens, H]``: a call's results are views of their
        first ``T`` rows, valid until the next call on this workspace (vLLM consumes them right away: each layer's
        V up-projection follows its attention call, so one workspace serves every layer);
        split fp32: the split-KV partials of every plan of up to ``max_tokens`` tokens.

    The kernels read a ``(ql_nope, q_pe)`` pair where it lies.  A query they cannot read in place (a last dim
    that is not contiguous, or a functional-API backend, which takes one tensor) is copied into ``q``, bf16
    ``[max_tokens, H, head_dim]``, allocated at its first use (vLLM's warm-up runs, before any graph capture).
    """

    def __init__(self, fmt: KVFormat, max_tokens: int, num_heads: int, topk: int, device):
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"fmt: expected a KVFormat (resolve_format), got {type(fmt).__name__}")
        for name, value in (("max_tokens", max_tokens), ("num_heads", num_heads), ("topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_heads > MAX_HEADS:
            raise ValueError(f"num_heads: the kernels serve 1..{MAX_HEADS} heads per call, got {num_heads}")
        self.fmt = fmt
        self.max_tokens, self.num_heads, self.topk = max_tokens, num_heads, topk
        self.device = device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            self.device = device = torch.device("cuda", torch.cuda.current_device())
        self.device_index = device.index if device.type == "cuda" else -1  # as Tensor.get_device() gives it
        self.facts = _device_facts(device)
        self.out = torch.zeros((max_tokens, num_heads, V_DIM), dtype=torch.bfloat16, device=device)
        self.lse = torch.zeros((max_tokens, num_heads), dtype=torch.float32, device=device)
        self.q = None  # allocated at its first use (query_view)
        self.split = torch.empty(max(1, _split_elements(fmt, max_tokens, num_heads, topk, device)),
                                 dtype=torch.float32, device=device)
        # per token count: the output views and the plans (host time: slicing two tensors and a plan lookup cost
        # ~4 us a call, a dict lookup ~0.1 us); the plans are dropped when a kernel is marked unavailable
        self._views: dict = {}
        self._qviews: dict = {}
        self._plans: dict = {}
        self._plans_under = unavailable_set()
        weakref.finalize(self, host_entry.forget_id, id(self))  # (the host entry's records of its calls)

    @property
    def nbytes(self) -> int:
        """Device bytes held."""
        return sum(t.numel() * t.element_size() for t in (self.out, self.lse, self.q, self.split) if t is not None)

    def plan(self, num_tokens: int, q_aligned: bool = True, kv_aligned: bool = True):
        """The kernel plan of a call on ``num_tokens`` tokens (host only, cached)."""
        under = unavailable_set()
        if under is not self._plans_under:  # a kernel failed to build since: plan again
            self._plans.clear()
            self._plans_under = under
        key = (num_tokens, q_aligned, kv_aligned)
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = _plan(self.fmt, num_tokens, self.num_heads, self.topk, self.facts, q_aligned,
                                         kv_aligned)
        return p

    def views(self, num_tokens: int):
        """``(out, lse)``: the first ``num_tokens`` rows of the output buffers (the same views every call)."""
        v = self._views.get(num_tokens)
        if v is None:
            v = self._views[num_tokens] = (self.out[:num_tokens], self.lse[:num_tokens])
        return v

    def query_view(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows of the query buffer (the same view every call), which is allocated at
        the first call."""
        v = self._qviews.get(num_tokens)
        if v is None:
            if self.q is None:
                self.q = torch.zeros((self.max_tokens, self.num_heads, self.fmt.head_dim), dtype=torch.bfloat16,
                                     device=self.device)
            v = self._qviews[num_tokens] = self.q[:num_tokens]
        return v

    def prepare(self, *token_counts: int) -> None:
        """Plan the calls of a step on the host ahead of the forward (an engine's metadata build, outside graph
        capture); a captured call then finds its plan cached."""
        for t in token_counts:
            if 0 < t <= self.max_tokens:
                self.plan(int(t))

    def __repr__(self) -> str:
        return (f"Workspace({self.fmt.id}, max_tokens={self.max_tokens}, num_heads={self.num_heads}, "
                f"topk={self.topk}, {self.nbytes / 2**20:.1f} MiB on {self.device})")


# ------------------------------------------------------------------------------------------------------------
# one layer
# ------------------------------------------------------------------------------------------------------------
_BF16, _I32, _Tensor = torch.bfloat16, torch.int32, torch.Tensor
_CONFIGS: dict = {}  # a layer's settings -> the object the host entry's key holds for them


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned rows: the base address and the token / head strides (bf16 elements)."""
    return (t.data_ptr() & 15) == 0 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0


class LayerAttention:
    """Sparse MLA attention of one vLLM layer over vLLM's tensors.

    Args:
        workspace: the buffers (shared by every layer of the shape).
        kv_cache_dtype: vLLM's cache dtype name; head_size: 576, or 512 for a NoPE model.
        sm_scale: the model's softmax scale.
        model_dtype: the model dtype (``auto`` caches store it; bf16 is the only one read).
        backend: ``"native"`` (default: the kernel launcher on the workspace's buffers; graph-safe) or a
            backend name of the functional API (``"reference"``, ``"triton-staged"``, a peer), which runs
            eagerly and may allocate.
    """

    def __init__(self, workspace: Workspace, kv_cache_dtype: str, head_size: int, sm_scale: float, *,
                 model_dtype=torch.bfloat16, backend: str = "native"):
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace: expected a Workspace, got {type(workspace).__name__}")
        sm_scale = float(sm_scale)
        if not (sm_scale > 0 and sm_scale != float("inf")):
            raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale}")
        if workspace.fmt.head_dim != head_size:
            raise ValueError(f"head_size: the workspace's format {workspace.fmt.id} has head size "
                             f"{workspace.fmt.head_dim}, got {head_size}")
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected 'native' or a backend name, got {type(backend).__name__}")
        self.workspace = workspace
        self.fmt = workspace.fmt
        self.kv_cache_dtype, self.head_size, self.model_dtype = kv_cache_dtype, head_size, model_dtype
        self.sm_scale = sm_scale
        self.backend = backend
        self._native = backend == "native"
        # layers of equal settings share one object: the host entry's records hold for all of them
        self._config = _CONFIGS.setdefault((kv_cache_dtype, head_size, str(model_dtype), backend), object())
        self._view_key = None
        self._cache = None
        self._kv_aligned = False

    # --- the cache view (checked once per tensor) ----------------------------------------------------------
    def cache_view(self, kv_cache: torch.Tensor):
        """The :class:`~sparsemla.cache.PagedKVCache` over ``kv_cache`` (its ``.rows`` are what indices address).

        The format is checked against the tensor's actual bytes per token; a tensor seen before is not checked
        again (same address, shape, strides and dtype)."""
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        if key != self._view_key:
            if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() not in (3, 4):
                raise ValueError(f"kv_cache: expected one layer's [num_blocks, block_size, E] view, got "
                                 f"{getattr(kv_cache, 'shape', kv_cache)}")
            bpt = kv_cache.shape[-1] * kv_cache.element_size()
            fmt = resolve_format(self.kv_cache_dtype, self.head_size, bpt, self.model_dtype)
            if fmt != self.fmt:
                raise ValueError(f"kv_cache: its {bpt}-byte rows are {fmt.id}, the workspace holds {self.fmt.id}")
            cache = _wrap_cache(fmt, kv_cache)
            if cache.device != self.workspace.device:
                raise ValueError(f"kv_cache: expected it on {self.workspace.device}, got {cache.device}")
            self._cache, self._view_key = cache, key
            self._kv_aligned = (cache.rows.data_ptr() & 15) == 0
        return self._cache

    # --- the query ------------------------------------------------------------------------------------------
    def query(self, q: Query, num_tokens: int, workspace: Optional[Workspace] = None) -> torch.Tensor:
        """One bf16 ``[T, H, head_dim]`` query tensor with a contiguous last dim (:func:`assemble_query`)."""
        return assemble_query(q, self.fmt, self.workspace if workspace is None else workspace, num_tokens)

    # --- the call --------------------------------------------------------------------------------------------
    def forward(self, q: Query, kv_cache: torch.Tensor, indices: torch.Tensor, valid_counts: Optional[torch.Tensor],
                k_scale: float = 1.0, *, decode: bool = True, workspace: Optional[Workspace] = None):
        """Attend every query token to its top-k rows.

        Args:
            q: the ``(ql_nope, q_pe)`` pair or one ``[T, H, head_dim]`` tensor (module docstring).
            kv_cache: this layer's cache view.
            indices: int32 ``[T, K]`` rows of the cache's flat view, -1 = none, contiguous rows, ``K <= topk``.
            valid_counts: int32 ``[T]`` (entries at or past it are not read) or None.
            k_scale: the layer's k_scale (the plain ``fp8`` format's per-tensor scale; the others ignore it).
            decode: whether the tokens are decode tokens (only a functional-API backend distinguishes).
            workspace: the buffers to use (default: the one given at construction; an engine that runs several
                micro-batches side by side passes each its own).

        Returns:
            ``(out, lse)``: views of the workspace's buffers, bf16 ``[T, H, 512]`` and fp32 ``[T, H]``.
        """
        ws = self.workspace if workspace is None else workspace
        # a configuration served before: replayed by the compiled host entry (sparsemla.host_entry)
        r = host_entry.layer(ws, self._config, q, kv_cache, indices, valid_counts, self.sm_scale, k_scale) \
            if self._native else None
        if r.__class__ is tuple:
            return r
        ishape = indices.shape
        t = ishape[0]
        if t > ws.max_tokens:
            raise ValueError(f"indices: {t} query tokens exceed the workspace's max_tokens ({ws.max_tokens})")
        if indices.dtype is not _I32 or len(ishape) != 2 or indices.stride(1) != 1 or ishape[1] > ws.topk:
            raise ValueError(f"indices: expected int32 [T, K <= {ws.topk}] with contiguous rows, got {indices.dtype} "
                             f"{tuple(indices.shape)} strides {tuple(indices.stride())}")
        if valid_counts is not None and (valid_counts.dtype is not _I32 or valid_counts.shape != (t,)
                                         or (t > 1 and valid_counts.stride(0) != 1)
                                         or valid_counts.get_device() != ws.device_index):
            raise ValueError(f"valid_counts: expected contiguous int32 [{t}] on {ws.device}, got "
                             f"{valid_counts.dtype} {tuple(valid_counts.shape)} on {valid_counts.device}")
        if indices.get_device() != ws.device_index:
            raise ValueError(f"indices: expected them on {ws.device}, got {indices.device}")
        cache = self.cache_view(kv_cache)
        out, lse = ws.views(t)
        if self._native:
            qq, qpe, aligned = _query_in_place(q, self.fmt, ws, t)
            if t == 0:
                return out, lse
            plan = ws.plan(t, aligned, self._kv_aligned)
            # the launches recorded for later calls of this configuration, where the entry would read q and the rows
            # where the caller's tensors start
            rec = None
            if (r is not None and cache.rows.data_ptr() == kv_cache.data_ptr()
                    and qq is (q[0] if qpe is not None else q)):
                rec = host_entry.begin(r, host_entry.LAYER_SLOTS, qr_own=qpe is not None)
            try:
                _launch(plan, qq, qpe, cache.rows, self.fmt, indices, self.sm_scale, valid_counts, float(k_scale),
                        out, lse, ws.split)
                if rec is not None:
                    host_entry.commit(rec, out, lse)
            finally:
                if rec is not None:
                    host_entry.end()
        else:
            qq = assemble_query(q, self.fmt, ws, t)
            if t == 0:
                return out, lse
            _functional("decode" if decode else "prefill", qq, cache, indices, self.sm_scale, valid_counts,
                        float(k_scale), self.backend, out, lse)
        return out, lse


def _query_in_place(q: Query, fmt: KVFormat, ws: Workspace, t: int):
    """``(q, q_pe, aligned)``: :func:`query_parts` and whether both parts have 16-byte aligned rows.  The common
    cases -- vLLM's RoPE pair, one tensor -- are checked in one pass here (host time: a call is paid per layer);
    anything else goes through :func:`query_parts`, whose checks name what is wrong."""
    h, dev = ws.num_heads, ws.device_index
    if type(q) is tuple:
        if len(q) == 2 and fmt.rope_dim:
            qq, qpe = q
            if type(qq) is _Tensor and type(qpe) is _Tensor:
                ns, ps = qq.stride(), qpe.stride()
                if (qq.dtype is _BF16 and qpe.dtype is _BF16 and ns[2] == 1 and ps[2] == 1
                        and qq.shape == (t, h, V_DIM) and qpe.shape == (t, h, fmt.rope_dim)
                        and qq.get_device() == dev and qpe.get_device() == dev):
                    return qq, qpe, not ((qq.data_ptr() | qpe.data_ptr()) & 15 or (ns[0] | ns[1] | ps[0] | ps[1]) & 7)
    elif type(q) is _Tensor:
        qs = q.stride()
        if q.dtype is _BF16 and qs[2] == 1 and q.shape == (t, h, fmt.head_dim) and q.get_device() == dev:
            return q, None, not (q.data_ptr() & 15 or (qs[0] | qs[1]) & 7)
    qq, qpe = query_parts(q, fmt, ws, t)
    return qq, qpe, _aligned(qq) and (qpe is None or _aligned(qpe))


def query_parts(q: Query, fmt: KVFormat, ws: Workspace, num_tokens: int):
    """``(q, q_pe)``: the query as the kernels read it, checked.  ``q`` is bf16 ``[T, H, 512]`` and ``q_pe`` bf16
    ``[T, H, R]`` (both with a contiguous last dim, any token / head strides: a ``(ql_nope, q_pe)`` pair as it
    comes, no copy), or ``q`` is ``[T, H, head_dim]`` and ``q_pe`` None (a NoPE pair's ``ql_nope``, one tensor, or
    a query copied into ``ws.q`` because a last dim is strided)."""
    if isinstance(q, tuple):
        if len(q) != 2:
            raise ValueError(f"q: expected a (ql_nope, q_pe) pair, got {len(q)} tensors")
        q_nope, q_pe = q
        rope = fmt.rope_dim
        _check_q("q[0] (ql_nope)", q_nope, num_tokens, ws, V_DIM)
        if not isinstance(q_pe, torch.Tensor) or q_pe.shape[-1] != rope:
            raise ValueError(f"q[1] (q_pe): {fmt.id} rows hold {rope} RoPE dims, got q_pe of shape "
                             f"{tuple(getattr(q_pe, 'shape', ()))}")
        if not rope:
            return q_nope, None
        _check_q("q[1] (q_pe)", q_pe, num_tokens, ws, rope, contiguous=False)
        if q_pe.stride(2) == 1:
            return q_nope, q_pe
        return torch.cat((q_nope, q_pe), dim=-1, out=ws.query_view(num_tokens)), None
    _check_q("q", q, num_tokens, ws, fmt.head_dim, contiguous=False)
    if q.stride(2) == 1:
        return q, None
    buf = ws.query_view(num_tokens)
    buf.copy_(q)
    return buf, None


def assemble_query(q: Query, fmt: KVFormat, ws: Workspace, num_tokens: int) -> torch.Tensor:
    """The query as one bf16 ``[T, H, head_dim]`` tensor with a contiguous last dim (what the functional API takes):
    :func:`query_parts`, a pair concatenated into ``ws.q``."""
    qq, q_pe = query_parts(q, fmt, ws, num_tokens)
    if q_pe is None:
        return qq
    return torch.cat((qq, q_pe), dim=-1, out=ws.query_view(num_tokens))


def _check_q(name: str, q: torch.Tensor, t: int, ws: Workspace, d: int, contiguous: bool = True) -> None:
    h = ws.num_heads
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3:
        raise ValueError(f"{name}: expected a bf16 [T, H, {d}] tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    if q.shape[0] != t or q.shape[1] != h or q.shape[2] != d:
        raise ValueError(f"{name}: expected shape [{t}, {h}, {d}] (tokens of indices, the workspace's heads), "
                         f"got {tuple(q.shape)}")
    if contiguous and q.stride(2) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (strides {tuple(q.stride())})")
    if q.get_device() != ws.device_index:
        raise ValueError(f"{name}: expected it on {ws.device}, got {q.device}")


__all__ = ["Workspace", "LayerAttention", "assemble_query", "query_parts", "resolve_format", "vllm_row_bytes", "V_DIM",
           "MAX_HEADS"]
