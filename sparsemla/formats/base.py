"""The KV-format interface: bytes per token, byte layout, and a pure-PyTorch encoder/decoder.

A format object is the executable form of one section of ``docs/kv-formats.md`` (copied from the
shared contract).  Kernels read the layout constants below; tests and the reference read
``encode``/``decode``.  Everything else in the library trusts these objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import check_k_scale, check_tensor

KV_LORA_RANK = 512  # latent dims (kv_c); also the value dims
SUPPORTED_ROPE_DIMS = (64, 0)
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside one token row (all ``-1`` when a part is absent).

    value_offset:  start of the 512 latent values (bf16 / e4m3 / packed e2m1)
    rope_offset:   start of the ``rope_dim`` RoPE values (bf16 / e4m3), -1 when rope_dim == 0
    scale_offset:  start of the per-group scales (fp32 x4 or e4m3 x32), -1 when there are none
    """

    value_offset: int
    rope_offset: int
    scale_offset: int


class KVFormat:
    """Base class of every KV format.

    Attributes: ``name`` (``bf16``, ``fp8``, ``fp8_ds_mla``, ``nvfp4_ds_mla``), ``rope_dim`` (64 or 0),
    ``kv_lora_rank`` (512), ``head_dim`` (512 + rope_dim), ``bytes_per_token``, ``layout``,
    ``uses_k_scale`` (True only for the plain ``fp8`` format, where k_scale changes the values).
    """

    name: str = ""
    kv_lora_rank: int = KV_LORA_RANK
    uses_k_scale: bool = False

    def __init__(self, rope_dim: int = 64):
        if rope_dim not in SUPPORTED_ROPE_DIMS:
            raise ValueError(f"rope_dim: expected 64 or 0 for format {self.name!r}, got {rope_dim}")
        self.rope_dim = rope_dim

    # --- geometry -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_token(self) -> int:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @property
    def layout(self) -> Layout:  # pragma: no cover
        raise NotImplementedError

    @property
    def id(self) -> str:
        """Unique short name: ``fp8_ds_mla`` or ``fp8_ds_mla-nope``."""
        return self.name if self.rope_dim else f"{self.name}-nope"

    # --- codec ----------------------------------------------------------------------------
    def encode(self, kv_c: torch.Tensor, k_pe: torch.Tensor | None = None, k_scale: float = 1.0) -> torch.Tensor:
        """kv_c ``[N, 512]`` and k_pe ``[N, rope_dim]`` (any float dtype) -> uint8 ``[N, bytes_per_token]``."""
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` -> float32 ``[N, head_dim]`` (the exact dequantized values)."""
        raise NotImplementedError

    # --- shared argument checks for encode / decode (helpers for subclasses) ------------------
    def _check_encode_args(self, kv_c, k_pe, k_scale):
        """Validate ``encode`` arguments; returns ``(kv_c_fp32 [N, 512], k_pe_fp32 [N, rope_dim] or
        None, k_scale_fp32 0-d tensor on kv_c's device)``.

        kv_c / k_pe: fp16, bf16 or fp32, same device, finite (NaN / inf are rejected rather than
        given some arbitrary encoding).  k_pe must be None (or an empty ``[N, 0]`` tensor) for
        NoPE formats.  k_scale: positive, finite, and still so after rounding to fp32.
        """
        k_scale = check_k_scale(k_scale)
        check_tensor("kv_c", kv_c, dtypes=_INPUT_DTYPES, ndim=2)
        n = kv_c.shape[0]
        if kv_c.shape[1] != self.kv_lora_rank:
            raise ValueError(f"kv_c: expected shape [N, {self.kv_lora_rank}] for {self.id}, got {tuple(kv_c.shape)}")
        if self.rope_dim:
            if k_pe is None:
                raise ValueError(f"k_pe: format {self.id} stores {self.rope_dim} RoPE dims; expected a tensor "
                                 f"of shape [{n}, {self.rope_dim}], got None")
            check_tensor("k_pe", k_pe, dtypes=_INPUT_DTYPES, shape=(n, self.rope_dim), device=kv_c.device)
        elif k_pe is not None:
            if not isinstance(k_pe, torch.Tensor) or tuple(k_pe.shape) != (n, 0):
                shape = tuple(k_pe.shape) if isinstance(k_pe, torch.Tensor) else type(k_pe).__name__
                raise ValueError(f"k_pe: format {self.id} has no RoPE part; expected None, got {shape}")
            k_pe = None
        ks = _k_scale_fp32(k_scale).to(kv_c.device)
        x = kv_c.to(torch.float32)
        _check_finite("kv_c", x)
        r = None
        if k_pe is not None:
            r = k_pe.to(torch.float32)
            _check_finite("k_pe", r)
        return x, r, ks

    def _check_decode_args(self, rows, k_scale):
        """Validate ``decode`` arguments: rows uint8 ``[N, bytes_per_token]`` (any strides).
        Returns ``k_scale`` as a 0-d fp32 tensor on rows' device."""
        k_scale = check_k_scale(k_scale)
        check_tensor("rows", rows, dtype=torch.uint8, ndim=2)
        if rows.shape[1] != self.bytes_per_token:
            raise ValueError(f"rows: expected shape [N, {self.bytes_per_token}] (bytes per token of {self.id}), "
                             f"got {tuple(rows.shape)}")
        return _k_scale_fp32(k_scale).to(rows.device)

    def __repr__(self) -> str:
        return f"<KVFormat {self.id}: {self.bytes_per_token} B/token, head_dim {self.head_dim}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, KVFormat) and (self.name, self.rope_dim) == (other.name, other.rope_dim)

    def __hash__(self) -> int:
        return hash((self.name, self.rope_dim))


def _check_finite(name: str, x: torch.Tensor) -> None:
    """Raise if ``x`` holds NaN or +-inf.  max / min propagate NaN, and two reductions without a
    temporary are much cheaper than ``isfinite(x).all()`` (one host sync on CUDA)."""
    if x.numel() == 0:
        return
    lo, hi = torch.aminmax(x)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise ValueError(f"{name}: expected finite values, found NaN or inf")


def _k_scale_fp32(k_scale: float) -> torch.Tensor:
    """k_scale (already a positive finite Python float) rounded to the fp32 the formats use, as a
    0-d CPU tensor; it must stay positive and finite in fp32 (1e-60 or 1e60 would not)."""
    ks = torch.tensor(k_scale, dtype=torch.float32)
    if not (bool(torch.isfinite(ks)) and float(ks) > 0):
        raise ValueError(f"k_scale: expected a value representable as a positive finite fp32, got {k_scale}")
    return ks
