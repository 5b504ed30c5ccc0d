"""The bad-input sweep over the public API: every class of bad input raises a named error.

Functional calls (``sparse_mla_decode`` / ``sparse_mla_prefill``), the runner (``SparseMLA`` construction,
``plan``, ``run``), ``PagedKVCache`` (construction, views, ``write``, ``read``), ``convert_indices`` and the
CLI.  For each case the call must raise the named exception class with a message that starts with the
argument's name (``"q: expected ..."``), or for the CLI exit with status 2 and name the flag, without a
traceback.  Nothing may crash or be silently accepted.

Index values are checked against the cache only on request (``check=True``, a device sync); the cases for
out-of-range entries pass it.  What the host knows is always checked: shapes, dtypes, devices, scales, and
in the runner every block a request's context needs against the cache, at plan time.

Non-finite input to cache writes follows one policy on every path (the PyTorch encoder, the Triton write,
``PagedKVCache.write`` on each device): either every path raises ``ValueError`` naming the argument and
leaves the cache untouched, or every path stores the same bytes and the other tokens of the write are
unaffected (``docs/reliability.md``).

Runs on the CPU (Triton interpreter) and, unchanged, on a GPU (``python3 -m pytest tests/test_bad_inputs.py``).
"""
import math
import os
import re
import sys

import pytest
import torch

import sparsemla
from sparsemla import PagedKVCache, get_format

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import reliab_runner  # noqa: E402
from reliab_cases import POISON, format_ids  # noqa: E402

NAN, INF = float("nan"), float("inf")
FMT = "fp8_ds_mla"
BS = 16


class Env:
    """Valid arguments on one device; each case changes one of them."""

    def __init__(self, device):
        self.dev = device
        g = torch.Generator().manual_seed(0)
        self.cache = PagedKVCache(FMT, 4, BS, device)                        # 64 rows
        self.cache8 = PagedKVCache("fp8", 4, BS, device)
        n = self.cache.num_slots
        kv, pe = torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g)
        rows = self.cache.slot_to_row(torch.arange(n))
        for c in (self.cache, self.cache8):  # the encoder's bytes (the write path has its own tests)
            c.rows[rows.to(device)] = c.fmt.encode(kv, pe).to(device)
        self.q = torch.randn(3, 4, 576, generator=g).to(torch.bfloat16).to(device)
        self.idx = torch.randint(0, 64, (3, 8), generator=g, dtype=torch.int32).to(device)
        self.vc = torch.tensor([8, 3, 0], dtype=torch.int32, device=device)
        self.ws = torch.randn(40, 576, generator=g).to(torch.bfloat16).to(device)
        self.ws_idx = torch.randint(0, 40, (3, 8), generator=g, dtype=torch.int32).to(device)

    def decode(self, **kw):
        a = dict(q=self.q, cache=self.cache, indices=self.idx, sm_scale=0.1, valid_counts=self.vc)
        a.update(kw)
        return sparsemla.sparse_mla_decode(**a)

    def prefill(self, **kw):
        a = dict(q=self.q, kv=self.ws, indices=self.ws_idx, sm_scale=0.1)
        a.update(kw)
        return sparsemla.sparse_mla_prefill(**a)


_ENVS = {}


def env(device) -> Env:
    """One Env per device for the whole sweep (the cases only read it)."""
    if device not in _ENVS:
        _ENVS[device] = Env(device)
    return _ENVS[device]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _strided_q(e):
    return torch.zeros(3, 4, 1152, dtype=torch.bfloat16, device=e.dev)[..., ::2]


# (id, call, exception, argument the message must start with)
FUNCTIONAL = [
    # q
    ("q-list", lambda e: e.decode(q=e.q.tolist()), TypeError, "q"),
    ("q-float32", lambda e: e.decode(q=e.q.float()), TypeError, "q"),
    ("q-float16", lambda e: e.decode(q=e.q.half()), TypeError, "q"),
    ("q-int", lambda e: e.decode(q=e.q.to(torch.int32)), TypeError, "q"),
    ("q-2d", lambda e: e.decode(q=e.q[:, 0]), ValueError, "q"),
    ("q-head-dim", lambda e: e.decode(q=e.q[..., :575]), ValueError, "q"),
    ("q-nope-dim-on-rope-cache", lambda e: e.decode(q=e.q[..., :512].contiguous()), ValueError, "q"),
    ("q-no-heads", lambda e: e.decode(q=e.q[:, :0]), ValueError, "q"),
    ("q-129-heads", lambda e: e.decode(q=torch.zeros(3, 129, 576, dtype=torch.bfloat16, device=e.dev)),
     ValueError, "q"),
    ("q-last-dim-strided", lambda e: e.decode(q=_strided_q(e)), ValueError, "q"),
    ("q-other-device", lambda e: e.decode(q=meta(3, 4, 576)), ValueError, "(q|cache)"),
    ("q-tokens-vs-indices", lambda e: e.decode(q=e.q[:2]), ValueError, "(indices|q)"),
    # cache / kv
    ("cache-tensor", lambda e: e.decode(cache=e.cache.rows), TypeError, "cache"),
    ("cache-none", lambda e: e.decode(cache=None), TypeError, "cache"),
    ("kv-list", lambda e: e.prefill(kv=[1, 2]), TypeError, "kv"),
    ("kv-float32", lambda e: e.prefill(kv=e.ws.float()), TypeError, "kv"),
    ("kv-width", lambda e: e.prefill(kv=e.ws[:, :100].contiguous()), ValueError, "kv"),
    ("kv-not-contiguous", lambda e: e.prefill(kv=torch.zeros(576, 40, dtype=torch.bfloat16, device=e.dev).t()),
     ValueError, "kv"),
    ("kv-3d", lambda e: e.prefill(kv=e.ws[None]), ValueError, "kv"),
    ("kv-nope-for-rope-q", lambda e: e.prefill(kv=e.ws[:, :512].contiguous()), ValueError, "(q|kv)"),
    ("kv-other-device", lambda e: e.prefill(kv=meta(40, 576)), ValueError, "(kv|q)"),
    # indices
    ("indices-int64", lambda e: e.decode(indices=e.idx.long()), TypeError, "indices"),
    ("indices-float", lambda e: e.decode(indices=e.idx.float()), TypeError, "indices"),
    ("indices-bool", lambda e: e.decode(indices=e.idx > 3), TypeError, "indices"),
    ("indices-list", lambda e: e.decode(indices=e.idx.tolist()), TypeError, "indices"),
    ("indices-1d", lambda e: e.decode(indices=e.idx[0]), ValueError, "indices"),
    ("indices-3d", lambda e: e.decode(indices=e.idx[None]), ValueError, "indices"),
    ("indices-rows", lambda e: e.decode(indices=e.idx[:2]), ValueError, "indices"),
    ("indices-no-columns", lambda e: e.decode(indices=e.idx[:, :0]), ValueError, "indices"),
    ("indices-columns-strided", lambda e: e.decode(indices=e.idx.t().contiguous().t()), ValueError, "indices"),
    ("indices-other-device", lambda e: e.decode(indices=meta(3, 8, dtype=torch.int32)), ValueError, "indices"),
    ("indices-past-cache-checked", lambda e: e.decode(indices=torch.full_like(e.idx, 64), valid_counts=None,
                                                      check=True), ValueError, "indices"),
    ("indices-far-past-cache-checked", lambda e: e.decode(indices=torch.full_like(e.idx, 2 ** 31 - 1),
                                                          valid_counts=None, check=True), ValueError, "indices"),
    ("indices-below-minus-one-checked", lambda e: e.decode(indices=torch.full_like(e.idx, -2), check=True),
     ValueError, "indices"),
    ("indices-past-workspace-checked", lambda e: e.prefill(indices=torch.full_like(e.ws_idx, 40), check=True),
     ValueError, "indices"),
    # valid_counts
    ("valid-counts-int64", lambda e: e.decode(valid_counts=e.vc.long()), TypeError, "valid_counts"),
    ("valid-counts-float", lambda e: e.decode(valid_counts=e.vc.float()), TypeError, "valid_counts"),
    ("valid-counts-bool", lambda e: e.decode(valid_counts=e.vc > 0), TypeError, "valid_counts"),
    ("valid-counts-list", lambda e: e.decode(valid_counts=[8, 3, 0]), TypeError, "valid_counts"),
    ("valid-counts-shape", lambda e: e.decode(valid_counts=torch.zeros(4, dtype=torch.int32, device=e.dev)),
     ValueError, "valid_counts"),
    ("valid-counts-2d", lambda e: e.decode(valid_counts=e.vc[:, None]), ValueError, "valid_counts"),
    ("valid-counts-strided", lambda e: e.decode(valid_counts=torch.zeros(6, dtype=torch.int32, device=e.dev)[::2]),
     ValueError, "valid_counts"),
    ("valid-counts-negative-checked", lambda e: e.decode(valid_counts=torch.tensor([8, -1, 0], dtype=torch.int32,
                                                                                    device=e.dev), check=True),
     ValueError, "valid_counts"),
    ("valid-counts-other-device", lambda e: e.decode(valid_counts=meta(3, dtype=torch.int32)), ValueError,
     "valid_counts"),
    # sm_scale
    ("sm-scale-zero", lambda e: e.decode(sm_scale=0.0), ValueError, "sm_scale"),
    ("sm-scale-negative", lambda e: e.decode(sm_scale=-0.1), ValueError, "sm_scale"),
    ("sm-scale-nan", lambda e: e.decode(sm_scale=NAN), ValueError, "sm_scale"),
    ("sm-scale-inf", lambda e: e.decode(sm_scale=INF), ValueError, "sm_scale"),
    ("sm-scale-fp32-overflow", lambda e: e.decode(sm_scale=1e39), ValueError, "sm_scale"),
    ("sm-scale-fp32-underflow", lambda e: e.decode(sm_scale=1e-50), ValueError, "sm_scale"),
    ("sm-scale-bool", lambda e: e.decode(sm_scale=True), TypeError, "sm_scale"),
    ("sm-scale-str", lambda e: e.decode(sm_scale="0.1"), TypeError, "sm_scale"),
    ("sm-scale-none", lambda e: e.decode(sm_scale=None), TypeError, "sm_scale"),
    ("sm-scale-tensor", lambda e: e.decode(sm_scale=torch.tensor(0.1)), TypeError, "sm_scale"),
    # k_scale (the plain fp8 format's values depend on it; every format rejects a bad one)
    ("k-scale-zero", lambda e: e.decode(cache=e.cache8, k_scale=0.0), ValueError, "k_scale"),
    ("k-scale-negative", lambda e: e.decode(cache=e.cache8, k_scale=-1.0), ValueError, "k_scale"),
    ("k-scale-nan", lambda e: e.decode(cache=e.cache8, k_scale=NAN), ValueError, "k_scale"),
    ("k-scale-inf", lambda e: e.decode(cache=e.cache8, k_scale=INF), ValueError, "k_scale"),
    ("k-scale-fp32-overflow", lambda e: e.decode(cache=e.cache8, k_scale=1e60), ValueError, "k_scale"),
    ("k-scale-fp32-underflow", lambda e: e.decode(cache=e.cache8, k_scale=1e-60), ValueError, "k_scale"),
    ("k-scale-fp32-overflow-triton", lambda e: e.decode(cache=e.cache8, k_scale=1e60, backend="triton"),
     ValueError, "k_scale"),
    ("k-scale-fp32-underflow-triton", lambda e: e.decode(cache=e.cache8, k_scale=1e-60, backend="triton"),
     ValueError, "k_scale"),
    ("k-scale-fp32-overflow-staged", lambda e: e.decode(k_scale=1e60, backend="triton-staged"), ValueError,
     "k_scale"),
    ("k-scale-nan-ds-format", lambda e: e.decode(k_scale=NAN), ValueError, "k_scale"),
    ("k-scale-bool", lambda e: e.decode(cache=e.cache8, k_scale=True), TypeError, "k_scale"),
    ("k-scale-str", lambda e: e.decode(cache=e.cache8, k_scale="1"), TypeError, "k_scale"),
    ("k-scale-none", lambda e: e.decode(cache=e.cache8, k_scale=None), TypeError, "k_scale"),
    ("k-scale-two-elements", lambda e: e.decode(cache=e.cache8, k_scale=torch.ones(2)), ValueError, "k_scale"),
    # backend
    ("backend-unknown", lambda e: e.decode(backend="no-such-backend"), ValueError, "backend"),
    ("backend-int", lambda e: e.decode(backend=3), TypeError, "backend"),
    ("backend-none-of-ours", lambda e: e.decode(backend=object()), TypeError, "backend"),
    # out / lse
    ("out-float32", lambda e: e.decode(out=torch.empty(3, 4, 512, device=e.dev)), TypeError, "out"),
    ("out-shape", lambda e: e.decode(out=torch.empty(3, 4, 576, dtype=torch.bfloat16, device=e.dev)),
     ValueError, "out"),
    ("out-heads", lambda e: e.decode(out=torch.empty(3, 5, 512, dtype=torch.bfloat16, device=e.dev)),
     ValueError, "out"),
    ("out-last-dim-strided", lambda e: e.decode(out=torch.empty(3, 4, 1024, dtype=torch.bfloat16,
                                                                device=e.dev)[..., ::2]), ValueError, "out"),
    ("out-other-device", lambda e: e.decode(out=meta(3, 4, 512)), ValueError, "out"),
    ("out-list", lambda e: e.decode(out=[0.0]), TypeError, "out"),
    ("lse-bf16", lambda e: e.decode(lse=torch.empty(3, 4, dtype=torch.bfloat16, device=e.dev)), TypeError, "lse"),
    ("lse-shape", lambda e: e.decode(lse=torch.empty(3, 5, device=e.dev)), ValueError, "lse"),
    ("lse-3d", lambda e: e.decode(lse=torch.empty(3, 4, 1, device=e.dev)), ValueError, "lse"),
    ("lse-other-device", lambda e: e.decode(lse=meta(3, 4, dtype=torch.float32)), ValueError, "lse"),
]


def _cache(**kw):
    a = dict(fmt=FMT, num_blocks=4, block_size=BS)
    a.update(kw)
    return PagedKVCache(a.pop("fmt"), a.pop("num_blocks"), a.pop("block_size"), **a)


def _write(e, cache=None, **kw):
    cache = cache or e.cache
    a = dict(kv_c=torch.randn(5, 512, device=e.dev), k_pe=torch.randn(5, 64, device=e.dev),
             slot_mapping=torch.arange(5, dtype=torch.int32, device=e.dev))
    a.update(kw)
    return cache.write(a.pop("kv_c"), a.pop("k_pe"), a.pop("slot_mapping"), **a)


def _from_tensor(data, fmt=FMT):
    return PagedKVCache.from_tensor(fmt, data)


CACHE = [
    ("fmt-unknown", lambda e: _cache(fmt="fp9"), ValueError, "fmt"),
    ("fmt-int", lambda e: _cache(fmt=3), TypeError, "fmt"),
    ("num-blocks-zero", lambda e: _cache(num_blocks=0), ValueError, "num_blocks"),
    ("num-blocks-negative", lambda e: _cache(num_blocks=-1), ValueError, "num_blocks"),
    ("num-blocks-float", lambda e: _cache(num_blocks=4.0), TypeError, "num_blocks"),
    ("num-blocks-bool", lambda e: _cache(num_blocks=True), TypeError, "num_blocks"),
    ("block-size-zero", lambda e: _cache(block_size=0), ValueError, "block_size"),
    ("block-size-float", lambda e: _cache(block_size=16.0), TypeError, "block_size"),
    ("block-stride-below-size", lambda e: _cache(block_stride_rows=8), ValueError, "block_stride_rows"),
    ("block-stride-float", lambda e: _cache(block_stride_rows=20.0), TypeError, "block_stride_rows"),
    ("from-tensor-float", lambda e: _from_tensor(torch.zeros(4, BS, 656)), TypeError, "data"),
    ("from-tensor-int32", lambda e: _from_tensor(torch.zeros(4, BS, 164, dtype=torch.int32)), TypeError, "data"),
    ("from-tensor-two-heads", lambda e: _from_tensor(torch.zeros(4, BS, 2, 656, dtype=torch.uint8)), ValueError,
     "data"),
    ("from-tensor-2d", lambda e: _from_tensor(torch.zeros(64, 656, dtype=torch.uint8)), ValueError, "data"),
    ("from-tensor-row-bytes", lambda e: _from_tensor(torch.zeros(4, BS, 576, dtype=torch.uint8)), ValueError, "data"),
    ("from-tensor-not-packed", lambda e: _from_tensor(torch.zeros(4, 2 * BS, 656, dtype=torch.uint8)[:, ::2]),
     ValueError, "data"),
    ("from-tensor-stride-not-rows", lambda e: _from_tensor(torch.zeros(4 * (BS * 656 + 8), dtype=torch.uint8)
                                                           .as_strided((4, BS, 656), (BS * 656 + 8, 656, 1))),
     ValueError, "data"),
    ("from-budget-too-small", lambda e: PagedKVCache.from_budget(FMT, 1000, BS), ValueError, "nbytes"),
    ("from-budget-float", lambda e: PagedKVCache.from_budget(FMT, 1e9, BS), TypeError, "nbytes"),
    # write
    ("write-kv-int", lambda e: _write(e, kv_c=torch.zeros(5, 512, dtype=torch.int32, device=e.dev)), TypeError, "kv_c"),
    ("write-kv-float64", lambda e: _write(e, kv_c=torch.zeros(5, 512, dtype=torch.float64, device=e.dev)),
     TypeError, "kv_c"),
    ("write-kv-list", lambda e: _write(e, kv_c=[[0.0] * 512] * 5), TypeError, "kv_c"),
    ("write-kv-width", lambda e: _write(e, kv_c=torch.zeros(5, 511, device=e.dev)), ValueError, "kv_c"),
    ("write-kv-1d", lambda e: _write(e, kv_c=torch.zeros(512, device=e.dev)), ValueError, "kv_c"),
    ("write-kv-other-device", lambda e: _write(e, kv_c=meta(5, 512, dtype=torch.float32)), ValueError, "kv_c"),
    ("write-pe-missing", lambda e: _write(e, k_pe=None), ValueError, "k_pe"),
    ("write-pe-for-nope", lambda e: _write(e, cache=PagedKVCache("fp8_ds_mla-nope", 4, BS, e.dev)), ValueError, "k_pe"),
    ("write-pe-shape", lambda e: _write(e, k_pe=torch.zeros(5, 32, device=e.dev)), ValueError, "k_pe"),
    ("write-pe-rows", lambda e: _write(e, k_pe=torch.zeros(4, 64, device=e.dev)), ValueError, "k_pe"),
    ("write-pe-int", lambda e: _write(e, k_pe=torch.zeros(5, 64, dtype=torch.int32, device=e.dev)), TypeError, "k_pe"),
    ("write-slots-float", lambda e: _write(e, slot_mapping=torch.arange(5., device=e.dev)), TypeError, "slot_mapping"),
    ("write-slots-bool", lambda e: _write(e, slot_mapping=torch.ones(5, dtype=torch.bool, device=e.dev)),
     TypeError, "slot_mapping"),
    ("write-slots-list", lambda e: _write(e, slot_mapping=[0, 1, 2, 3, 4]), TypeError, "slot_mapping"),
    ("write-slots-length", lambda e: _write(e, slot_mapping=torch.arange(4, dtype=torch.int32, device=e.dev)),
     ValueError, "slot_mapping"),
    ("write-slots-2d", lambda e: _write(e, slot_mapping=torch.arange(5, dtype=torch.int32, device=e.dev)[:, None]),
     ValueError, "slot_mapping"),
    ("write-slot-past-cache", lambda e: _write(e, slot_mapping=torch.tensor([0, 1, 2, 3, 64], dtype=torch.int32,
                                                                             device=e.dev), check=True), ValueError, "slot_mapping"),
    ("write-slot-below-minus-one", lambda e: _write(e, slot_mapping=torch.tensor([0, 1, -2, 3, 4], dtype=torch.int32,
                                                                                  device=e.dev), check=True), ValueError,
     "slot_mapping"),
    ("write-slot-twice", lambda e: _write(e, slot_mapping=torch.tensor([0, 1, 2, 1, 4], dtype=torch.int32,
                                                                        device=e.dev), check=True), ValueError, "slot_mapping"),
    ("write-k-scale-zero", lambda e: _write(e, cache=e.cache8, k_scale=0.0), ValueError, "k_scale"),
    ("write-k-scale-nan", lambda e: _write(e, cache=e.cache8, k_scale=NAN), ValueError, "k_scale"),
    ("write-k-scale-fp32-overflow", lambda e: _write(e, cache=e.cache8, k_scale=1e60), ValueError, "k_scale"),
    ("write-k-scale-bool", lambda e: _write(e, cache=e.cache8, k_scale=True), TypeError, "k_scale"),
    # read
    ("read-rows-past-cache", lambda e: e.cache.read(torch.tensor([0, 64])), ValueError, "rows"),
    ("read-rows-negative", lambda e: e.cache.read(torch.tensor([-1])), ValueError, "rows"),
    ("read-rows-float", lambda e: e.cache.read(torch.tensor([0.0])), TypeError, "rows"),
]


def _convert(e, **kw):
    a = dict(topk_local=torch.randint(0, 40, (3, 8), dtype=torch.int32, device=e.dev),
             req_id_per_token=torch.tensor([0, 1, 1], dtype=torch.int32, device=e.dev),
             block_table=torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32, device=e.dev), block_size=BS)
    a.update(kw)
    return sparsemla.convert_indices(**a)


CONVERT = [
    ("topk-float", lambda e: _convert(e, topk_local=torch.zeros(3, 8, device=e.dev)), TypeError, "topk_local"),
    ("topk-bool", lambda e: _convert(e, topk_local=torch.zeros(3, 8, dtype=torch.bool, device=e.dev)), TypeError,
     "topk_local"),
    ("topk-list", lambda e: _convert(e, topk_local=[[0] * 8] * 3), TypeError, "topk_local"),
    ("topk-1d", lambda e: _convert(e, topk_local=torch.zeros(8, dtype=torch.int32, device=e.dev)), ValueError,
     "topk_local"),
    ("topk-below-minus-one", lambda e: _convert(e, topk_local=torch.full((3, 8), -3, dtype=torch.int32, device=e.dev),
                                                check=True), ValueError, "topk_local"),
    ("req-float", lambda e: _convert(e, req_id_per_token=torch.zeros(3, device=e.dev)), TypeError, "req_id_per_token"),
    ("req-shape", lambda e: _convert(e, req_id_per_token=torch.zeros(2, dtype=torch.int32, device=e.dev)),
     ValueError, "req_id_per_token"),
    ("req-out-of-table", lambda e: _convert(e, req_id_per_token=torch.tensor([0, 1, 2], dtype=torch.int32,
                                                                              device=e.dev), check=True),
     ValueError, "req_id_per_token"),
    ("req-other-device", lambda e: _convert(e, req_id_per_token=meta(3, dtype=torch.int32)), ValueError,
     "req_id_per_token"),
    ("table-float", lambda e: _convert(e, block_table=torch.zeros(2, 3, device=e.dev)), TypeError, "block_table"),
    ("table-1d", lambda e: _convert(e, block_table=torch.zeros(3, dtype=torch.int32, device=e.dev)), ValueError,
     "block_table"),
    ("block-size-zero", lambda e: _convert(e, block_size=0), ValueError, "block_size"),
    ("block-size-bool", lambda e: _convert(e, block_size=True), TypeError, "block_size"),
    ("block-size-float", lambda e: _convert(e, block_size=16.0), TypeError, "block_size"),
    ("block-stride-below-size", lambda e: _convert(e, block_stride_rows=8), ValueError, "block_stride_rows"),
    ("workspace-start-shape", lambda e: _convert(e, workspace_start=torch.zeros(3, dtype=torch.int32, device=e.dev)),
     ValueError, "workspace_start"),
    ("workspace-start-float", lambda e: _convert(e, workspace_start=torch.zeros(2, device=e.dev)), TypeError,
     "workspace_start"),
    ("out-int64", lambda e: _convert(e, out=torch.empty(3, 8, dtype=torch.int64, device=e.dev)), TypeError, "out"),
    ("out-shape", lambda e: _convert(e, out=torch.empty(3, 9, dtype=torch.int32, device=e.dev)), ValueError, "out"),
]


# --------------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------------
def _runner(e, cache=None, **kw):
    a = dict(max_tokens=8, max_requests=4, max_blocks_per_request=4, num_heads=4, head_dim=576, topk=16,
             fmt=FMT, block_size=BS, device=e.dev, sm_scale=0.1)
    a.update(kw)
    return reliab_runner.make_runner(cache or e.cache, **a)


def _md(e, tables=((0,), (1, 2)), seq=(10, 20), qlens=(1, 1)):
    return sparsemla.BatchMetadata.from_lists(list(qlens), list(seq), [list(t) for t in tables])


def _planned(e):
    r = _runner(e)
    reliab_runner.plan(r, _md(e), e.cache)
    return r


def _topk(e, t=2, k=16, dtype=torch.int32):
    return torch.randint(0, 10, (t, k), device=e.dev).to(dtype)


def _no_sm_scale(e):
    a = dict(max_tokens=8, max_requests=4, max_blocks_per_request=4, num_heads=4, head_dim=576, topk=16,
             fmt=FMT, block_size=BS, device=e.dev)
    return reliab_runner.make_runner(e.cache, **a)


RUNNER = [
    ("sm-scale-required", _no_sm_scale, TypeError, "sm_scale"),
    ("sm-scale-nan", lambda e: _runner(e, sm_scale=NAN), ValueError, "sm_scale"),
    ("sm-scale-bool", lambda e: _runner(e, sm_scale=True), TypeError, "sm_scale"),
    ("max-tokens-zero", lambda e: _runner(e, max_tokens=0), ValueError, "max_tokens"),
    ("max-tokens-bool", lambda e: _runner(e, max_tokens=True), TypeError, "max_tokens"),
    ("max-requests-float", lambda e: _runner(e, max_requests=4.0), TypeError, "max_requests"),
    ("max-blocks-zero", lambda e: _runner(e, max_blocks_per_request=0), ValueError, "max_blocks_per_request"),
    ("heads-zero", lambda e: _runner(e, num_heads=0), ValueError, "num_heads"),
    ("heads-129", lambda e: _runner(e, num_heads=129), ValueError, "num_heads"),
    ("heads-float", lambda e: _runner(e, num_heads=4.0), TypeError, "num_heads"),
    ("head-dim", lambda e: _runner(e, head_dim=575), ValueError, "head_dim"),
    ("topk-zero", lambda e: _runner(e, topk=0), ValueError, "topk"),
    ("fmt-unknown", lambda e: _runner(e, fmt="fp9"), ValueError, "fmt"),
    ("fmt-head-dim-mismatch", lambda e: _runner(e, fmt="fp8_ds_mla-nope"), ValueError, "(fmt|head_dim)"),
    ("block-stride-below-size", lambda e: _runner(e, block_stride_rows=8), ValueError, "block_stride_rows"),
    ("index-topk-vs-kpool", lambda e: _runner(e, index_topk=10, kpool=4), ValueError, "index_topk"),
    ("topk-below-pooled-width", lambda e: _runner(e, index_topk=16, kpool=4), ValueError, "topk"),
    ("backend-unknown", lambda e: _runner(e, backend="no-such-backend"), ValueError, "backend"),
    # plan
    ("plan-metadata-dict", lambda e: _runner(e).plan({"seq_lens": [1]}), TypeError, "metadata"),
    ("plan-too-many-tokens", lambda e: reliab_runner.plan(_runner(e, max_tokens=1), _md(e), e.cache), ValueError,
     "metadata"),
    ("plan-too-many-requests", lambda e: reliab_runner.plan(_runner(e, max_requests=1), _md(e), e.cache),
     ValueError, "metadata"),
    ("plan-table-too-wide", lambda e: reliab_runner.plan(_runner(e, max_blocks_per_request=1), _md(e), e.cache),
     ValueError, "metadata"),
    ("plan-padded-below-tokens", lambda e: reliab_runner.plan(_runner(e), _md(e), e.cache, num_tokens_padded=1),
     ValueError, "num_tokens_padded"),
    ("plan-padded-past-max", lambda e: reliab_runner.plan(_runner(e), _md(e), e.cache, num_tokens_padded=9),
     ValueError, "num_tokens_padded"),
    # run
    ("run-before-plan", lambda e: _runner(e).run(e.q[:2], e.cache, _topk(e)), RuntimeError, "SparseMLA.run"),
    ("run-q-float", lambda e: _planned(e).run(e.q[:2].float(), e.cache, _topk(e)), TypeError, "q"),
    ("run-q-heads", lambda e: _planned(e).run(e.q[:2, :3], e.cache, _topk(e)), ValueError, "q"),
    ("run-q-fewer-tokens", lambda e: _planned(e).run(e.q[:1], e.cache, _topk(e, 1)), ValueError, "q"),
    ("run-cache-tensor", lambda e: _planned(e).run(e.q[:2], e.cache.rows, _topk(e)), TypeError, "cache"),
    ("run-cache-format", lambda e: _planned(e).run(e.q[:2], e.cache8, _topk(e)), ValueError, "cache"),
    ("run-cache-geometry", lambda e: _planned(e).run(e.q[:2], PagedKVCache(FMT, 4, 8, e.dev), _topk(e)), ValueError,
     "cache"),
    ("run-cache-smaller-than-planned-tables", lambda e: _planned(e).run(e.q[:2], PagedKVCache(FMT, 2, BS, e.dev),
                                                                       _topk(e)), ValueError, "(cache|metadata)"),
    ("run-topk-int64", lambda e: _planned(e).run(e.q[:2], e.cache, _topk(e, dtype=torch.int64)), TypeError,
     "topk_local"),
    ("run-topk-width", lambda e: _planned(e).run(e.q[:2], e.cache, _topk(e, k=15)), ValueError, "topk_local"),
    ("run-k-scale-tensor", lambda e: _planned(e).run(e.q[:2], e.cache, _topk(e), torch.tensor(1.0)), TypeError,
     "k_scale"),
    ("run-k-scale-nan", lambda e: _planned(e).run(e.q[:2], e.cache, _topk(e), NAN), ValueError, "k_scale"),
    ("run-k-scale-fp32-overflow", lambda e: _planned(e).run(e.q[:2], e.cache, _topk(e), 1e60), ValueError, "k_scale"),
    ("run-out-shape", lambda e: _planned(e).run(e.q[:2], e.cache, _topk(e),
                                                out=torch.empty(2, 4, 576, dtype=torch.bfloat16, device=e.dev)),
     ValueError, "out"),
    ("metadata-table-entry-float", lambda e: sparsemla.BatchMetadata.from_lists([1], [5], [[0.0]]), TypeError,
     r"block_table\[0\]"),
]

ALL = ([("api-" + c[0],) + c[1:] for c in FUNCTIONAL] + [("cache-" + c[0],) + c[1:] for c in CACHE]
       + [("convert-" + c[0],) + c[1:] for c in CONVERT] + [("runner-" + c[0],) + c[1:] for c in RUNNER])


@pytest.mark.parametrize("name, call, exc, arg", ALL, ids=[c[0] for c in ALL])
def test_bad_input_raises_named_error(name, call, exc, arg, device):
    e = env(device)
    with pytest.raises(exc) as info:
        call(e)
    msg = str(info.value)
    assert re.match(rf"{arg}(?![A-Za-z0-9_])", msg), f"{name}: the message must start with the argument {arg!r}: {msg!r}"


# --------------------------------------------------------------------------------------------------------
# the runner's block-table check (host side, at plan time)
# --------------------------------------------------------------------------------------------------------
def _assert_names_request_and_block(msg: str, request: int, block: int):
    assert re.search(rf"(request\s*#?\s*{request}\b|block_table\[{request}\])", msg), \
        f"the error must name request {request}: {msg!r}"
    assert re.search(rf"\b{block}\b", msg), f"the error must name block {block}: {msg!r}"


@pytest.mark.parametrize("tables, seq, req, block", [
    (((0,), (99,)), (10, 5), 1, 99),            # far past a 4-block cache
    (((0,), (1, 4)), (10, 20), 1, 4),           # the first block past the end
    (((0, 1, 2, 3, 5), (1,)), (70, 3), 0, 5),   # the last block a long context needs
    (((2,), (3,), (0, 2**31 - 1)), (3, 3, 17), 2, 2**31 - 1),
], ids=["block-99-of-4", "block-equal-num-blocks", "last-needed-block", "int32-max"])
@pytest.mark.parametrize("build", ["lists", "tensors"])
def test_plan_rejects_block_tables_past_the_cache(tables, seq, req, block, build, device):
    """A block table entry a context needs that is not a block of the cache: ``plan`` raises ValueError naming
    the request and the block (host values, no device sync), for metadata from lists and from host tensors.
    ``run`` is never reached with such a table (it would read outside the cache)."""
    e = Env(device)
    r = _runner(e, max_blocks_per_request=8, max_requests=4)
    md = sparsemla.BatchMetadata.from_lists([1] * len(seq), list(seq), [list(t) for t in tables])
    if build == "tensors":
        md = sparsemla.BatchMetadata.from_tensors(md.query_start_loc, md.seq_lens, md.block_table,
                                                  num_tokens=md.num_tokens, num_decode_tokens=md.num_tokens,
                                                  num_decode_requests=md.num_requests)
    assert reliab_runner.knows_cache_at_plan(r), (
        "SparseMLA cannot check block tables before run(): plan() takes no cache (or number of blocks) and the "
        "runner is not built with one")
    try:
        reliab_runner.plan(r, md, e.cache)
    except ValueError as err:
        _assert_names_request_and_block(str(err), req, block)
    else:
        pytest.fail(f"plan() accepted block {block} of request {req} for a {e.cache.num_blocks}-block cache")


@pytest.mark.parametrize("build", ["lists", "tensors"])
def test_plan_rejects_a_missing_block_inside_a_context(build, device):
    """-1 (no block) in the part of a table row that the request's context needs: its tokens would be dropped
    silently; ``plan`` raises ValueError naming the request."""
    e = Env(device)
    r = _runner(e)
    md = sparsemla.BatchMetadata.from_lists([1, 1], [10, 20], [[0], [1, -1]])
    if build == "tensors":
        md = sparsemla.BatchMetadata.from_tensors(md.query_start_loc, md.seq_lens, md.block_table,
                                                  num_tokens=2, num_decode_tokens=2, num_decode_requests=2)
    with pytest.raises(ValueError) as info:
        reliab_runner.plan(r, md, e.cache)
    assert re.search(r"(request\s*#?\s*1\b|block_table\[1\])", str(info.value)), str(info.value)


def test_plan_accepts_tables_inside_the_cache(device):
    """The check does not reject a valid step: every block < num_blocks, -1 only past each context."""
    e = Env(device)
    r = _runner(e)
    reliab_runner.plan(r, sparsemla.BatchMetadata.from_lists([1, 2], [16, 33], [[3, -1, -1], [0, 1, 2]]), e.cache)
    out, lse = r.run(torch.zeros(3, 4, 576, dtype=torch.bfloat16, device=device), e.cache,
                     torch.zeros(3, 16, dtype=torch.int32, device=device))
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


# --------------------------------------------------------------------------------------------------------
# empty inputs: valid, and they return well-formed (empty) results
# --------------------------------------------------------------------------------------------------------
def test_zero_tokens_return_empty_outputs(device):
    e = Env(device)
    q = e.q[:0]
    out, lse = e.decode(q=q, indices=e.idx[:0], valid_counts=e.vc[:0])
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)
    out, lse = e.prefill(q=q, indices=e.ws_idx[:0])
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)
    e.cache.write(torch.zeros(0, 512, device=device), torch.zeros(0, 64, device=device),
                  torch.zeros(0, dtype=torch.int32, device=device))
    rows = sparsemla.convert_indices(torch.zeros(0, 8, dtype=torch.int32, device=device),
                                     torch.zeros(0, dtype=torch.int32, device=device),
                                     torch.zeros(1, 1, dtype=torch.int32, device=device), BS)
    assert rows.shape == (0, 8)


# --------------------------------------------------------------------------------------------------------
# non-finite input to cache writes: one policy on every path
# --------------------------------------------------------------------------------------------------------
def _nonfinite_cases():
    out = []
    for fid in format_ids():
        f = get_format(fid)
        for value in ("nan", "inf", "-inf"):
            out.append((fid, "kv_c", value))
            if f.rope_dim:
                out.append((fid, "k_pe", value))
    return out


def _bad_inputs(f, where, value, device):
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(5, 512, generator=g)
    pe = torch.randn(5, f.rope_dim, generator=g) if f.rope_dim else None
    bad_kv, bad_pe = kv.clone(), None if pe is None else pe.clone()
    v = float(value)
    if where == "kv_c":
        bad_kv[2, 37] = v
    else:
        bad_pe[2, 5] = v
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    return dev(kv), dev(pe), dev(bad_kv), dev(bad_pe)


def _outcome(fn):
    try:
        return ("stored", fn())
    except (ValueError, TypeError, RuntimeError) as err:
        return ("raised", err)


SLOTS = [3, 9, 0, 14, 6]


def _write_path(f, kv, pe, device, interpret):
    """Bytes of a fresh poisoned cache after writing 5 tokens through PagedKVCache.write, with the Triton kernel
    (``interpret`` True on the CPU; CUDA) or with the PyTorch encoder (``interpret`` False: the CPU without the
    interpreter, chosen by switching the interpreter off and telling the cache module Triton does not run)."""
    import sparsemla.cache as cache_mod
    cache = PagedKVCache(f, 2, BS, device, block_stride_rows=BS + 2)
    cache.rows.fill_(POISON)
    old_env, old_fn = os.environ.get("TRITON_INTERPRET"), getattr(cache_mod, "triton_runs_on", None)
    if interpret is False:
        os.environ["TRITON_INTERPRET"] = "0"
        if old_fn is not None:
            cache_mod.triton_runs_on = lambda dev: torch.device(dev).type == "cuda"
    try:
        cache.write(kv, pe, torch.tensor(SLOTS, dtype=torch.int32, device=device))
    finally:
        if interpret is False:
            if old_env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old_env
            if old_fn is not None:
                cache_mod.triton_runs_on = old_fn
    return cache


def _paths(device):
    """(name, interpret switch) of every write path on this device."""
    if torch.device(device).type == "cuda":
        return [("write-cuda", None)]
    return [("write-triton-interpreter", True), ("write-pytorch", False)]


@pytest.mark.parametrize("fid, where, value", _nonfinite_cases(),
                         ids=[f"{a}-{b}-{c}" for a, b, c in _nonfinite_cases()])
def test_nonfinite_write_follows_one_policy(fid, where, value, device):
    """The encoder and every write path agree: all raise ValueError naming the argument (and leave the cache
    as it was), or all store the same bytes; the finite tokens of the same write get their usual bytes and no
    row outside the written slots changes."""
    f = get_format(fid)
    kv, pe, bad_kv, bad_pe = _bad_inputs(f, where, value, device)
    clean = f.encode(kv.cpu(), None if pe is None else pe.cpu())
    results = {"encode": _outcome(lambda: f.encode(bad_kv.cpu(), None if bad_pe is None else bad_pe.cpu()))}
    for name, interp in _paths(device):
        results[name] = _outcome(lambda: _write_path(f, bad_kv, bad_pe, device, interp))
    kinds = {k: v[0] for k, v in results.items()}
    assert len(set(kinds.values())) == 1, f"{fid}: non-finite {where} handled differently per path: {kinds}"
    if kinds["encode"] == "raised":
        for name, (_, err) in results.items():
            assert isinstance(err, ValueError) and re.match(rf"{where}\b", str(err)), (name, err)
        return
    encoded = results["encode"][1]
    ref_cache = _write_path(f, kv, pe, device, None)
    rows_of = ref_cache.slot_to_row(torch.tensor(SLOTS)).tolist()
    for name, (_, cache) in results.items():
        if name == "encode":
            continue
        got = cache.rows.cpu()
        assert torch.equal(got[rows_of], encoded), f"{name}: bytes differ from the encoder's for non-finite input"
        keep = [i for i in range(5) if i != 2]
        assert torch.equal(got[[rows_of[i] for i in keep]], clean[keep]), f"{name}: a finite token's row changed"
        others = torch.ones(got.shape[0], dtype=torch.bool)
        others[rows_of] = False
        assert (got[others] == POISON).all(), f"{name}: a row outside the written slots changed"


# --------------------------------------------------------------------------------------------------------
# the CLI: a bad flag exits with status 2 and names the flag, no traceback
# --------------------------------------------------------------------------------------------------------
CLI = [
    ("info-format", ["info", "--format", "fp9"], "--format|format"),
    ("info-heads-zero", ["info", "--heads", "0"], "--heads|heads"),
    ("info-heads-129", ["info", "--heads", "129"], "--heads|heads"),
    ("info-topk-zero", ["info", "--topk", "0"], "--topk|topk"),
    ("info-tokens-negative", ["info", "--tokens", "-1"], "--tokens|tokens"),
    ("info-heads-not-int", ["info", "--heads", "x"], "--heads"),
    ("demo-formats", ["demo", "--cpu", "--formats", "fp9"], "--formats|formats"),
    ("demo-requests-zero", ["demo", "--cpu", "--requests", "0"], "--requests"),
    ("demo-heads", ["demo", "--cpu", "--heads", "0,16"], "--heads"),
    ("demo-topk-zero", ["demo", "--cpu", "--topk", "0"], "--topk"),
    ("check-formats", ["check", "--formats", "fp9"], "--formats|formats"),
    ("check-backends", ["check", "--backends", "no-such-backend"], "--backends|backends"),
    ("check-shapes", ["check", "--shapes", "no-such-shape"], "--shapes|shapes"),
    ("bench-formats", ["bench", "--formats", "fp9", "--list"], "--formats|formats"),
    ("bench-configs", ["bench", "--configs", "no-such-config", "--list"], "--configs|configs"),
    ("capacity-utilization", ["capacity", "--utilization", "1.5"], "--utilization"),
    ("capacity-tp-zero", ["capacity", "--tp", "0"], "--tp"),
    ("capacity-layers-zero", ["capacity", "--layers", "0"], "--layers"),
    ("capacity-block-size-zero", ["capacity", "--block-size", "0"], "--block-size"),
    ("unknown-command", ["no-such-command"], "invalid choice|no-such-command"),
]


@pytest.mark.parametrize("name, argv, flag", CLI, ids=[c[0] for c in CLI])
def test_cli_bad_flag_exits_2_naming_it(name, argv, flag, capsys):
    from sparsemla.cli.main import main
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors (status 2)
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2, f"{argv}: exit status {rc} (expected 2); stderr: {err[-500:]!r}"
    assert re.search(flag, err), f"{argv}: the error must name {flag!r}: {err[-500:]!r}"
    assert "Traceback" not in err


def test_a_tensor_off_the_current_device_is_named_with_both_devices(monkeypatch):
    """The check behind every call's device test (the CPU has no CUDA device: the current index is simulated)."""
    from sparsemla import _device, _validate
    monkeypatch.setattr(_device, "current_cuda_index", lambda: 0)
    with pytest.raises(ValueError, match=r"q: on cuda:-1, but the current CUDA device is cuda:0"):
        _validate.check_current_device("q", torch.empty(1))
    monkeypatch.setattr(_device, "current_cuda_index", lambda: -1)
    _validate.check_current_device("q", torch.empty(1))  # the same index: no error
