"""TEMPORARY: the dispatch predicates of the sm_90 kernels, for the lead to lift into ``sparsemla/plan.py``.

Moved here unchanged in behaviour from the kernel modules (kernel modules hold no policy).  Nothing in
``sparsemla/kernels/sm90/`` imports this module; delete it once ``plan.py`` holds these rules.

- bf16 rows, more than 32 heads, sm_90, 16-byte aligned q rows and cache: the bf16 kernel (``bf16.py``).
- fp8 / fp8_ds_mla / nvfp4_ds_mla rows, sm_90, bf16 q, 16-byte aligned cache: the few-heads kernel
  (``few.py``, 16 heads per program) at <= FEW_MAX_HEADS heads, and above while tokens x ceil(H / 16)
  programs fit in FEW_WAVES[kind] waves of one program per SM; otherwise fp8 / fp8_ds_mla go to the wide
  kernel (``wide.py``, 64 heads per program, each row converted once for all of them) and nvfp4 to the
  portable Triton wide kernel.  Above 32 heads the few-heads kernel runs ceil(H / 16) programs per token,
  each reading the token's rows (from L2 after the first): cheap while the batch is small, then the wide
  kernel's single conversion per row wins; nvfp4 rows, whose conversion costs the most, stay on the
  few-heads kernel for up to four waves.
"""
from __future__ import annotations

import torch

from .._runtime import capability as _capability
from .._runtime import num_sms as _sms

FEW_KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")
FEW_MAX_HEADS = 32
FEW_WAVES = {"fp8": 1, "fp8_ds_mla": 1, "nvfp4_ds_mla": 4}
WIDE_Q_KINDS = ("fp8", "fp8_ds_mla")


def supported(q: torch.Tensor, kv: torch.Tensor, kind: str, num_heads: int) -> bool:
    """Whether the bf16 kernel can take this call: bf16 rows, > 32 heads, an sm_90 GPU, and 16-byte aligned
    q rows and cache."""
    if kind != "bf16" or num_heads <= 32 or q.device.type != "cuda":
        return False
    if _capability(q.device) != (9, 0):
        return False
    return (q.data_ptr() % 16 == 0 and kv.data_ptr() % 16 == 0 and (q.stride(0) * 2) % 16 == 0
            and (q.stride(1) * 2) % 16 == 0)


def few_planned(kind: str, num_tokens: int, num_heads: int, num_sms: int = 132) -> bool:
    """Whether a call of this kind and size goes to the few-heads kernel (see FEW_WAVES)."""
    if kind not in FEW_KINDS:
        return False
    return num_heads <= FEW_MAX_HEADS or num_tokens * -(-num_heads // 16) <= FEW_WAVES[kind] * num_sms


def wide_q_planned(kind: str, num_tokens: int, num_heads: int, num_sms: int = 132) -> bool:
    """Whether a call of this kind and size goes to the wide kernel for quantized rows: fp8 / fp8_ds_mla above
    FEW_MAX_HEADS heads when the few-heads kernel does not take it."""
    return (kind in WIDE_Q_KINDS and num_heads > FEW_MAX_HEADS
            and not few_planned(kind, num_tokens, num_heads, num_sms))


def _quantized_ok(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """An sm_90 GPU, bf16 q, a 16-byte aligned cache (the kernels for quantized rows)."""
    if q.device.type != "cuda" or q.dtype != torch.bfloat16:
        return False
    return _capability(q.device) == (9, 0) and kv.data_ptr() % 16 == 0


def few_supported(q: torch.Tensor, kv: torch.Tensor, kind: str, num_heads: int) -> bool:
    """Whether the few-heads kernel takes this call: fp8 / fp8_ds_mla / nvfp4_ds_mla rows (rope or NoPE),
    ``few_planned`` for q's tokens and heads, an sm_90 GPU, a 16-byte aligned cache, bf16 q."""
    return few_planned(kind, q.shape[0], num_heads, _sms(q.device)) and _quantized_ok(q, kv)


def wide_q_supported(q: torch.Tensor, kv: torch.Tensor, kind: str, num_heads: int) -> bool:
    """Whether the wide kernel for quantized rows takes this call: ``wide_q_planned`` for q's tokens and heads,
    an sm_90 GPU, a 16-byte aligned cache, bf16 q."""
    return wide_q_planned(kind, q.shape[0], num_heads, _sms(q.device)) and _quantized_ok(q, kv)
