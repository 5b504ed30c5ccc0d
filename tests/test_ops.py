"""torch.library custom ops: schemas and fake implementations (opcheck), and torch.compile(fullgraph=True) on CPU."""
import torch

from sparsemla import ops
from sparsemla.attention import sparse_mla_decode, sparse_mla_prefill
from sparsemla.cache import PagedKVCache
from sparsemla.indices import convert_indices


def small_cache(fmt="fp8_ds_mla", num_blocks=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(fmt, num_blocks, 64)
    n = cache.num_slots
    k_pe = torch.randn(n, cache.fmt.rope_dim, generator=g) if cache.fmt.rope_dim else None
    cache.rows[:] = cache.fmt.encode(torch.randn(n, 512, generator=g), k_pe)
    return cache


def test_ops_are_registered():
    for name in ("cache_write", "convert_indices", "sparse_mla_decode", "sparse_mla_prefill"):
        assert hasattr(torch.ops.sparsemla, name)


def test_decode_and_prefill_ops_match_the_functional_api():
    cache = small_cache()
    q = torch.randn(3, 4, 576).bfloat16()
    idx = torch.randint(-1, cache.num_rows, (3, 64), dtype=torch.int32)
    vc = torch.tensor([64, 3, 0], dtype=torch.int32)
    assert all(torch.equal(a, b) for a, b in zip(ops.sparse_mla_decode(q, cache, idx, 0.1, vc),
                                                 sparse_mla_decode(q, cache, idx, 0.1, vc)))
    ws = torch.randn(100, 576).bfloat16()
    idx = torch.randint(-1, 100, (3, 64), dtype=torch.int32)
    assert all(torch.equal(a, b) for a, b in zip(ops.sparse_mla_prefill(q, ws, idx, 0.1),
                                                 sparse_mla_prefill(q, ws, idx, 0.1)))
    assert all(torch.equal(a, b) for a, b in zip(ops.sparse_mla_prefill(q, cache, idx, 0.1, backend="reference"),
                                                 sparse_mla_prefill(q, cache, idx, 0.1)))


def test_opcheck_attention_ops():
    cache = small_cache()
    q = torch.randn(2, 4, 576).bfloat16()
    idx = torch.randint(-1, cache.num_rows, (2, 64), dtype=torch.int32)
    vc = torch.tensor([64, 5], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparsemla.sparse_mla_decode.default,
                          (q, cache.rows, "fp8_ds_mla", 64, 64, idx, 0.1, vc, 1.0, "reference"))
    ws = torch.randn(cache.num_rows, 576).bfloat16()
    torch.library.opcheck(torch.ops.sparsemla.sparse_mla_prefill.default,
                          (q, ws, "", 1, 1, idx, 0.1, None, 1.0, "auto"))


def test_opcheck_convert_and_write():
    topk = torch.tensor([[0, 70, -1], [5, -1, 3]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    bt = torch.tensor([[1, 0], [0, -1]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparsemla.convert_indices.default, (topk, req, bt, 64, 64))
    rows, vc = ops.convert_indices(topk, req, bt, 64)
    want_rows, want_vc = convert_indices(topk, req, bt, 64, return_valid_counts=True)
    assert torch.equal(rows, want_rows) and torch.equal(vc, want_vc)
    cache = PagedKVCache("bf16", 2, 64)
    kv_c, k_pe = torch.randn(3, 512), torch.randn(3, 64)
    slots = torch.tensor([5, -1, 100], dtype=torch.int32)
    # opcheck runs the op on copies of its arguments; then write for real through the helper.
    torch.library.opcheck(torch.ops.sparsemla.cache_write.default,
                          (cache.rows, kv_c, k_pe, slots, "bf16", 64, 64, 1.0))
    ops.cache_write(cache, kv_c, k_pe, slots)
    got = cache.read(cache.slot_to_row(torch.tensor([5, 100])))
    assert torch.allclose(got[:, :512], kv_c[[0, 2]].bfloat16().float())


class TinyDecode(torch.nn.Module):
    """Writes new tokens, converts request-local top-k to rows, attends: what a decode layer does."""

    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.proj = torch.nn.Linear(576, 576, bias=False)

    def forward(self, x, kv_c, k_pe, slots, topk, req, block_table):
        ops.cache_write(self.cache, kv_c, k_pe, slots)
        rows, counts = ops.convert_indices(topk, req, block_table, self.cache.block_size)
        q = self.proj(x).to(torch.bfloat16)
        out, lse = ops.sparse_mla_decode(q, self.cache, rows, 0.05, counts)
        return out.float().mean(-1) + lse


def test_compile_fullgraph_on_cpu():
    torch.manual_seed(0)
    cache = PagedKVCache("bf16", 4, 64)
    m = TinyDecode(cache)
    n = cache.num_slots
    args = (torch.randn(3, 16, 576), torch.randn(n, 512), torch.randn(n, 64), torch.arange(n, dtype=torch.int32),
            torch.randint(-1, 120, (3, 64), dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32),
            torch.tensor([[2, 0], [1, 3]], dtype=torch.int32))
    with torch.no_grad():
        want = m(*args)
        torch._dynamo.reset()
        # aot_eager traces through dynamo and AOTAutograd with the fake implementations (a graph break
        # would raise under fullgraph=True); inductor is exercised on the H200, where it is fast.
        got = torch.compile(m, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(got, want)
