"""H200: the data-movement kernels at realistic sizes (cache write, index conversion, staging gathers).

Run: ``python3 -m pytest -m gpu tests/gpu/test_movement_gpu.py -v``

* cache write: 65,536 heavy-tailed tokens per format (vLLM's NoPE rows and the compact ones included)
  into shuffled blocks 80 rows apart (64-token blocks), bytes identical to ``fmt.encode`` and every other
  byte of the allocation unchanged; both conversion paths (the GPU's cvt instructions and the
  bit-arithmetic path the interpreter uses); hard values (e4m3 ties / saturation / subnormals, every
  nvfp4 decision point of every scale); non-finite tokens (the format's non-finite row: NaN must
  survive the GPU's maxima); slots outside the cache; layers interleaved per block.
* caches above 2^31 bytes (~2.3 GB per format, e.g. fp8_ds_mla with 3.5 M tokens): writes into the last
  blocks, gathers and upconverts from them.
* index conversion at b 128 x top-k 2048 / 2112 and a 4096-token prefill, against the PyTorch
  reference; into caller buffers (``out=``) captured in a CUDA graph with no allocation.
* staging: the top-k gather (b 128, top-k 2048, 32K-token contexts) and the context upconvert
  (4 x 32K) against the formats' decoders, k_scale 1 and 0.5.
"""
import os
import sys

import pytest
import torch

from sparsemla.cache import PagedKVCache
from sparsemla.formats import all_formats, get_format
from sparsemla.formats import _numerics as nm
from sparsemla.indices import convert_indices, convert_indices_torch, pooled_width
from sparsemla.kernels.cache_write import cache_write
from sparsemla.kernels.convert_indices import convert_indices_triton
from sparsemla.kernels.staging import gather_topk_fp8, upconvert_context

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conversion_probe import every_bf16_amax, probe_conversions, probe_nvfp4_scales  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
BS = 64
ALL_IDS = [f.id for f in all_formats(compact=True)]


def heavy(n, d, seed, dtype=torch.bfloat16):
    """Student-t-like values, per-token scales over decades, outlier channels, rare spikes."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = torch.empty(n, d, dtype=dtype, device=DEV)
    step = 1 << 18  # rows a chunk: the fp32 temporaries of a 4M-token cache would take tens of GB at once
    for a in range(0, n, step):
        m = min(step, n - a)
        x = torch.randn(m, d, generator=g, device=DEV) / torch.sqrt(torch.rand(m, d, generator=g, device=DEV) + 0.05)
        x = x * torch.exp(1.5 * torch.randn(m, 1, generator=g, device=DEV))
        x[:, 3] *= 30
        x[:, d // 2] *= 10
        out[a:a + m] = torch.where(torch.rand(m, d, generator=g, device=DEV) < 0.005, x * 100, x)
    out[0] = 0
    return out


def shuffled_slots(n, num_blocks, seed):
    """n slots in randomly chosen, shuffled blocks (every slot of a chosen block used), -1 sprinkled."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g, device=DEV)[: -(-n // BS)]
    slots = (blocks[:, None] * BS + torch.arange(BS, device=DEV)).reshape(-1)[:n]
    slots = slots[torch.randperm(n, generator=g, device=DEV)]
    slots[torch.rand(n, generator=g, device=DEV) < 0.01] = -1
    return slots.to(torch.int32)


def strided_cache(fmt, num_blocks, stride_rows, seed):
    """A cache whose blocks sit stride_rows apart, on random bytes; returns (cache, the whole allocation,
    a copy of its bytes).  ``cache.rows`` starts at the allocation's first byte."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    storage = torch.randint(0, 256, (num_blocks * stride_rows, fmt.bytes_per_token), generator=g,
                            device=DEV, dtype=torch.uint8)
    data = storage.as_strided((num_blocks, BS, fmt.bytes_per_token),
                              (stride_rows * fmt.bytes_per_token, fmt.bytes_per_token, 1))
    return PagedKVCache.from_tensor(fmt, data), storage, storage.clone()


def assert_rows_equal(got, want, what):
    bad = got != want
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} bytes differ; first row {r} byte {c}: "
                             f"got {int(got[r, c]):#04x}, want {int(want[r, c]):#04x}")


# ------------------------------------------------------------------------------------------------
# cache write
# ------------------------------------------------------------------------------------------------
WRITE_CASES = [(torch.bfloat16, 1.0, False), (torch.float32, 0.5, False), (torch.float16, 0.37, False),
               (torch.bfloat16, 1.0, True), (torch.float32, 0.37, True)]


@pytest.mark.parametrize("fid", ALL_IDS)
@pytest.mark.parametrize("dtype,k_scale,emulate", WRITE_CASES,
                         ids=["bf16-cvt", "fp32-ks0.5-cvt", "fp16-ks0.37-cvt", "bf16-bitexact", "fp32-ks0.37-bitexact"])
def test_write_65536_tokens_shuffled_strided(fid, dtype, k_scale, emulate):
    fmt = get_format(fid)
    n, num_blocks, stride = 65536, 1100, 80
    cache, storage, before = strided_cache(fmt, num_blocks, stride, seed=1)
    kv = heavy(n, 512, seed=2, dtype=dtype)
    if dtype == torch.float16:
        kv = kv.float().clamp(-6e4, 6e4).half()
    pe = heavy(n, 64, seed=3, dtype=dtype) if fmt.rope_dim else None
    if pe is not None and dtype == torch.float16:
        pe = pe.float().clamp(-6e4, 6e4).half()  # heavy() can overflow fp16 (inf would poison the token)
    slots = shuffled_slots(n, num_blocks, seed=4)
    cache_write(cache.rows, fmt, kv, pe, slots, BS, stride, k_scale, _emulate=emulate)
    keep = slots >= 0
    rows = cache.slot_to_row(slots[keep])
    expect = before.clone()
    expect[rows] = fmt.encode(kv[keep], None if pe is None else pe[keep], k_scale)
    assert_rows_equal(storage, expect, f"{fid} {dtype} k_scale={k_scale}")


@pytest.mark.parametrize("fid", ALL_IDS)
@pytest.mark.parametrize("dtype,emulate", [(torch.bfloat16, False), (torch.float32, False), (torch.float16, False),
                                           (torch.bfloat16, True), (torch.float32, True)],
                         ids=["bf16-cvt", "fp32-cvt", "fp16-cvt", "bf16-bitexact", "fp32-bitexact"])
def test_write_nonfinite_tokens(fid, dtype, emulate):
    """NaN / inf in any tile or block of kv_c, or in k_pe, of 1 % of 8192 tokens: fmt.encode's bytes, so
    each non-finite group's NaN bytes (the GPU's max drops NaN: the kernel must not; its e4m3 conversion
    of NaN must give 0x7F)."""
    fmt = get_format(fid)
    n = 8192
    cache, storage, before = strided_cache(fmt, 160, 80, seed=21)
    kv = heavy(n, 512, seed=22, dtype=torch.float32)
    pe = heavy(n, 64, seed=23, dtype=torch.float32) if fmt.rope_dim else None
    if dtype == torch.float16:
        kv, pe = kv.clamp(-6e4, 6e4), None if pe is None else pe.clamp(-6e4, 6e4)
    g = torch.Generator(device=DEV).manual_seed(24)
    bad = torch.randperm(n, generator=g, device=DEV)[: n // 100]
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")], device=DEV)
    dims = torch.randint(0, 512, (bad.numel(),), generator=g, device=DEV)
    kv[bad, dims] = specials[torch.arange(bad.numel(), device=DEV) % 4]
    if pe is not None:
        bad_pe = torch.randperm(n, generator=g, device=DEV)[: n // 100]
        pe[bad_pe, torch.randint(0, 64, (bad_pe.numel(),), generator=g, device=DEV)] = float("nan")
    kv, pe = kv.to(dtype), None if pe is None else pe.to(dtype)
    slots = shuffled_slots(n, 160, seed=25)
    cache_write(cache.rows, fmt, kv, pe, slots, BS, 80, 0.5, _emulate=emulate)
    keep = slots >= 0
    expect = before.clone()
    expect[cache.slot_to_row(slots[keep])] = fmt.encode(kv[keep], None if pe is None else pe[keep], 0.5)
    assert_rows_equal(storage, expect, f"{fid} {dtype} non-finite")
    rows = cache.slot_to_row(slots[keep])
    nan_rows = torch.isnan(fmt.decode(cache.rows[rows], 0.5)).any(dim=1)
    has_special = ~torch.isfinite(kv[keep].float()).all(dim=1)
    if pe is not None:
        has_special |= ~torch.isfinite(pe[keep].float()).all(dim=1)
    assert torch.equal(nan_rows, has_special)


def test_write_interleaved_layers_and_slots_outside():
    """Three layers interleaved per block in one tensor: each layer's view takes its writes (slots past
    the cache included, which are skipped) and no other byte of the tensor changes."""
    fmt = get_format("nvfp4_ds_mla-nope")
    nb, n_layers = 300, 3
    g = torch.Generator(device=DEV).manual_seed(26)
    big = torch.randint(0, 256, (nb, n_layers, BS, fmt.bytes_per_token), generator=g, device=DEV, dtype=torch.uint8)
    expect = big.clone()
    for layer in range(n_layers):
        cache = PagedKVCache.from_tensor(fmt, big[:, layer])
        n = 4096
        slots = shuffled_slots(n, nb, seed=27 + layer).to(torch.int64)
        slots[::97] = nb * BS + 5 + layer                      # outside the cache: skipped
        kv = heavy(n, 512, seed=30 + layer)
        cache.write(kv, None, slots)
        keep = (slots >= 0) & (slots < nb * BS)
        s = slots[keep]
        expect[s // BS, layer, s % BS] = fmt.encode(kv[keep])
    assert torch.equal(big, expect)


def _hard_e4m3_values():
    vals = nm.e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = ((vals[:-1].double() + vals[1:].double()) / 2).float()
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    edge = torch.tensor([448.0, 455.9, 464.0, 464.0001, 480.0, 1e6, 2.0 ** -10, 2.0 ** -11, 1e-30, 0.0,
                         1e-40, 3.4e38])
    v = torch.cat([vals, mids, up, down, edge])
    return torch.cat([v, -v])


@pytest.mark.parametrize("emulate", [False, True], ids=["cvt", "bitexact"])
def test_write_fp8_hard_values(emulate):
    fmt = get_format("fp8")
    v = _hard_e4m3_values()
    n = -(-v.numel() // 576)
    flat = torch.zeros(n * 576)
    flat[: v.numel()] = v
    x = flat.reshape(n, 576).to(DEV)
    rows = torch.zeros(n, 576, dtype=torch.uint8, device=DEV)
    cache_write(rows, fmt, x[:, :512], x[:, 512:], torch.arange(n, dtype=torch.int32, device=DEV), 4, 4,
                _emulate=emulate)
    assert_rows_equal(rows, fmt.encode(x[:, :512], x[:, 512:]), "fp8 hard values")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("emulate", [False, True], ids=["cvt", "bitexact"])
def test_write_nvfp4_every_scale_and_decision_point(dtype, emulate):
    ts = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    blocks = []
    for code in range(1, 0x7F):
        sf = nm.e4m3_decode(torch.tensor([code], dtype=torch.uint8)).item()
        thr = (ts * sf).to(dtype)
        if dtype == torch.bfloat16:
            step = lambda d: thr.view(torch.int16).add(d).view(torch.bfloat16).float()
            near = torch.cat([thr.float(), step(1), step(-1)])
        else:
            near = torch.cat([thr, torch.nextafter(thr, thr * 2), torch.nextafter(thr, thr * 0)])
        vals = torch.cat([near, -near])
        for i in range(0, vals.numel(), 15):
            blk = torch.zeros(16)
            chunk = vals[i:i + 15]
            blk[: chunk.numel()] = chunk
            blk[15] = 6 * sf
            blocks.append(blk)
    blocks.append(torch.tensor([2.1] + [0.3] * 15))
    blocks.append(torch.tensor([1e5, -4000.0] + [100.0] * 14))
    while len(blocks) % 32:
        blocks.append(torch.zeros(16))
    x = torch.stack(blocks).reshape(-1, 512).to(dtype).to(DEV)
    n = x.shape[0]
    fmt = get_format("nvfp4_ds_mla")
    pe = torch.randn(n, 64, device=DEV).to(dtype)
    rows = torch.zeros(n, fmt.bytes_per_token, dtype=torch.uint8, device=DEV)
    cache_write(rows, fmt, x, pe, torch.arange(n, dtype=torch.int32, device=DEV), 8, 8, _emulate=emulate)
    assert_rows_equal(rows, fmt.encode(x, pe), "nvfp4 decision points")


@pytest.mark.parametrize("emulate", [False, True], ids=["cvt", "bitexact"])
def test_conversions_on_2e7_random_bit_patterns(emulate):
    """Both conversion paths against PyTorch on 20 M random fp32 bit patterns plus the hard values."""
    g = torch.Generator(device=DEV).manual_seed(9)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (20_000_000,), generator=g, device=DEV, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(torch.float32), _hard_e4m3_values().to(DEV)])
    x = x[~torch.isnan(x)]
    e4, bf, back = probe_conversions(x, emulate)
    ref = nm.e4m3_encode(x)
    assert torch.equal(e4, ref), f"e4m3: {x[e4 != ref][:5].tolist()}"
    assert torch.equal(bf, x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(back.view(torch.int32), nm.e4m3_decode(ref).view(torch.int32))


def _big_cache(fid):
    """A cache just above 2^31 + 2^28 bytes (~2.4 GB) filled with 0xA5."""
    fmt = get_format(fid)
    target = 2 ** 31 + 2 ** 28
    num_blocks = -(-target // (BS * fmt.bytes_per_token))
    cache = PagedKVCache(fmt, num_blocks, BS, DEV)
    cache.rows.fill_(0xA5)
    assert cache.rows.numel() > 2 ** 31
    return cache


def test_nvfp4_scale_shortcut_on_every_bf16_amax():
    """The bf16-pair write's block-scale shortcut equals the recipe on every non-negative bf16 amax, on
    the GPU's instructions (ceil, integer ops)."""
    x = every_bf16_amax("cuda")
    c1, s1, c2, s2 = probe_nvfp4_scales(x)
    bad = (c1 != c2) | (s1 != s2)
    assert not bool(bad.any()), f"{int(bad.sum())} mismatches, first amax {x[bad][:5].tolist()}"


@pytest.mark.parametrize("fid", ALL_IDS)
def test_cache_above_2_31_bytes(fid):
    """Write the last 64 blocks (shuffled) of a > 2 GiB cache; only they change; then gather and
    upconvert from them."""
    cache = _big_cache(fid)
    fmt = cache.fmt
    nb = cache.num_blocks
    n = 64 * BS
    g = torch.Generator(device=DEV).manual_seed(5)
    last = nb - 64 + torch.randperm(64, generator=g, device=DEV)
    slots = (last[:, None] * BS + torch.arange(BS, device=DEV)).reshape(-1).to(torch.int32)
    kv = heavy(n, 512, seed=6)
    pe = heavy(n, 64, seed=7) if fmt.rope_dim else None
    cache.write(kv, pe, slots, check=False)
    rows = cache.slot_to_row(slots)
    assert int(rows.max()) * fmt.bytes_per_token > 2 ** 31
    assert_rows_equal(cache.rows[rows], fmt.encode(kv, pe), f"{fid} last blocks")
    changed = (cache.rows != 0xA5).any(dim=1)
    assert int(changed[: (nb - 64) * BS].sum()) == 0
    # gather the last rows back
    idx = rows.reshape(16, 256)
    got = gather_topk_fp8(cache.rows, fmt, idx, check=False)
    want = nm.e4m3_encode(fmt.decode(cache.rows[rows.long()])).reshape(16, 256, -1)
    assert_rows_equal(got.view(torch.uint8).reshape(n, -1), want.reshape(n, -1), f"{fid} gather")
    # upconvert one request living in the last blocks
    table = last[None, :].to(torch.int32)
    seq = torch.tensor([n - 5], dtype=torch.int32, device=DEV)
    out, _ = upconvert_context(cache.rows, fmt, table, seq, BS)
    p = torch.arange(n - 5, device=DEV)
    want_rows = table[0, p // BS].long() * BS + p % BS
    want = fmt.decode(cache.rows[want_rows]).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    del cache
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# index conversion
# ------------------------------------------------------------------------------------------------
def decode_batch(b, topk, ctx, seed, n_req=None):
    """b query tokens, each of a request with a ctx-token context in shuffled blocks; distinct
    random positions, -1 padded where the context is shorter than top-k."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n_req = n_req or b
    max_blocks = -(-ctx // BS)
    table = torch.randperm(n_req * max_blocks, generator=g, device=DEV).reshape(n_req, max_blocks).to(torch.int32)
    req = torch.randint(0, n_req, (b,), generator=g, device=DEV).to(torch.int32)
    lens = torch.randint(1, ctx + 1, (b,), generator=g, device=DEV)
    lens[0] = ctx
    lens[1] = 3
    pos = torch.argsort(torch.rand(b, ctx, generator=g, device=DEV), dim=1)[:, :topk]
    pos = torch.where(pos < lens[:, None], pos, torch.full_like(pos, -1))
    pos = torch.sort(pos, dim=1, descending=True).values                 # valid first (a prefix)
    return pos.to(torch.int32), req, table


@pytest.mark.parametrize("topk", [2048, pooled_width(2048, 4)])
@pytest.mark.parametrize("compact", [False, True])
def test_convert_indices_decode_batch(topk, compact):
    pos, req, table = decode_batch(128, topk, 32768, seed=topk)
    table[3, 5] = -1                                                      # a missing block
    for counts in (False, True):
        want = convert_indices_torch(pos, req, table, BS, 80, counts, compact)
        got = convert_indices_triton(pos, req, table, BS, 80, counts, compact)
        for a, b in zip(got if counts else (got,), want if counts else (want,)):
            assert torch.equal(a, b)


def test_convert_indices_prefill_workspace():
    pos, req, table = decode_batch(4096, 2048, 8192, seed=3, n_req=4)
    ws = torch.tensor([0, -1, 8192, 20000], dtype=torch.int32, device=DEV)
    for compact in (False, True):
        want = convert_indices_torch(pos, req, table, BS, BS, True, compact, ws)
        got = convert_indices_triton(pos, req, table, BS, BS, True, compact, ws)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_convert_indices_in_cuda_graph():
    """The public ``convert_indices`` into caller buffers inside a CUDA graph: no allocation, no sync."""
    pos, req, table = decode_batch(128, 2048, 32768, seed=4)
    rows = torch.empty(128, 2048, dtype=torch.int32, device=DEV)
    counts = torch.empty(128, dtype=torch.int32, device=DEV)
    kw = dict(compact=True, out=rows, counts_out=counts)
    convert_indices(pos, req, table, BS, BS, True, **kw)                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # measured inside the capture: entering one allocates 1 KiB of PyTorch's own state on the H200
        before = torch.cuda.memory_allocated()
        got = convert_indices(pos, req, table, BS, BS, True, **kw)
        after = torch.cuda.memory_allocated()
    assert got[0].data_ptr() == rows.data_ptr() and got[1].data_ptr() == counts.data_ptr()
    assert after == before
    pos2, req2, table2 = decode_batch(128, 2048, 32768, seed=5)
    pos.copy_(pos2), req.copy_(req2), table.copy_(table2)
    graph.replay()
    want = convert_indices_torch(pos, req, table, BS, BS, True, True)
    assert torch.equal(rows, want[0]) and torch.equal(counts, want[1])


# ------------------------------------------------------------------------------------------------
# staging gathers
# ------------------------------------------------------------------------------------------------
def filled_cache(fid, num_blocks, seed, k_scale=1.0):
    fmt = get_format(fid)
    cache = PagedKVCache(fmt, num_blocks, BS, DEV)
    n = cache.num_slots
    kv = heavy(n, 512, seed)
    pe = heavy(n, 64, seed + 1) if fmt.rope_dim else None
    cache.write(kv, pe, torch.arange(n, dtype=torch.int32, device=DEV), k_scale, check=False)
    return cache


@pytest.mark.parametrize("fid", ALL_IDS)
@pytest.mark.parametrize("k_scale", [1.0, 0.5])
def test_gather_topk_b128_k2048(fid, k_scale):
    cache = filled_cache(fid, 128 * 512, seed=10, k_scale=k_scale)            # 128 x 32K tokens
    pos, req, table = decode_batch(128, 2048, 32768, seed=11)
    rows, counts = convert_indices_torch(pos, req, table, BS, BS, True)
    counts[5] = 100                                                       # entries past a valid count
    out = torch.full((128, 2048, cache.fmt.head_dim), 0x5A, dtype=torch.uint8, device=DEV)
    got = gather_topk_fp8(cache.rows, cache.fmt, rows, counts, k_scale, out=out.view(torch.float8_e4m3fn))
    flat = rows.reshape(-1).clamp(min=0).long()
    want = nm.e4m3_encode(nm.div_rn(cache.fmt.decode(cache.rows[flat], k_scale), k_scale))
    want = want.reshape(128, 2048, -1)
    valid = (rows >= 0) & (torch.arange(2048, device=DEV)[None, :] < counts[:, None])
    want[~valid] = 0
    assert_rows_equal(got.view(torch.uint8).reshape(-1, cache.fmt.head_dim), want.reshape(-1, cache.fmt.head_dim),
                      f"{fid} gather")
    if k_scale == 1.0:    # the bit-exact path agrees too (a slice, to keep the run short)
        got2 = gather_topk_fp8(cache.rows, cache.fmt, rows[:8], counts[:8], k_scale, _emulate=True)
        assert torch.equal(got2.view(torch.uint8), want[:8])


@pytest.mark.parametrize("fid", ALL_IDS)
def test_upconvert_4x32k(fid):
    k_scale = 0.5 if get_format(fid).name == "fp8" else 1.0
    cache = filled_cache(fid, 4 * 512 + 8, seed=12, k_scale=k_scale)
    g = torch.Generator(device=DEV).manual_seed(13)
    table = torch.randperm(cache.num_blocks, generator=g, device=DEV)[: 4 * 512].reshape(4, 512).to(torch.int32)
    seq = torch.tensor([32768, 32767, 1, 20000], dtype=torch.int32, device=DEV)
    out, ws = upconvert_context(cache.rows, cache.fmt, table, seq, BS, None, k_scale)
    for r in range(4):
        p = torch.arange(int(seq[r]), device=DEV)
        rows = table[r, p // BS].long() * BS + p % BS
        want = cache.fmt.decode(cache.rows[rows], k_scale).to(torch.bfloat16)
        got = out[int(ws[r]): int(ws[r]) + int(seq[r])]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{fid} request {r}"


def test_staging_in_cuda_graph():
    """Given outputs and check=False, both staging kernels capture into a CUDA graph."""
    cache = filled_cache("nvfp4_ds_mla", 64, seed=14)
    pos, req, table = decode_batch(16, 512, 1024, seed=15, n_req=4)
    table = table % 64
    rows = convert_indices_torch(pos, req, table, BS, BS)
    staged = torch.empty(16, 512, 576, dtype=torch.float8_e4m3fn, device=DEV)
    ws_out = torch.empty(4 * 1024, 576, dtype=torch.bfloat16, device=DEV)
    seq = torch.tensor([1024, 5, 700, 64], dtype=torch.int32, device=DEV)
    starts = torch.tensor([0, 1024, 2048, 3072], dtype=torch.int32, device=DEV)
    gather_topk_fp8(cache.rows, cache.fmt, rows, out=staged, check=False)
    upconvert_context(cache.rows, cache.fmt, table, seq, BS, out=ws_out, workspace_start=starts, check=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_topk_fp8(cache.rows, cache.fmt, rows, out=staged, check=False)
        upconvert_context(cache.rows, cache.fmt, table, seq, BS, out=ws_out, workspace_start=starts, check=False)
    staged.zero_()
    ws_out.zero_()
    graph.replay()
    assert torch.equal(staged.view(torch.uint8), gather_topk_fp8(cache.rows, cache.fmt, rows).view(torch.uint8))
    ref, _ = upconvert_context(cache.rows, cache.fmt, table, seq, BS, workspace_start=starts,
                               out=torch.zeros_like(ws_out))
    assert torch.equal(ws_out.view(torch.int16), ref.view(torch.int16))
