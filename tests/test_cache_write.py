"""Cache-write kernel (kernels/cache_write.py) under the Triton interpreter: the bytes written must be
IDENTICAL to ``fmt.encode`` for every format (vLLM's NoPE rows with their zero RoPE slot, and the compact
ones), input dtype and k_scale, on heavy-tailed data and on hand-picked hard values (ties, saturation,
subnormals, every nvfp4 decision point of every e4m3 scale) and on non-finite input (the format's
non-finite row); slot -1 and slots outside the cache are skipped; strided, shuffled blocks; nothing
outside the written rows changes.

Small shapes (a few dozen tokens) keep each kernel run under a second in the interpreter.  The GPU
suite (tests/gpu/test_movement_gpu.py) repeats this at realistic sizes, on both conversion paths.
"""
import pytest
import torch

from sparsemla.cache import PagedKVCache
from sparsemla.formats import all_formats, get_format
from sparsemla.formats import _numerics as nm
from sparsemla.kernels.cache_write import cache_write, k_scale_mode, slots_in
from sparsemla._device import interpreting

from conversion_probe import every_bf16_amax, probe_conversions, probe_nvfp4_scales

ALL = all_formats(compact=True)
ALL_IDS = [f.id for f in ALL]
POISON = 0xA5


def heavy_tailed(n, dim, seed, dtype=torch.float32, device="cpu"):
    """Student-t-like rows with per-token scales spanning decades, a few outlier channels, rare
    spikes, an all-zero token and an all-zero 128-dim tile / 16-dim block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) / torch.sqrt(torch.rand(n, dim, generator=g) + 0.05)
    x = x * torch.exp(1.5 * torch.randn(n, 1, generator=g))
    x[:, [3 % dim, 200 % dim, dim - 1]] *= 30.0                          # outlier channels
    spikes = torch.rand(n, dim, generator=g) < 0.01
    x = torch.where(spikes, x * 100.0, x)
    if n > 2 and dim >= 144:
        x[1] = 0.0
        x[2, :128] = 0.0
        x[2, 128:144] = -0.0
    return x.to(dtype).to(device)


def write_and_expect(fmt, kv, pe, slots, k_scale, num_rows, block_size, stride_rows, device, poison=POISON,
                     config=None):
    """Run the kernel on a poisoned cache; return (cache rows, expected rows from fmt.encode)."""
    rows = torch.full((num_rows, fmt.bytes_per_token), poison, dtype=torch.uint8, device=device)
    cache_write(rows, fmt, kv, pe, slots, block_size, stride_rows, k_scale, _config=config)
    expect = torch.full_like(rows, poison)
    num_slots = slots_in(num_rows, block_size, stride_rows)  # slots whose row lies inside the rows
    keep = (slots >= 0) & (slots < num_slots)
    s = slots[keep].to(torch.int64)
    target = (s // block_size) * stride_rows + s % block_size
    expect[target] = fmt.encode(kv[keep], None if pe is None else pe[keep], k_scale)
    return rows, expect


def first_mismatch(got, want):
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return None
    r, c = bad[0].tolist()
    return f"{bad.shape[0]} bytes differ; first at row {r} byte {c}: got {got[r, c].item():#04x}, want {want[r, c].item():#04x}"


# --------------------------------------------------------------------------------------------
# byte equality with fmt.encode
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fid", ALL_IDS)
@pytest.mark.parametrize("dtype,k_scale", [(torch.bfloat16, 1.0), (torch.float32, 0.5), (torch.float16, 0.37)])
def test_bytes_equal_encode(fid, dtype, k_scale, device):
    fmt = get_format(fid)
    n, bs, stride = 40, 8, 11                       # strided blocks: 3 rows between blocks belong to nobody
    nb = 7
    kv = heavy_tailed(n, 512, seed=sum(map(ord, fid)), dtype=dtype, device=device)
    if dtype == torch.float16:
        kv = kv.clamp(-6e4, 6e4)
    pe = heavy_tailed(n, 64, seed=7, dtype=dtype, device=device) if fmt.rope_dim else None
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(nb * bs, generator=g)[:n]          # shuffled slots over shuffled blocks
    slots[[0, 5, 17]] = -1                                     # skipped tokens
    slots = slots.to(torch.int32).to(device)
    rows, expect = write_and_expect(fmt, kv, pe, slots, k_scale, (nb - 1) * stride + bs, bs, stride, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


@pytest.mark.parametrize("fid", ["fp8_ds_mla-nope", "nvfp4_ds_mla-nope"])
def test_nope_rows_zero_the_rope_slot(fid, device):
    """vLLM's NoPE rows: the RoPE slot is written as zeros over whatever the cache held, and every other
    byte equals the rope format's row for the same kv_c with k_pe = 0."""
    fmt = get_format(fid)
    rope = get_format(fmt.name)
    n = 12
    kv = heavy_tailed(n, 512, seed=21, dtype=torch.bfloat16, device=device)
    slots = torch.arange(n, dtype=torch.int32, device=device).flip(0)
    rows, expect = write_and_expect(fmt, kv, None, slots, 1.0, 16, 4, 4, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)
    lay = fmt.layout
    got = rows[slots.long()]
    assert bool((got[:, lay.zero_offset:lay.zero_offset + lay.zero_bytes] == 0).all())
    full = rope.encode(kv, torch.zeros(n, 64, device=device))
    keep = torch.ones(fmt.bytes_per_token, dtype=torch.bool)
    keep[lay.zero_offset:lay.zero_offset + lay.zero_bytes] = False
    assert torch.equal(got[:, keep.to(device)], full[:, keep.to(device)])


@pytest.mark.parametrize("fid", ALL_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_nonfinite_tokens_match_encode(fid, dtype, device):
    """NaN / +inf / -inf in kv_c (in various 128-dim tiles and 16-dim blocks, a whole token) or k_pe: the
    kernel writes the same bytes as fmt.encode (each non-finite value group's NaN bytes, every other byte
    as for finite input); bf16 input takes the nvfp4 pair path, fp32 / fp16 the other."""
    fmt = get_format(fid)
    n = 14
    kv = heavy_tailed(n, 512, seed=23, dtype=torch.float32)
    pe = heavy_tailed(n, 64, seed=24, dtype=torch.float32) if fmt.rope_dim else None
    if dtype == torch.float16:
        kv, pe = kv.clamp(-6e4, 6e4), None if pe is None else pe.clamp(-6e4, 6e4)
    kv[1, 0] = float("nan")
    kv[2, 140] = float("inf")
    kv[3, 511] = -float("inf")
    kv[4] = float("nan")
    kv[5, 17] = -float("nan")
    bad = [1, 2, 3, 4, 5]
    if pe is not None:
        pe[7, 0] = float("nan")
        pe[8, 63] = float("inf")
        pe[9, 5] = -float("inf")
        bad += [7, 8, 9]
    kv, pe = kv.to(dtype).to(device), None if pe is None else pe.to(dtype).to(device)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    rows, expect = write_and_expect(fmt, kv, pe, slots, 0.5, 16, 8, 8, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)
    assert torch.equal(rows[4], fmt.nonfinite_row(device)) == (pe is None)     # token 4: every latent group
    nan = torch.isnan(fmt.decode(rows[:n].cpu(), 0.5)).any(dim=1)
    assert nan.tolist() == [i in bad for i in range(n)]


def test_slots_outside_the_cache_are_skipped(device):
    """A slot past the last block (or below -1) is never written: the kernel stays inside ``rows``."""
    fmt = get_format("fp8_ds_mla")
    bs, stride, nb = 4, 6, 3
    backing = torch.full((nb * stride + 8, fmt.bytes_per_token), POISON, dtype=torch.uint8, device=device)
    rows = backing[: (nb - 1) * stride + bs]
    kv = heavy_tailed(5, 512, seed=25, device=device)
    pe = torch.randn(5, 64, device=device)
    slots = torch.tensor([nb * bs, 5, -7, 10 ** 6, 0], dtype=torch.int64, device=device)
    cache_write(rows, fmt, kv, pe, slots, bs, stride)
    expect = torch.full_like(backing, POISON)
    ok = torch.tensor([1, 4])
    expect[torch.tensor([stride + 1, 0])] = fmt.encode(kv[ok.to(device)], pe[ok.to(device)]).to(expect.device)
    assert first_mismatch(backing, expect) is None, first_mismatch(backing, expect)


@pytest.mark.parametrize("fid", ["fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16-nope"])
def test_int64_slots_and_row_strided_input(fid, device):
    """int64 slot mapping; kv_c and k_pe as column slices of one fused [N, 576] tensor (row stride 576)."""
    fmt = get_format(fid)
    n = 19
    fused = heavy_tailed(n, 576, seed=3, dtype=torch.bfloat16, device=device)
    kv, pe = fused[:, :512], (fused[:, 512:] if fmt.rope_dim else None)
    slots = torch.tensor(list(range(40, 40 - n, -1)), dtype=torch.int64, device=device)
    rows, expect = write_and_expect(fmt, kv, pe, slots, 1.0, 48, 16, 16, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


@pytest.mark.parametrize("fid", ["nvfp4_ds_mla", "nvfp4_ds_mla-nope", "nvfp4_ds_mla-nope-compact"])
def test_nvfp4_aligned_and_unaligned_pairs(fid, device):
    """bf16 pairs read with the 16-byte alignment hint (contiguous rows, or the row-strided slice of a fused
    [N, 576] tensor) and without it (rows starting 4 bytes into a 16-byte line): the same bytes."""
    fmt = get_format(fid)
    n = 21
    fused = heavy_tailed(n, 576, seed=5, dtype=torch.bfloat16, device=device)
    shifted = heavy_tailed(n, 516, seed=5, dtype=torch.bfloat16, device=device)[:, 2:514]   # stride 516, +4 B
    for kv in (fused[:, :512].contiguous(), fused[:, :512], shifted):
        pe = fused[:, 512:] if fmt.rope_dim else None
        slots = torch.arange(n, dtype=torch.int32, device=device).flip(0)
        rows, expect = write_and_expect(fmt, kv, pe, slots, 1.0, 32, 8, 8, device)
        assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


@pytest.mark.parametrize("fid", ["fp8", "nvfp4_ds_mla", "bf16", "bf16-nope"])
def test_odd_row_stride_bf16_takes_generic_path(fid, device):
    """A bf16 kv_c whose row stride is odd cannot be read as bf16 pairs (uint32): same bytes anyway."""
    fmt = get_format(fid)
    n = 9
    big = heavy_tailed(n, 513, seed=4, dtype=torch.bfloat16, device=device)
    kv = big[:, 1:]                                          # stride 513, starts 2 bytes in
    pe = heavy_tailed(n, 64, seed=5, dtype=torch.bfloat16, device=device) if fmt.rope_dim else None
    slots = torch.arange(n, dtype=torch.int32, device=device)
    rows, expect = write_and_expect(fmt, kv, pe, slots, 1.0, 16, 16, 16, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


def _hard_e4m3_values():
    """e4m3 values, midpoints (ties), just off the midpoints, the saturation edge, subnormals."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    vals = nm.e4m3_decode(codes)                             # 0 .. 448
    mids = (vals[:-1].double() + vals[1:].double()) / 2      # exact in fp32 (one more bit)
    mids = mids.float()
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    edge = torch.tensor([448.0, 455.9, 464.0, 464.0001, 480.0, 1e6, 2.0 ** -10, 2.0 ** -11, 1e-30, 0.0])
    v = torch.cat([vals, mids, up, down, edge])
    return torch.cat([v, -v])


@pytest.mark.parametrize("fid", ["fp8", "fp8-nope"])
def test_fp8_ties_and_saturation(fid, device):
    fmt = get_format(fid)
    v = _hard_e4m3_values()
    d = fmt.head_dim
    n = -(-v.numel() // d)
    flat = torch.zeros(n * d)
    flat[: v.numel()] = v
    x = flat.reshape(n, d).to(device)
    kv, pe = x[:, :512], (x[:, 512:] if fmt.rope_dim else None)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    rows, expect = write_and_expect(fmt, kv, pe, slots, 1.0, n, 4, 4, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


def test_fp8_ds_mla_scale_edges(device):
    """Tile amax / 448 exactly a power of two, just above one, 0.75 of one, and an all-zero tile."""
    fmt = get_format("fp8_ds_mla")
    x = torch.randn(4, 512) * 0.1
    x[0, 5] = 448.0                      # amax/448 = 1     -> scale 1
    x[0, 130] = 448.0 * 1.0000001        # just above       -> scale 2
    x[0, 300] = 0.75 * 448.0             # 0.75             -> scale 1
    x[0, 384:] = 0.0                     # all-zero tile    -> 2^-13
    x[1] = torch.tensor([2.0 ** -20, -3e-9] * 256)           # tiny: floor 1e-4
    x[2, :128] = 1e30                    # huge
    x[3] = torch.linspace(-5000, 5000, 512)
    pe = torch.randn(4, 64)
    slots = torch.arange(4, dtype=torch.int32)
    rows, expect = write_and_expect(fmt, x.to(device), pe.to(device), slots.to(device), 1.0, 4, 4, 4, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_every_scale_and_decision_point(dtype, device):
    """For every e4m3 block scale ``sf``, values right at and next to each e2m1 decision point
    ``t * sf`` (the kernel compares against ``t * sf`` instead of dividing; this shows the two agree),
    plus a block whose scale must round up and one that saturates.  fp32 input takes the fp32 path,
    bf16 input the bf16-pair path."""
    ts = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    blocks = []
    for code in range(1, 0x7F):
        sf = nm.e4m3_decode(torch.tensor([code], dtype=torch.uint8)).item()
        thr = (ts * sf).to(dtype).float()                                     # exact in bf16 too
        if dtype == torch.bfloat16:
            nb = lambda v, d: v.to(torch.bfloat16).view(torch.int16).add(d).view(torch.bfloat16).float()
            near = torch.cat([thr, nb(thr, 1), nb(thr, -1)])
        else:
            near = torch.cat([thr, torch.nextafter(thr, thr * 2), torch.nextafter(thr, thr * 0)])
        vals = torch.cat([near, -near])                                       # 42 values
        for i in range(0, vals.numel(), 15):                                  # 15 values + the block max 6*sf
            chunk = vals[i:i + 15]
            blk = torch.zeros(16)
            blk[: chunk.numel()] = chunk
            blk[15] = 6 * sf
            blocks.append(blk)
    blocks.append(torch.tensor([7.0 * 0.3] + [0.3] * 15))                    # sf must round up
    blocks.append(torch.tensor([1e5, -4000.0] + [100.0] * 14))               # amax > 6 * 448: saturates
    while len(blocks) % 32:
        blocks.append(torch.zeros(16))
    x = torch.stack(blocks).reshape(-1, 512).to(dtype)
    n = x.shape[0]
    fmt = get_format("nvfp4_ds_mla")
    pe = torch.randn(n, 64).to(dtype)
    slots = torch.arange(n, dtype=torch.int32)
    rows, expect = write_and_expect(fmt, x.to(device), pe.to(device), slots.to(device), 1.0, n, 8, 8, device)
    assert first_mismatch(rows, expect) is None, first_mismatch(rows, expect)


def test_nothing_outside_written_rows_changes(device):
    """A cache on random bytes, blocks 20 rows apart, a write into shuffled blocks: every byte that is
    not in a written row keeps its value (including the rows between blocks)."""
    fmt = get_format("nvfp4_ds_mla")
    g = torch.Generator().manual_seed(11)
    bs, stride, nb = 8, 20, 6
    storage = torch.randint(0, 256, (nb * stride, fmt.bytes_per_token), generator=g, dtype=torch.uint8)
    before = storage.clone()
    storage = storage.to(device)
    data = storage.as_strided((nb, bs, fmt.bytes_per_token), (stride * fmt.bytes_per_token, fmt.bytes_per_token, 1))
    cache = PagedKVCache.from_tensor(fmt, data)
    n = 13
    blocks = torch.tensor([4, 1, 5])
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
    slots = slots[torch.randperm(n, generator=g)].to(torch.int32)
    kv = heavy_tailed(n, 512, seed=12, dtype=torch.bfloat16)
    pe = torch.randn(n, 64).to(torch.bfloat16)
    cache.write(kv.to(device), pe.to(device), slots.to(device))
    assert cache.num_rows == (nb - 1) * stride + bs
    after = storage.cpu()
    written = (slots // bs).long() * stride + (slots % bs).long()
    mask = torch.ones(after.shape[0], dtype=torch.bool)
    mask[written] = False
    assert torch.equal(after[mask], before[mask])
    assert torch.equal(after[written], fmt.encode(kv, pe))


def test_paged_cache_write_dispatches_to_kernel(device, monkeypatch):
    """PagedKVCache.write uses the kernel wherever Triton runs (CUDA, or CPU under the interpreter)."""
    import sparsemla.cache as cache_mod
    calls = []
    real = cache_mod.launch_cache_write
    monkeypatch.setattr(cache_mod, "launch_cache_write", lambda *a, **k: calls.append(1) or real(*a, **k))
    fmt = get_format("fp8_ds_mla")
    cache = PagedKVCache(fmt, num_blocks=4, block_size=4, device=device, block_stride_rows=6)
    kv = heavy_tailed(5, 512, seed=13, device=device)
    pe = torch.randn(5, 64, device=device)
    slots = torch.tensor([15, -1, 0, 9, 4], dtype=torch.int32, device=device)
    cache.write(kv, pe, slots)
    rows = cache.slot_to_row(slots[slots >= 0])
    assert torch.equal(cache.rows[rows], fmt.encode(kv[slots >= 0], pe[slots >= 0]))
    assert calls == [1] and (interpreting() or device == "cuda")


def test_empty_and_all_skipped(device):
    fmt = get_format("bf16")
    rows = torch.full((8, fmt.bytes_per_token), POISON, dtype=torch.uint8, device=device)
    cache_write(rows, fmt, torch.zeros(0, 512, device=device), torch.zeros(0, 64, device=device),
                torch.zeros(0, dtype=torch.int32, device=device), 4, 4)
    kv = torch.randn(3, 512, device=device)
    cache_write(rows, fmt, kv, torch.randn(3, 64, device=device),
                torch.full((3,), -1, dtype=torch.int32, device=device), 4, 4)
    assert bool((rows == POISON).all())


# --------------------------------------------------------------------------------------------
# the bit-exact conversion helpers used under the interpreter (the GPU suite also runs them there)
# --------------------------------------------------------------------------------------------
def conversion_probe_values(device):
    g = torch.Generator().manual_seed(5)
    rnd = torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    rnd = rnd.view(torch.float32)
    rnd = rnd[torch.isfinite(rnd)]
    bf_ties = (torch.randint(0, 2 ** 15, (4000,), generator=g, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-45, -1e-45, 1.17e-38])
    return torch.cat([_hard_e4m3_values(), rnd, bf_ties, bf_ties * 1e-3, specials,
                      torch.randn(5000) * 1e-3]).to(device)


def test_emulated_conversions_are_exact(device):
    """e4m3 (RNE, saturating, NaN -> 0x7F, signed zero), bf16 RNE and e4m3 -> fp32, bit arithmetic
    version, against PyTorch's conversions on ties, subnormals, saturation and random bit patterns."""
    x = conversion_probe_values(device)
    e4, bf, back = probe_conversions(x, emulate=True)
    ref = nm.e4m3_encode(x)
    assert torch.equal(e4, ref), f"e4m3 mismatches at {x[e4 != ref][:5].tolist()}"
    ref_bf = x.to(torch.bfloat16)
    nan = torch.isnan(x)
    assert torch.equal(bf[~nan], ref_bf.view(torch.int16)[~nan])
    assert bool(torch.isnan(ref_bf[nan].float()).all()) and bool((bf[nan] == 0x7FC0).all())
    dec = nm.e4m3_decode(ref)
    same = (back == dec) | (torch.isnan(back) & torch.isnan(dec))
    assert bool(same.all())
    assert torch.equal(back.view(torch.int32)[dec == 0], dec.view(torch.int32)[dec == 0])   # signed zeros


def test_nvfp4_scale_shortcut_on_every_bf16_amax(device):
    """The bf16-pair path's block scale (``_nvfp4_scale_bf16``: a multiply and a ceiling on the bits)
    equals the recipe's (``_nvfp4_scale``: correctly rounded amax / 6, e4m3 round trip, one code up) for
    every non-negative bf16 amax, +inf included, in code and value."""
    x = every_bf16_amax(device)
    c1, s1, c2, s2 = probe_nvfp4_scales(x)
    bad = (c1 != c2) | (s1 != s2)
    assert not bool(bad.any()), f"{int(bad.sum())} mismatches, first amax {x[bad][:5].tolist()}"
    assert int(c2.max()) == 0x7E and int(c2.min()) == 1     # saturates at 448; floor 2^-9


def test_k_scale_mode():
    assert k_scale_mode(1.0)[0] == 0
    assert k_scale_mode(0.5)[:3] == (1, 0.5, 2.0)
    assert k_scale_mode(2.0 ** -100)[0] == 1
    assert k_scale_mode(0.37)[0] == 2
    assert k_scale_mode(3.0)[0] == 2


# --------------------------------------------------------------------------------------------
# argument errors
# --------------------------------------------------------------------------------------------
def test_errors(device):
    fmt = get_format("fp8_ds_mla")
    rows = torch.zeros(16, fmt.bytes_per_token, dtype=torch.uint8, device=device)
    kv = torch.randn(2, 512, device=device)
    pe = torch.randn(2, 64, device=device)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="rows"):
        cache_write(rows.float(), fmt, kv, pe, slots, 4, 4)
    with pytest.raises(ValueError, match="rows"):
        cache_write(rows[:, :100], fmt, kv, pe, slots, 4, 4)
    with pytest.raises(ValueError, match="kv_c"):
        cache_write(rows, fmt, kv[:, :256], pe, slots, 4, 4)
    with pytest.raises(TypeError, match="kv_c"):
        cache_write(rows, fmt, kv.to(torch.int32), pe, slots, 4, 4)
    with pytest.raises(ValueError, match="k_pe"):
        cache_write(rows, fmt, kv, None, slots, 4, 4)
    nope = get_format("fp8_ds_mla-nope")
    rows_nope = torch.zeros(16, nope.bytes_per_token, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="k_pe"):
        cache_write(rows_nope, nope, kv, pe, slots, 4, 4)
    with pytest.raises(TypeError, match="slot_mapping"):
        cache_write(rows, fmt, kv, pe, slots.float(), 4, 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache_write(rows, fmt, kv, pe, slots[:1], 4, 4)
    with pytest.raises(ValueError, match="block_stride_rows"):
        cache_write(rows, fmt, kv, pe, slots, 4, 2)
    with pytest.raises(ValueError, match="k_scale"):
        cache_write(rows, fmt, kv, pe, slots, 4, 4, k_scale=0.0)


def test_nvfp4_fma_path_values_are_exact_in_bf16():
    """The GPU's NVFP4 pair path (``_e2m1_bytes_bf16x2_fma``) builds its thresholds with bf16x2 fmas and
    its codes as ``128 + b0 + 2 b1 + 4 b2``; both are only right if every intermediate value is exact in
    bf16.  Check them for every e4m3 block scale the recipe can produce (2^-9 .. 448), and that the code
    sums have the bits ``0x4300 + code``."""
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)  # positive finite e4m3 codes
    sf = codes.view(torch.float8_e4m3fn).to(torch.float64)
    sf = sf[sf >= 2.0 ** -9]
    # factors of the products (t * sf) and of the fma results (t1, u, v, t0 in the kernel)
    for t in (0.25, 0.75, 1.0, 1.25, 1.5, 1.75, 2.25, 2.5, 2.75, 3.5, 3.75, 5.0):
        v = sf * t
        assert torch.equal(v.to(torch.bfloat16).to(torch.float64), v), t
    for k in range(8):
        b = torch.tensor([128.0 + k]).to(torch.bfloat16).view(torch.int16).item()
        assert b == 0x4300 + k


def test_config_accepts_only_tiling(device):
    fmt = get_format("bf16")
    rows = torch.zeros(8, fmt.bytes_per_token, dtype=torch.uint8, device=device)
    args = (rows, fmt, torch.randn(2, 512, device=device), torch.randn(2, 64, device=device),
            torch.tensor([0, 1], dtype=torch.int32, device=device), 4, 4)
    cache_write(*args, _config={"TOK": 2, "num_warps": 1})
    assert torch.equal(rows[:2], fmt.encode(args[2], args[3]))
    with pytest.raises(ValueError, match="_config.*fma"):
        cache_write(*args, _config={"fma": False})
