"""H200: the runner under CUDA graphs, plan/run rules, torch.compile of the custom ops, and the peers.

Run: ``python3 -m pytest -m gpu tests/gpu/test_runner_gpu.py -v`` (peers are exercised where installed; see
``shared/docs/gpu-runs.md`` for bringing ``sgl-flash-mla`` and a trimmed FlashInfer to the machine).
"""
import math

import pytest
import torch

from sparsemla import ops
from sparsemla.attention import sparse_mla_decode, sparse_mla_prefill
from sparsemla.backends import AttentionConfig, clear_selection_cache, get_backend
from sparsemla.backends.registry import device_capability
from sparsemla.cache import PagedKVCache
from sparsemla.formats import get_format
from sparsemla.indices import convert_indices_torch
from sparsemla.reference import sparse_mla
from sparsemla.runner import BatchMetadata, SparseMLA

pytestmark = pytest.mark.gpu
DEV = "cuda"
BS = 64


def heavy(n, d, gen):
    """Heavy-tailed values with two outlier channels (fresh each call)."""
    x = torch.randn(n, d, generator=gen, device=DEV) * torch.exp(torch.randn(n, 1, generator=gen, device=DEV) * 0.5)
    x[:, 3] *= 30
    x[:, d // 2] *= 10
    return x


def filled_cache(fmt, num_blocks, gen, k_scale=1.0):
    cache = PagedKVCache(fmt, num_blocks, BS, DEV)
    n = cache.num_slots
    k_pe = heavy(n, cache.fmt.rope_dim, gen) if cache.fmt.rope_dim else None
    cache.write(heavy(n, 512, gen), k_pe, torch.arange(n, dtype=torch.int32, device=DEV), k_scale=k_scale)
    return cache


class Batch:
    """A random decode batch: shuffled block tables, top-k of distinct positions, garbage past each count."""

    def __init__(self, gen, num_requests, max_ctx, num_blocks, topk, query_len=1):
        cpu = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen, device=DEV)))
        self.seq_lens = torch.randint(query_len, max_ctx + 1, (num_requests,), generator=cpu).tolist()
        perm = torch.randperm(num_blocks, generator=cpu).tolist()
        self.tables, used = [], 0
        for s in self.seq_lens:
            nb = -(-s // BS)
            self.tables.append(perm[used:used + nb])
            used += nb
        assert used <= num_blocks
        self.md = BatchMetadata.from_lists([query_len] * num_requests, self.seq_lens, self.tables, block_size=BS,
                                           max_decode_query_len=query_len, device=DEV)
        ctx = self.md.context_lens_host()
        t = len(ctx)
        self.counts = torch.tensor([min(c, topk) for c in ctx], dtype=torch.int32)
        tl = torch.randint(0, max_ctx, (t, topk), generator=cpu, dtype=torch.int32)  # garbage past the counts
        for i, c in enumerate(ctx):
            n = int(self.counts[i])
            tl[i, :n] = torch.randperm(c, generator=cpu)[:n].to(torch.int32)
        self.topk_local = tl.to(DEV)
        self.num_tokens = t

    def reference(self, cache, q, sm_scale, k_scale=1.0):
        md = self.md
        rows = convert_indices_torch(self.topk_local.cpu(), md.req_id_per_token.cpu(), md.block_table.cpu(), BS)
        rows[torch.arange(rows.shape[1])[None, :] >= self.counts[:, None]] = -1
        return sparse_mla(q, cache, rows.to(DEV), sm_scale, k_scale=k_scale)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_close_lse(a, b, tol=1e-2):
    """lse equal where the reference is +-inf, and within ``tol`` times max(1, |lse| / 100) elsewhere: heavy-tailed
    q and keys give |lse| up to ~1e4 here, where one fp32 ulp is ~1e-3."""
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    assert torch.all(a[~fin] == b[~fin])
    if fin.any():
        d = (a[fin].double() - b[fin].double()).abs().max().item()
        big = b[fin].abs().max().item()
        assert d <= tol * max(1.0, big / 100), (d, big)


# --------------------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla", "bf16", "fp8", "fp8_ds_mla-nope"])
def test_capture_one_decode_step_and_replay_100_random_batches(fmt):
    gen = torch.Generator(device=DEV).manual_seed(hash(fmt) % 2 ** 31)
    max_reqs, heads, topk, max_ctx = 64, 16, 2048, 8192
    blocks_per_req = max_ctx // BS
    k_scale = 0.5 if fmt.startswith("fp8") and "ds" not in fmt else 1.0
    cache = filled_cache(fmt, max_reqs * blocks_per_req + 8, gen, k_scale)
    fmt_obj = get_format(fmt)
    d = fmt_obj.head_dim
    sm_scale = 1.0 / math.sqrt(192)
    runner = SparseMLA(max_reqs, max_reqs, blocks_per_req, heads, d, topk, fmt_obj, sm_scale=sm_scale, device=DEV)
    assert runner.decode_backend.name == "triton"
    q = torch.zeros(max_reqs, heads, d, dtype=torch.bfloat16, device=DEV)
    topk_local = torch.full((max_reqs, topk), -1, dtype=torch.int32, device=DEV)

    def load(batch):
        b = batch.num_tokens
        q.copy_(torch.randn(max_reqs, heads, d, generator=gen, device=DEV).to(torch.bfloat16))
        topk_local.copy_(torch.randint(0, max_ctx, (max_reqs, topk), generator=gen, device=DEV, dtype=torch.int32))
        topk_local[:b] = batch.topk_local
        runner.plan(batch.md, num_tokens_padded=max_reqs)

    first = Batch(gen, max_reqs, max_ctx, cache.num_blocks, topk)
    load(first)
    runner.run(q, cache, topk_local, k_scale=k_scale)  # eager warm-up: compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = runner.run(q, cache, topk_local, k_scale=k_scale)
    e_out = torch.empty_like(g_out)
    e_lse = torch.empty_like(g_lse)
    for step in range(100):
        b = int(torch.randint(1, max_reqs + 1, (1,), generator=gen, device=DEV))
        batch = Batch(gen, b, max_ctx, cache.num_blocks, topk)
        load(batch)
        if step % 10 == 0:  # new cache contents between replays, too
            n = cache.num_slots
            sl = torch.randperm(n, generator=gen, device=DEV)[:1024].to(torch.int32)
            kpe = heavy(1024, fmt_obj.rope_dim, gen) if fmt_obj.rope_dim else None
            cache.write(heavy(1024, 512, gen), kpe, sl, k_scale=k_scale)
        g_out.fill_(float("nan"))
        graph.replay()
        e_out.fill_(float("nan"))
        runner.run(q, cache, topk_local, k_scale=k_scale, out=e_out, lse=e_lse)  # eager, same planned batch
        torch.cuda.synchronize()
        assert torch.equal(g_out, e_out), f"step {step}: replay differs from the eager run"
        assert torch.equal(g_lse, e_lse), f"step {step}: replay lse differs from the eager run"
        assert torch.all(g_out[b:] == 0) and torch.all(g_lse[b:] == float("-inf"))
        if step % 25 == 0:
            ro, rl = batch.reference(cache, q[:b], sm_scale, k_scale)
            assert rel_err(g_out[:b], ro) <= 1e-2
            assert_close_lse(g_lse[:b], rl)


def _planned_step(seed: int):
    """(cache, runner, batch, q): a small fp8_ds_mla step, planned and run once (eagerly)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache = filled_cache("fp8_ds_mla", 64, gen)
    runner = SparseMLA(8, 8, 8, 16, 576, 256, "fp8_ds_mla", sm_scale=0.07, device=DEV)
    batch = Batch(gen, 4, 400, cache.num_blocks, 256)
    runner.plan(batch.md)
    q = torch.randn(batch.num_tokens, 16, 576, device=DEV).to(torch.bfloat16)
    runner.run(q, cache, batch.topk_local)
    return cache, runner, batch, q


def test_plan_during_capture_raises():
    _, runner, batch, _ = _planned_step(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
                runner.plan(batch.md)
        finally:
            graph.capture_end()


def test_async_upper_bounds_plan_and_run_without_any_sync():
    gen = torch.Generator(device=DEV).manual_seed(2)
    cache = filled_cache("nvfp4_ds_mla", 512, gen)
    runner = SparseMLA(32, 32, 16, 16, 576, 1024, "nvfp4_ds_mla", sm_scale=0.07, device=DEV)
    batch = Batch(gen, 20, 1000, cache.num_blocks, 1024)
    md = batch.md
    q = torch.randn(batch.num_tokens, 16, 576, device=DEV, generator=gen).to(torch.bfloat16)
    runner.plan(md)
    runner.run(q, cache, batch.topk_local)  # warm-up (kernel compilation may sync)
    want_o, want_l = (x.clone() for x in runner.run(q, cache, batch.topk_local))
    dev_md = BatchMetadata.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, num_tokens=md.num_tokens,
                                        num_decode_tokens=md.num_decode_tokens,
                                        num_decode_requests=md.num_decode_requests)
    bounds = [s + 2 for s in batch.seq_lens]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.plan(dev_md, seq_lens_upper_bound=bounds)
        out, lse = runner.run(q, cache, batch.topk_local)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(runner.valid_counts[: md.num_tokens].cpu(), batch.counts)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)


# --------------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------------
class TinyDecode(torch.nn.Module):
    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.proj = torch.nn.Linear(576, 576, bias=False, device=DEV)

    def forward(self, x, kv_c, k_pe, slots, topk, req, block_table):
        ops.cache_write(self.cache, kv_c, k_pe, slots)
        rows, counts = ops.convert_indices(topk, req, block_table, self.cache.block_size)
        q = self.proj(x).to(torch.bfloat16)
        out, lse = ops.sparse_mla_decode(q, self.cache, rows, 0.05, counts)
        return out.float() * 2, lse


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_fullgraph_module_calling_the_ops(mode):
    torch._dynamo.reset()
    gen = torch.Generator(device=DEV).manual_seed(3)
    cache = PagedKVCache("fp8_ds_mla", 64, BS, DEV)
    m = TinyDecode(cache)
    n = cache.num_slots
    args = (torch.randn(32, 16, 576, generator=gen, device=DEV), heavy(n, 512, gen), heavy(n, 64, gen),
            torch.randperm(n, generator=gen, device=DEV).to(torch.int32),
            torch.randint(-1, 2000, (32, 512), generator=gen, device=DEV, dtype=torch.int32),
            torch.randint(0, 4, (32,), generator=gen, device=DEV, dtype=torch.int32),
            torch.randperm(64, generator=gen, device=DEV).to(torch.int32).view(4, 16))
    with torch.no_grad():
        want_o, want_l = m(*args)
        cm = torch.compile(m, fullgraph=True, mode=mode)
        for _ in range(3):  # reduce-overhead records a CUDA graph on a later call
            got_o, got_l = cm(*args)
    torch.cuda.synchronize()
    assert rel_err(got_o, want_o) <= 1e-2
    assert_close_lse(got_l, want_l)


# --------------------------------------------------------------------------------------------------------
# peers, where installed: agreement with the native backend on the cases both serve
# --------------------------------------------------------------------------------------------------------
def _config(mode, fmt, heads, topk, source="cache", **kw):
    dev_type, cap = device_capability(DEV)
    return AttentionConfig(mode, get_format(fmt), heads, topk, dev_type, cap, source, **kw)


def _skip_unless(name, config):
    clear_selection_cache()
    reason = get_backend(name).why_not(config)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")


def _decode_case(fmt, heads, topk, tokens, gen, k_scale=1.0, max_ctx=8192):
    cache = filled_cache(fmt, tokens * (max_ctx // BS) + 4, gen, k_scale)
    batch = Batch(gen, tokens, max_ctx, cache.num_blocks, topk)
    md = batch.md
    rows = convert_indices_torch(batch.topk_local, md.req_id_per_token, md.block_table, BS)
    q = torch.randn(batch.num_tokens, heads, cache.fmt.head_dim, generator=gen, device=DEV).to(torch.bfloat16)
    vc = batch.counts.to(DEV)
    vc[: tokens // 4] = 0  # a few empty queries
    return cache, q, rows, vc


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla-nope"])
def test_flashmla_decode_agrees_with_native(fmt, heads):
    _skip_unless("flashmla", _config("decode", fmt, heads, 2048))
    gen = torch.Generator(device=DEV).manual_seed(heads)
    cache, q, rows, vc = _decode_case(fmt, heads, 2048, 64, gen)
    o_n, l_n = sparse_mla_decode(q, cache, rows, 0.07, vc, backend="triton")
    o_f, l_f = sparse_mla_decode(q, cache, rows, 0.07, vc, backend="flashmla")
    assert rel_err(o_f, o_n) <= 1e-2
    assert_close_lse(l_f, l_n)


@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_prefill_agrees_with_native(heads):
    _skip_unless("flashmla", _config("prefill", "bf16", heads, 2048, "workspace"))
    gen = torch.Generator(device=DEV).manual_seed(heads + 1)
    ws = heavy(32768, 576, gen).to(torch.bfloat16)
    q = torch.randn(512, heads, 576, generator=gen, device=DEV).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(32768, generator=gen, device=DEV)[:2048] for _ in range(512)]).to(torch.int32)
    idx[:, 1500:] = -1
    vc = torch.full((512,), 2048, dtype=torch.int32, device=DEV)
    vc[:8] = 0
    o_n, l_n = sparse_mla_prefill(q, ws, idx, 0.07, vc, backend="triton")
    o_f, l_f = sparse_mla_prefill(q, ws, idx, 0.07, vc, backend="flashmla")
    assert rel_err(o_f, o_n) <= 1e-2
    assert_close_lse(l_f, l_n)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "bf16-nope", "fp8-nope"])
def test_flashinfer_decode_agrees_with_native(fmt, heads):
    _skip_unless("flashinfer", _config("decode", fmt, heads, 2048))
    gen = torch.Generator(device=DEV).manual_seed(heads + 7)
    k_scale = 0.5 if fmt.startswith("fp8") else 1.0
    cache, q, rows, vc = _decode_case(fmt, heads, 2048, 64, gen, k_scale)
    o_n, l_n = sparse_mla_decode(q, cache, rows, 0.07, vc, k_scale, backend="triton")
    o_f, l_f = sparse_mla_decode(q, cache, rows, 0.07, vc, k_scale, backend="flashinfer")
    assert rel_err(o_f, o_n) <= 1e-2
    assert_close_lse(l_f, l_n)


# triton-fp8qk (the opt-in FP8-QK mode): its lse is ~1e-3 x |lse| from the reference (e4m3 tensor-core
# accumulation), hence the looser lse tolerance (0.3 x max(1, |lse| / 100))
@pytest.mark.parametrize("backend,fmt,lse_tol", [("flashinfer", "bf16", 1e-2), ("flashinfer", "fp8", 1e-2),
                                                 ("triton-fp8qk", "fp8", 0.3), ("triton-fp8qk", "fp8_ds_mla", 0.3)])
def test_runner_capture_and_replay_against_native(backend, fmt, lse_tol):
    _skip_unless(backend, _config("decode", fmt, 16, 2048, graph_capture=True, runner=True))
    gen = torch.Generator(device=DEV).manual_seed(11)
    k_scale = 0.5 if fmt == "fp8" else 1.0
    max_reqs, topk, max_ctx = 32, 2048, 4096
    cache = filled_cache(fmt, max_reqs * (max_ctx // BS) + 4, gen, k_scale)
    runner = SparseMLA(max_reqs, max_reqs, max_ctx // BS, 16, 576, topk, fmt, backend=backend, sm_scale=0.07,
                       device=DEV)
    native = SparseMLA(max_reqs, max_reqs, max_ctx // BS, 16, 576, topk, fmt, backend="triton", sm_scale=0.07,
                       device=DEV)
    q = torch.zeros(max_reqs, 16, 576, dtype=torch.bfloat16, device=DEV)
    tk = torch.full((max_reqs, topk), -1, dtype=torch.int32, device=DEV)

    def load(batch):
        q.copy_(torch.randn(max_reqs, 16, 576, generator=gen, device=DEV).to(torch.bfloat16))
        tk.fill_(-1)
        tk[: batch.num_tokens] = batch.topk_local
        runner.plan(batch.md, num_tokens_padded=max_reqs)
        native.plan(batch.md, num_tokens_padded=max_reqs)

    load(Batch(gen, max_reqs, max_ctx, cache.num_blocks, topk))
    runner.run(q, cache, tk, k_scale=k_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = runner.run(q, cache, tk, k_scale=k_scale)
    for step in range(10):
        b = int(torch.randint(1, max_reqs + 1, (1,), generator=gen, device=DEV))
        load(Batch(gen, b, max_ctx, cache.num_blocks, topk))
        graph.replay()
        n_out, n_lse = native.run(q, cache, tk, k_scale=k_scale)
        torch.cuda.synchronize()
        assert rel_err(g_out[:b], n_out[:b]) <= 1e-2, f"step {step}"
        assert_close_lse(g_lse[:b], n_lse[:b], lse_tol)
        assert torch.all(g_out[b:] == 0) and torch.all(g_lse[b:] == float("-inf"))


# --------------------------------------------------------------------------------------------------------
# prefill through the bf16 workspace
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, k_scale", [("fp8_ds_mla", 1.0), ("nvfp4_ds_mla", 1.0), ("fp8", 0.5),
                                          ("nvfp4_ds_mla-nope", 1.0)])
def test_mixed_batch_prefill_through_the_workspace(fmt, k_scale):
    """Decode requests read the cache, prefill requests the upconverted workspace; both against float64."""
    gen = torch.Generator(device=DEV).manual_seed(11 + hash(fmt) % 1000)
    cpu = torch.Generator().manual_seed(5)
    topk, heads = 2048, 16
    query_lens, seq_lens = [1, 1, 300, 200], [5000, 900, 4096, 2048]
    num_blocks = sum(-(-s // BS) for s in seq_lens) + 8
    cache = filled_cache(fmt, num_blocks, gen, k_scale=k_scale)
    perm = torch.randperm(num_blocks, generator=cpu).tolist()
    tables, used = [], 0
    for s in seq_lens:
        tables.append(perm[used:used + -(-s // BS)])
        used += len(tables[-1])
    md = BatchMetadata.from_lists(query_lens, seq_lens, tables, block_size=BS, device=DEV)
    ctx = md.context_lens_host()
    counts = torch.tensor([min(c, topk) for c in ctx], dtype=torch.int32)
    tl = torch.randint(0, max(seq_lens), (len(ctx), topk), generator=cpu, dtype=torch.int32)
    for i, c in enumerate(ctx):
        tl[i, :int(counts[i])] = torch.randperm(c, generator=cpu)[:int(counts[i])].to(torch.int32)
    topk_local = tl.to(DEV)
    q = heavy(len(ctx) * heads, cache.fmt.head_dim, gen).view(len(ctx), heads, -1).to(torch.bfloat16)
    runner = SparseMLA(512, 8, 128, heads, cache.fmt.head_dim, topk, fmt, backend="triton", block_size=BS,
                       sm_scale=0.05, device=DEV, prefill_workspace_tokens=8192)
    runner.plan(md)
    assert runner._ws_plan is not None
    out, lse = runner.run(q, cache, topk_local, k_scale=k_scale)
    rows = convert_indices_torch(tl, md.req_id_per_token.cpu(), md.block_table.cpu(), BS)
    rows[torch.arange(topk)[None, :] >= counts[:, None]] = -1
    ro, rl = sparse_mla(q, cache, rows.to(DEV), 0.05, k_scale=k_scale)
    print(f"mixed batch {fmt}: rel err {rel_err(out, ro):.2e}, lse max diff "
          f"{(lse - rl)[torch.isfinite(rl)].abs().max().item():.2e}, max |lse| {rl[torch.isfinite(rl)].abs().max().item():.1f}")
    assert rel_err(out, ro) <= 1e-2, rel_err(out, ro)
    assert_close_lse(lse, rl)


def test_a_call_on_another_device_than_the_current_one_raises(monkeypatch):
    """Triton launches on the current device: a call whose q is on another one raises, naming both devices, in the
    functional API and in the runner (another device simulated: the current-device query answers one index more)."""
    import sparsemla._device as device_mod
    import sparsemla.attention as api
    import sparsemla.runner.runner as runner_mod
    cache, runner, batch, q = _planned_step(2)  # the current device: runs
    idx = torch.zeros(batch.num_tokens, 256, dtype=torch.int32, device=DEV)
    sparse_mla_decode(q, cache, idx, 0.07)
    sparse_mla_decode(q, cache, idx, 0.07)  # (recorded by the compiled host entry where it is in use)
    other = lambda: q.get_device() + 1  # noqa: E731
    real = device_mod.current_cuda_index
    for mod in (api, runner_mod, device_mod):
        monkeypatch.setattr(mod, "current_cuda_index", other)
    from sparsemla import host_entry
    entry = host_entry.load()
    if entry is not None:  # the entry reads the current device itself
        host_entry._configure(entry, get_device=other)
    try:
        with pytest.raises(ValueError, match=r"q: on cuda:\d+, but the current CUDA device is cuda:\d+"):
            sparse_mla_decode(q, cache, idx, 0.07)
    finally:
        if entry is not None:  # (the real query: the module's attribute is still the stand-in here)
            host_entry._configure(entry, get_device=real)
    with pytest.raises(ValueError, match=r"q: on cuda:\d+, but the current CUDA device is cuda:\d+"):
        runner.run(q, cache, batch.topk_local)
