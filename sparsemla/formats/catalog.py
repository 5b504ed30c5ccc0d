"""The catalogue of formats: ids -> shared format objects, and the choice of a format by row size.

Ids and the meaning of ``-nope`` / ``-nope-compact``: see the package docstring (``formats/__init__.py``).
"""
from __future__ import annotations

from typing import Optional

from .base import KVFormat
from .bf16 import BF16Format
from .fp8 import FP8Format
from .fp8_ds_mla import FP8DSMLAFormat
from .nvfp4_ds_mla import NVFP4DSMLAFormat

FORMAT_NAMES = ("bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla")
_CLASSES = {
    "bf16": BF16Format,
    "fp8": FP8Format,
    "fp8_ds_mla": FP8DSMLAFormat,
    "nvfp4_ds_mla": NVFP4DSMLAFormat,
}
_NOPE, _COMPACT = "-nope", "-nope-compact"
_CACHE: dict = {}


class UnsupportedFormat(ValueError):
    """No sparsemla format matches the description; the message says why."""


def _make(base: str, rope_dim: int, compact: bool) -> KVFormat:
    key = (base, rope_dim, compact)
    fmt = _CACHE.get(key)
    if fmt is None:
        fmt = _CACHE[key] = _CLASSES[base](rope_dim, compact)
    return fmt


def get_format(name, rope_dim: Optional[int] = None, *, arg: str = "name") -> KVFormat:
    """Return the (shared, immutable) format object for ``name``.

    Args:
        name: a format id (``"fp8_ds_mla"``, ``"nvfp4_ds_mla-nope"``, ``"fp8_ds_mla-nope-compact"``, ...)
            or a :class:`KVFormat`, which is returned unchanged.
        rope_dim: optional 64 or 0.  With a base name it picks the variant (0: vLLM's NoPE row); with a
            ``-nope`` id it must be 0 (or None).
        arg: the argument name error messages start with (a caller's own, e.g. ``"fmt"``).
    """
    if isinstance(name, KVFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"{arg}: expected a format name (str) or KVFormat, got {type(name).__name__}")
    if rope_dim is not None and (isinstance(rope_dim, bool) or not isinstance(rope_dim, int)):
        raise TypeError(f"rope_dim: expected an int (64 or 0), got {type(rope_dim).__name__}")
    base, compact, nope = name, False, False
    if name.endswith(_COMPACT):
        base, compact, nope = name[: -len(_COMPACT)], True, True
    elif name.endswith(_NOPE):
        base, nope = name[: -len(_NOPE)], True
    if base not in _CLASSES:
        raise ValueError(f"{arg}: expected one of {list(FORMAT_NAMES)}, optionally with '-nope' (or "
                         f"'-nope-compact' for fp8_ds_mla / nvfp4_ds_mla), got {name!r}")
    if nope:
        if rope_dim not in (None, 0):
            raise ValueError(f"rope_dim: {name!r} is a NoPE format (rope_dim 0), got rope_dim {rope_dim}")
        rope_dim = 0
    elif rope_dim is None:
        rope_dim = 64
    if compact and not _CLASSES[base].has_compact_nope:
        raise ValueError(f"{arg}: {base!r} has no compact NoPE layout (its NoPE row is {base}-nope), got {name!r}")
    return _make(base, rope_dim, compact)


def all_formats(compact: bool = False):
    """Every format with vLLM's rows, rope and NoPE (8 objects); ``compact=True`` adds the two compact
    NoPE layouts (10)."""
    fmts = [get_format(n, r) for r in (64, 0) for n in FORMAT_NAMES]
    if compact:
        fmts += [get_format(n + _COMPACT) for n in FORMAT_NAMES if _CLASSES[n].has_compact_nope]
    return fmts


def format_for(name: str, bytes_per_token: int, rope_dim: int) -> KVFormat:
    """The format of base name ``name`` with ``rope_dim`` whose row is ``bytes_per_token`` long.

    ``format_for("fp8_ds_mla", 656, 0)`` is ``fp8_ds_mla-nope``, ``format_for("fp8_ds_mla", 528, 0)``
    ``fp8_ds_mla-nope-compact``.  Raises :class:`UnsupportedFormat` naming the sizes that exist.
    """
    if name not in _CLASSES:
        raise UnsupportedFormat(f"name: expected one of {list(FORMAT_NAMES)}, got {name!r}")
    if rope_dim not in (64, 0):
        raise UnsupportedFormat(f"rope_dim: expected 64 or 0, got {rope_dim!r}")
    options = [get_format(name, rope_dim)]
    if rope_dim == 0 and _CLASSES[name].has_compact_nope:
        options.append(get_format(name + _COMPACT))
    for fmt in options:
        if fmt.bytes_per_token == bytes_per_token:
            return fmt
    sizes = ", ".join(f"{f.id} {f.bytes_per_token} B" for f in options)
    raise UnsupportedFormat(f"bytes_per_token: {name} with rope_dim {rope_dim} has rows of {sizes}; "
                            f"got {bytes_per_token}")



__all__ = ["FORMAT_NAMES", "UnsupportedFormat", "get_format", "all_formats", "format_for"]
