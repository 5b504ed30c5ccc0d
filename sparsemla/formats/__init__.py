"""KV-cache formats (the byte contract of ``docs/kv-formats.md``).

``get_format(name, rope_dim=64)`` returns the format object for ``bf16``, ``fp8``, ``fp8_ds_mla``
or ``nvfp4_ds_mla`` with rope_dim 64 (DeepSeek-V3.2 / GLM-5.x) or 0 (NoPE models).  A name
ending in ``-nope`` (e.g. ``fp8_ds_mla-nope``) selects rope_dim 0.
"""
from __future__ import annotations

from .base import KV_LORA_RANK, KVFormat, Layout
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
_CACHE: dict = {}


def get_format(name, rope_dim: int = 64) -> KVFormat:
    """Return the (shared, immutable) format object for ``name`` and ``rope_dim``.

    ``name`` may already be a :class:`KVFormat`, which is returned unchanged.
    """
    if isinstance(name, KVFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"name: expected a format name (str) or KVFormat, got {type(name).__name__}")
    base = name
    if name.endswith("-nope"):
        base, rope_dim = name[: -len("-nope")], 0
    if base not in _CLASSES:
        raise ValueError(f"name: expected one of {list(FORMAT_NAMES)} (optionally with '-nope'), got {name!r}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int):
        raise TypeError(f"rope_dim: expected an int (64 or 0), got {type(rope_dim).__name__}")
    key = (base, rope_dim)
    if key not in _CACHE:
        _CACHE[key] = _CLASSES[base](rope_dim)
    return _CACHE[key]


def all_formats():
    """Every format, rope and NoPE: 8 objects."""
    return [get_format(n, r) for r in (64, 0) for n in FORMAT_NAMES]


__all__ = ["KVFormat", "Layout", "KV_LORA_RANK", "FORMAT_NAMES", "get_format", "all_formats",
           "BF16Format", "FP8Format", "FP8DSMLAFormat", "NVFP4DSMLAFormat"]
