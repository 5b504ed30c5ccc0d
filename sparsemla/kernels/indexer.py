"""Lightning-indexer kernels: index-key cache write, fp8 scoring, top-k (``docs/kv-formats.md`` §9).

* ``index_cache_write``: quantize 128-dim index keys to e4m3 with one power-of-two fp32 scale per
  token and scatter them into vLLM's paged layout (per block: all e4m3 bytes, then all scales).
  Byte-identical to ``sparsemla.reference.indexer.write_index_cache``.
* ``quantize_index_q``: the same recipe for the queries, one scale per (token, head) (PyTorch ops).
* ``index_scores``: ``I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])`` with fp8 q and keys,
  -inf for ``s >= context_lens[t]`` (causal mask by per-token context length), keys read through
  the block table.  One launch; no host synchronisation (CUDA-graph safe).
* ``index_topk``: top-k of the scores with ``torch.topk`` (a sort-free selection is not needed at
  these widths: 2048 of 32K per row), -1 padded; pooled variant through
  ``sparsemla.indices.expand_pooled_topk``.

A default call (``check=False``) reads nothing on the host; the kernels never touch memory outside
their tensors: a slot outside the cache is skipped, and a key past the block table, in a block id outside
the cache or of a request id outside the table scores -inf.  ``check=True`` is a debug option that
validates value ranges on the host first (a device sync) and raises.

The e4m3 rounding is done with integer arithmetic instead of ``.to(tl.float8e4nv)``: the Triton 3.6
interpreter rounds fp32 -> e4m3 wrongly (126.8 -> 64), and doing it by hand makes the bytes
identical on every backend.  The scale is found from the exponent bits (no log2, no division), so
it is exact too.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._validate import check_positive_int, check_tensor
from ..indices import expand_pooled_topk, pooled_width
from .._device import interpreting, num_sms

INDEX_HEAD_DIM = 128
INDEX_BYTES_PER_TOKEN = 132
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INT = (torch.int32, torch.int64)


# --- fp8 helpers (device) ------------------------------------------------------------------------

@triton.jit
def _pow2_scale_bits(amax):
    """Biased fp32 exponent of ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``.

    With ``a = max(amax, 1e-4) = m * 2**e`` (``m`` in [1, 2)) and ``448 = 1.75 * 2**8``, the smallest
    ``k`` with ``448 * 2**k >= a`` is ``e - 8`` when ``m <= 1.75`` and ``e - 7`` otherwise; ``m <= 1.75``
    is ``mantissa bits <= 0x600000``.  So the biased exponent of ``s`` is ``biased(e) - 8 (+1)``.
    """
    a = tl.maximum(amax, 1e-4)
    bits = a.to(tl.int32, bitcast=True)
    bexp = (bits >> 23) & 0xFF
    return bexp - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _e4m3_code(y):
    """fp32 ``y`` (|y| <= 448 after the clamp here) -> e4m3 byte as int32, round-to-nearest-even."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(y)
    abits = a.to(tl.int32, bitcast=True)
    # Normal e4m3 (a >= 2**-6): keep 3 of fp32's 23 mantissa bits, RNE; a carry moves into the
    # exponent by itself.  Rebias the exponent from 127 to 7: subtract 120 << 3 from (bits >> 20).
    rounded = abits + 0x7FFFF + ((abits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal e4m3: multiples of 2**-9; a * 512 < 8 is rounded to an integer (RNE) by adding and
    # removing 2**23 in fp32.  8 is the code of 2**-6, the smallest normal, so the ranges join.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return tl.minimum(code, 0x7E) | (sign << 7)


# --- cache write ---------------------------------------------------------------------------------

@triton.jit
def _index_cache_write_kernel(k_ptr, stride_k, slot_ptr, cache_ptr, block_stride, n_tokens, num_slots,
                              D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program quantizes BLOCK_N tokens: amax over the 128 dims, power-of-two scale, e4m3 codes.
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    in_range = i < n_tokens
    slot = tl.load(slot_ptr + i, mask=in_range, other=-1).to(tl.int64)
    keep = (slot >= 0) & (slot < num_slots)
    x = tl.load(k_ptr + i[:, None] * stride_k + d[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
    sbits = _pow2_scale_bits(tl.max(tl.abs(x), axis=1))
    scale = (sbits << 23).to(tl.float32, bitcast=True)
    inv = ((254 - sbits) << 23).to(tl.float32, bitcast=True)  # exactly 1 / scale (both powers of two)
    code = _e4m3_code(x * inv[:, None])
    blk = slot // PAGE
    off = slot % PAGE
    base = cache_ptr + blk * block_stride  # int64 byte offsets
    tl.store(base[:, None] + off[:, None] * D + d[None, :], code.to(tl.uint8), mask=keep[:, None])
    scale_ptr = (base + PAGE * D + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, scale, mask=keep)


def _check_cache(cache: torch.Tensor, name: str = "index_cache"):
    check_tensor(name, cache, dtype=torch.uint8, ndim=3)
    nb, bs, bpt = cache.shape
    if bpt != INDEX_BYTES_PER_TOKEN:
        raise ValueError(f"{name}: expected shape [num_blocks, block_size, {INDEX_BYTES_PER_TOKEN}], "
                         f"got {tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != bpt:
        raise ValueError(f"{name}: a block must be contiguous (strides (*, {bpt}, 1)), got {cache.stride()}")
    if nb > 1 and cache.stride(0) < bs * bpt:
        raise ValueError(f"{name}: block stride {cache.stride(0)} bytes is smaller than a block ({bs * bpt})")
    if cache.stride(0) % 4 or cache.data_ptr() % 4:
        raise ValueError(f"{name}: blocks must start 4-byte aligned (fp32 scales); "
                         f"block stride {cache.stride(0)}, address {cache.data_ptr()}")
    return nb, bs, cache.stride(0)


def index_cache_write(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *, check: bool = False) -> None:
    """Quantize and scatter index keys.

    Args:
        cache: uint8 ``[num_blocks, block_size, 132]`` (block stride may be larger than a block).
        k: ``[N, 128]`` bf16 / fp16 / fp32 keys (last dim contiguous).
        slot_mapping: int32/int64 ``[N]``, ``block * block_size + offset``; -1 (or any slot outside
            ``[0, num_blocks * block_size)``) skips the token.
        check: debug option: raise for a slot outside ``[-1, num_blocks * block_size)`` (reads them on the
            host: one device sync).
    """
    nb, bs, stride0 = _check_cache(cache)
    check_tensor("k", k, dtypes=_FLOATS, ndim=2, device=cache.device)
    n = k.shape[0]
    if k.shape[1] != INDEX_HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {INDEX_HEAD_DIM}], got {tuple(k.shape)}")
    if k.stride(1) != 1:
        raise ValueError(f"k: the last dim must be contiguous, got strides {k.stride()}")
    check_tensor("slot_mapping", slot_mapping, dtypes=_INT, shape=(n,), device=cache.device)
    if n == 0:
        return
    if check:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            raise ValueError(f"slot_mapping: entries must be -1 or in [0, {nb * bs}), found range [{lo}, {hi}]")
    block_n = 8
    _index_cache_write_kernel[(-(-n // block_n),)](
        k, k.stride(0), slot_mapping, cache, stride0, n, nb * bs,
        D=INDEX_HEAD_DIM, PAGE=bs, BLOCK_N=block_n, num_warps=4)


# --- query quantization (PyTorch ops: cheap, and graph-safe) -------------------------------------

def quantize_index_q(q: torch.Tensor):
    """Quantize index queries ``[..., 128]`` with one power-of-two scale per row (the key recipe).

    Returns ``(q_fp8 float8_e4m3fn [..., 128], q_scale float32 [...])`` with ``q ~= q_fp8 * q_scale``.
    """
    check_tensor("q", q, dtypes=_FLOATS + (torch.float64,))
    x = q.to(torch.float32)
    a = x.abs().amax(dim=-1).clamp_min(1e-4) / 448.0  # correctly rounded: never crosses a power of two
    m, e = torch.frexp(a)
    e = e - (m == 0.5).to(e.dtype)
    s = torch.ldexp(torch.ones_like(a), e)
    q8 = (x / s[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q8, s


# --- scores --------------------------------------------------------------------------------------

@triton.jit
def _score_tile(tile, q, w, cache_ptr, bt_row_ptr, ctx, out_row_ptr, block_stride, max_context, num_blocks,
                D: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Scores of one query against keys ``[tile*BLOCK_S, (tile+1)*BLOCK_S)`` (a tile that starts inside
    the context), stored to its out row; keys at or past ``ctx`` or in a block id outside the cache get
    -inf."""
    s = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    in_ctx = s < ctx
    blk = tl.load(bt_row_ptr + s // PAGE, mask=in_ctx, other=-1).to(tl.int64)
    valid = in_ctx & (blk >= 0) & (blk < num_blocks)
    blk = tl.where(valid, blk, 0)
    off = (s % PAGE).to(tl.int64)
    base = blk * block_stride  # int64 byte offsets
    k = tl.load(cache_ptr + base[:, None] + off[:, None] * D + d[None, :], mask=valid[:, None], other=0)
    k = k.to(tl.float8e4nv, bitcast=True)
    k_scale = tl.load((cache_ptr + base + PAGE * D + off * 4).to(tl.pointer_type(tl.float32)),
                      mask=valid, other=0.0)
    dots = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_S] fp32, all heads at once
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * k_scale
    tl.store(out_row_ptr + s, tl.where(valid, score, float("-inf")), mask=s < max_context)


@triton.jit
def _mask_tile(tile, out_row_ptr, max_context, BLOCK_S: tl.constexpr):
    """-inf for a tile that starts at or past the context (up to ``max_context``)."""
    s = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    tl.store(out_row_ptr + s, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=s < max_context)


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, cache_ptr, bt_ptr, req_ptr, ctx_ptr, out_ptr,
                         stride_qt, stride_qh, stride_wt, stride_bt, stride_out, block_stride,
                         max_context, n_tiles, SPLIT, n_req, max_blocks, num_blocks,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr):
    # Program (t, split) handles tiles split, split + SPLIT, ... of query token t: the query (all heads,
    # fp8) is loaded once and reused for every tile; one fp8 dot per tile gives all heads' q.k at once,
    # then relu, the head weights and the key scale reduce it to one score per key.  Tiles inside the
    # context and tiles past it are two loops (no branch in the hot loop, so it can be pipelined).
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    req = tl.load(req_ptr + t).to(tl.int64)
    req_ok = (req >= 0) & (req < n_req)
    req = tl.where(req_ok, req, 0)
    # keys past the block table, or of a request id outside it, are not read: they score -inf
    ctx = tl.where(req_ok, tl.minimum(tl.load(ctx_ptr + t), max_blocks * PAGE), 0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    hmask = h < H
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0)
    q = q.to(tl.float8e4nv, bitcast=True)
    w = tl.load(w_ptr + t * stride_wt + h, mask=hmask, other=0.0)
    bt_row = bt_ptr + req * stride_bt
    out_row = out_ptr + t * stride_out
    n_ctx_tiles = tl.cdiv(ctx, BLOCK_S)
    # First masked tile of this program: the smallest tile >= n_ctx_tiles with tile % SPLIT == split.
    first_masked = n_ctx_tiles + (split - n_ctx_tiles % SPLIT + SPLIT) % SPLIT
    if INTERPRET:
        # The interpreter (with numpy 2) cannot take a runtime scalar as a range() bound; while loops do
        # the same iterations.  Compiled code keeps the for loops, which Triton can pipeline.
        tile = split
        while tile < n_ctx_tiles:
            _score_tile(tile, q, w, cache_ptr, bt_row, ctx, out_row, block_stride, max_context, num_blocks, D, PAGE,
                        BLOCK_S)
            tile += SPLIT
        tile = first_masked
        while tile < n_tiles:
            _mask_tile(tile, out_row, max_context, BLOCK_S)
            tile += SPLIT
    else:
        for tile in range(split, n_ctx_tiles, SPLIT):
            _score_tile(tile, q, w, cache_ptr, bt_row, ctx, out_row, block_stride, max_context, num_blocks, D, PAGE,
                        BLOCK_S)
        for tile in range(first_masked, n_tiles, SPLIT):
            _mask_tile(tile, out_row, max_context, BLOCK_S)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: few programs, each looping over many tiles
    return num_sms(device)


def index_scores(q_fp8: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                 req_id: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                 out: Optional[torch.Tensor] = None, *, check: bool = False) -> torch.Tensor:
    """Indexer scores of every query token against its request's keys.

    Args:
        q_fp8: float8_e4m3fn ``[T, H, 128]`` (from ``quantize_index_q``; last dim contiguous).
        weights: float32 ``[T, H]`` head weights with the query scales folded in (``w * q_scale``).
        cache: uint8 ``[num_blocks, block_size, 132]`` index-key cache.
        block_table: int32/int64 ``[R, max_blocks]``; req_id int ``[T]``; context_lens int ``[T]``
            (keys ``[0, context_lens[t])`` are visible to token ``t``).
        max_context: width of the result (``>= max(context_lens)``; a static bound for CUDA graphs).
        out: optional float32 ``[T, max_context]`` (row stride may be larger).
        check: debug option: raise for context lengths outside ``[0, max_context]`` or past the block
            table, or request ids outside it (reads them on the host: one device sync).

    Returns float32 ``[T, max_context]``, -inf where ``s >= context_lens[t]`` (and for keys that cannot
    be read, see the module docstring).
    """
    nb, bs, stride0 = _check_cache(cache)
    dev = cache.device
    check_tensor("q_fp8", q_fp8, dtype=torch.float8_e4m3fn, ndim=3, device=dev)
    t, h, d = q_fp8.shape
    if d != INDEX_HEAD_DIM or q_fp8.stride(2) != 1:
        raise ValueError(f"q_fp8: expected [T, H, {INDEX_HEAD_DIM}] with a contiguous last dim, "
                         f"got shape {tuple(q_fp8.shape)} strides {q_fp8.stride()}")
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, h), device=dev)
    if weights.stride(1) != 1:
        raise ValueError(f"weights: the last dim must be contiguous, got strides {weights.stride()}")
    check_tensor("block_table", block_table, dtypes=_INT, ndim=2, device=dev)
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table: rows must be contiguous, got strides {block_table.stride()}")
    check_tensor("req_id", req_id, dtypes=_INT, shape=(t,), device=dev, contiguous=True)
    check_tensor("context_lens", context_lens, dtypes=_INT, shape=(t,), device=dev, contiguous=True)
    check_positive_int("max_context", max_context)
    if out is None:
        out = torch.empty((t, max_context), dtype=torch.float32, device=dev)
    else:
        check_tensor("out", out, dtype=torch.float32, shape=(t, max_context), device=dev)
        if out.stride(1) != 1:
            raise ValueError(f"out: the last dim must be contiguous, got strides {out.stride()}")
    if check and t:
        c_hi = int(context_lens.max())
        if int(context_lens.min()) < 0 or c_hi > max_context:
            raise ValueError(f"context_lens: entries must be in [0, max_context={max_context}], found max {c_hi}")
        if c_hi > block_table.shape[1] * bs:
            raise ValueError(f"context_lens: {c_hi} tokens need more than the block table's "
                             f"{block_table.shape[1]} blocks of {bs}")
        r_lo, r_hi = int(req_id.min()), int(req_id.max())
        if r_lo < 0 or r_hi >= block_table.shape[0]:
            raise ValueError(f"req_id: entries must be in [0, {block_table.shape[0]}), found [{r_lo}, {r_hi}]")
    if t == 0:
        return out
    block_s = 64
    n_tiles = -(-max_context // block_s)
    # Enough programs to fill the GPU (about 4 per SM) while each reuses its query over many tiles.
    # A runtime argument, so a new batch size does not compile a new kernel.
    split = max(1, min(n_tiles, -(-4 * _num_sms(dev) // t)))
    block_h = max(16, triton.next_power_of_2(h))
    _index_scores_kernel[(t, split)](
        q_fp8.view(torch.uint8), weights, cache, block_table, req_id, context_lens, out,
        q_fp8.stride(0), q_fp8.stride(1), weights.stride(0), block_table.stride(0), out.stride(0), stride0,
        max_context, n_tiles, split, block_table.shape[0], block_table.shape[1], nb,
        H=h, BLOCK_H=block_h, D=INDEX_HEAD_DIM, PAGE=bs, BLOCK_S=block_s,
        INTERPRET=interpreting(), num_warps=4)
    return out


# --- top-k ---------------------------------------------------------------------------------------

def index_topk(scores: torch.Tensor, topk: int, *, context_lens: Optional[torch.Tensor] = None, kpool: int = 1,
               width: Optional[int] = None) -> torch.Tensor:
    """Top-k positions of each row of ``scores`` (float ``[T, S]``, -inf = masked), -1 padded.

    ``kpool == 1``: int32 ``[T, topk]``, best first (``torch.topk``; ties in any order).
    ``kpool > 1``: pools ``[p*kpool, (p+1)*kpool)`` complete for ``context_lens`` are ranked by their
    best token, the best ``topk / kpool`` are expanded and the unfinished tail appended (int32
    ``[T, width]``, default ``pooled_width(topk, kpool)``).  No host synchronisation.
    """
    check_tensor("scores", scores, dtypes=(torch.float32, torch.float64), ndim=2)
    check_positive_int("topk", topk)
    check_positive_int("kpool", kpool)
    t, s = scores.shape
    if kpool > 1:
        if topk % kpool:
            raise ValueError(f"topk: expected a multiple of kpool ({kpool}), got {topk}")
        if context_lens is None:
            raise ValueError("context_lens: required when kpool > 1 (it decides which pools are complete)")
        check_tensor("context_lens", context_lens, dtypes=_INT, shape=(t,), device=scores.device)
        npool = s // kpool
        pooled = scores[:, : npool * kpool].reshape(t, npool, kpool).amax(dim=2)
        p = torch.arange(npool, device=scores.device)
        complete = (p[None, :] + 1) * kpool <= context_lens[:, None]
        pooled = pooled.masked_fill(~complete, float("-inf"))
        pools = index_topk(pooled, topk // kpool) if npool else \
            torch.full((t, topk // kpool), -1, dtype=torch.int32, device=scores.device)
        return expand_pooled_topk(pools, context_lens, kpool, width or pooled_width(topk, kpool))
    k = min(topk, s)
    vals, idx = torch.topk(scores, k, dim=1)
    idx = torch.where(vals == float("-inf"), torch.full_like(idx, -1), idx).to(torch.int32)
    if k == topk:
        return idx
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = idx
    return out


__all__ = ["index_cache_write", "quantize_index_q", "index_scores", "index_topk",
           "INDEX_HEAD_DIM", "INDEX_BYTES_PER_TOKEN"]
