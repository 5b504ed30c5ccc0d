"""H200: the lightning indexer at 32K-token contexts, the DSA layer in DeepSeek-V3.2 geometry, CUDA-graph
capture of a decode step, and the small model's decode loop under a graph.

Run: ``python3 -m pytest -m gpu tests/gpu/test_layer_gpu.py -v -s`` (``-s`` shows the measured errors,
overlaps and kernel times).
"""
import pytest
import torch
import triton

from sparsemla.cache import PagedKVCache
from sparsemla.indices import pooled_valid_counts
from sparsemla.kernels import indexer as K
from sparsemla.layer import DSAAttention, DSAConfig, DSAMetadata, IndexKeyCache, init_dsa_weights_, realistic_hidden
from sparsemla.layer.accuracy import layer_accuracy, rel_err
from sparsemla.layer.model import DSAModel, ModelConfig, generate, init_model_weights_, make_block_table
from sparsemla.reference import indexer as R

pytestmark = pytest.mark.gpu
DEV = "cuda"
BS = 64
CTX = 32768


def heavy(shape, gen, device=DEV):
    """Student-t (df 3) values with 1 % of 50x outliers, drawn on the CPU (reproducible)."""
    z = torch.randn(shape, generator=gen)
    chi = sum(torch.randn(shape, generator=gen) ** 2 for _ in range(3)) / 3
    x = z / chi.sqrt()
    return torch.where(torch.rand(shape, generator=gen) < 0.01, x * 50, x).to(device)


def index_setup(gen, lens, *, on_gpu=False):
    """An index cache (block stride > block) holding ``len(lens)`` requests of bf16 keys in shuffled blocks
    (keys drawn on the GPU with ``on_gpu``: fast, for timing)."""
    nblk = max(-(-n // BS) for n in lens)
    nb = nblk * len(lens)
    store = torch.full((nb * (BS + 8) * 132,), 0xAB, dtype=torch.uint8, device=DEV)
    cache = store.as_strided((nb, BS, 132), ((BS + 8) * 132, 132, 1))
    bt = torch.randperm(nb, generator=gen).view(len(lens), nblk).to(torch.int32).to(DEV)
    for r, n in enumerate(lens):
        if on_gpu:
            k = torch.randn((n, 128), device=DEV) * torch.exp(torch.randn((n, 1), device=DEV))
        else:
            k = heavy((n, 128), gen)
        K.index_cache_write(cache, k.to(torch.bfloat16), R.request_slots(bt, r, n, BS))
    return cache, store, bt


def test_index_cache_write_is_byte_identical_at_32k():
    gen = torch.Generator().manual_seed(0)
    n = CTX
    k = (heavy((n, 128), gen) * torch.logspace(-6, 4, n, device=DEV)[:, None]).clamp(-6e4, 6e4)
    for dtype in (torch.bfloat16, torch.float32):
        kk = k.to(dtype)
        slots = torch.randperm(n + 512, generator=gen)[:n].to(DEV)
        slots[::97] = -1
        nb = (n + 512) // BS
        caches = []
        for _ in range(2):
            store = torch.full((nb * (BS + 8) * 132,), 0xAB, dtype=torch.uint8, device=DEV)
            caches.append((store.as_strided((nb, BS, 132), ((BS + 8) * 132, 132, 1)), store))
        R.write_index_cache(caches[0][0], kk, slots)
        K.index_cache_write(caches[1][0], kk, slots)
        torch.cuda.synchronize()
        assert torch.equal(caches[0][1], caches[1][1]), f"{dtype}: bytes differ"


@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_scores_and_topk_match_reference_at_32k(shape):
    gen = torch.Generator().manual_seed(1)
    if shape == "decode":  # 8 requests, one query token each, contexts near 32K and two shorter than top-k
        lens = torch.randint(CTX - 2048, CTX + 1, (8,), generator=gen).tolist()
        lens[0], lens[1] = 1000, 2047
        req = torch.arange(8, dtype=torch.int32)
        ctx = torch.tensor(lens, dtype=torch.int32)
    else:  # one request, 128 consecutive query tokens at the end of a 32K prompt (causal)
        lens = [CTX]
        req = torch.zeros(128, dtype=torch.int32)
        ctx = torch.arange(CTX - 127, CTX + 1, dtype=torch.int32)
    cache, _, bt = index_setup(gen, lens)
    t = req.numel()
    q8, qs = K.quantize_index_q(heavy((t, 64, 128), gen))
    wq = (torch.rand(t, 64, generator=gen).to(DEV) * qs).contiguous()
    req, ctx = req.to(DEV), ctx.to(DEV)
    got = K.index_scores(q8, wq, cache, bt, req, ctx, CTX + BS)
    ref = R.index_scores_paged(q8.double(), wq, cache, bt, req, ctx, CTX + BS)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    scale = ref[fin].abs().max()
    err = ((got.double() - ref)[fin].abs().max() / scale).item()
    print(f"\n{shape}: max score error / max |score| = {err:.2e}")
    # Hopper's fp8 MMAs accumulate with fewer bits than fp32 (no promotion inside a K=128 dot), hence
    # a looser bound than the interpreter's; a wrong scale or key would be off by O(1).
    assert err < 1e-3
    topk = K.index_topk(got, 2048)
    ref_topk = R.topk_positions(ref, 2048)
    sub = slice(0, t, max(1, t // 16))  # the set comparison runs on the host
    err = 2 * R.score_errors(got[sub], ref[sub]).cpu()
    assert R.non_tie_mismatches(topk[sub].cpu(), ref_topk[sub].cpu(), ref[sub].cpu(), rtol=0.0, atol=err) == 0
    assert ((topk < ctx[:, None]) | (topk == -1)).all()
    assert torch.equal((topk >= 0).sum(1), torch.clamp(ctx, max=2048).to(torch.int64))
    # Pooled (kpool 4): valid counts, the appended tail, and the chosen pools (up to near ties).
    kp = 4
    pooled = K.index_topk(got, 2048, context_lens=ctx, kpool=kp)
    assert torch.equal((pooled >= 0).sum(1).to(torch.int32), pooled_valid_counts(ctx, 2048, kp))
    ref_pool_scores = R.pool_scores(ref, ctx, kp)
    got_pool_scores = R.pool_scores(got.double(), ctx, kp)
    n_pools = torch.clamp(ctx // kp, max=2048 // kp)
    cols = torch.arange(2048 // kp, device=DEV) * kp
    pools = torch.where(cols[None, :] < n_pools[:, None] * kp, pooled[:, cols] // kp, -1)
    ref_pools = R.topk_positions(ref_pool_scores, 2048 // kp)
    perr = 2 * R.score_errors(got_pool_scores[sub], ref_pool_scores[sub]).cpu()
    assert R.non_tie_mismatches(pools[sub].cpu(), ref_pools[sub].cpu(), ref_pool_scores[sub].cpu(), rtol=0.0,
                                atol=perr) == 0
    c = ctx.to(torch.int64)
    last = (pooled >= 0).sum(1) - 1
    has_tail = c % kp > 0
    assert torch.equal(pooled[torch.arange(t, device=DEV), last][has_tail].to(torch.int64), (c - 1)[has_tail])


def test_fp8_indexer_overlap_with_float64_at_32k():
    """Real DeepSeek-V3.2 indexer geometry and realistic weights: fp8 top-k vs float64 top-k."""
    gen = torch.Generator().manual_seed(2)
    layer = init_dsa_weights_(DSAAttention(DSAConfig(), device=DEV), gen)
    x = realistic_hidden(CTX, 7168, gen, device=DEV).to(torch.bfloat16)
    bt, nb = make_block_table(1, CTX, BS, device=DEV)
    ic = IndexKeyCache(nb, BS, DEV)
    with torch.no_grad():
        for s0 in range(0, CTX, 4096):
            layer.indexer.write_keys(x[s0:s0 + 4096], torch.arange(s0, s0 + 4096, device=DEV),
                                     DSAMetadata.from_lists([4096], [s0], bt, BS).slot_mapping, ic)
        qpos = torch.arange(CTX - 32, CTX, device=DEV)
        meta = DSAMetadata.from_lists([32], [CTX - 32], bt, BS)
        ix = layer.indexer
        qr = layer.q_norm(layer.wq_a(x[qpos]))
        topk = ix(x[qpos], qr, meta, ic, write=False)
        ref, ref_scores = ix.reference_topk(x, qr, qpos)
        # The fast path's scores, to tell near ties (swaps the fp8 score error explains) from real misses.
        q8, qs = K.quantize_index_q(ix.index_q(qr, qpos))
        fast = ix.scores(q8, (ix.index_weights(x[qpos]) * qs).contiguous(), ic, bt, meta.req_id, meta.context_lens,
                         meta.max_context)[:, :CTX]
    overlap = R.topk_overlap(topk.cpu(), ref.cpu())
    err = R.score_errors(fast, ref_scores)
    spread = ref_scores[torch.isfinite(ref_scores)].abs().max()
    print(f"\nindexer top-k overlap vs float64: mean {overlap.mean():.4f} min {overlap.min():.4f}; "
          f"max score error / max |score| {(err.max() / spread).item():.2e}")
    assert overlap.mean() > 0.9
    assert (err < 0.1 * spread).all()
    assert R.non_tie_mismatches(topk.cpu(), ref.cpu(), ref_scores.cpu(), rtol=0.0, atol=2 * err.cpu()) == 0


@pytest.mark.parametrize("rope", [64, 0])
def test_layer_errors_per_format_at_32k(rope):
    res = layer_accuracy(DSAConfig(qk_rope_head_dim=rope), context_len=CTX, num_eval=16, device=DEV)
    for fid, m in res.items():
        print(f"\n{fid:18s} vs bf16 {m['layer_err_vs_bf16']:.3e}  vs f64 {m['layer_err_vs_f64']:.3e}  "
              f"e2e {m['layer_err_vs_f64_e2e']:.3e}  overlap {m['topk_overlap']:.4f}")
    b = "bf16" if rope else "bf16-nope"
    assert all(m["topk_same_across_formats"] for m in res.values())
    assert res[b]["layer_err_vs_f64"] < 3e-2  # bf16 compute and a bf16 cache
    for name, bound in (("fp8", 0.15), ("fp8_ds_mla", 0.12), ("nvfp4_ds_mla", 0.35)):
        fid = name if rope else name + "-nope"
        assert res[fid]["layer_err_vs_f64"] < bound, (fid, res[fid])
        assert res[fid]["layer_err_vs_bf16"] > res[b]["layer_err_vs_bf16"]
    sfx = "" if rope else "-nope"
    assert res["fp8_ds_mla" + sfx]["layer_err_vs_bf16"] < res["nvfp4_ds_mla" + sfx]["layer_err_vs_bf16"]


def _decode_setup(fmt="fp8_ds_mla", num_requests=4, ctx=CTX - 1, seed=3):
    """DeepSeek-geometry layer, caches holding ``ctx`` tokens of each request, and a decode-step maker."""
    gen = torch.Generator().manual_seed(seed)
    layer = init_dsa_weights_(DSAAttention(DSAConfig(), device=DEV), gen)
    bt, nb = make_block_table(num_requests, ctx + 2 * BS, BS, device=DEV)
    kv, ic = PagedKVCache(fmt, nb, BS, DEV), IndexKeyCache(nb, BS, DEV)
    with torch.no_grad():
        for r in range(num_requests):
            x = realistic_hidden(ctx, 7168, gen, device=DEV).to(torch.bfloat16)
            for s0 in range(0, ctx, 8192):
                s1 = min(ctx, s0 + 8192)
                meta = DSAMetadata.from_positions(torch.arange(s0, s1, device=DEV),
                                                  torch.full((s1 - s0,), r, dtype=torch.int32, device=DEV), bt, BS)
                layer.write_cache(x[s0:s1], meta, kv, ic)

    def step(pos):
        x = realistic_hidden(num_requests, 7168, gen).to(DEV, torch.bfloat16)
        meta = DSAMetadata.from_lists([1] * num_requests, [pos] * num_requests, bt, BS)
        return x, meta

    return layer, kv, ic, step


def test_decode_step_has_no_host_sync():
    layer, kv, ic, step = _decode_setup(num_requests=2)
    x, meta = step(CTX - 1)
    with torch.no_grad():
        layer(x, meta, kv, ic)  # warm-up: compiles kernels, picks the backend
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x, meta, kv, ic)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_decode_step_cuda_graph_matches_eager():
    layer, kv, ic, step = _decode_setup()
    x0, meta0 = step(CTX - 1)
    static_x = x0.clone()
    static_meta = DSAMetadata.from_lists([1] * 4, [CTX - 1] * 4, meta0.block_table.clone(), BS)
    with torch.no_grad():
        eager0, topk0 = layer(x0, meta0, kv, ic, return_indices=True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(static_x, static_meta, kv, ic)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, topk = layer(static_x, static_meta, kv, ic, return_indices=True)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(topk, topk0)
        assert rel_err(out, eager0) < 1e-3, rel_err(out, eager0)
        # The next token: new inputs and positions copied into the captured buffers.
        x1, meta1 = step(CTX)
        static_x.copy_(x1)
        static_meta.copy_from(meta1)
        g.replay()
        torch.cuda.synchronize()
        graph1 = out.clone()
        eager1 = layer(x1, meta1, kv, ic)
    print(f"\ngraph vs eager: step 0 {rel_err(out, eager0):.2e}, step 1 {rel_err(graph1, eager1):.2e}")
    assert rel_err(graph1, eager1) < 1e-3


def test_model_decode_loop_under_cuda_graph_matches_eager():
    cfg = ModelConfig()
    model = init_model_weights_(DSAModel(cfg, device=DEV), seed=0)
    prompts = torch.randint(0, cfg.vocab_size, (2, 4096), generator=torch.Generator().manual_seed(0))
    eager = generate(model, prompts, 16, "nvfp4_ds_mla")
    graph = generate(model, prompts, 16, "nvfp4_ds_mla", cuda_graph=True, force_tokens=eager.tokens.cpu())
    agree = (graph.tokens == eager.tokens).float().mean().item()
    print(f"\nmodel: graph vs eager greedy agreement {agree:.3f}")
    assert agree == 1.0


def test_indexer_kernel_times():
    """Informational: scoring-kernel time for a decode batch and a prefill chunk at 32K contexts."""
    gen = torch.Generator().manual_seed(4)
    cache, _, bt = index_setup(gen, [CTX] * 128, on_gpu=True)
    for name, t, ctx, req in (
            ("decode b128", 128, torch.full((128,), CTX, dtype=torch.int32), torch.arange(128, dtype=torch.int32)),
            ("prefill 4096 @ 28K-32K", 4096, torch.arange(CTX - 4095, CTX + 1, dtype=torch.int32),
             torch.zeros(4096, dtype=torch.int32))):
        q8, qs = K.quantize_index_q(heavy((t, 64, 128), gen))
        wq = qs.contiguous()
        ctx, req = ctx.to(DEV), req.to(DEV)
        out = torch.empty((t, CTX), device=DEV)
        ms = triton.testing.do_bench(lambda: K.index_scores(q8, wq, cache, bt, req, ctx, CTX, out=out, check=False))
        ms_topk = triton.testing.do_bench(lambda: K.index_topk(out, 2048))
        keys = int(ctx.to(torch.int64).sum())
        print(f"\n{name}: scores {ms * 1e3:.1f} us ({keys * 132 / ms / 1e9:.2f} TB/s of keys read, "
              f"{2 * keys * 64 * 128 / ms / 1e9:.1f} TFLOP/s), top-k {ms_topk * 1e3:.1f} us")
