"""Paged KV cache: allocation, the flat row view with the real block stride, slot mapping.

Layout (``docs/kv-formats.md``): a uint8 tensor ``[num_blocks, block_size, bytes_per_token]``
whose blocks may sit ``block_stride_rows >= block_size`` rows apart (an engine that interleaves
other layers' pages).  ``rows`` is the flat ``[num_rows, bytes_per_token]`` view of the whole
allocation; the row of slot ``s = block * block_size + offset`` is
``block * block_stride_rows + offset``.  Attention indices are rows of ``rows``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._validate import check_block_geometry, check_k_scale, check_positive_int, check_tensor
from .formats import KVFormat, get_format
from .kernels._runtime import triton_runs_on


class PagedKVCache:
    """A paged cache of one KV format.

    Args:
        fmt: a format name (``"fp8_ds_mla"``, ``"nvfp4_ds_mla-nope"``, ...) or :class:`KVFormat`.
        num_blocks: number of pages.
        block_size: tokens per page (64 by default, as FlashMLA and vLLM's sparse backends use).
        device: where to allocate.
        block_stride_rows: rows between the starts of consecutive blocks (``>= block_size``);
            the rows in between belong to nobody (another layer, in an engine).

    Attributes:
        data: uint8 ``[num_blocks, block_size, bytes_per_token]`` (a strided view of ``rows``).
        rows: uint8 ``[num_rows, bytes_per_token]``, ``num_rows = num_blocks * block_stride_rows``.
    """

    def __init__(self, fmt, num_blocks: int, block_size: int = 64, device=None,
                 block_stride_rows: Optional[int] = None, *, _storage: Optional[torch.Tensor] = None):
        self.fmt: KVFormat = get_format(fmt)
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        self.block_stride_rows = block_stride_rows = check_block_geometry(block_size, block_stride_rows)
        bpt = self.fmt.bytes_per_token
        num_rows = num_blocks * block_stride_rows
        if _storage is None:
            _storage = torch.zeros((num_rows, bpt), dtype=torch.uint8, device=device)
        self.rows: torch.Tensor = _storage
        self.data: torch.Tensor = _storage.as_strided(
            (num_blocks, block_size, bpt), (block_stride_rows * bpt, bpt, 1))

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_budget(cls, fmt, nbytes: int, block_size: int = 64, device=None) -> "PagedKVCache":
        """The largest cache of whole blocks that fits in ``nbytes``."""
        fmt = get_format(fmt)
        check_positive_int("nbytes", nbytes)
        per_block = block_size * fmt.bytes_per_token
        num_blocks = nbytes // per_block
        if num_blocks < 1:
            raise ValueError(f"nbytes: {nbytes} bytes cannot hold one block of {block_size} tokens "
                             f"of {fmt.id} ({per_block} bytes)")
        return cls(fmt, num_blocks, block_size, device)

    @classmethod
    def from_tensor(cls, fmt, data: torch.Tensor) -> "PagedKVCache":
        """Wrap an engine's existing uint8 ``[num_blocks, block_size, bytes_per_token]`` tensor
        (block stride may exceed ``block_size * bytes_per_token``; it must be a whole number of rows)."""
        fmt = get_format(fmt)
        check_tensor("data", data, dtype=torch.uint8, ndim=3)
        nb, bs, bpt = data.shape
        if bpt != fmt.bytes_per_token:
            raise ValueError(f"data: last dim must be {fmt.bytes_per_token} bytes for {fmt.id}, got {bpt}")
        if data.stride(2) != 1 or data.stride(1) != bpt:
            raise ValueError(f"data: tokens must be packed inside a block (strides (*, {bpt}, 1)), got {data.stride()}")
        if data.stride(0) % bpt:
            raise ValueError(f"data: block stride {data.stride(0)} bytes is not a multiple of {bpt}")
        stride_rows = data.stride(0) // bpt
        if stride_rows < bs:
            raise ValueError(f"data: block stride of {stride_rows} rows is smaller than block_size {bs}")
        storage = data.as_strided((nb * stride_rows, bpt), (bpt, 1))
        return cls(fmt, nb, bs, data.device, stride_rows, _storage=storage)

    # --- geometry ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.fmt.bytes_per_token

    def slot_to_row(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots ``block * block_size + offset`` (int) -> rows of ``rows`` (int64); -1 stays -1."""
        s = slots.to(torch.int64)
        r = (s // self.block_size) * self.block_stride_rows + s % self.block_size
        return torch.where(s < 0, torch.full_like(r, -1), r)

    # --- write / read ------------------------------------------------------------------------
    def write(self, kv_c: torch.Tensor, k_pe: Optional[torch.Tensor], slot_mapping: torch.Tensor,
              k_scale: float = 1.0, *, check: bool = True) -> None:
        """Quantize and scatter ``N`` tokens.

        kv_c ``[N, 512]`` and k_pe ``[N, rope_dim]`` (bf16/fp16/fp32; k_pe None for NoPE formats);
        slot_mapping int32/int64 ``[N]``, slot -1 = skip the token.  On CUDA (and under the Triton
        interpreter) this is one Triton launch; otherwise the format's PyTorch encoder.
        ``check=False`` skips the range/duplicate checks, which read the slots on the host.
        """
        fmt = self.fmt
        k_scale = check_k_scale(k_scale)
        check_tensor("kv_c", kv_c, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                     device=self.device)
        n = kv_c.shape[0]
        if kv_c.shape[1] != fmt.kv_lora_rank:
            raise ValueError(f"kv_c: expected shape [N, {fmt.kv_lora_rank}], got {tuple(kv_c.shape)}")
        if fmt.rope_dim:
            if k_pe is None:
                raise ValueError(f"k_pe: format {fmt.id} stores {fmt.rope_dim} RoPE dims; got None")
            check_tensor("k_pe", k_pe, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                         shape=(n, fmt.rope_dim), device=self.device)
        elif k_pe is not None and k_pe.numel() != 0:
            raise ValueError(f"k_pe: format {fmt.id} has no RoPE part; expected None, got shape {tuple(k_pe.shape)}")
        check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), shape=(n,),
                     device=self.device)
        if check and n:
            lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
            if lo < -1 or hi >= self.num_slots:
                raise ValueError(f"slot_mapping: entries must be -1 or in [0, {self.num_slots}), "
                                 f"found range [{lo}, {hi}]")
            valid = slot_mapping[slot_mapping >= 0]
            if valid.numel() != torch.unique(valid).numel():
                raise ValueError("slot_mapping: the same slot appears twice in one write")
        if n == 0:
            return
        if triton_runs_on(self.device):
            from .kernels.cache_write import cache_write
            cache_write(self.rows, fmt, kv_c, k_pe, slot_mapping, self.block_size, self.block_stride_rows, k_scale)
        else:
            keep = slot_mapping >= 0
            rows = self.slot_to_row(slot_mapping[keep])
            enc = fmt.encode(kv_c[keep], None if k_pe is None else k_pe[keep], k_scale)
            self.rows[rows] = enc

    def read(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """Rows (int, any shape ``S``, no -1) -> float32 ``[*S, head_dim]``, dequantized."""
        k_scale = check_k_scale(k_scale)
        check_tensor("rows", rows, dtypes=(torch.int32, torch.int64))
        if rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= self.num_rows:
                raise ValueError(f"rows: entries must be in [0, {self.num_rows}), found range [{lo}, {hi}]")
        flat = rows.reshape(-1).to(device=self.device, dtype=torch.int64)
        out = self.fmt.decode(self.rows[flat], k_scale)
        return out.reshape(*rows.shape, self.fmt.head_dim)

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.fmt.id}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"block_stride_rows={self.block_stride_rows}, device={self.device})")
