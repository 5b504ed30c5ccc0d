"""The peers' attention kernels on prepared inputs, for timing beside ours in one process.

Each builder takes one decode or prefill problem (a :class:`~sparsemla.bench.workload.Workload` over a
cache of the format the peer reads) and returns a call with no arguments that runs only the peer's kernel
launch(es): every one-time step (metadata, plans, q padded to the peer's head count, page tables) happens
in the builder, outside the timed call, as an engine would do it once per step for all layers.

* FlashMLA's Hopper kernels (``pip install sgl-flash-mla``, import ``flash_mla``), fp8_ds_mla rows of 656 B:
  decode ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=, use_legacy=True)`` with q padded to 64
  or 128 heads (the only counts its sparse decode takes); prefill ``flash_mla_sparse_fwd(q, kv, indices,
  sm_scale, 512, use_legacy=True)`` over bf16 rows.  Its indices are ``block * 64 + offset``, which is what a
  cache row index is when the block stride is 64 rows.
* FlashInfer's ``BatchMLAPagedAttentionWrapper`` (backend ``fa3``), bf16 and per-tensor fp8 rows, page
  size 1: each query's top-k rows are its page table.

A builder raises :class:`PeerUnavailable` (with the reason) when the package is missing or cannot serve the
problem; the drivers record the reason and go on.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

V_DIM = 512


class PeerUnavailable(RuntimeError):
    pass


def _import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception as e:  # missing, or built for another torch / CUDA
        raise PeerUnavailable(f"{name} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:120]})")


def flashmla_heads(h: int) -> int:
    """The head count FlashMLA's sparse kernels run for ``h`` query heads (64 or 128)."""
    if h > 128:
        raise PeerUnavailable(f"FlashMLA's sparse kernels take at most 128 heads, got {h}")
    return 64 if h <= 64 else 128


def flashmla_decode(wl) -> Callable[[], object]:
    """FlashMLA sparse decode on an fp8_ds_mla (656 B) cache; q padded to 64 / 128 heads."""
    if wl.fmt.id != "fp8_ds_mla":
        raise PeerUnavailable(f"FlashMLA's sparse decode reads fp8_ds_mla rows, not {wl.fmt.id}")
    if wl.cache.block_stride_rows != wl.cache.block_size:
        raise PeerUnavailable("FlashMLA needs a cache whose block stride equals its block size")
    fm = _import("flash_mla")
    t, h, d = wl.q.shape
    hp = flashmla_heads(h)
    rows = wl.cache.rows
    bs = wl.cache.block_size
    k_cache = rows.view(rows.shape[0] // bs, bs, 1, rows.shape[1])
    q = torch.zeros(t, 1, hp, d, dtype=torch.bfloat16, device=wl.q.device)
    q[:, 0, :h] = wl.q
    idx = wl.indices.masked_fill(
        torch.arange(wl.indices.shape[1], device=wl.q.device)[None] >= wl.valid_counts[:, None], -1)
    idx = idx.view(t, 1, -1).contiguous()
    gm = fm.get_mla_metadata
    params = inspect.signature(gm).parameters
    if all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in params.values()):
        meta, splits = gm()
    else:  # releases that plan from per-request lengths and the head layout
        k = idx.shape[-1]
        meta, splits = gm(torch.full((t,), k, dtype=torch.int32, device=q.device), hp, 1, hp, True, k)
    sm = wl.sm_scale
    return lambda: fm.flash_mla_with_kvcache(q, k_cache, None, None, V_DIM, meta, splits, sm, False,
                                             is_fp8_kvcache=True, indices=idx, use_legacy=True)


def flashmla_prefill(wl, kv_bf16: torch.Tensor) -> Callable[[], object]:
    """FlashMLA sparse prefill over bf16 rows ``kv_bf16 [rows, 576]`` (indices are its rows)."""
    fm = _import("flash_mla")
    if not hasattr(fm, "flash_mla_sparse_fwd"):
        raise PeerUnavailable("this flash_mla has no flash_mla_sparse_fwd")
    t, h, d = wl.q.shape
    hp = flashmla_heads(h)
    q = torch.zeros(t, hp, d, dtype=torch.bfloat16, device=wl.q.device)
    q[:, :h] = wl.q
    idx = wl.indices.masked_fill(
        torch.arange(wl.indices.shape[1], device=wl.q.device)[None] >= wl.valid_counts[:, None], -1)
    kv = kv_bf16[:, None]
    idx = idx[:, None].contiguous()
    sm = wl.sm_scale
    return lambda: fm.flash_mla_sparse_fwd(q, kv, idx, sm, V_DIM, use_legacy=True)


def flashinfer_attention(wl, workspace_bytes: int = 128 << 20) -> Callable[[], object]:
    """FlashInfer's MLA wrapper (fa3, page size 1) on a bf16 or per-tensor fp8 cache; one plan, timed run()."""
    if wl.fmt.id not in ("bf16", "fp8"):
        raise PeerUnavailable(f"FlashInfer's MLA kernels read bf16 or fp8 rows, not {wl.fmt.id}")
    fi = _import("flashinfer.mla")
    dev = wl.q.device
    t, h, d = wl.q.shape
    rope = d - V_DIM
    if rope <= 0:
        raise PeerUnavailable("FlashInfer's MLA wrapper needs the RoPE part")
    kv_dtype = torch.float8_e4m3fn if wl.fmt.id == "fp8" else torch.bfloat16
    vals = wl.cache.rows.view(kv_dtype)
    ckv, kpe = vals[:, :V_DIM].unsqueeze(1), vals[:, V_DIM:V_DIM + rope].unsqueeze(1)
    # Page size 1: a token's valid rows, in order, are its pages.
    valid = torch.arange(wl.indices.shape[1], device=dev)[None] < wl.valid_counts[:, None]
    valid &= wl.indices >= 0
    lens = valid.sum(1).to(torch.int32)
    pages = wl.indices[valid].contiguous()
    kv_indptr = torch.zeros(t + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    qo_indptr = torch.arange(t + 1, dtype=torch.int32, device=dev)
    w = fi.BatchMLAPagedAttentionWrapper(torch.empty(workspace_bytes, dtype=torch.uint8, device=dev), backend="fa3")
    w.plan(qo_indptr, kv_indptr, pages, lens, h, V_DIM, rope, 1, False, wl.sm_scale, torch.bfloat16, kv_dtype)
    qn, qp = wl.q[..., :V_DIM].contiguous(), wl.q[..., V_DIM:].contiguous()
    kw = {}
    if wl.fmt.id == "fp8" and "ckv_scale" in inspect.signature(w.run).parameters:
        kw = {"ckv_scale": wl.k_scale, "kpe_scale": wl.k_scale}
    return lambda: w.run(qn, qp, ckv, kpe, return_lse=True, **kw)


PEER_FORMATS = {"flashmla": ("fp8_ds_mla",), "flashinfer": ("bf16", "fp8")}
DECODE_BUILDERS = {"flashmla": flashmla_decode, "flashinfer": flashinfer_attention}

__all__ = ["PeerUnavailable", "flashmla_heads", "flashmla_decode", "flashmla_prefill", "flashinfer_attention",
           "PEER_FORMATS", "DECODE_BUILDERS"]
