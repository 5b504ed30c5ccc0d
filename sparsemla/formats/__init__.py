"""KV-cache formats (the byte contract of ``docs/kv-formats.md``).

Format ids: ``bf16``, ``fp8``, ``fp8_ds_mla``, ``nvfp4_ds_mla`` (rope_dim 64: DeepSeek-V3.2 / GLM-5.x)
and their ``-nope`` variants (rope_dim 0, 512-dim keys).  A ``-nope`` id always means vLLM's row:
``bf16-nope`` 1024 B, ``fp8-nope`` 512 B, ``fp8_ds_mla-nope`` 656 B and ``nvfp4_ds_mla-nope`` 352 B
(the DS rows keep their RoPE slot, zero-filled).  ``fp8_ds_mla-nope-compact`` (528 B) and
``nvfp4_ds_mla-nope-compact`` (288 B) are this library's own rows without the slot; no engine writes them.

* ``get_format(name, rope_dim=None)``: the format object of an id, or of a base name and a rope dim
  (``get_format("fp8_ds_mla", 0)`` is vLLM's 656-byte NoPE row).
* ``format_for(name, bytes_per_token, rope_dim)``: the format of a base name whose row has that size
  (the compact layouts included), or ``UnsupportedFormat`` saying why none fits.
* ``from_vllm(kv_cache_dtype, head_size, bytes_per_token)``: the format of a vLLM cache (``vllm.py``).
"""
from __future__ import annotations

from .base import KV_LORA_RANK, KVFormat, Layout
from .bf16 import BF16Format
from .catalog import FORMAT_NAMES, UnsupportedFormat, all_formats, format_for, get_format
from .fp8 import FP8Format
from .fp8_ds_mla import FP8DSMLAFormat
from .nvfp4_ds_mla import NVFP4DSMLAFormat
from .vllm import from_vllm

__all__ = ["KVFormat", "Layout", "KV_LORA_RANK", "FORMAT_NAMES", "UnsupportedFormat", "get_format", "all_formats",
           "format_for", "from_vllm", "BF16Format", "FP8Format", "FP8DSMLAFormat", "NVFP4DSMLAFormat"]
