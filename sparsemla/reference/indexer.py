"""Float64 reference of the lightning indexer (``docs/kv-formats.md`` §7 and §9).

Index-key cache (132 bytes per token).  An index key is 128 values stored as e4m3 with one fp32
scale per token, ``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))`` (a power of two, so ``k / s`` is
exact and ``float(e4m3) * s`` is exact), each value ``e4m3(k / s)`` rounded to nearest even and
saturated to +-448.  The cache is a uint8 tensor ``[num_blocks, block_size, 132]`` in vLLM's paged
layout: block ``b`` is ``block_size * 132`` contiguous bytes starting at byte ``b * stride(0)``,
holding first the ``block_size * 128`` e4m3 bytes of its tokens (token ``o``'s dim ``d`` at byte
``o * 128 + d``), then their ``block_size`` fp32 scales (token ``o``'s at byte
``block_size * 128 + 4 * o``).  So ``data[b, o, :]`` is NOT token ``o``'s row; the 3-d shape only
sizes the allocation.  Slots are ``block * block_size + offset`` as for the KV cache.

Scores.  For query token ``t`` with index heads ``h``, weights ``w[t, h]`` and key ``k[s]``:

    I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])     for s < context_len[t]
    I[t, s] = -inf                                                   otherwise (causal mask)

where ``k[s]`` are the stored e4m3 values and ``k_scale[s]`` their scale (with unquantized keys,
``k_scale = 1``).  Top-k keeps the ``topk`` highest scores, best first, request-local positions,
padded with -1; ties are broken towards the lower position.

Pooled indexers (``kpool > 1``).  Pool ``p`` holds positions ``[p*kpool, (p+1)*kpool)``.  A pool is
*complete* for a query when ``(p+1)*kpool <= context_len``; only complete pools are ranked, by the
**maximum** score of their tokens (the choice made here: a pool is chosen when any of its tokens
would be), the best ``index_topk / kpool`` are kept, and ``sparsemla.indices.expand_pooled_topk``
expands them to positions and appends the unfinished tail ``[c - c % kpool, c)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._validate import check_positive_int, check_tensor
from ..indices import expand_pooled_topk, pooled_width

INDEX_HEAD_DIM = 128
INDEX_BYTES_PER_TOKEN = INDEX_HEAD_DIM + 4  # 128 e4m3 + one fp32 scale
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INT = (torch.int32, torch.int64)


# --- the fp8 recipe -------------------------------------------------------------------------------

def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(max(amax, 1e-4) / 448))`` computed exactly (float64 in, float64 out).

    ``frexp`` gives ``x = m * 2**e`` with ``m`` in ``[0.5, 1)``; ``ceil(log2 x)`` is ``e - 1`` when
    ``x`` is itself a power of two (``m == 0.5``) and ``e`` otherwise.  No ``log2`` rounding involved.
    """
    x = amax.to(torch.float64).clamp_min(AMAX_FLOOR) / FP8_MAX
    m, e = torch.frexp(x)
    e = e - (m == 0.5).to(e.dtype)
    return torch.ldexp(torch.ones_like(x), e)


def quantize_fp8_pow2(x: torch.Tensor):
    """Quantize the last dim of ``x`` (``[..., D]``, any float) with one power-of-two scale per row.

    Returns ``(codes uint8 [..., D], scales float32 [...])`` with ``codes`` the e4m3 bytes of
    ``x / s`` (RNE, saturating) and ``x ~= float(e4m3) * s``.  Inputs are first rounded to fp32 (the
    kernels read fp32 too), so an fp32 / bf16 / fp16 input is used exactly.
    """
    xf = x.to(torch.float32).to(torch.float64)
    s = pow2_scale(xf.abs().amax(dim=-1))
    y = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX)  # exact: s is a power of two
    codes = y.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, s.to(torch.float32)


def dequantize_fp8_pow2(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 ``[..., D]`` and float32 ``[...]`` -> float64 ``[..., D]``."""
    return codes.view(torch.float8_e4m3fn).to(torch.float64) * scales.to(torch.float64)[..., None]


# --- the paged index-key cache --------------------------------------------------------------------

def check_index_cache(cache: torch.Tensor, name: str = "index_cache"):
    """Validate an index-key cache; returns ``(num_blocks, block_size, block_stride_bytes)``."""
    check_tensor(name, cache, dtype=torch.uint8, ndim=3)
    nb, bs, bpt = cache.shape
    if bpt != INDEX_BYTES_PER_TOKEN:
        raise ValueError(f"{name}: expected shape [num_blocks, block_size, {INDEX_BYTES_PER_TOKEN}], "
                         f"got {tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != bpt:
        raise ValueError(f"{name}: a block must be {bs} x {bpt} contiguous bytes (strides (*, {bpt}, 1)), "
                         f"got strides {cache.stride()}")
    stride0 = cache.stride(0)
    if nb > 1 and stride0 < bs * bpt:
        raise ValueError(f"{name}: block stride {stride0} bytes is smaller than a block ({bs * bpt} bytes)")
    if stride0 % 4:
        raise ValueError(f"{name}: block stride {stride0} bytes must be a multiple of 4 (fp32 scales)")
    return nb, bs, stride0


def _block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """uint8 ``[num_blocks, block_size * 132]`` view: one row per block, in the block's byte order."""
    nb, bs, stride0 = check_index_cache(cache)
    return cache.as_strided((nb, bs * INDEX_BYTES_PER_TOKEN), (stride0, 1))


def write_index_cache(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Reference writer: quantize ``k`` float ``[N, 128]`` and store token ``i`` at slot
    ``slot_mapping[i]`` (``block * block_size + offset``; -1 = skip)."""
    nb, bs, _ = check_index_cache(cache)
    check_tensor("k", k, dtypes=_FLOATS, ndim=2, device=cache.device)
    if k.shape[1] != INDEX_HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {INDEX_HEAD_DIM}], got {tuple(k.shape)}")
    check_tensor("slot_mapping", slot_mapping, dtypes=_INT, shape=(k.shape[0],), device=cache.device)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if keep.any() and int(slots.max()) >= nb * bs:
        raise ValueError(f"slot_mapping: entries must be -1 or in [0, {nb * bs}), found {int(slots.max())}")
    slots = slots[keep]
    codes, scales = quantize_fp8_pow2(k[keep])
    blocks = _block_bytes(cache)
    blk, off = slots // bs, slots % bs
    val_cols = off[:, None] * INDEX_HEAD_DIM + torch.arange(INDEX_HEAD_DIM, device=cache.device)
    blocks[blk[:, None], val_cols] = codes
    sc_cols = bs * INDEX_HEAD_DIM + off[:, None] * 4 + torch.arange(4, device=cache.device)
    blocks[blk[:, None], sc_cols] = scales.contiguous().view(torch.uint8).reshape(-1, 4)


def read_index_cache(cache: torch.Tensor, slots: torch.Tensor, *, dequantize: bool = True):
    """Slots int ``[N]`` (no -1) -> float64 ``[N, 128]`` dequantized keys, or, with
    ``dequantize=False``, the raw ``(codes uint8 [N, 128], scales float32 [N])``."""
    nb, bs, _ = check_index_cache(cache)
    check_tensor("slots", slots, dtypes=_INT, ndim=1)
    s = slots.to(device=cache.device, dtype=torch.int64)
    if s.numel() and (int(s.min()) < 0 or int(s.max()) >= nb * bs):
        raise ValueError(f"slots: entries must be in [0, {nb * bs}), found range [{int(s.min())}, {int(s.max())}]")
    blocks = _block_bytes(cache)
    blk, off = s // bs, s % bs
    codes = blocks[blk[:, None], off[:, None] * INDEX_HEAD_DIM + torch.arange(INDEX_HEAD_DIM, device=cache.device)]
    sc_bytes = blocks[blk[:, None], bs * INDEX_HEAD_DIM + off[:, None] * 4 + torch.arange(4, device=cache.device)]
    scales = sc_bytes.contiguous().view(torch.float32).reshape(-1)
    if not dequantize:
        return codes, scales
    return dequantize_fp8_pow2(codes, scales)


def request_slots(block_table: torch.Tensor, req: int, length: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``[0, length)`` of request ``req`` (int64 ``[length]``)."""
    pos = torch.arange(length, device=block_table.device, dtype=torch.int64)
    blk = block_table[req].to(torch.int64)[pos // block_size]
    return blk * block_size + pos % block_size


# --- scores and top-k ---------------------------------------------------------------------------

def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, context_lens: torch.Tensor,
                 key_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scores of every query against the keys of ONE sequence.

    Args:
        q: float ``[T, H, D]`` index queries (dequantized if they were quantized).
        weights: float ``[T, H]`` per-head weights (any query scale folded in).
        keys: float ``[S, D]`` keys by position (the stored e4m3 values, or the dequantized / exact keys).
        context_lens: int ``[T]`` positions ``[0, context_lens[t])`` are visible to query ``t``.
        key_scales: optional float ``[S]`` (``k_scale[s]`` above); None means 1.

    Returns float64 ``[T, S]``, -inf where ``s >= context_lens[t]``.
    """
    check_tensor("q", q, dtypes=_FLOATS, ndim=3)
    t, h, d = q.shape
    check_tensor("weights", weights, dtypes=_FLOATS, shape=(t, h), device=q.device)
    check_tensor("keys", keys, dtypes=_FLOATS, ndim=2, device=q.device)
    if keys.shape[1] != d:
        raise ValueError(f"keys: expected shape [S, {d}] (q's head dim), got {tuple(keys.shape)}")
    check_tensor("context_lens", context_lens, dtypes=_INT, shape=(t,), device=q.device)
    dots = torch.einsum("thd,sd->ths", q.to(torch.float64), keys.to(torch.float64))
    scores = torch.einsum("th,ths->ts", weights.to(torch.float64), dots.clamp_min(0))
    if key_scales is not None:
        check_tensor("key_scales", key_scales, dtypes=_FLOATS, shape=(keys.shape[0],), device=q.device)
        scores = scores * key_scales.to(torch.float64)[None, :]
    pos = torch.arange(keys.shape[0], device=q.device)
    return scores.masked_fill(pos[None, :] >= context_lens.to(q.device)[:, None], float("-inf"))


def index_scores_paged(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                       req_id: torch.Tensor, context_lens: torch.Tensor, max_context: int) -> torch.Tensor:
    """``index_scores`` over a paged index-key cache (what the scoring kernel computes).

    q float ``[T, H, 128]``, weights ``[T, H]``, block_table int ``[R, max_blocks]``, req_id int ``[T]``,
    context_lens int ``[T]`` (each ``<= max_context``).  Returns float64 ``[T, max_context]``.
    """
    _, bs, _ = check_index_cache(cache)
    check_tensor("q", q, dtypes=_FLOATS, ndim=3)
    t = q.shape[0]
    check_tensor("req_id", req_id, dtypes=_INT, shape=(t,))
    check_tensor("context_lens", context_lens, dtypes=_INT, shape=(t,))
    check_positive_int("max_context", max_context)
    if t and int(context_lens.max()) > max_context:
        raise ValueError(f"context_lens: entries must be <= max_context ({max_context}), "
                         f"found {int(context_lens.max())}")
    out = torch.full((t, max_context), float("-inf"), dtype=torch.float64, device=q.device)
    for r in torch.unique(req_id).tolist():
        rows = (req_id == r).nonzero().flatten()
        length = int(context_lens[rows].max())
        if length == 0:
            continue
        codes, scales = read_index_cache(cache, request_slots(block_table, r, length, bs), dequantize=False)
        keys = codes.view(torch.float8_e4m3fn).to(torch.float64)
        out[rows, :length] = index_scores(q[rows], weights[rows], keys, context_lens[rows], scales)
    return out


def topk_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Best ``topk`` positions per row of ``scores`` (float ``[T, S]``, -inf = masked), best first,
    ties to the lower position; int32 ``[T, topk]``, -1 padded (masked positions are never chosen)."""
    check_tensor("scores", scores, dtypes=_FLOATS, ndim=2)
    check_positive_int("topk", topk)
    t, s = scores.shape
    vals, idx = torch.sort(scores, dim=1, descending=True, stable=True)
    k = min(topk, s)
    idx = torch.where(vals[:, :k] == float("-inf"), torch.full_like(idx[:, :k], -1), idx[:, :k])
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = idx.to(torch.int32)
    return out


def pool_scores(scores: torch.Tensor, context_lens: torch.Tensor, kpool: int) -> torch.Tensor:
    """Pool score = max of its tokens' scores for complete pools, -inf for the others.

    scores float ``[T, S]``; returns ``[T, S // kpool]`` (a pool past ``S`` cannot be complete)."""
    check_positive_int("kpool", kpool)
    t, s = scores.shape
    npool = s // kpool
    pooled = scores[:, : npool * kpool].reshape(t, npool, kpool).amax(dim=2)
    p = torch.arange(npool, device=scores.device)
    complete = (p[None, :] + 1) * kpool <= context_lens.to(scores.device)[:, None]
    return pooled.masked_fill(~complete, float("-inf"))


def pooled_topk_positions(scores: torch.Tensor, context_lens: torch.Tensor, index_topk: int, kpool: int,
                          width: Optional[int] = None) -> torch.Tensor:
    """Top-k for a pooled indexer: best ``index_topk / kpool`` complete pools, expanded, plus the tail.

    Returns int32 ``[T, width]`` (default ``pooled_width(index_topk, kpool)``), valid prefix then -1."""
    check_positive_int("index_topk", index_topk)
    check_positive_int("kpool", kpool)
    if index_topk % kpool:
        raise ValueError(f"index_topk: expected a multiple of kpool ({kpool}), got {index_topk}")
    if width is None:
        width = pooled_width(index_topk, kpool)
    pools = topk_positions(pool_scores(scores, context_lens, kpool), index_topk // kpool)
    return expand_pooled_topk(pools, context_lens, kpool, width)


# --- comparing two selections -------------------------------------------------------------------

def _valid_sets(idx: torch.Tensor):
    return [set(v for v in row.tolist() if v >= 0) for row in idx]


def topk_overlap(test: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float64 ``[T]``: ``|test ∩ ref| / |ref|`` per row over the valid (>= 0) entries (1 for an empty ref)."""
    out = []
    for a, b in zip(_valid_sets(test), _valid_sets(ref)):
        out.append(len(a & b) / len(b) if b else float(len(a) == 0))
    return torch.tensor(out, dtype=torch.float64)


def non_tie_mismatches(test: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor, rtol: float = 1e-3,
                       atol=0.0) -> int:
    """How many positions one selection holds and the other does not, for a reason other than a near tie.

    A position in the symmetric difference of a row is forgiven when its reference score lies within
    ``atol + rtol * max|finite reference score of the row|`` of the row's threshold (the lowest reference
    score that ``ref`` kept): an error of that size moves it across the cut.  ``atol`` may be a float or a
    per-row tensor ``[T]`` (e.g. twice the largest score error of each row).  Rows whose numbers of valid
    entries differ count the difference.  For pooled selections pass pool-level selections and scores.
    """
    bad = 0
    for t, (a, b) in enumerate(zip(_valid_sets(test), _valid_sets(ref))):
        if len(a) != len(b):
            bad += abs(len(a) - len(b))
            continue
        diff = a ^ b
        if not diff:
            continue
        row = ref_scores[t].to(torch.float64)
        finite = row[torch.isfinite(row)]
        tol = rtol * float(finite.abs().max()) if finite.numel() else 0.0
        tol += float(atol[t]) if isinstance(atol, torch.Tensor) else float(atol)
        thr = float(row[list(b)].min())
        bad += sum(1 for p in diff if abs(float(row[p]) - thr) > tol)
    return bad


def score_errors(test_scores: torch.Tensor, ref_scores: torch.Tensor) -> torch.Tensor:
    """float64 ``[T]``: the largest ``|test - ref|`` over each row's finite reference scores (0 if none)."""
    fin = torch.isfinite(ref_scores)
    diff = (test_scores.to(torch.float64) - ref_scores.to(torch.float64)).abs()
    return torch.where(fin, diff, torch.zeros_like(diff)).amax(dim=1) if ref_scores.shape[1] else \
        torch.zeros(ref_scores.shape[0], dtype=torch.float64, device=ref_scores.device)


__all__ = ["INDEX_HEAD_DIM", "INDEX_BYTES_PER_TOKEN", "pow2_scale", "quantize_fp8_pow2", "dequantize_fp8_pow2",
           "check_index_cache", "write_index_cache", "read_index_cache", "request_slots", "index_scores",
           "index_scores_paged", "topk_positions", "pool_scores", "pooled_topk_positions", "topk_overlap",
           "non_tie_mismatches", "score_errors"]
