"""The standard benchmark configurations (``docs/benchmarking.md``), as data, with filtering.

Each row of the shared table becomes one or more :class:`BenchConfig` *variants*: ``D-small`` is
six variants (b 1/4/16 x h 16/128), ``D-k`` four (top-k 512/1024 x h 16/128).  A variant has a
unique ``name``; ``id`` is the table row it came from, so ``--configs D-small`` selects all six and
``--configs D-small-b1-h128`` one of them.  Shell-style wildcards work (``D-h*``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, replace
from typing import Iterable, List, Optional, Sequence

CONTEXT = 32768      # tokens per request in every decode/prefill configuration
BLOCK_SIZE = 64      # cache page size (FlashMLA's and vLLM's sparse backends)
WRITE_TOKENS = 65536  # tokens per cache-write measurement (config W)

KINDS = ("decode", "prefill", "write")


@dataclass(frozen=True)
class BenchConfig:
    """One measured shape.

    id:        the row of the standard table (``D-h16``, ``D-small``, ``W``, ...)
    name:      unique variant name (``D-small-b4-h128``); equal to ``id`` for one-variant rows
    kind:      ``decode``, ``prefill`` or ``write``
    batch:     requests (decode/prefill); 0 for ``write``
    s_q:       query tokens per request (1 decode, 2 decode with one draft token, 4096 prefill)
    num_heads: query heads h_q
    topk:      index top-k width K
    context:   tokens per request (s_kv)
    tokens:    tokens written (``write`` only)
    note:      what it stands for
    scaled:    True for a shrunken copy (CPU runs, tests): its numbers are not the standard ones
    """

    id: str
    name: str
    kind: str
    batch: int = 0
    s_q: int = 0
    num_heads: int = 0
    topk: int = 0
    context: int = CONTEXT
    tokens: int = 0
    note: str = ""
    scaled: bool = False

    @property
    def num_tokens(self) -> int:
        """Query tokens in one call (``batch * s_q``), or tokens written for ``write``."""
        return self.tokens if self.kind == "write" else self.batch * self.s_q

    def describe(self) -> str:
        if self.kind == "write":
            return f"{self.name}: cache write of {self.tokens} tokens"
        return (f"{self.name}: {self.kind} b={self.batch} s_q={self.s_q} h={self.num_heads} "
                f"top-k={self.topk} ctx={self.context}")

    def as_dict(self) -> dict:
        return asdict(self)

    def scaled_down(self, *, batch: int = 2, context: int = 512, topk: int = 64, heads: int = 4,
                    s_q_prefill: int = 8, tokens: int = 1024) -> "BenchConfig":
        """A tiny copy with the same structure (for the CPU path and tests).

        Keeps what makes the case distinct (s_q 2 stays 2, prefill stays many-token, top-k stays
        below the context) while making every dimension small enough for a float64 CPU reference.
        """
        if self.kind == "write":
            return replace(self, tokens=min(self.tokens, tokens), scaled=True)
        s_q = min(self.s_q, s_q_prefill) if self.kind == "prefill" else self.s_q
        return replace(self, batch=min(self.batch, batch), s_q=s_q, num_heads=min(self.num_heads, heads),
                       topk=min(self.topk, topk), context=min(self.context, context), scaled=True)


def _decode(id_, name, batch, h, topk=2048, s_q=1, note=""):
    return BenchConfig(id_, name, "decode", batch=batch, s_q=s_q, num_heads=h, topk=topk, note=note)


def _standard() -> List[BenchConfig]:
    rows = [
        _decode("D-h16", "D-h16", 128, 16, note="decode, TP8 shard (memory-bound); the main serving case"),
        _decode("D-h32", "D-h32", 128, 32, note="decode, TP4 shard"),
        _decode("D-h64", "D-h64", 128, 64, note="decode, TP2 shard"),
        _decode("D-h128", "D-h128", 128, 128, note="decode, TP1 (compute-bound); FlashMLA's headline"),
        _decode("D-h128-mtp", "D-h128-mtp", 128, 128, s_q=2, note="decode with 1 draft token"),
    ]
    for b in (1, 4, 16):
        for h in (16, 128):
            rows.append(_decode("D-small", f"D-small-b{b}-h{h}", b, h, note="small-batch latency"))
    for k in (512, 1024):
        for h in (16, 128):
            rows.append(_decode("D-k", f"D-k-k{k}-h{h}", 128, h, topk=k, note="top-k sweep"))
    rows += [
        BenchConfig("P-32k", "P-32k", "prefill", batch=1, s_q=4096, num_heads=128, topk=2048,
                    note="sparse prefill, s_kv 32768"),
        BenchConfig("P-h16", "P-h16", "prefill", batch=1, s_q=4096, num_heads=16, topk=2048,
                    note="sparse prefill, TP8, s_kv 32768"),
        BenchConfig("W", "W", "write", tokens=WRITE_TOKENS, context=0,
                    note="cache write; bytes read + written"),
    ]
    return rows


STANDARD_CONFIGS: tuple = tuple(_standard())

# A short run that still covers the memory-bound and the compute-bound decode, latency, prefill and write.
QUICK_NAMES = ("D-h16", "D-h128", "D-small-b1-h16", "P-h16", "W")


def list_configs() -> List[BenchConfig]:
    """Every standard variant, in table order."""
    return list(STANDARD_CONFIGS)


def select_configs(patterns: Optional[Iterable[str]] = None, *, kinds: Optional[Sequence[str]] = None,
                   quick: bool = False, configs: Optional[Sequence[BenchConfig]] = None) -> List[BenchConfig]:
    """Filter the standard configurations.

    Args:
        patterns: ids (``D-small``), variant names (``D-small-b4-h16``) or wildcards (``D-h*``);
            a comma-separated string is split.  None or empty = all (or the quick set).
        kinds: keep only these kinds (``decode``, ``prefill``, ``write``).
        quick: start from the quick set (:data:`QUICK_NAMES`) instead of the whole table.
        configs: the list to filter (default: the standard table).

    Raises ``ValueError`` naming a pattern that matches nothing, or an unknown kind.
    """
    pool = list(STANDARD_CONFIGS if configs is None else configs)
    if quick:
        pool = [c for c in pool if c.name in QUICK_NAMES]
    if kinds:
        kinds = [k.strip() for k in kinds]
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise ValueError(f"kinds: expected some of {list(KINDS)}, got {bad}")
        pool = [c for c in pool if c.kind in kinds]
    pats = _split(patterns)
    if not pats:
        return pool
    out: List[BenchConfig] = []
    for p in pats:
        hit = [c for c in pool if fnmatch.fnmatchcase(c.name, p) or fnmatch.fnmatchcase(c.id, p)]
        if not hit:
            known = sorted({c.id for c in STANDARD_CONFIGS} | {c.name for c in STANDARD_CONFIGS})
            raise ValueError(f"configs: {p!r} matches no configuration"
                             f"{' in the quick set' if quick else ''}; known: {', '.join(known)}")
        out += [c for c in hit if c not in out]
    # Keep table order whatever order the patterns came in.
    order = {c.name: i for i, c in enumerate(STANDARD_CONFIGS)}
    return sorted(out, key=lambda c: order.get(c.name, len(order)))


def _split(patterns) -> List[str]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        out += [s.strip() for s in str(p).split(",") if s.strip()]
    return out


__all__ = ["BenchConfig", "STANDARD_CONFIGS", "QUICK_NAMES", "CONTEXT", "BLOCK_SIZE", "WRITE_TOKENS", "KINDS",
           "list_configs", "select_configs"]
