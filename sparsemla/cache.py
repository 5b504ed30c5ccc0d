"""Paged KV cache: allocation, the flat row view with the real block stride, views of an engine's
tensors, slot mapping.

Layout (``docs/kv-formats.md``): ``data`` is ``[num_blocks, block_size, bytes_per_token]`` bytes whose
blocks start ``block_stride_rows >= block_size`` rows apart (an engine that interleaves other layers'
pages between them).  ``rows`` is the flat ``[num_rows, bytes_per_token]`` view from the first token of
block 0 to the last token of the last block, so

    num_rows = (num_blocks - 1) * block_stride_rows + block_size

and it never reaches past the tensor it views (for a layer of an interleaved cache the rows between
its blocks belong to other layers: nothing here reads or writes them).  The row of slot
``s = block * block_size + offset`` is ``block * block_stride_rows + offset``; attention indices are
rows of ``rows``.  Byte offsets are ``row * bytes_per_token`` in 64-bit.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._validate import check_block_geometry, check_k_scale, check_positive_int, check_tensor
from .formats import KVFormat, get_format
from ._device import triton_runs_on
from .kernels.cache_write import launch_cache_write

# dtypes an engine stores cache rows in (vLLM: uint8 for the DS formats, fp8 or uint8 for fp8, bf16 for
# bf16); a view as uint8 reinterprets the bytes without a copy.
STORAGE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def rows_extent(num_blocks: int, block_size: int, block_stride_rows: int) -> int:
    """Rows from the first token of block 0 to the last token of block ``num_blocks - 1``."""
    return (num_blocks - 1) * block_stride_rows + block_size


class PagedKVCache:
    """A paged cache of one KV format.

    Args:
        fmt: a format id (``"fp8_ds_mla"``, ``"nvfp4_ds_mla-nope"``, ...) or :class:`KVFormat`.
        num_blocks: number of pages.
        block_size: tokens per page (64 by default, as FlashMLA and vLLM's sparse backends use).
        device: where to allocate.
        block_stride_rows: rows between the starts of consecutive blocks (``>= block_size``); the
            rows in between belong to nobody (to other layers, in an engine).

    Attributes:
        data: uint8 ``[num_blocks, block_size, bytes_per_token]`` (a strided view of ``rows``).
        rows: uint8 ``[num_rows, bytes_per_token]``, contiguous, ``num_rows`` as in the module docstring.

    Use :meth:`from_tensor` to wrap an engine's per-layer tensor and :meth:`from_rows` to wrap a flat
    row view; neither copies.
    """

    def __init__(self, fmt, num_blocks: int, block_size: int = 64, device=None,
                 block_stride_rows: Optional[int] = None, *, _storage: Optional[torch.Tensor] = None):
        self.fmt: KVFormat = get_format(fmt, arg="fmt")
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        self.block_stride_rows = block_stride_rows = check_block_geometry(block_size, block_stride_rows)
        bpt = self.fmt.bytes_per_token
        num_rows = rows_extent(num_blocks, block_size, block_stride_rows)
        if _storage is None:
            _storage = torch.zeros((num_rows, bpt), dtype=torch.uint8, device=device)
        else:
            check_tensor("rows", _storage, dtype=torch.uint8, ndim=2, contiguous=True)
            if _storage.shape[1] != bpt or _storage.shape[0] < num_rows:
                raise ValueError(f"rows: expected at least [{num_rows}, {bpt}] for {num_blocks} blocks of {block_size} "
                                 f"{self.fmt.id} tokens {block_stride_rows} rows apart, got {tuple(_storage.shape)}")
            _storage = _storage[:num_rows]
        self.rows: torch.Tensor = _storage
        self.data: torch.Tensor = _storage.as_strided(
            (num_blocks, block_size, bpt), (block_stride_rows * bpt, bpt, 1))
        self.num_slots = num_blocks * block_size

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_budget(cls, fmt, nbytes: int, block_size: int = 64, device=None) -> "PagedKVCache":
        """The largest cache of whole blocks that fits in ``nbytes``."""
        fmt = get_format(fmt, arg="fmt")
        check_positive_int("nbytes", nbytes)
        per_block = block_size * fmt.bytes_per_token
        num_blocks = nbytes // per_block
        if num_blocks < 1:
            raise ValueError(f"nbytes: {nbytes} bytes cannot hold one block of {block_size} tokens "
                             f"of {fmt.id} ({per_block} bytes)")
        return cls(fmt, num_blocks, block_size, device)

    @classmethod
    def from_tensor(cls, fmt, data: torch.Tensor) -> "PagedKVCache":
        """Wrap one layer of an engine's cache without a copy.

        Args:
            fmt: the cache's format (check it with ``formats.from_vllm`` for a vLLM cache).
            data: ``[num_blocks, block_size, E]`` or ``[num_blocks, block_size, 1, E]`` (a unit head dim),
                dtype uint8 / int8 / fp8 / bf16 / fp16 (the bytes are reinterpreted), ``E * element size
                == bytes_per_token``.  Tokens packed inside a block (unit stride on the last dim, token
                stride one row); the block stride any whole number of rows ``>= block_size`` (a view of
                one layer of a tensor whose blocks interleave layers, e.g. ``t[:, layer]`` of
                ``[num_blocks, num_layers, block_size, E]``).
        """
        fmt = get_format(fmt, arg="fmt")
        check_tensor("data", data, dtypes=STORAGE_DTYPES)
        if data.dim() == 4:
            if data.shape[2] != 1:
                raise ValueError(f"data: a 4-d cache must be [num_blocks, block_size, 1, bytes] (one KV head), "
                                 f"got {tuple(data.shape)}")
            data = data[:, :, 0]
        elif data.dim() != 3:
            raise ValueError(f"data: expected [num_blocks, block_size, bytes] (or with a unit head dim), "
                             f"got {tuple(data.shape)}")
        nb, bs, width = data.shape
        bpt = width * data.element_size()
        if bpt != fmt.bytes_per_token:
            raise ValueError(f"data: rows of {width} x {data.dtype} = {bpt} bytes; {fmt.id} needs {fmt.bytes_per_token}")
        if nb < 1 or bs < 1:
            raise ValueError(f"data: expected at least one block of one token, got {tuple(data.shape)}")
        if data.stride(2) != 1 or (bs > 1 and data.stride(1) != width):
            raise ValueError(f"data: tokens must be packed inside a block (strides (*, {width}, 1)), got {data.stride()}")
        raw = data.view(torch.uint8)
        block_stride = raw.stride(0) if nb > 1 else bs * bpt
        if block_stride % bpt:
            raise ValueError(f"data: block stride {block_stride} bytes is not a multiple of the {bpt}-byte row")
        stride_rows = block_stride // bpt
        if stride_rows < bs:
            raise ValueError(f"data: block stride of {stride_rows} rows is smaller than block_size {bs}")
        rows = raw.as_strided((rows_extent(nb, bs, stride_rows), bpt), (bpt, 1))
        return cls(fmt, nb, bs, data.device, stride_rows, _storage=rows)

    @classmethod
    def from_rows(cls, fmt, rows: torch.Tensor, block_size: int,
                  block_stride_rows: Optional[int] = None) -> "PagedKVCache":
        """Wrap a flat row view (``cache.rows`` of another object, a custom op's argument): uint8
        ``[num_rows, bytes_per_token]`` contiguous; it holds the largest number of whole blocks that fit,
        ``(num_rows - block_size) // block_stride_rows + 1``."""
        fmt = get_format(fmt, arg="fmt")
        stride = check_block_geometry(block_size, block_stride_rows)
        check_tensor("rows", rows, dtype=torch.uint8, ndim=2, contiguous=True)
        if rows.shape[0] < block_size:
            raise ValueError(f"rows: {rows.shape[0]} rows cannot hold one block of {block_size} tokens")
        return cls(fmt, (rows.shape[0] - block_size) // stride + 1, block_size, rows.device, stride, _storage=rows)

    # --- geometry ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.fmt.bytes_per_token

    def slot_to_row(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots ``block * block_size + offset`` (int, any shape) -> rows of ``rows`` (int64); -1 stays -1."""
        s = slots.to(torch.int64)
        r = (s // self.block_size) * self.block_stride_rows + s % self.block_size
        return torch.where(s < 0, torch.full_like(r, -1), r)

    # --- write / read ------------------------------------------------------------------------
    def write(self, kv_c: torch.Tensor, k_pe: Optional[torch.Tensor], slot_mapping: torch.Tensor,
              k_scale: float = 1.0, *, check: bool = False) -> None:
        """Quantize and scatter ``N`` tokens (bytes of ``fmt.encode``, the RoPE slot of a NoPE row zero).

        Args:
            kv_c: ``[N, 512]`` bf16 / fp16 / fp32, unit column stride preferred (else copied).
            k_pe: ``[N, rope_dim]`` of the same kinds; None (or ``[N, 0]``) for NoPE formats.
            slot_mapping: int32 / int64 ``[N]``; slot -1 = skip the token.
            k_scale: the per-tensor scale (changes only the ``fp8`` format's bytes).
            check: a debug option that reads the inputs on the host (one device sync): raise
                ``ValueError`` for a slot outside ``[-1, num_slots)``, a slot written twice, or a NaN /
                inf in kv_c or k_pe.  Default False: no sync; a slot outside the cache is skipped (never
                written outside ``rows``) and a NaN / inf input makes its value group decode to NaN
                (``formats/base.py``).

        On CUDA (and under the Triton interpreter) this is one Triton launch; otherwise the format's
        PyTorch encoder.  Either way the bytes are the same.
        """
        fmt = self.fmt
        k_scale = check_k_scale(k_scale)
        check_tensor("kv_c", kv_c, dtypes=_FLOATS, ndim=2, device=self.device)
        n = kv_c.shape[0]
        if kv_c.shape[1] != fmt.kv_lora_rank:
            raise ValueError(f"kv_c: expected shape [N, {fmt.kv_lora_rank}], got {tuple(kv_c.shape)}")
        if fmt.rope_dim:
            if k_pe is None:
                raise ValueError(f"k_pe: format {fmt.id} stores {fmt.rope_dim} RoPE dims; got None")
            check_tensor("k_pe", k_pe, dtypes=_FLOATS, shape=(n, fmt.rope_dim), device=self.device)
        elif k_pe is not None:
            if not isinstance(k_pe, torch.Tensor) or k_pe.numel() != 0:
                shape = tuple(k_pe.shape) if isinstance(k_pe, torch.Tensor) else type(k_pe).__name__
                raise ValueError(f"k_pe: format {fmt.id} has no RoPE part; expected None, got {shape}")
            k_pe = None
        check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), shape=(n,),
                     device=self.device)
        if check and n:
            self._check_write(kv_c, k_pe, slot_mapping)
        if n == 0:
            return
        if triton_runs_on(self.device):
            launch_cache_write(self.rows, fmt, kv_c, k_pe, slot_mapping, self.block_size, self.block_stride_rows,
                               k_scale)
        else:
            keep = (slot_mapping >= 0) & (slot_mapping < self.num_slots)
            rows = self.slot_to_row(slot_mapping[keep])
            self.rows[rows] = fmt.encode(kv_c[keep], None if k_pe is None else k_pe[keep], k_scale)

    def _check_write(self, kv_c, k_pe, slot_mapping) -> None:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= self.num_slots:
            raise ValueError(f"slot_mapping: entries must be -1 or in [0, {self.num_slots}), found range [{lo}, {hi}]")
        valid = slot_mapping[slot_mapping >= 0]
        if valid.numel() != torch.unique(valid).numel():
            raise ValueError("slot_mapping: the same slot appears twice in one write")
        for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
            if t is not None and t.numel():
                ok = torch.isfinite(t).all(dim=1)
                if not bool(ok.all()):
                    tok = int((~ok).nonzero()[0, 0])
                    raise ValueError(f"{name}: expected finite values, found NaN or inf in token {tok}")

    def read(self, rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
        """Rows (int, any shape ``S``, no -1) -> float32 ``[*S, head_dim]``, dequantized.  Checks the
        rows against ``num_rows`` on the host (a test and debugging helper)."""
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
