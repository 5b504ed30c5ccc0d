"""Batch metadata of one engine step: which query tokens belong to which request, how long each request's
context is, and where its KV blocks are.

Layout (the usual one in serving engines): requests ``0..R-1``, decode requests first, then prefill
requests; their query tokens are concatenated in that order (``T`` tokens in all).

    query_start_loc   int32 [R + 1]   tokens of request r are [query_start_loc[r], query_start_loc[r+1])
    seq_lens          int32 [R]       context length of request r, its new tokens included
    block_table       int32 [R, B]    physical KV block of each block-sized chunk of the request (-1 = none)
    req_id_per_token  int32 [T]       request of each token

Token ``i`` of request ``r`` (0-based among its ``q_r`` new tokens) sees ``seq_lens[r] - q_r + i + 1``
context tokens (itself and everything before it), so its top-k has that many candidates at most.

Build it from Python lists (:meth:`BatchMetadata.from_lists`: validated completely on the host) or from
tensors an engine already has on the device (:meth:`BatchMetadata.from_tensors`: shapes and dtypes are
checked, values are not read back, so building it never syncs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .._validate import check_positive_int, check_tensor


@dataclass
class BatchMetadata:
    """One step's batch (see the module docstring).  Construct with :meth:`from_lists` or :meth:`from_tensors`.

    Attributes:
        query_start_loc, seq_lens, block_table, req_id_per_token: int32 tensors (all on ``device``).
        num_tokens: T; num_requests: R; num_decode_tokens / num_decode_requests: the decode part (first).
        query_lens_host, seq_lens_host: Python lists when the host knows them (from_lists, or CPU tensors),
            else None.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    req_id_per_token: torch.Tensor
    num_tokens: int
    num_requests: int
    num_decode_tokens: int
    num_decode_requests: int
    query_lens_host: Optional[List[int]] = None
    seq_lens_host: Optional[List[int]] = None

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def from_lists(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_table: Sequence[Sequence[int]],
                   *, block_size: Optional[int] = None, max_decode_query_len: int = 1,
                   device=None) -> "BatchMetadata":
        """Build and fully validate a batch from plain Python lists.

        Args:
            query_lens: new query tokens of each request (>= 1).
            seq_lens: context length of each request, new tokens included (>= its query length).
            block_table: one list of physical block ids per request (lists may differ in length; they are
                padded with -1).
            block_size: when given, each request's table must hold ``ceil(seq_len / block_size)`` blocks >= 0.
            max_decode_query_len: a request with at most this many query tokens is a decode request
                (1; 1 + draft tokens with speculative decoding).  Decode requests must come first.
            device: where the tensors go.
        """
        query_lens = _int_list("query_lens", query_lens)
        seq_lens = _int_list("seq_lens", seq_lens)
        check_positive_int("max_decode_query_len", max_decode_query_len)
        r = len(query_lens)
        if len(seq_lens) != r:
            raise ValueError(f"seq_lens: expected {r} entries (one per request, as query_lens), got {len(seq_lens)}")
        if not isinstance(block_table, (list, tuple)) or len(block_table) != r:
            got = len(block_table) if isinstance(block_table, (list, tuple)) else type(block_table).__name__
            raise ValueError(f"block_table: expected a list of {r} lists (one per request), got {got}")
        rows = [_int_list(f"block_table[{i}]", row) for i, row in enumerate(block_table)]
        for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
            if ql < 1:
                raise ValueError(f"query_lens[{i}]: expected >= 1 query token, got {ql}")
            if sl < ql:
                raise ValueError(f"seq_lens[{i}]: expected >= query_lens[{i}] ({ql}) since the context includes "
                                 f"the new tokens, got {sl}")
        if block_size is not None:
            check_positive_int("block_size", block_size)
            for i, (sl, row) in enumerate(zip(seq_lens, rows)):
                need = -(-sl // block_size)
                if len(row) < need or any(b < 0 for b in row[:need]):
                    raise ValueError(f"block_table[{i}]: a context of {sl} tokens needs {need} blocks >= 0 "
                                     f"(block_size {block_size}), got {row[:need]}")
        num_decode_requests = _count_decode_prefix(query_lens, max_decode_query_len)
        width = max([len(row) for row in rows] + [1])
        table = [row + [-1] * (width - len(row)) for row in rows]
        qsl = [0]
        for ql in query_lens:
            qsl.append(qsl[-1] + ql)
        req = [i for i, ql in enumerate(query_lens) for _ in range(ql)]
        dev = torch.device(device) if device is not None else torch.device("cpu")
        i32 = dict(dtype=torch.int32, device=dev)
        return cls(query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq_lens, **i32),
                   block_table=torch.tensor(table, **i32).reshape(r, width),
                   req_id_per_token=torch.tensor(req, **i32), num_tokens=qsl[-1], num_requests=r,
                   num_decode_tokens=qsl[num_decode_requests], num_decode_requests=num_decode_requests,
                   query_lens_host=list(query_lens), seq_lens_host=list(seq_lens))

    @classmethod
    def from_tensors(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     *, num_tokens: int, num_decode_tokens: int, num_decode_requests: int,
                     req_id_per_token: Optional[torch.Tensor] = None) -> "BatchMetadata":
        """Wrap tensors an engine already has (any one device), without reading their values.

        Args:
            query_start_loc: int32 ``[R + 1]``; seq_lens: int32 ``[R]``; block_table: int32 ``[R, B]``.
            num_tokens: T (= ``query_start_loc[R]``, which is not read back); num_decode_tokens and
                num_decode_requests: the decode part, first in the batch (the engine knows them).
            req_id_per_token: optional int32 ``[T]``; computed on the device when absent.
        CPU tensors are also read on the host (their values are free to read), so they get full checks.
        """
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
        dev = query_start_loc.device
        r = query_start_loc.shape[0] - 1
        if r < 0:
            raise ValueError("query_start_loc: expected [R + 1] entries (at least 1), got an empty tensor")
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(r,), device=dev)
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
        if block_table.shape[0] != r:
            raise ValueError(f"block_table: expected {r} rows (one per request), got shape {tuple(block_table.shape)}")
        check_positive_int("num_tokens", num_tokens, minimum=0)
        check_positive_int("num_decode_tokens", num_decode_tokens, minimum=0)
        check_positive_int("num_decode_requests", num_decode_requests, minimum=0)
        if num_decode_tokens > num_tokens:
            raise ValueError(f"num_decode_tokens: expected <= num_tokens ({num_tokens}), got {num_decode_tokens}")
        if num_decode_requests > r:
            raise ValueError(f"num_decode_requests: expected <= the number of requests ({r}), got {num_decode_requests}")
        if (num_decode_tokens == 0) != (num_decode_requests == 0) or num_decode_tokens < num_decode_requests:
            raise ValueError(f"num_decode_tokens ({num_decode_tokens}) and num_decode_requests "
                             f"({num_decode_requests}) disagree: each decode request has at least one token")
        if req_id_per_token is None:
            # Token i belongs to the request r with query_start_loc[r] <= i < query_start_loc[r + 1].
            tok = torch.arange(num_tokens, device=dev, dtype=torch.int32)
            req_id_per_token = (torch.searchsorted(query_start_loc[1:], tok, right=True)
                                .clamp(max=max(r - 1, 0)).to(torch.int32))
        else:
            check_tensor("req_id_per_token", req_id_per_token, dtype=torch.int32, shape=(num_tokens,), device=dev)
        md = cls(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                 req_id_per_token=req_id_per_token, num_tokens=num_tokens, num_requests=r,
                 num_decode_tokens=num_decode_tokens, num_decode_requests=num_decode_requests)
        if dev.type == "cpu":
            md._check_host_values()
        return md

    def _check_host_values(self) -> None:
        """Full value checks of CPU tensors (from_tensors on CPU)."""
        qsl = self.query_start_loc.tolist()
        sl = self.seq_lens.tolist()
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc: expected query_start_loc[0] == 0, got {qsl[0]}")
        qlens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        for i, (ql, s) in enumerate(zip(qlens, sl)):
            if ql < 1:
                raise ValueError(f"query_start_loc: request {i} has {ql} query tokens (entries must increase)")
            if s < ql:
                raise ValueError(f"seq_lens[{i}]: expected >= its {ql} query tokens, got {s}")
        if qsl[-1] != self.num_tokens:
            raise ValueError(f"num_tokens: query_start_loc ends at {qsl[-1]}, but num_tokens is {self.num_tokens}")
        if qsl[self.num_decode_requests] != self.num_decode_tokens:
            raise ValueError(f"num_decode_tokens: the first {self.num_decode_requests} requests hold "
                             f"{qsl[self.num_decode_requests]} tokens, not {self.num_decode_tokens}")
        self.query_lens_host, self.seq_lens_host = qlens, sl

    def to(self, device) -> "BatchMetadata":
        """The same batch with its tensors on ``device`` (host lists kept)."""
        dev = torch.device(device)
        return BatchMetadata(self.query_start_loc.to(dev), self.seq_lens.to(dev), self.block_table.to(dev),
                             self.req_id_per_token.to(dev), self.num_tokens, self.num_requests,
                             self.num_decode_tokens, self.num_decode_requests, self.query_lens_host,
                             self.seq_lens_host)

    def context_lens_host(self) -> Optional[List[int]]:
        """Per-token context lengths (host list) when the host knows the batch, else None."""
        if self.query_lens_host is None or self.seq_lens_host is None:
            return None
        out: List[int] = []
        for ql, sl in zip(self.query_lens_host, self.seq_lens_host):
            out.extend(sl - ql + i + 1 for i in range(ql))
        return out


def _int_list(name: str, v) -> List[int]:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1:
            raise ValueError(f"{name}: expected a 1-d list of ints, got a tensor of shape {tuple(v.shape)}")
        return [int(x) for x in v.tolist()]
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"{name}: expected a list of ints, got {type(v).__name__}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}]: expected an int, got {type(x).__name__}")
        out.append(x)
    return out


def _count_decode_prefix(query_lens: List[int], max_decode_query_len: int) -> int:
    """Number of leading decode requests; a decode request after a prefill request is an error."""
    n = 0
    while n < len(query_lens) and query_lens[n] <= max_decode_query_len:
        n += 1
    for i in range(n, len(query_lens)):
        if query_lens[i] <= max_decode_query_len:
            raise ValueError(f"query_lens: decode requests must come first, but request {i} ({query_lens[i]} "
                             f"token(s)) follows the prefill request {n} ({query_lens[n]} tokens)")
    return n
