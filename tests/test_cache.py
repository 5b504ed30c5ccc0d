"""Paged cache (sparsemla/cache.py): views of an engine's tensors without copies (per-layer views of a
cache whose blocks interleave layers, vLLM's storage dtypes and shapes), the row extent (never past the
tensor), ``from_rows``, and ``write``'s defaults (no host reads; slots outside the cache skipped;
non-finite tokens stored as the format's non-finite row) against its debug ``check=True``.
"""
import pytest
import torch

import sparsemla.cache as cache_mod
from sparsemla.cache import PagedKVCache, rows_extent
from sparsemla.formats import all_formats, get_format

ALL_IDS = [f.id for f in all_formats(compact=True)]


def tokens(n, fmt, seed, device):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(n, 512, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).to(device)
    pe = torch.randn(n, 64, generator=g).to(device) if fmt.rope_dim else None
    return kv, pe


def extent_ok(view: torch.Tensor, base: torch.Tensor) -> bool:
    """``view``'s bytes lie inside ``base``'s."""
    lo = view.data_ptr()
    hi = lo + view.numel() * view.element_size()
    return base.data_ptr() <= lo and hi <= base.data_ptr() + base.numel() * base.element_size()


@pytest.mark.parametrize("fid", ["fp8_ds_mla", "nvfp4_ds_mla-nope", "bf16", "fp8-nope"])
def test_interleaved_layers_each_view_reads_exactly_its_bytes(fid, device):
    """One engine tensor ``[num_blocks, num_layers, block_size, bytes]``: every layer's view (the last
    ones included) wraps without a copy, its rows stay inside the tensor, a write into one layer changes
    only that layer's bytes at those slots, and each layer reads back exactly what was written to it."""
    fmt = get_format(fid)
    nb, n_layers, bs = 5, 3, 4
    g = torch.Generator().manual_seed(1)
    big = torch.randint(0, 256, (nb, n_layers, bs, fmt.bytes_per_token), generator=g, dtype=torch.uint8).to(device)
    before = big.clone()
    caches = [PagedKVCache.from_tensor(fmt, big[:, layer]) for layer in range(n_layers)]
    slots = torch.tensor([17, 0, 9, 4, 19], dtype=torch.int32, device=device)
    written = {}
    for layer, c in enumerate(caches):
        assert (c.num_blocks, c.block_size, c.block_stride_rows) == (nb, bs, n_layers * bs)
        assert c.num_rows == rows_extent(nb, bs, n_layers * bs) == (nb - 1) * n_layers * bs + bs
        assert c.rows.data_ptr() == big[:, layer].data_ptr() and extent_ok(c.rows, big)
        assert c.data.data_ptr() == big[:, layer].data_ptr() and c.data.stride() == big[:, layer].stride()
        m = 5 - layer                                        # a different set of slots per layer
        kv, pe = tokens(m, fmt, seed=10 + layer, device=device)
        c.write(kv, pe, slots[:m])
        written[layer] = (kv, pe, slots[:m])
    expect = before.clone()
    for layer, (kv, pe, s) in written.items():
        blk, off = (s // bs).long(), (s % bs).long()
        expect[blk, layer, off] = fmt.encode(kv, pe)
    assert torch.equal(big, expect)
    for layer, c in enumerate(caches):
        kv, pe, s = written[layer]
        got = c.read(c.slot_to_row(s))
        assert torch.equal(got, fmt.decode(fmt.encode(kv, pe)))
        assert torch.equal(c.data[(s // bs).long(), (s % bs).long()], expect[(s // bs).long(), layer, (s % bs).long()])


@pytest.mark.parametrize("fid,dtype,width", [
    ("bf16", torch.bfloat16, 576), ("bf16-nope", torch.bfloat16, 512), ("fp8", torch.float8_e4m3fn, 576),
    ("fp8", torch.uint8, 576), ("fp8-nope", torch.float8_e4m3fn, 512), ("fp8_ds_mla", torch.uint8, 656),
    ("fp8_ds_mla-nope", torch.uint8, 656), ("nvfp4_ds_mla", torch.uint8, 352), ("nvfp4_ds_mla-nope", torch.int8, 352),
])
@pytest.mark.parametrize("head_dim", [False, True])
def test_vllm_storage_dtypes_and_shapes(fid, dtype, width, head_dim, device):
    """vLLM's per-layer MLA tensors: ``[num_blocks, block_size, head_size]`` in the cache's storage dtype
    (bf16 / fp8 / uint8), or with a unit head dim; interleaved with another layer.  No copy: a write
    through the cache is visible in the engine's tensor."""
    fmt = get_format(fid)
    nb, bs = 3, 8
    shape = (nb, 2, bs, 1, width * (2 if dtype == torch.bfloat16 else 1))
    shape = shape if head_dim else shape[:3] + shape[4:]
    engine = torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)   # zero bytes in vLLM's dtype
    layer = engine[:, 1]
    c = PagedKVCache.from_tensor(fmt, layer)
    assert c.rows.untyped_storage().data_ptr() == engine.untyped_storage().data_ptr()
    assert extent_ok(c.rows, engine)
    kv, pe = tokens(3, fmt, seed=2, device=device)
    slots = torch.tensor([23, 0, 9], dtype=torch.int64, device=device)
    c.write(kv, pe, slots)
    raw = layer.view(torch.uint8).reshape(nb, bs, fmt.bytes_per_token)
    assert torch.equal(raw[(slots // bs), (slots % bs)], fmt.encode(kv, pe))
    other = engine[:, 0].view(torch.uint8)
    assert not bool(other.any())


def test_from_tensor_errors(device):
    fmt = get_format("fp8_ds_mla")
    ok = torch.zeros(4, 8, 656, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="656"):
        PagedKVCache.from_tensor(fmt, ok[..., :600])
    with pytest.raises(ValueError, match="656"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4, 8, 656, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="data.*dtype"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4, 8, 164, dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match="unit head dim|one KV head"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4, 8, 2, 656, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="data"):
        PagedKVCache.from_tensor(fmt, torch.zeros(8, 656, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="packed"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4, 16, 656, dtype=torch.uint8, device=device)[:, ::2])
    with pytest.raises(ValueError, match="packed"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4, 656, 8, dtype=torch.uint8, device=device).transpose(1, 2))
    with pytest.raises(ValueError, match="multiple"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4, 8 * 656 + 4, dtype=torch.uint8, device=device)[:, :8 * 656]
                                 .reshape(4, 8, 656))
    with pytest.raises(ValueError, match="smaller than block_size"):
        PagedKVCache.from_tensor(fmt, torch.zeros(4 * 8 * 656, dtype=torch.uint8, device=device)
                                 .as_strided((4, 8, 656), (4 * 656, 656, 1)))
    single = PagedKVCache.from_tensor(fmt, ok[:1])
    assert single.num_blocks == 1 and single.num_rows == 8


def test_own_allocation_and_from_rows(device):
    c = PagedKVCache("nvfp4_ds_mla", 4, 8, device=device, block_stride_rows=11)
    assert c.num_rows == 3 * 11 + 8 and c.rows.shape == (41, 352) and c.num_slots == 32
    assert c.data.shape == (4, 8, 352) and c.data.stride() == (11 * 352, 352, 1)
    again = PagedKVCache.from_rows(c.fmt, c.rows, 8, 11)
    assert again.num_blocks == 4 and again.rows.data_ptr() == c.rows.data_ptr() and again.num_rows == c.num_rows
    # a longer flat view holds as many whole blocks as fit
    longer = torch.zeros(4 * 11, 352, dtype=torch.uint8, device=device)
    assert PagedKVCache.from_rows("nvfp4_ds_mla", longer, 8, 11).num_blocks == 4
    with pytest.raises(ValueError, match="rows"):
        PagedKVCache.from_rows("nvfp4_ds_mla", longer[:7], 8, 11)
    with pytest.raises(ValueError, match="rows"):
        PagedKVCache.from_rows("fp8_ds_mla", longer, 8, 11)
    with pytest.raises(ValueError, match="block_stride_rows"):
        PagedKVCache("bf16", 2, 8, device=device, block_stride_rows=4)


def test_write_defaults_and_debug_check(device):
    """Default: slots outside the cache are skipped and non-finite tokens get the non-finite row, with no
    error; ``check=True`` raises for each instead (and for a slot written twice)."""
    fmt = get_format("fp8_ds_mla-nope")
    c = PagedKVCache(fmt, 2, 4, device=device, block_stride_rows=6)
    c.rows.fill_(0x33)
    kv, _ = tokens(4, fmt, seed=3, device=device)
    kv[2, 100] = float("nan")
    slots = torch.tensor([1, 8, 6, -1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        c.write(kv, None, slots, check=True)
    with pytest.raises(ValueError, match="kv_c.*finite.*token 2"):
        c.write(kv, None, slots.clamp(max=7), check=True)
    with pytest.raises(ValueError, match="twice"):
        c.write(kv, None, torch.tensor([1, 1, 2, 3], dtype=torch.int32, device=device), check=True)
    assert bool((c.rows == 0x33).all())              # nothing written by the refused calls
    c.write(kv, None, slots)
    assert torch.equal(c.rows[1], fmt.encode(kv[:1])[0])
    assert torch.equal(c.rows[6 + 2], fmt.encode(kv[2:3])[0])
    assert torch.isnan(c.read(torch.tensor([8]))[0]).nonzero()[:, 0].tolist() == list(range(128))  # tile 0
    untouched = torch.ones(c.num_rows, dtype=torch.bool)
    untouched[[1, 8]] = False
    assert bool((c.rows[untouched.to(device)] == 0x33).all())
    fmt_rope = get_format("bf16")
    c2 = PagedKVCache(fmt_rope, 1, 4, device=device)
    kv, pe = tokens(2, fmt_rope, seed=4, device=device)
    pe[1, 0] = float("inf")
    with pytest.raises(ValueError, match="k_pe.*finite.*token 1"):
        c2.write(kv, pe, torch.tensor([0, 1], dtype=torch.int32, device=device), check=True)


def test_write_reads_nothing_on_the_host(device, monkeypatch):
    """A default write validates shapes and dtypes only: no tensor value is read on the host (the kernel
    launch is replaced by a stub)."""
    import sparsemla.kernels.cache_write as cw
    if not cache_mod.triton_runs_on(device):
        pytest.skip("the PyTorch path runs on this device")
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(grid)

    monkeypatch.setattr(cw, "_cache_write_kernel", Stub())
    c = PagedKVCache("nvfp4_ds_mla", 2, 4, device=device)
    kv, pe = tokens(5, c.fmt, seed=5, device=device)
    slots = torch.arange(5, dtype=torch.int32, device=device)

    def boom(*a, **k):
        raise AssertionError("a tensor value was read on the host")
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    c.write(kv, pe, slots, 0.5)
    assert len(launches) == 1


@pytest.mark.parametrize("fid", ALL_IDS)
def test_pytorch_path_equals_kernel_path(fid, device, monkeypatch):
    """Where Triton cannot run, ``write`` uses ``fmt.encode``: the same bytes, the same skips."""
    fmt = get_format(fid)
    kv, pe = tokens(6, fmt, seed=6, device=device)
    kv[4, 0] = -float("inf")
    slots = torch.tensor([3, -1, 7, 100, 0, 5], dtype=torch.int32, device=device)
    a = PagedKVCache(fmt, 2, 4, device=device)
    b = PagedKVCache(fmt, 2, 4, device=device)
    a.rows.fill_(0x5A)
    b.rows.fill_(0x5A)
    a.write(kv, pe, slots)
    monkeypatch.setattr(cache_mod, "triton_runs_on", lambda dev: False)
    b.write(kv, pe, slots)
    assert torch.equal(a.rows, b.rows)
