"""vLLM-shaped tensors for tests and benchmarks of the vLLM integration (no vLLM import): per-layer views of a cache
whose blocks interleave the layers, vLLM's storage dtypes, its query pair with a strided ``q_pe``, converted
top-k rows with valid counts, and the float64 result they must give.
"""
from __future__ import annotations

import torch

from ...formats import KVFormat

V_DIM = 512

# vLLM cache dtype name -> the storage dtype of its per-layer tensor (fp8 is viewed as e4m3 by the layer)
STORAGE = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8, "nvfp4_ds_mla": torch.uint8}
FORMATS = ("bfloat16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla")


class LayeredCache:
    """A cache of ``num_layers`` layers interleaved per block: storage ``[num_blocks, num_layers, block_size, E]``
    (vLLM's block-outermost layout), each layer's view ``storage[:, layer]`` with a block stride of
    ``num_layers * block_size`` rows.  Layer ``layer`` holds ``fmt.encode`` of random values (heavy-tailed, with
    outliers); every other byte holds 0x7F (NaN in e4m3, near the largest magnitude in bf16 and fp32), which would
    poison a result that read it.  Pass another layer's ``storage`` to fill one more layer of the same tensor
    (:func:`layered_caches`)."""

    def __init__(self, fmt: KVFormat, kv_cache_dtype: str, num_blocks: int, block_size: int, num_layers: int = 3,
                 layer: int = 1, k_scale: float = 1.0, device="cpu", seed: int = 0,
                 storage: "torch.Tensor | None" = None):
        gen = torch.Generator().manual_seed(seed)
        self.fmt, self.block_size, self.num_blocks, self.num_layers, self.layer = fmt, block_size, num_blocks, \
            num_layers, layer
        bpt = fmt.bytes_per_token
        dtype = STORAGE[kv_cache_dtype]
        width = bpt // torch.empty((), dtype=dtype).element_size()
        if storage is None:
            storage = torch.empty((num_blocks, num_layers, block_size, width), dtype=dtype, device=device)
            storage.view(torch.uint8).fill_(0x7F)
        elif storage.shape != (num_blocks, num_layers, block_size, width) or storage.dtype != dtype:
            raise ValueError(f"storage: expected {dtype} {(num_blocks, num_layers, block_size, width)}, got "
                             f"{storage.dtype} {tuple(storage.shape)}")
        self.storage = storage
        self.view = self.storage[:, layer]
        self.stride_rows = num_layers * block_size
        n = num_blocks * block_size
        kv_c = torch.randn(n, V_DIM, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
        kv_c[torch.rand(n, V_DIM, generator=gen) < 0.002] *= 30.0  # outliers
        k_pe = torch.randn(n, fmt.rope_dim, generator=gen) if fmt.rope_dim else None
        rows = self.slot_rows(torch.arange(n))
        enc = fmt.encode(kv_c, k_pe, k_scale).to(device)
        flat = self.view.view(torch.uint8).as_strided(((num_blocks - 1) * self.stride_rows + block_size, bpt),
                                                      (bpt, 1))
        flat[rows.to(device)] = enc
        self.flat = flat
        self.k_scale = k_scale

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the layer's flat view (vLLM's ``flat_kv_row_view``) of slots ``block * block_size + offset``."""
        return (slots // self.block_size) * self.stride_rows + slots % self.block_size

    def decoded(self, rows: torch.Tensor) -> torch.Tensor:
        """float64 ``[n, head_dim]`` values of rows of the layer's flat view."""
        return self.fmt.decode(self.flat[rows.to(self.flat.device).long()].cpu(), self.k_scale).double()


def layered_caches(fmt: KVFormat, kv_cache_dtype: str, num_blocks: int, block_size: int, num_layers: int,
                   k_scale: float = 1.0, device="cpu", seed: int = 0):
    """Every layer of one interleaved tensor, each filled with its own values."""
    first = LayeredCache(fmt, kv_cache_dtype, num_blocks, block_size, num_layers, 0, k_scale, device, seed)
    return [first] + [LayeredCache(fmt, kv_cache_dtype, num_blocks, block_size, num_layers, i, k_scale, device,
                                   seed + i, storage=first.storage) for i in range(1, num_layers)]


def topk_rows(cache: LayeredCache, counts, width: int, seed: int = 1, junk_past_count: bool = True):
    """int32 ``[T, width]`` rows of distinct slots, the valid ones first (``counts[t]`` of them), then -1 or, with
    ``junk_past_count``, rows far outside the cache (what a kernel must never read); int32 ``[T]`` counts."""
    gen = torch.Generator().manual_seed(seed)
    n = cache.num_blocks * cache.block_size
    t = len(counts)
    idx = torch.full((t, width), -1, dtype=torch.int32)
    for i, c in enumerate(counts):
        slots = torch.randperm(n, generator=gen)[:c]
        idx[i, :c] = cache.slot_rows(slots).to(torch.int32)
        if junk_past_count and c < width:
            idx[i, c:c + 8] = 1 << 30
    return idx, torch.tensor(counts, dtype=torch.int32)


def query_pair(t: int, h: int, rope_dim: int, seed: int = 2, head_major: bool = False):
    """vLLM's ``(ql_nope [T, H, 512], q_pe [T, H, R])``: ``q_pe`` a strided view of a ``[T, H, 128 + R]``
    projection (the generic MLA layer's split); ``head_major`` gives ``ql_nope`` the strides of a transposed
    head-major bmm result (``(512, T * 512, 1)``, DeepSeek-V3.2's layer)."""
    gen = torch.Generator().manual_seed(seed)
    if head_major:
        ql = torch.randn(h, t, V_DIM, generator=gen).to(torch.bfloat16).transpose(0, 1)
    else:
        ql = torch.randn(t, h, V_DIM, generator=gen).to(torch.bfloat16)
    proj = torch.randn(t, h, 128 + rope_dim, generator=gen).to(torch.bfloat16)
    return ql, proj[..., 128:]


def reference(cache: LayeredCache, q: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor, sm_scale: float):
    """float64 ``(out [T, H, 512], lse [T, H])`` over the valid rows (empty row: 0, -inf)."""
    q = q.double().cpu()
    t, h, _ = q.shape
    out = torch.zeros(t, h, V_DIM, dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    for i in range(t):
        c = int(counts[i])
        if c == 0:
            continue
        k = cache.decoded(idx[i, :c])
        s = (q[i] @ k.T) * sm_scale
        lse[i] = torch.logsumexp(s, -1)
        out[i] = torch.softmax(s, -1) @ k[:, :V_DIM]
    return out, lse


def assert_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                 what: str = "") -> None:
    """bf16 output within 1e-2 of the float64 result relative to its scale, lse within 1e-3; empty rows exact."""
    out, lse = out.double().cpu(), lse.double().cpu()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), f"{what}: empty rows differ"
    assert (out[empty.unsqueeze(-1).expand_as(out)] == 0).all(), f"{what}: an empty row is not 0"
    full = ~empty
    if full.any():
        scale = ref_out.abs().amax().clamp_min(1e-6)
        err = ((out - ref_out).abs().amax() / scale).item()
        lerr = (lse[full] - ref_lse[full]).abs().max().item()
        assert err < 1e-2 and lerr < 1e-3, f"{what}: out error {err:.2e} (relative), lse error {lerr:.2e}"


def cat_query(pair, rope_dim: int) -> torch.Tensor:
    ql, qp = pair
    return ql if not rope_dim else torch.cat((ql, qp), dim=-1)


__all__ = ["LayeredCache", "layered_caches", "topk_rows", "query_pair", "reference", "assert_close", "cat_query", "STORAGE",
           "FORMATS"]

