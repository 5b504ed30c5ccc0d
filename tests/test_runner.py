"""Batch metadata and the SparseMLA plan/run runner on CPU (reference backend; one small interpreted native run)."""
import pytest
import torch

from sparsemla.backends import clear_selection_cache
from sparsemla.cache import PagedKVCache
from sparsemla.indices import convert_indices_torch
from sparsemla.reference import sparse_mla
from sparsemla.runner import BatchMetadata, SparseMLA


@pytest.fixture(autouse=True)
def _fresh_selection():
    clear_selection_cache()


# --------------------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------------------
def test_from_lists_layout():
    md = BatchMetadata.from_lists([1, 2, 4], [10, 70, 4], [[3], [5, 1], [0]], block_size=64,
                                  max_decode_query_len=2)
    assert md.query_start_loc.tolist() == [0, 1, 3, 7]
    assert md.req_id_per_token.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert md.block_table.tolist() == [[3, -1], [5, 1], [0, -1]]
    assert (md.num_tokens, md.num_requests, md.num_decode_tokens, md.num_decode_requests) == (7, 3, 3, 2)
    assert md.num_prefill_tokens == 4
    assert md.context_lens_host() == [10, 69, 70, 1, 2, 3, 4]
    assert md.block_table.dtype == torch.int32 and md.seq_lens.dtype == torch.int32


def test_from_lists_accepts_tensors():
    md = BatchMetadata.from_lists(torch.tensor([1, 1]), torch.tensor([5, 6]), [torch.tensor([2]), [4]])
    assert md.req_id_per_token.tolist() == [0, 1]


@pytest.mark.parametrize("args, kw, exc, pattern", [
    (([1, 3, 1], [5, 5, 5], [[0], [1], [2]]), {}, ValueError, r"decode requests must come first.*request 2"),
    (([2], [1], [[0]]), {}, ValueError, r"seq_lens\[0\]: expected >= query_lens\[0\]"),
    (([0], [1], [[0]]), {}, ValueError, r"query_lens\[0\]: expected >= 1"),
    (([1, 1], [5], [[0], [1]]), {}, ValueError, "seq_lens: expected 2 entries"),
    (([1], [5], [[0], [1]]), {}, ValueError, "block_table: expected a list of 1 lists"),
    (([1.0], [5], [[0]]), {}, TypeError, r"query_lens\[0\]: expected an int"),
    (([1], [65], [[0]]), dict(block_size=64), ValueError, r"block_table\[0\]: a context of 65 tokens needs 2 blocks"),
    (([1], [5], [[-1]]), dict(block_size=64), ValueError, r"block_table\[0\]: .* needs 1 blocks >= 0"),
    (("1", [5], [[0]]), {}, TypeError, "query_lens: expected a list of ints"),
])
def test_from_lists_errors(args, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        BatchMetadata.from_lists(*args, **kw)


def _tensors(md):
    return dict(query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, block_table=md.block_table)


def test_from_tensors_matches_from_lists():
    ref = BatchMetadata.from_lists([1, 1, 3, 2], [9, 4, 130, 2], [[1], [2], [3, 4, 5], [6]])
    md = BatchMetadata.from_tensors(**_tensors(ref), num_tokens=7, num_decode_tokens=2, num_decode_requests=2)
    assert md.req_id_per_token.tolist() == ref.req_id_per_token.tolist()
    assert md.context_lens_host() == ref.context_lens_host()  # CPU tensors are read on the host


@pytest.mark.parametrize("over, exc, pattern", [
    (dict(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int64)), TypeError, "query_start_loc: expected dtype"),
    (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), ValueError, r"seq_lens: expected shape \[2\]"),
    (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "block_table: expected 2 rows"),
    (dict(num_tokens=4), ValueError, "num_tokens: query_start_loc ends at 3"),
    (dict(num_decode_tokens=2, num_decode_requests=1), ValueError, "num_decode_tokens: the first 1 requests hold 1"),
    (dict(num_decode_tokens=0, num_decode_requests=1), ValueError, "disagree"),
    (dict(num_decode_tokens=5), ValueError, r"num_decode_tokens: expected <= num_tokens"),
    (dict(query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32), seq_lens=torch.tensor([1, 5], dtype=torch.int32)),
     ValueError, r"seq_lens\[0\]: expected >= its 2 query tokens"),
])
def test_from_tensors_errors(over, exc, pattern):
    a = dict(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32), seq_lens=torch.tensor([4, 9], dtype=torch.int32),
             block_table=torch.zeros(2, 1, dtype=torch.int32), num_tokens=3, num_decode_tokens=1,
             num_decode_requests=1)
    a.update(over)
    with pytest.raises(exc, match=pattern):
        BatchMetadata.from_tensors(**a)


# --------------------------------------------------------------------------------------------------------
# runner
# --------------------------------------------------------------------------------------------------------
BS, STRIDE = 16, 24  # small blocks, interleaved with another layer's rows (stride > block size)


def make_cache(fmt, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(fmt, num_blocks, BS, block_stride_rows=STRIDE)
    n = cache.num_slots
    kv_c = torch.randn(n, 512, generator=g)
    kv_c[:, 7] *= 20  # an outlier channel
    k_pe = torch.randn(n, cache.fmt.rope_dim, generator=g) if cache.fmt.rope_dim else None
    cache.rows[cache.slot_to_row(torch.arange(n))] = cache.fmt.encode(kv_c, k_pe)
    return cache


def random_batch(query_lens, max_ctx, num_blocks, topk, index_topk, kpool, seed):
    """(metadata, topk_local, expected valid counts) with shuffled block tables and garbage past each count."""
    g = torch.Generator().manual_seed(seed)
    r = len(query_lens)
    seq_lens = [int(torch.randint(q, max_ctx + 1, (1,), generator=g)) for q in query_lens]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for s in seq_lens:
        nb = -(-s // BS)
        tables.append(perm[used:used + nb])
        used += nb
    md = BatchMetadata.from_lists(query_lens, seq_lens, tables, block_size=BS)
    ctx = md.context_lens_host()
    t = md.num_tokens
    topk_local = torch.randint(0, max_ctx, (t, topk), generator=g, dtype=torch.int32)  # garbage everywhere
    counts = []
    for i, c in enumerate(ctx):
        n = c if c <= index_topk else index_topk + c % kpool
        n = min(n, topk)
        counts.append(n)
        topk_local[i, :n] = torch.randperm(c, generator=g)[:n].to(torch.int32)
        topk_local[i, : n // 5] = -1  # some -1 inside the valid prefix too
    return md, topk_local, torch.tensor(counts, dtype=torch.int32)


def expected(md, cache, q, topk_local, counts, sm_scale, k_scale=1.0):
    rows = convert_indices_torch(topk_local, md.req_id_per_token, md.block_table, BS, STRIDE)
    rows[torch.arange(rows.shape[1])[None, :] >= counts[:, None]] = -1
    return sparse_mla(q, cache, rows, sm_scale, k_scale=k_scale)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla-nope", "fp8"])
def test_plan_run_matches_reference(fmt):
    cache = make_cache(fmt, 40)
    topk = 32
    runner = SparseMLA(16, 6, 8, 5, cache.fmt.head_dim, topk, fmt, block_size=BS, block_stride_rows=STRIDE,
                       sm_scale=0.06, device="cpu")
    assert runner.decode_backend.name == "reference"
    md, topk_local, counts = random_batch([1, 1, 1, 3, 5], 100, 40, topk, topk, 1, seed=3)
    runner.plan(md)
    assert runner.valid_counts[: md.num_tokens].tolist() == counts.tolist()
    assert torch.all(runner.valid_counts[md.num_tokens:] == 0)
    q = torch.randn(md.num_tokens, 5, cache.fmt.head_dim).bfloat16()
    o, l = runner.run(q, cache, topk_local, k_scale=0.5)
    ro, rl = expected(md, cache, q, topk_local, counts, 0.06, k_scale=0.5)
    assert torch.equal(o, ro) and torch.equal(l, rl)


def test_pooled_valid_counts():
    cache = make_cache("fp8_ds_mla", 40)
    topk, index_topk, kpool = 24, 20, 4
    runner = SparseMLA(8, 4, 8, 4, 576, topk, "fp8_ds_mla", block_size=BS, block_stride_rows=STRIDE,
                       index_topk=index_topk, kpool=kpool, sm_scale=576 ** -0.5, device="cpu")
    md, topk_local, counts = random_batch([1, 1, 2], 90, 40, topk, index_topk, kpool, seed=5)
    runner.plan(md)
    ctx = md.context_lens_host()
    want = [c if c <= 20 else 20 + c % 4 for c in ctx]
    assert runner.valid_counts[: md.num_tokens].tolist() == want == counts.tolist()
    q = torch.randn(md.num_tokens, 4, 576).bfloat16()
    o, l = runner.run(q, cache, topk_local)
    ro, rl = expected(md, cache, q, topk_local, counts, 576 ** -0.5)
    assert torch.equal(o, ro) and torch.equal(l, rl)


def test_upper_bounds_give_the_same_counts_from_device_lengths():
    runner = SparseMLA(8, 4, 8, 4, 576, 32, "fp8_ds_mla", block_size=BS, block_stride_rows=STRIDE, sm_scale=0.1,
                       device="cpu")
    md, _, counts = random_batch([1, 1, 3], 60, 20, 32, 32, 1, seed=7)
    dev_md = BatchMetadata.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, num_tokens=md.num_tokens,
                                        num_decode_tokens=2, num_decode_requests=2)
    runner.plan(dev_md, seq_lens_upper_bound=[s + 3 for s in md.seq_lens_host])
    assert runner.valid_counts[: md.num_tokens].tolist() == counts.tolist()
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound: expected 3 entries"):
        runner.plan(dev_md, seq_lens_upper_bound=[5, 5])
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound: each bound must be >= its request's query length"):
        runner.plan(dev_md, seq_lens_upper_bound=[5, 5, 1])


def test_padded_tokens_have_no_entries_and_outputs_are_owned_buffers():
    cache = make_cache("bf16", 20)
    runner = SparseMLA(8, 4, 8, 3, 576, 16, "bf16", block_size=BS, block_stride_rows=STRIDE, sm_scale=576 ** -0.5,
                       device="cpu")
    md, topk_local, counts = random_batch([1, 1], 50, 20, 16, 16, 1, seed=11)
    runner.plan(md, num_tokens_padded=5)
    q = torch.randn(5, 3, 576).bfloat16()
    tl_pad = torch.cat([topk_local, torch.randint(0, 40, (3, 16), dtype=torch.int32)])
    o, l = runner.run(q, cache, tl_pad)
    assert o.shape == (5, 3, 512)
    assert torch.all(o[2:] == 0) and torch.all(l[2:] == float("-inf"))
    ro, rl = expected(md, cache, q[:2], topk_local, counts, 576 ** -0.5)
    assert torch.equal(o[:2], ro) and torch.equal(l[:2], rl)
    o2, _ = runner.run(q, cache, tl_pad)
    assert o2.data_ptr() == o.data_ptr()  # the same owned buffer every time
    mine = torch.empty(5, 3, 512, dtype=torch.bfloat16)
    o3, _ = runner.run(q, cache, tl_pad, out=mine)
    assert o3 is mine and torch.equal(mine, o)


def test_metadata_buffers_are_16_byte_aligned():
    """Every device buffer a run hands to a kernel starts on a 16-byte boundary, also for odd request and token
    counts: the launchers' fast path (a specialization key from the integers alone) needs aligned pointers."""
    cache = make_cache("fp8_ds_mla", 40)
    for max_tokens, max_requests in ((7, 5), (6, 3), (9, 1)):
        runner = SparseMLA(max_tokens, max_requests, 8, 4, 576, 16, "fp8_ds_mla", block_size=BS,
                           block_stride_rows=STRIDE, sm_scale=0.1, device="cpu")
        bufs = {"seq_lens": runner._seq_lens, "req_id": runner._req_id, "valid_counts": runner._valid_counts,
                "block_table": runner._block_table, "rows": runner._rows}
        for name, buf in bufs.items():
            assert buf.data_ptr() % 16 == 0, (name, max_tokens, max_requests)
        assert runner._seq_lens.numel() == max_requests and runner._req_id.numel() == max_tokens
        assert runner._valid_counts.numel() == max_tokens
        md, topk_local, counts = random_batch([1] * min(3, max_requests), 60, 40, 16, 16, 1, seed=3)
        if md.num_tokens > max_tokens:
            continue
        runner.plan(md)
        assert runner.valid_counts[: md.num_tokens].tolist() == counts.tolist()
        q = torch.randn(md.num_tokens, 4, 576).bfloat16()
        o, l = runner.run(q, cache, topk_local)
        ro, rl = expected(md, cache, q, topk_local, counts, 0.1)
        assert torch.equal(o, ro) and torch.equal(l, rl)


def test_runner_construction_errors():
    base = dict(max_tokens=8, max_requests=4, max_blocks_per_request=8, num_heads=4, head_dim=576, topk=32,
                fmt="fp8_ds_mla", sm_scale=0.1, device="cpu")
    for over, exc, pattern in [
        (dict(head_dim=500), ValueError, "head_dim: expected 576"),
        (dict(fmt="fp8_ds_mla-nope"), ValueError, "fmt: format fp8_ds_mla-nope has head_dim 512"),
        (dict(num_heads=129), ValueError, r"num_heads: expected 1\.\.128"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(kpool=3, index_topk=32), ValueError, "index_topk: expected a multiple of kpool"),
        (dict(kpool=4, index_topk=32), ValueError, "topk: a row holds up to index_topk"),
        (dict(block_stride_rows=8, block_size=16), ValueError, "block_stride_rows: expected >= block_size"),
        (dict(backend="flashmla"), ValueError, "backend 'flashmla' cannot serve"),
        (dict(sm_scale=0.0), ValueError, "sm_scale"),
        (dict(sm_scale=None), TypeError, r"sm_scale: the model's softmax scale is required.*DeepSeek-V3.2.*GLM-5"),
    ]:
        with pytest.raises(exc, match=pattern):
            SparseMLA(**{**base, **over})


def test_plan_and_run_errors():
    cache = make_cache("fp8_ds_mla", 8)
    runner = SparseMLA(4, 2, 4, 4, 576, 16, "fp8_ds_mla", block_size=BS, block_stride_rows=STRIDE, sm_scale=0.1,
                       device="cpu")
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    tk = torch.zeros(2, 16, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="before plan"):
        runner.run(q, cache, tk)
    with pytest.raises(TypeError, match="metadata: expected a BatchMetadata"):
        runner.plan({"seq_lens": [1]})
    with pytest.raises(ValueError, match=r"metadata: 5 query tokens exceed max_tokens \(4\)"):
        runner.plan(BatchMetadata.from_lists([5], [5], [[0]]))
    with pytest.raises(ValueError, match=r"metadata: 3 requests exceed max_requests"):
        runner.plan(BatchMetadata.from_lists([1, 1, 1], [5, 5, 5], [[0], [1], [2]]))
    with pytest.raises(ValueError, match="more than max_blocks_per_request"):
        runner.plan(BatchMetadata.from_lists([1], [5], [[0, 1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="a context needs 5 blocks"):
        runner.plan(BatchMetadata.from_lists([1], [70], [[0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="num_tokens_padded"):
        runner.plan(BatchMetadata.from_lists([1, 1], [5, 5], [[0], [1]]), num_tokens_padded=5)
    runner.plan(BatchMetadata.from_lists([1, 1], [5, 5], [[0], [1]]))
    for args, kw, exc, pattern in [
        ((q[:1], cache, tk[:1]), {}, ValueError, r"q: expected 2\.\.4 tokens"),
        ((q.float(), cache, tk), {}, TypeError, "q: expected dtype"),
        ((torch.zeros(2, 5, 576, dtype=torch.bfloat16), cache, tk), {}, ValueError, r"q: expected \[T, 4, 576\]"),
        ((q, make_cache("bf16", 2), tk), {}, ValueError, "cache: expected format fp8_ds_mla"),
        ((q, PagedKVCache("fp8_ds_mla", 2, BS), tk), {}, ValueError, "cache: expected block_size 16 and block_stride_rows 24"),
        ((q, cache.rows, tk), {}, TypeError, "cache: expected a PagedKVCache"),
        ((q, cache, torch.zeros(2, 8, dtype=torch.int32)), {}, ValueError, r"topk_local: expected shape \[2, 16\]"),
        ((q, cache, tk.long()), {}, TypeError, "topk_local: expected dtype torch.int32"),
        ((q, cache, tk), dict(k_scale=torch.tensor(1.0)), TypeError, "k_scale: expected a Python float"),
        ((q, cache, tk), dict(k_scale=-1.0), ValueError, "k_scale"),
        ((q, cache, tk), dict(out=torch.zeros(2, 4, 512)), TypeError, "out: expected dtype"),
    ]:
        with pytest.raises(exc, match=pattern):
            runner.run(*args, **kw)


def test_native_backend_in_the_runner_under_the_interpreter():
    """The native kernel through the runner's preallocated split buffers (tiny: the interpreter is slow)."""
    cache = make_cache("fp8_ds_mla", 12)
    runner = SparseMLA(3, 2, 4, 2, 576, 64, "fp8_ds_mla", backend="triton", block_size=BS,
                       block_stride_rows=STRIDE, sm_scale=0.05, device="cpu")
    md, topk_local, counts = random_batch([1, 2], 60, 12, 64, 64, 1, seed=13)
    runner.plan(md)
    q = torch.randn(md.num_tokens, 2, 576).bfloat16()
    o, l = runner.run(q, cache, topk_local)
    ro, rl = expected(md, cache, q, topk_local, counts, 0.05)
    err = ((o.double() - ro.double()).norm() / ro.double().norm()).item()
    assert err < 1e-2
    assert torch.allclose(l, rl, atol=1e-2, rtol=0)


@pytest.mark.parametrize("fmt, k_scale", [("fp8", 0.5), ("nvfp4_ds_mla", 1.0)])
def test_prefill_through_the_bf16_workspace(fmt, k_scale):
    """Quantized cache, prefill tokens read from the upconverted bf16 workspace (k_scale applied exactly once);
    a step whose contexts do not fit falls back to native reads with the same result."""
    cache = make_cache(fmt, 12)
    md, topk_local, counts = random_batch([1, 2], 60, 12, 64, 64, 1, seed=17)
    q = torch.randn(md.num_tokens, 2, 576).bfloat16()
    ro, rl = expected(md, cache, q, topk_local, counts, 0.05, k_scale=k_scale)
    for cap, uses in [(200, True), (md.seq_lens_host[1] - 1, False)]:
        # max_requests 3 > the 2 planned: the workspace starts must cover every block-table row
        runner = SparseMLA(3, 3, 4, 2, 576, 64, fmt, backend="triton", block_size=BS, block_stride_rows=STRIDE,
                           sm_scale=0.05, device="cpu", prefill_workspace_tokens=cap)
        runner.plan(md)
        assert (runner._ws_plan is not None) == uses
        o, l = runner.run(q, cache, topk_local, k_scale=k_scale)
        err = ((o.double() - ro.double()).norm() / ro.double().norm()).item()
        assert err < 1e-2, (cap, err)
        assert torch.allclose(l, rl, atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="prefill_workspace_tokens"):
        SparseMLA(3, 2, 4, 2, 576, 64, fmt, backend="triton", sm_scale=0.05, device="cpu", prefill_workspace_tokens=-1)


def test_block_tables_past_the_cache_are_rejected_on_the_host():
    """A block-table entry past the cache: plan() rejects it when the runner knows the cache's size, run() in any
    case, naming the request and the block, with nothing read back from the device."""
    cache = make_cache("fp8_ds_mla", 8)  # 8 blocks
    md = BatchMetadata.from_lists([1, 1], [20, 20], [[1, 2], [3, 99]])
    runner = SparseMLA(4, 2, 4, 4, 576, 16, "fp8_ds_mla", block_size=BS, block_stride_rows=STRIDE, sm_scale=0.1,
                       num_blocks=cache.num_blocks, device="cpu")
    with pytest.raises(ValueError, match=r"request 1 maps block-table entry 1 to block 99, past the cache's 8 blocks"):
        runner.plan(md)
    runner = SparseMLA(4, 2, 4, 4, 576, 16, "fp8_ds_mla", block_size=BS, block_stride_rows=STRIDE, sm_scale=0.1,
                       device="cpu")
    runner.plan(md)
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="request 1 maps block-table entry 1 to block 99"):
        runner.run(q, cache, torch.zeros(2, 16, dtype=torch.int32))
    # an entry past the context (not used) is not an error
    runner.plan(BatchMetadata.from_lists([1, 1], [10, 10], [[1, 99], [3, 99]]))
