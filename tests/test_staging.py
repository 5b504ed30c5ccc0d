"""Staging kernels (kernels/staging.py) under the Triton interpreter.

(a) top-k gather to FP8: ``out[t, k] == e4m3_RNE_sat(fmt.decode(row) / k_scale)`` byte for byte, for
    every format (vLLM's NoPE rows and the compact ones) and k_scale 1, 0.5 and 0.37; -1 entries,
    entries past the valid count and, without ``check``, entries outside the cache are zero rows; the
    fp8 format is a byte copy and the nvfp4 rope is copied bit-exactly at k_scale 1; a non-finite row
    stages as NaN codes.
(b) context upconvert: the bf16 workspace equals ``fmt.decode(rows).to(bf16)`` for each request in
    position order, at the default (back to back) or given workspace starts; rows of ``out`` no
    request maps to are left alone; it composes with ``convert_indices(workspace_start=...)``.
"""
import pytest
import torch

from sparsemla.cache import PagedKVCache
from sparsemla.formats import all_formats, get_format
from sparsemla.formats import _numerics as nm
from sparsemla.indices import convert_indices_torch
from sparsemla.kernels.staging import gather_topk_fp8, upconvert_context

ALL_IDS = [f.id for f in all_formats(compact=True)]


def heavy_tailed(n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) / torch.sqrt(torch.rand(n, dim, generator=g) + 0.05)
    x = x * torch.exp(1.5 * torch.randn(n, 1, generator=g))
    x[:, [1, dim - 3]] *= 40.0
    return x


def filled_cache(fid, n_tokens, block_size, stride_rows, seed, device, k_scale=1.0, spare_blocks=2):
    """A cache with strided blocks holding ``n_tokens`` tokens at shuffled slots; returns (cache, slot
    of each token).  Rows between the blocks and unwritten slots hold random bytes."""
    fmt = get_format(fid)
    nb = -(-n_tokens // block_size) + spare_blocks
    g = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (nb * stride_rows, fmt.bytes_per_token), generator=g, dtype=torch.uint8)
    storage = storage.to(device)
    data = storage.as_strided((nb, block_size, fmt.bytes_per_token),
                              (stride_rows * fmt.bytes_per_token, fmt.bytes_per_token, 1))
    cache = PagedKVCache.from_tensor(fmt, data)
    slots = torch.randperm(nb * block_size, generator=g)[:n_tokens].to(torch.int32)
    kv = heavy_tailed(n_tokens, 512, seed + 1).to(torch.bfloat16)
    pe = (heavy_tailed(n_tokens, 64, seed + 2) * 0.1).to(torch.bfloat16) if fmt.rope_dim else None
    cache.write(kv.to(device), None if pe is None else pe.to(device), slots.to(device), k_scale)
    return cache, slots


def staged_reference(fmt, rows, idx, valid_counts, k_scale):
    """e4m3_RNE_sat(decode(row) / k_scale), zero rows for -1 and entries past the valid count."""
    t, k = idx.shape
    flat = idx.reshape(-1).clamp(min=0).long()
    dec = fmt.decode(rows[flat].cpu(), k_scale)
    ref = nm.e4m3_encode(nm.div_rn(dec, k_scale)).reshape(t, k, fmt.head_dim)
    valid = idx.cpu() >= 0
    if valid_counts is not None:
        valid &= torch.arange(k)[None, :] < valid_counts.cpu()[:, None]
    ref[~valid] = 0
    return ref


@pytest.mark.parametrize("fid", ALL_IDS)
@pytest.mark.parametrize("k_scale", [1.0, 0.5, 0.37])
def test_gather_matches_reference(fid, k_scale, device):
    fmt = get_format(fid)
    cache, slots = filled_cache(fid, 40, 8, 11, seed=1, device=device, k_scale=k_scale)
    g = torch.Generator().manual_seed(2)
    t, k = 3, 21                                         # K not a multiple of the program's row count
    written = cache.slot_to_row(slots).cpu()             # (the rows between blocks hold random bytes)
    pick = torch.randint(0, written.numel(), (t, k), generator=g)
    idx = torch.where(torch.rand(t, k, generator=g) < 0.2, -1, written[pick]).to(torch.int32)
    vc = torch.tensor([k, 7, 0], dtype=torch.int32)
    out = torch.full((t, k, fmt.head_dim), 0x5A, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    got = gather_topk_fp8(cache.rows, fmt, idx.to(device), vc.to(device), k_scale, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float8_e4m3fn
    want = staged_reference(fmt, cache.rows, idx, vc, k_scale)
    bad = (got.view(torch.uint8).cpu() != want)
    assert not bool(bad.any()), f"{int(bad.sum())} bytes differ, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("fid", ["fp8", "nvfp4_ds_mla", "fp8_ds_mla-nope"])
def test_gather_without_valid_counts_int64(fid, device):
    fmt = get_format(fid)
    cache, slots = filled_cache(fid, 20, 4, 4, seed=3, device=device)
    w = cache.slot_to_row(slots).cpu()
    idx = torch.tensor([[w[3], -1, w[0], w[19]], [-1, -1, -1, -1]], dtype=torch.int64)
    got = gather_topk_fp8(cache.rows, fmt, idx.to(device))
    want = staged_reference(fmt, cache.rows, idx, None, 1.0)
    assert torch.equal(got.view(torch.uint8).cpu(), want)


def test_gather_ignores_garbage_past_the_valid_count(device):
    """Entries past valid_counts may hold anything (even out-of-range rows): not checked, not read."""
    fmt = get_format("fp8_ds_mla")
    cache, slots = filled_cache("fp8_ds_mla", 20, 4, 4, seed=10, device=device)
    w = cache.slot_to_row(slots).cpu()
    idx = torch.tensor([[w[0], w[1], 10 ** 6, -7], [w[2], -1, -1, -1]], dtype=torch.int32)
    vc = torch.tensor([2, 1], dtype=torch.int32)
    got = gather_topk_fp8(cache.rows, fmt, idx.to(device), vc.to(device))
    want = staged_reference(fmt, cache.rows, idx.clamp(min=-1, max=int(w.max())), vc, 1.0)
    assert torch.equal(got.view(torch.uint8).cpu(), want)
    with pytest.raises(ValueError, match="indices"):
        gather_topk_fp8(cache.rows, fmt, idx.to(device), (vc + 1).to(device), check=True)
    # without the debug check an entry outside the cache stages as a zero row and reads nothing
    got = gather_topk_fp8(cache.rows, fmt, idx.to(device), (vc + 2).to(device))
    want = staged_reference(fmt, cache.rows, torch.where((idx >= 0) & (idx < cache.num_rows), idx, -1), vc + 2, 1.0)
    assert torch.equal(got.view(torch.uint8).cpu(), want)


@pytest.mark.parametrize("fid", ALL_IDS)
def test_nonfinite_rows_stage_as_nan(fid, device):
    """Rows written from non-finite input stage as e4m3 NaN (0x7F) exactly in their NaN dims (a value, a
    tile or a block) and upconvert to bf16 NaN there; the rows next to them are unaffected."""
    fmt = get_format(fid)
    cache = PagedKVCache(fmt, 2, 4, device=device)
    kv = heavy_tailed(8, 512, seed=30)
    kv[3, 7] = float("nan")
    kv[5, 500] = -float("inf")
    pe = heavy_tailed(8, 64, seed=31) * 0.1 if fmt.rope_dim else None
    cache.write(kv.to(device), None if pe is None else pe.to(device), torch.arange(8, dtype=torch.int32, device=device))
    idx = torch.arange(8, dtype=torch.int32, device=device)[None]
    got = gather_topk_fp8(cache.rows, fmt, idx, k_scale=0.5).view(torch.uint8).cpu()[0]
    nan = torch.isnan(fmt.decode(cache.rows[:8].cpu()))
    assert bool(nan[3, 7]) and bool(nan[5, 500]) and nan[[0, 1, 2, 4, 6, 7]].sum() == 0
    assert torch.equal(got == 0x7F, nan)
    assert torch.equal(got, staged_reference(fmt, cache.rows, idx.cpu(), None, 0.5)[0])
    out, _ = upconvert_context(cache.rows, fmt, torch.tensor([[0, 1]], dtype=torch.int32, device=device),
                               torch.tensor([8], dtype=torch.int32, device=device), 4)
    assert torch.equal(torch.isnan(out.float().cpu()), nan)


def test_fp8_gather_is_a_byte_copy_and_nvfp4_rope_is_copied(device):
    fmt = get_format("fp8")
    cache, slots = filled_cache("fp8", 16, 4, 4, seed=4, device=device, k_scale=0.37)
    idx = cache.slot_to_row(slots).to(torch.int32).reshape(2, 8)
    got = gather_topk_fp8(cache.rows, fmt, idx, k_scale=0.37)
    assert torch.equal(got.view(torch.uint8).reshape(16, -1), cache.rows[idx.reshape(-1).long()])
    fmt = get_format("nvfp4_ds_mla")
    cache, slots = filled_cache("nvfp4_ds_mla", 16, 4, 4, seed=5, device=device)
    idx = cache.slot_to_row(slots).to(torch.int32).reshape(2, 8)
    got = gather_topk_fp8(cache.rows, fmt, idx)
    lay = fmt.layout
    assert torch.equal(got.view(torch.uint8).reshape(16, -1)[:, 512:],
                       cache.rows[idx.reshape(-1).long(), lay.rope_offset:lay.rope_offset + 64])


@pytest.mark.parametrize("fid", ALL_IDS)
def test_upconvert_matches_decode(fid, device):
    fmt = get_format(fid)
    bs, stride = 4, 6
    k_scale = 0.5 if fmt.name == "fp8" else 1.0
    cache, _ = filled_cache(fid, 48, bs, stride, seed=6, device=device, k_scale=k_scale, spare_blocks=0)
    g = torch.Generator().manual_seed(7)
    table = torch.randperm(cache.num_blocks, generator=g)[:12].reshape(3, 4).to(torch.int32)
    table[2, 3] = -1                                          # unused entry (past the context)
    seq = torch.tensor([13, 0, 11], dtype=torch.int32)
    out, ws = upconvert_context(cache.rows, fmt, table.to(device), seq.to(device), bs, stride, k_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (24, fmt.head_dim)
    assert ws.cpu().tolist() == [0, 13, 13]
    for r in range(3):
        p = torch.arange(int(seq[r]))
        rows = table[r, p // bs].long() * stride + p % bs
        want = fmt.decode(cache.rows[rows.to(device)].cpu(), k_scale).to(torch.bfloat16)
        got = out[int(ws[r]): int(ws[r]) + int(seq[r])].cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"request {r}"


def test_upconvert_given_workspace_and_indices_compose(device):
    """Given starts with a gap and a skipped request: unmapped workspace rows keep their bytes, and the
    rows that convert_indices gives in workspace mode point at the right dequantized tokens."""
    fmt = get_format("nvfp4_ds_mla")
    bs = 8
    cache, _ = filled_cache("nvfp4_ds_mla", 48, bs, bs, seed=8, device=device, spare_blocks=0)
    table = torch.tensor([[4, 0, 2], [1, 3, 5]], dtype=torch.int32)
    seq = torch.tensor([20, 17], dtype=torch.int32)
    starts = torch.tensor([30, -1], dtype=torch.int32)
    out = torch.full((64, fmt.head_dim), 7.0, dtype=torch.bfloat16, device=device)
    got, ws = upconvert_context(cache.rows, fmt, table.to(device), seq.to(device), bs, None, 1.0,
                                out=out, workspace_start=starts.to(device))
    assert got.data_ptr() == out.data_ptr() and torch.equal(ws.cpu(), starts)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[30:50] = False
    assert bool((out.cpu()[untouched] == 7.0).all())
    topk = torch.tensor([[19, 0, 5, -1], [3, -1, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    ws_rows = convert_indices_torch(topk, req, table, bs, bs, workspace_start=starts)
    cache_rows = convert_indices_torch(topk, req, table, bs, bs)
    for t in range(2):
        for j in range(4):
            if ws_rows[t, j] >= 0 and starts[req[t]] >= 0:
                want = fmt.decode(cache.rows[int(cache_rows[t, j])][None].cpu()).to(torch.bfloat16)
                assert torch.equal(out[int(ws_rows[t, j])].cpu()[None], want)


def test_upconvert_errors(device):
    fmt = get_format("fp8_ds_mla")
    cache, _ = filled_cache("fp8_ds_mla", 16, 4, 4, seed=9, device=device, spare_blocks=0)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="seq_lens"):
        upconvert_context(cache.rows, fmt, table, torch.tensor([9, 1], dtype=torch.int32, device=device), 4, check=True)
    with pytest.raises(ValueError, match="seq_lens"):
        upconvert_context(cache.rows, fmt, table, torch.tensor([-1, 1], dtype=torch.int32, device=device), 4,
                          check=True)
    bad = torch.tensor([[0, 99], [2, 3]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_table"):
        upconvert_context(cache.rows, fmt, bad, torch.tensor([8, 1], dtype=torch.int32, device=device), 4, check=True)
    # without the debug check: the block past the cache gives zero rows, the context past the table is
    # not read, and nothing is written past out's last row
    out, _ = upconvert_context(cache.rows, fmt, bad, torch.tensor([8, 1], dtype=torch.int32, device=device), 4)
    assert bool((out[4:8].float() == 0).all())
    assert torch.equal(out[:4].cpu().view(torch.int16),
                       fmt.decode(cache.rows[:4].cpu()).to(torch.bfloat16).view(torch.int16))
    small = torch.full((12, fmt.head_dim), 3.0, dtype=torch.bfloat16, device=device)
    backing = torch.full((16, fmt.head_dim), 3.0, dtype=torch.bfloat16, device=device)
    backing[:12] = small
    upconvert_context(cache.rows, fmt, table, torch.tensor([9, 8], dtype=torch.int32, device=device), 4,
                      out=backing[:12], workspace_start=torch.tensor([0, 8], dtype=torch.int32, device=device))
    assert bool((backing[12:].float() == 3.0).all())
    # a missing block (-1) inside the context is allowed: its positions become zero rows
    holes = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32, device=device)
    out, _ = upconvert_context(cache.rows, fmt, holes, torch.tensor([8, 2], dtype=torch.int32, device=device), 4)
    assert bool((out[4:8].float() == 0).all())
    assert torch.equal(out[:4].cpu().view(torch.int16),
                       fmt.decode(cache.rows[:4].cpu()).to(torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError, match="out"):
        upconvert_context(cache.rows, fmt, table, torch.tensor([8, 8], dtype=torch.int32, device=device), 4,
                          out=torch.zeros(10, fmt.head_dim, dtype=torch.bfloat16, device=device), check=True)
    with pytest.raises(TypeError, match="out"):
        upconvert_context(cache.rows, fmt, table, torch.tensor([8, 8], dtype=torch.int32, device=device), 4,
                          out=torch.zeros(16, fmt.head_dim, device=device))


def test_gather_errors(device):
    fmt = get_format("bf16")
    rows = torch.zeros(8, fmt.bytes_per_token, dtype=torch.uint8, device=device)
    idx = torch.zeros(2, 3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="indices"):
        gather_topk_fp8(rows, fmt, idx + 8, check=True)
    with pytest.raises(ValueError, match="indices"):
        gather_topk_fp8(rows, fmt, idx - 2, check=True)
    with pytest.raises(TypeError, match="indices"):
        gather_topk_fp8(rows, fmt, idx.float())
    with pytest.raises(ValueError, match="rows"):
        gather_topk_fp8(rows, get_format("fp8"), idx)
    with pytest.raises(ValueError, match="valid_counts"):
        gather_topk_fp8(rows, fmt, idx, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out"):
        gather_topk_fp8(rows, fmt, idx, out=torch.zeros(2, 3, 512, dtype=torch.float8_e4m3fn, device=device))
    with pytest.raises(ValueError, match="k_scale"):
        gather_topk_fp8(rows, fmt, idx, k_scale=-1.0)
