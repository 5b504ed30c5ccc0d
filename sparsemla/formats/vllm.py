"""The sparsemla format of a vLLM MLA cache: ``from_vllm(kv_cache_dtype, head_size, bytes_per_token)``.

vLLM names an MLA cache by its ``--kv-cache-dtype`` and sizes a DS-format row by that name alone
(``fp8_ds_mla`` 656 B, ``nvfp4_ds_mla`` 352 B, whatever the RoPE dim), so the name does not identify the
layout: forks reuse a name for other row sizes.  This function checks the size too and refuses what
does not match vLLM's rows, with the reason.  Head size 576 is kv_lora_rank 512 + RoPE 64, 512 a NoPE
model.  No vLLM import.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import KVFormat
from .catalog import UnsupportedFormat, format_for, get_format

# vLLM --kv-cache-dtype -> sparsemla base name (None: needs the model dtype)
_VLLM_NAMES = {"auto": None, "bfloat16": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8",
               "fp8_ds_mla": "fp8_ds_mla", "nvfp4_ds_mla": "nvfp4_ds_mla"}
_REFUSED = {
    "fp8_e5m2": "e5m2 values are not a sparsemla format (fp8 means e4m3 with a per-tensor scale)",
    "float16": "sparsemla has no fp16 cache format (bf16 only)",
    "half": "sparsemla has no fp16 cache format (bf16 only)",
    "fp8_inc": "fp8_inc is Intel Gaudi's fp8 cache, not a sparsemla format",
    "int8": "sparsemla has no int8 cache format",
}
_HEAD_SIZES = {576: 64, 512: 0}


def _dtype_name(model_dtype) -> str:
    if isinstance(model_dtype, torch.dtype):
        return str(model_dtype).replace("torch.", "")
    return str(model_dtype)


def from_vllm(kv_cache_dtype: str, head_size: int, bytes_per_token: int, *, model_dtype=None) -> KVFormat:
    """The sparsemla format that reads a vLLM MLA cache byte for byte.

    Args:
        kv_cache_dtype: vLLM's ``cache_config.cache_dtype`` (``auto``, ``bfloat16``, ``fp8``,
            ``fp8_e4m3``, ``fp8_ds_mla``, ``nvfp4_ds_mla``).
        head_size: the MLA head size of the cache (576, or 512 for a NoPE model).
        bytes_per_token: the cache's row size in bytes (last dim times element size of the
            per-layer tensor): it must equal the format's.
        model_dtype: the model dtype (torch dtype or its name); needed for ``auto``, which stores
            the model dtype (bf16 is the only one sparsemla reads).

    Returns the :class:`KVFormat`; raises :class:`UnsupportedFormat` (a ValueError) with the reason.
    """
    if not isinstance(kv_cache_dtype, str):
        raise UnsupportedFormat(f"kv_cache_dtype: expected a vLLM cache dtype name, got {type(kv_cache_dtype).__name__}")
    if kv_cache_dtype in _REFUSED:
        raise UnsupportedFormat(f"kv_cache_dtype: {kv_cache_dtype!r}: {_REFUSED[kv_cache_dtype]}")
    if kv_cache_dtype not in _VLLM_NAMES:
        raise UnsupportedFormat(f"kv_cache_dtype: expected one of {sorted(_VLLM_NAMES)}, got {kv_cache_dtype!r}")
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size not in _HEAD_SIZES:
        raise UnsupportedFormat(f"head_size: expected 576 (512 latent + 64 RoPE) or 512 (NoPE), got {head_size!r}")
    if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int):
        raise UnsupportedFormat(f"bytes_per_token: expected an int, got {type(bytes_per_token).__name__}")
    rope_dim = _HEAD_SIZES[head_size]
    name = _VLLM_NAMES[kv_cache_dtype]
    if name is None:
        if model_dtype is None:
            raise UnsupportedFormat("model_dtype: kv_cache_dtype 'auto' stores the model dtype; pass model_dtype "
                                    "(sparsemla reads bfloat16 caches)")
        if _dtype_name(model_dtype) not in ("bfloat16", "bf16"):
            raise UnsupportedFormat(f"model_dtype: kv_cache_dtype 'auto' with a {_dtype_name(model_dtype)} model "
                                    f"stores {_dtype_name(model_dtype)} rows; sparsemla reads bfloat16 only")
        name = "bf16"
    fmt = get_format(name, rope_dim)
    if fmt.bytes_per_token == bytes_per_token:
        return fmt
    why = (f"bytes_per_token: vLLM's {kv_cache_dtype} rows for head size {head_size} are {fmt.bytes_per_token} "
           f"bytes ({fmt.id}), got {bytes_per_token}")
    try:
        other = format_for(name, bytes_per_token, rope_dim)
    except UnsupportedFormat:
        other = None
    if other is not None and other.compact:
        why += f"; {bytes_per_token} B is sparsemla's own {other.id} layout, which vLLM does not write"
    if name == "fp8_ds_mla" and bytes_per_token == 528:
        why += "; 528 B is also FlashMLA's DSv4.1 MXFP8 record, a different format"
    raise UnsupportedFormat(why)


__all__ = ["from_vllm"]
