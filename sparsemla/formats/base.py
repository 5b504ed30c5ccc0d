"""The KV-format interface: bytes per token, byte layout, and a pure-PyTorch encoder/decoder.

A format object is the executable form of one section of ``docs/kv-formats.md``.  Kernels read the
byte offsets of :class:`Layout` (passed to them as constexprs); tests and the float64 reference read
``encode`` / ``decode``.  Everything else in the library trusts these objects.

Non-finite input (one rule for every writer: ``encode`` here, the Triton cache-write kernel on CUDA
and under the interpreter).  A NaN or an infinity in ``kv_c`` or ``k_pe`` makes its *value group*
decode to NaN in every reader, written with fixed bytes, and leaves the rest of the row as encoded:

* a group is what shares a scale: one value of bf16 / fp8 (and every RoPE value), a 128-value tile
  of fp8_ds_mla, a 16-value block of nvfp4_ds_mla;
* its bytes: bf16 values 0x7FC0; e4m3 codes 0x7F (fp8 values, fp8_ds_mla tile codes, nvfp4 rope);
  an fp8_ds_mla tile scale the fp32 NaN 0x7FC00000; an nvfp4 block's value bytes 0 and scale 0x7F
  (e2m1 has no NaN: every value is ``0 * NaN``).

Nothing is raised and nothing is synchronized: a query that selects such a row gets NaN (every score
with it is NaN), every other query is unaffected, and the bytes are identical on every device.
Infinities become NaN too (a stored inf would let some queries ignore the row and others not), while
finite values outside a format's range saturate as the recipes say.  The group is the unit because a
scaled format has no per-value encoding of NaN or inf, and finding it costs the writers no reduction
beyond the per-group amax they compute anyway.  :meth:`KVFormat.nonfinite_row` is the row of a token
whose every group is non-finite.  ``PagedKVCache.write(check=True)`` raises on non-finite input instead
(a debug option: it reads the inputs on the host).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .._validate import check_k_scale, check_tensor

KV_LORA_RANK = 512  # latent dims (kv_c); also the value dims
SUPPORTED_ROPE_DIMS = (64, 0)
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside one token row; an offset is ``-1`` (and its size 0) when the part is absent.

    bytes_per_token:  row size; rows are packed at this stride inside a block.
    value_offset, value_bytes:  the 512 latent values (bf16 / e4m3 / packed e2m1).
    scale_offset, scale_bytes:  the per-group scales (4 fp32 or 32 permuted e4m3).
    rope_offset, rope_bytes:    the ``rope_dim`` RoPE values a reader uses (bf16 / e4m3); -1 for NoPE.
    rope_slot_offset, rope_slot_bytes:  where the row keeps a RoPE slot, whether it holds the RoPE
        values (rope_dim 64: the same as rope_offset) or zeros (a NoPE row in vLLM's layout of a DS
        format); -1 when the row has no slot.

    ``zero_offset`` / ``zero_bytes`` name the bytes a writer zero-fills (the slot of a NoPE row).
    """

    bytes_per_token: int
    value_offset: int
    value_bytes: int
    scale_offset: int
    scale_bytes: int
    rope_offset: int
    rope_bytes: int
    rope_slot_offset: int
    rope_slot_bytes: int

    @property
    def zero_offset(self) -> int:
        """Start of the bytes every writer stores as zero (-1: none)."""
        return self.rope_slot_offset if self.rope_offset < 0 else -1

    @property
    def zero_bytes(self) -> int:
        return self.rope_slot_bytes if self.rope_offset < 0 else 0


class KVFormat:
    """Base class of every KV format.

    Attributes:
        name: ``bf16``, ``fp8``, ``fp8_ds_mla`` or ``nvfp4_ds_mla``.
        rope_dim: 64 (DeepSeek-V3.2 / GLM-5.x) or 0 (NoPE models: 512-dim keys).
        compact: only for a NoPE DS format: True selects this library's own rows without a RoPE slot
            (528 / 288 B; not vLLM's), False vLLM's rows (656 / 352 B, the slot zero-filled).
        kv_lora_rank: 512; head_dim: ``512 + rope_dim``; bytes_per_token; layout (:class:`Layout`).
        uses_k_scale: True only for the plain ``fp8`` format, where k_scale changes the values.
    """

    name: str = ""
    kv_lora_rank: int = KV_LORA_RANK
    uses_k_scale: bool = False
    has_compact_nope: bool = False  # a DS format: its NoPE rows exist with and without the RoPE slot

    def __init__(self, rope_dim: int = 64, compact: bool = False):
        if rope_dim not in SUPPORTED_ROPE_DIMS:
            raise ValueError(f"rope_dim: expected 64 or 0 for format {self.name!r}, got {rope_dim}")
        if compact and (rope_dim or not self.has_compact_nope):
            raise ValueError(f"compact: only the NoPE rows of fp8_ds_mla and nvfp4_ds_mla have a compact layout, "
                             f"not {self.name!r} with rope_dim {rope_dim}")
        self.rope_dim = rope_dim
        self.compact = bool(compact)
        self._layout = self._make_layout()
        self._id = self.name if rope_dim else (f"{self.name}-nope-compact" if self.compact else f"{self.name}-nope")
        self._hash = hash(self._id)  # formats key the dispatch caches of every call
        self._nonfinite: Dict[torch.device, torch.Tensor] = {}

    # --- geometry -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def bytes_per_token(self) -> int:
        return self._layout.bytes_per_token

    @property
    def id(self) -> str:
        """Unique short name: ``fp8_ds_mla``, ``fp8_ds_mla-nope`` or ``fp8_ds_mla-nope-compact``."""
        return self._id

    def _make_layout(self) -> Layout:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    # --- non-finite input -----------------------------------------------------------------
    def _nonfinite_parts(self) -> Dict[str, Tuple[int, int]]:  # pragma: no cover
        """The NaN bytes per part (``"value"``, ``"scale"``, ``"rope"``): ``(pattern, width)``, a
        ``width``-byte little-endian pattern repeated over the part (bf16 NaN: ``(0x7FC0, 2)``)."""
        raise NotImplementedError

    def nonfinite_row(self, device=None) -> torch.Tensor:
        """uint8 ``[bytes_per_token]``: the row of a token whose every value group is non-finite (see the
        module docstring).  Every value decodes to NaN; the RoPE slot of a NoPE row is zero."""
        device = torch.device("cpu") if device is None else torch.device(device)
        row = self._nonfinite.get(device)
        if row is None:
            lay = self._layout
            cpu = torch.zeros(lay.bytes_per_token, dtype=torch.uint8)
            spans = {"value": (lay.value_offset, lay.value_bytes), "scale": (lay.scale_offset, lay.scale_bytes),
                     "rope": (lay.rope_offset, lay.rope_bytes)}
            for part, (pattern, width) in self._nonfinite_parts().items():
                off, size = spans[part]
                if size:
                    pat = torch.tensor([(pattern >> (8 * i)) & 0xFF for i in range(width)], dtype=torch.uint8)
                    cpu[off:off + size] = pat.repeat(size // width)
            row = self._nonfinite[device] = cpu.to(device)
        return row

    # --- codec ----------------------------------------------------------------------------
    def encode(self, kv_c: torch.Tensor, k_pe: Optional[torch.Tensor] = None, k_scale: float = 1.0) -> torch.Tensor:
        """kv_c ``[N, 512]`` and k_pe ``[N, rope_dim]`` (fp16 / bf16 / fp32; k_pe None for NoPE) ->
        uint8 ``[N, bytes_per_token]``; a non-finite value group gets the NaN bytes of the module
        docstring.  Runs on the inputs' device with no host synchronization."""
        x, r, ks = self._check_encode_args(kv_c, k_pe, k_scale)
        rows = torch.zeros((x.shape[0], self.bytes_per_token), dtype=torch.uint8, device=x.device)
        for off, part in self._encode_parts(x, r, ks):
            rows[:, off:off + part.shape[1]] = part
        return rows

    def _encode_parts(self, x: torch.Tensor, r: Optional[torch.Tensor], ks: torch.Tensor):  # pragma: no cover
        """fp32 ``x [N, 512]``, ``r [N, rope_dim]`` or None (may hold NaN / inf) -> ``[(byte offset,
        uint8 [N, n])]``."""
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """uint8 ``[N, bytes_per_token]`` (any strides) -> float32 ``[N, head_dim]`` (the exact
        dequantized values; the RoPE slot of a NoPE row is not read)."""
        raise NotImplementedError

    # --- shared argument checks for encode / decode (helpers for subclasses) ------------------
    def _check_encode_args(self, kv_c, k_pe, k_scale):
        """Validate ``encode`` arguments; returns ``(kv_c_fp32 [N, 512], k_pe_fp32 [N, rope_dim] or
        None, k_scale_fp32 0-d tensor on kv_c's device)``.

        kv_c / k_pe: fp16, bf16 or fp32, same device.  k_pe must be None (or an empty ``[N, 0]``
        tensor) for NoPE formats.  k_scale: positive, finite, and still so after rounding to fp32.
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
        r = None if k_pe is None else k_pe.to(torch.float32)
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
        return self is other or (isinstance(other, KVFormat) and self._id == other._id)

    def __hash__(self) -> int:
        return self._hash


def _k_scale_fp32(k_scale: float) -> torch.Tensor:
    """k_scale (already a positive finite Python float) rounded to the fp32 the formats use, as a
    0-d CPU tensor; it must stay positive and finite in fp32 (1e-60 or 1e60 would not)."""
    ks = torch.tensor(k_scale, dtype=torch.float32)
    if not (bool(torch.isfinite(ks)) and float(ks) > 0):
        raise ValueError(f"k_scale: expected a value representable as a positive finite fp32, got {k_scale}")
    return ks
