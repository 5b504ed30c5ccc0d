"""Runner helpers for the reliability tests: build a :class:`sparsemla.SparseMLA` and plan a step so that the
runner knows the cache it will read, whichever way it takes that (``plan(..., cache=)``,
``plan(..., num_blocks=)`` or ``SparseMLA(..., num_blocks=)``), and random decode batches for long
CUDA-graph runs.

The block-table check is a host-side rule of ``plan``: every block a request's context needs
(``ceil(seq_len / block_size)`` entries of its table row) must be a block of the cache, and the error names
the request and the block.  For that ``plan`` must know the cache's number of blocks before ``run``.
"""
from __future__ import annotations

import inspect
import random
from typing import List, Optional, Sequence

import torch

import sparsemla

CACHE_KWARGS = ("cache", "kv_cache", "num_blocks", "num_cache_blocks")


def _takes(fn, names) -> Optional[str]:
    params = inspect.signature(fn).parameters
    for n in names:
        if n in params:
            return n
    return None


def _value(name: str, cache):
    return cache if "cache" in name and "num" not in name else cache.num_blocks


def make_runner(cache, *args, **kwargs) -> "sparsemla.SparseMLA":
    """``SparseMLA(*args, **kwargs)``, told the cache's size at construction when it takes it there."""
    name = _takes(sparsemla.SparseMLA.__init__, CACHE_KWARGS)
    if name is not None and name not in kwargs:
        kwargs[name] = _value(name, cache)
    return sparsemla.SparseMLA(*args, **kwargs)


def knows_cache_at_plan(runner) -> bool:
    """Whether ``plan`` can check block tables against the cache: it takes the cache (or its size), or the
    runner was built with it."""
    return (_takes(runner.plan, CACHE_KWARGS) is not None
            or _takes(sparsemla.SparseMLA.__init__, CACHE_KWARGS) is not None)


def plan(runner, metadata, cache, **kwargs) -> None:
    """``runner.plan(metadata, **kwargs)``, passing the cache (or its size) where plan takes it."""
    name = _takes(runner.plan, CACHE_KWARGS)
    if name is not None:
        kwargs[name] = _value(name, cache)
    runner.plan(metadata, **kwargs)


class DecodeBatches:
    """Random decode batches over one cache: 1..max_requests requests, 1..max_query tokens each (speculative
    tokens), context lengths 1..max_ctx, block tables drawn fresh from a shuffled cache every step (a
    request's blocks never repeat within a step), top-k rows of distinct positions inside each token's
    visible context with random positions (garbage) past its valid count.

    ``step(i)`` returns ``(metadata, topk_local [num_tokens, topk] on device, seq_lens, tables)``.
    Metadata comes from host tensors (``BatchMetadata.from_tensors``) on most steps and from Python lists
    on every fifth, so both constructors run in the long loop."""

    def __init__(self, seed: int, cache, topk: int, max_requests: int, max_query: int, max_ctx: int,
                 device, index_topk: Optional[int] = None, kpool: int = 1):
        self.r = random.Random(seed)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cache, self.topk, self.device = cache, topk, torch.device(device)
        self.max_requests, self.max_query, self.max_ctx = max_requests, max_query, max_ctx
        self.index_topk, self.kpool = index_topk or topk, kpool
        self.bs = cache.block_size
        need = max_requests * -(-max_ctx // self.bs)
        if need > cache.num_blocks:
            raise ValueError(f"cache: {cache.num_blocks} blocks, a step may need {need}")

    def valid_count(self, ctx: int) -> int:
        n = ctx if ctx <= self.index_topk else self.index_topk + ctx % self.kpool
        return min(n, self.topk)

    def step(self, i: int, max_tokens: int):
        r = self.r
        nreq = r.randint(1, self.max_requests)
        qlens: List[int] = []
        while len(qlens) < nreq and sum(qlens) < max_tokens:
            qlens.append(min(r.randint(1, self.max_query), max_tokens - sum(qlens)))
        qlens = sorted(qlens)  # decode requests with more query tokens last (any order is a decode batch)
        seq = [r.randint(q, self.max_ctx) for q in qlens]
        perm = list(range(self.cache.num_blocks))
        r.shuffle(perm)
        tables, used = [], 0
        for s in seq:
            nb = -(-s // self.bs)
            tables.append(perm[used:used + nb])
            used += nb
        mql = max(qlens)
        if i % 5 == 0:
            md = sparsemla.BatchMetadata.from_lists(qlens, seq, tables, block_size=self.bs, max_decode_query_len=mql)
        else:
            width = max(len(t) for t in tables)
            bt = torch.full((len(seq), width), -1, dtype=torch.int32)
            for j, t in enumerate(tables):
                bt[j, : len(t)] = torch.tensor(t, dtype=torch.int32)
            qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
            qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
            md = sparsemla.BatchMetadata.from_tensors(qsl, torch.tensor(seq, dtype=torch.int32), bt,
                                                      num_tokens=sum(qlens), num_decode_tokens=sum(qlens),
                                                      num_decode_requests=len(qlens))
        # per token: visible context and valid count; distinct positions in [0, ctx), garbage after
        ctxs = [s - q + j + 1 for q, s in zip(qlens, seq) for j in range(q)]
        t = len(ctxs)
        counts = [self.valid_count(c) for c in ctxs]
        ctx_t = torch.tensor(ctxs, device=self.device, dtype=torch.int64)
        # random keys, argsort per row -> a random permutation prefix of the positions below ctx
        keys = torch.rand((t, self.max_ctx), generator=self.gen, device=self.device)
        keys = keys.masked_fill(torch.arange(self.max_ctx, device=self.device)[None, :] >= ctx_t[:, None], 2.0)
        order = torch.argsort(keys, dim=1)[:, : self.topk].to(torch.int32)
        cnt = torch.tensor(counts, device=self.device, dtype=torch.int32)
        garbage = torch.randint(0, self.max_ctx, (t, self.topk), generator=self.gen, device=self.device,
                                dtype=torch.int32)
        kk = torch.arange(self.topk, device=self.device, dtype=torch.int32)
        if self.topk > order.shape[1]:
            order = torch.cat([order, garbage[:, order.shape[1]:]], dim=1)
        topk_local = torch.where(kk[None, :] < cnt[:, None], order, garbage)
        return md, topk_local, seq, tables, counts
