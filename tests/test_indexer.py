"""Lightning indexer: index-key cache bytes, fp8 scoring kernel, top-k (CPU: Triton interpreter, tiny shapes)."""
import pytest
import torch
import triton
import triton.language as tl

from sparsemla.indices import pooled_valid_counts
from sparsemla.kernels import indexer as K
from sparsemla.reference import indexer as R

POISON = 0xAB


def heavy(shape, gen, scale=1.0):
    """Heavy-tailed values (Student-t, df 3) with a few 50x outliers."""
    z = torch.randn(shape, generator=gen)
    chi = sum(torch.randn(shape, generator=gen) ** 2 for _ in range(3)) / 3
    x = z / chi.sqrt()
    mask = torch.rand(shape, generator=gen) < 0.01
    return (torch.where(mask, x * 50, x) * scale)


@triton.jit
def _codes_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(o_ptr + i, K._e4m3_code(x).to(tl.uint8), mask=i < n)


def test_e4m3_rounding_matches_torch_at_every_midpoint():
    # Every e4m3 value, the midpoints between neighbours, and one fp32 ulp either side of them.
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    x = torch.cat([vals, mids, up, down, torch.tensor([448.0, 1e-12, 0.0, 2.0 ** -10, 3 * 2.0 ** -11])])
    x = torch.cat([x, -x])
    out = torch.full_like(x, POISON, dtype=torch.uint8)
    _codes_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:4]].tolist()}"


def _cache(nb, bs, stride_blocks=None, device="cpu"):
    """A poisoned index cache; ``stride_blocks`` > bs puts unused rows between blocks (engine-style)."""
    sb = stride_blocks or bs
    store = torch.full((nb * sb * 132,), POISON, dtype=torch.uint8, device=device)
    return store.as_strided((nb, bs, 132), (sb * 132, 132, 1)), store


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cache_write_bytes_identical_to_reference(device, dtype):
    gen = torch.Generator().manual_seed(1)
    nb, bs, n = 5, 8, 30
    k = heavy((n, 128), gen) * torch.logspace(-6, 4, n)[:, None]  # amax from < 1e-4 to > 448
    k[0] = 0.0
    k[1, 3] = 448.0 * 4  # a power-of-two boundary: the scale is exactly 4
    # Just above the boundary (the next value in this dtype): scale 8.
    k[2, 7] = torch.nextafter(torch.tensor(448.0 * 4, dtype=dtype), torch.tensor(1e9, dtype=dtype)).float()
    k = k.clamp(-60000.0, 60000.0).to(dtype)  # finite in fp16 too (inf / NaN keys are not supported)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[5] = -1
    c_ref, s_ref = _cache(nb, bs, stride_blocks=bs + 3)
    c_ker, s_ker = _cache(nb, bs, stride_blocks=bs + 3, device=device)
    R.write_index_cache(c_ref, k, slots)
    K.index_cache_write(c_ker, k.to(device), slots.to(device))
    assert torch.equal(s_ref, s_ker.cpu())
    # -1 slots and the gaps between blocks were not touched.
    assert (s_ref != POISON).sum() < nb * bs * 132
    codes, scales = R.read_index_cache(c_ref, slots[:3], dequantize=False)
    assert scales[1].item() == 4.0 and scales[2].item() == 8.0
    assert scales[0].item() == 2.0 ** -22  # all-zero key: max(amax, 1e-4) / 448 -> 2^-22


def test_cache_layout_is_blocked():
    """Per block: all tokens' 128 e4m3 bytes first, then their fp32 scales (not interleaved per token)."""
    bs = 4
    cache, _ = _cache(2, bs)
    k = torch.arange(1, 3, dtype=torch.float32)[:, None] * torch.ones(2, 128)  # token i all = i + 1
    R.write_index_cache(cache, k, torch.tensor([bs + 1, 2]))  # block 1 offset 1, block 0 offset 2
    flat = cache.reshape(2, bs * 132)
    s0 = R.pow2_scale(torch.tensor([1.0])).item()
    code1 = torch.tensor([1.0 / s0]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert (flat[1, 128:256] == code1).all()  # token 0 -> block 1, offset 1: bytes [128, 256)
    assert flat[1, bs * 128 + 4: bs * 128 + 8].view(torch.float32).item() == s0
    s1 = R.pow2_scale(torch.tensor([2.0])).item()
    assert flat[0, bs * 128 + 8: bs * 128 + 12].view(torch.float32).item() == s1


def test_roundtrip_error_is_fp8_sized():
    gen = torch.Generator().manual_seed(2)
    k = heavy((16, 128), gen)
    cache, _ = _cache(2, 8)
    R.write_index_cache(cache, k, torch.arange(16))
    back = R.read_index_cache(cache, torch.arange(16))
    s = R.pow2_scale(k.abs().amax(-1))
    # e4m3: |error| <= 2^-4 relative for normals, <= 2^-10 * s absolute for subnormals.
    tol = torch.maximum(k.abs().double() * 2.0 ** -4, s[:, None] * 2.0 ** -10)
    assert ((back - k.double()).abs() <= tol).all()


def test_quantize_index_q_matches_reference():
    gen = torch.Generator().manual_seed(3)
    q = (heavy((5, 3, 128), gen) * torch.logspace(-5, 3, 5)[:, None, None]).to(torch.bfloat16)
    q8, qs = K.quantize_index_q(q)
    codes, s = R.quantize_fp8_pow2(q)
    assert torch.equal(q8.view(torch.uint8), codes) and torch.equal(qs, s)


def _setup(device, gen, *, lens, bs=8, heads=3, spare_blocks=2):
    """Index cache with ``len(lens)`` requests of keys (shuffled blocks); returns cache, block table, keys."""
    nblk = max(-(-n // bs) for n in lens) + spare_blocks
    nb = len(lens) * nblk
    cache, _ = _cache(nb, bs, device=device)
    bt = torch.randperm(nb, generator=gen).view(len(lens), nblk).to(torch.int32)
    keys = []
    for r, n in enumerate(lens):
        k = heavy((n, 128), gen).to(torch.bfloat16)
        K.index_cache_write(cache, k.to(device), R.request_slots(bt, r, n, bs).to(device))
        keys.append(k)
    return cache, bt.to(device), keys


def test_scores_kernel_matches_reference(device):
    gen = torch.Generator().manual_seed(4)
    lens = [70, 45]
    cache, bt, _ = _setup(device, gen, lens=lens)
    req = torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    ctx = torch.tensor([1, 33, 70, 0, 45, 17, 44], dtype=torch.int32)
    q = heavy((7, 3, 128), gen)
    w = torch.randn(7, 3, generator=gen)
    q8, qs = K.quantize_index_q(q)
    wq = (w * qs).contiguous()
    max_context = 90  # wider than any context: the tail columns must be -inf
    out = torch.full((7, max_context), 12345.0, device=device)
    got = K.index_scores(q8.to(device), wq.to(device), cache, bt, req.to(device), ctx.to(device), max_context, out=out)
    ref = R.index_scores_paged(q8.double(), wq, cache.cpu(), bt.cpu(), req, ctx, max_context)
    got = got.cpu()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert (got[~fin] == float("-inf")).all()
    assert torch.allclose(got[fin].double(), ref[fin], rtol=1e-5, atol=1e-5 * ref[fin].abs().max().item())
    pos = torch.arange(max_context)
    assert torch.equal(fin, pos[None, :] < ctx[:, None])


def test_scores_kernel_checks_arguments(device):
    gen = torch.Generator().manual_seed(5)
    cache, bt, _ = _setup(device, gen, lens=[10])
    q8, qs = K.quantize_index_q(torch.randn(2, 2, 128))
    req = torch.zeros(2, dtype=torch.int32, device=device)
    ctx = torch.tensor([5, 10], dtype=torch.int32, device=device)
    args = (q8.to(device), qs.to(device), cache, bt, req, ctx)
    with pytest.raises(ValueError, match="context_lens"):
        K.index_scores(*args, 8, check=True)
    with pytest.raises(TypeError, match="q_fp8"):
        K.index_scores(q8.float().to(device), *args[1:], 16)
    with pytest.raises(ValueError, match="index_cache"):
        K.index_scores(args[0], args[1], cache[:, :, :128], *args[3:], 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        K.index_cache_write(cache, torch.randn(1, 128, device=device), torch.tensor([10 ** 6], device=device),
                            check=True)
    with pytest.raises(ValueError, match="req_id"):
        K.index_scores(args[0], args[1], cache, bt, req + 5, ctx, 16, check=True)


def test_kernels_stay_inside_their_tensors_by_default(device):
    """Without the debug check: a slot outside the cache is skipped; keys past the block table, in a
    block id outside the cache or of a request id outside the table score -inf (nothing read there)."""
    gen = torch.Generator().manual_seed(7)
    cache, bt, _ = _setup(device, gen, lens=[10])
    before = cache.clone()
    K.index_cache_write(cache, torch.randn(2, 128, device=device),
                        torch.tensor([10 ** 6, -5], dtype=torch.int64, device=device))
    assert torch.equal(cache, before)
    q8, qs = K.quantize_index_q(torch.randn(3, 2, 128))
    bad_bt = bt.clone()
    bad_bt[0, 0] = cache.shape[0] + 7
    req = torch.tensor([0, 0, 3], dtype=torch.int32, device=device)
    ctx = torch.tensor([bt.shape[1] * cache.shape[1] + 9, 5, 5], dtype=torch.int32, device=device)
    width = bt.shape[1] * cache.shape[1] + 16
    got = K.index_scores(q8.to(device), qs.to(device), cache, bad_bt, req, ctx, width).cpu()
    bs, table = cache.shape[1], bt.shape[1] * cache.shape[1]
    good = K.index_scores(q8.to(device), qs.to(device), cache, bt, torch.zeros_like(req),
                          torch.full_like(ctx, table), width).cpu()
    assert bool((got[0, :bs] == float("-inf")).all())                 # block id outside the cache
    assert torch.equal(got[0, bs:table], good[0, bs:table])            # the other blocks read as usual
    assert bool((got[0, table:] == float("-inf")).all())               # past the block table
    assert bool((got[1] == float("-inf")).all())                       # its 5 keys sit in the bad block
    assert bool((got[2] == float("-inf")).all())


def test_topk_matches_reference_and_pads():
    gen = torch.Generator().manual_seed(6)
    ctx = torch.tensor([0, 3, 20, 40], dtype=torch.int32)
    scores = torch.randn(4, 48, generator=gen, dtype=torch.float64)
    scores[torch.arange(48)[None, :] >= ctx[:, None]] = float("-inf")
    got = K.index_topk(scores.float(), 16)
    ref = R.topk_positions(scores, 16)
    assert got.dtype == torch.int32 and got.shape == (4, 16)
    for t, c in enumerate(ctx.tolist()):
        n = min(c, 16)
        assert (got[t, :n] >= 0).all() and (got[t, n:] == -1).all()  # valid prefix, then -1
        assert set(got[t, :n].tolist()) == set(ref[t, :n].tolist())
        assert (got[t, :n] < c).all()  # causal


def test_pooled_topk():
    gen = torch.Generator().manual_seed(7)
    kpool, topk = 4, 8
    ctx = torch.tensor([3, 8, 9, 23, 30], dtype=torch.int32)
    scores = torch.randn(5, 32, generator=gen, dtype=torch.float64)
    scores[torch.arange(32)[None, :] >= ctx[:, None]] = float("-inf")
    got = K.index_topk(scores.float(), topk, context_lens=ctx, kpool=kpool)
    ref = R.pooled_topk_positions(scores, ctx, topk, kpool)
    assert torch.equal(got, ref)  # no near-ties in this data: the orders match too
    counts = (got >= 0).sum(1).to(torch.int32)
    assert torch.equal(counts, pooled_valid_counts(ctx, topk, kpool))
    for t, c in enumerate(ctx.tolist()):
        sel = got[t][got[t] >= 0].tolist()
        tail = list(range(c - c % kpool, c))
        assert sel[len(sel) - len(tail):] == tail  # the unfinished pool is appended after the chosen ones
        pools = {p // kpool for p in sel[: len(sel) - len(tail)]}
        # The chosen pools are the complete pools with the best max-score.
        pool_best = scores[t, : (c // kpool) * kpool].view(-1, kpool).amax(1)
        want = set(pool_best.argsort(descending=True)[: topk // kpool].tolist())
        assert pools == want


def test_fp8_indexer_agrees_with_float64_indexer(device):
    """The whole fast indexer (fp8 keys in the cache, fp8 queries, kernel scores, top-k) against float64
    scores of the exact keys and queries: the selections differ only near the cut."""
    gen = torch.Generator().manual_seed(8)
    n, bs, heads, topk = 96, 16, 4, 24
    k = heavy((n, 128), gen)
    q = heavy((6, heads, 128), gen)
    w = torch.rand(6, heads, generator=gen) + 0.1
    ctx = torch.tensor([10, 30, 50, 70, 90, 96], dtype=torch.int32)
    cache, _ = _cache(n // bs, bs, device=device)
    bt = torch.arange(n // bs, dtype=torch.int32)[None].to(device)
    K.index_cache_write(cache, k.to(device), torch.arange(n, device=device))
    q8, qs = K.quantize_index_q(q)
    sc = K.index_scores(q8.to(device), (w * qs).to(device), cache, bt, torch.zeros(6, dtype=torch.int32, device=device),
                        ctx.to(device), n)
    got = K.index_topk(sc, topk).cpu()
    ref_scores = R.index_scores(q.double(), w.double(), k.double(), ctx)
    ref = R.topk_positions(ref_scores, topk)
    overlap = R.topk_overlap(got, ref)
    assert overlap.mean() > 0.9
    # A swap is a near tie when the fp8 score error of the row can explain it.
    err = R.score_errors(sc.cpu(), ref_scores)
    assert (err < 0.1 * ref_scores[torch.isfinite(ref_scores)].abs().max()).all()  # fp8-sized errors
    assert R.non_tie_mismatches(got, ref, ref_scores, rtol=0.0, atol=2 * err) == 0
