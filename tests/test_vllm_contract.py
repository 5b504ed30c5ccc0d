"""The vLLM contract module on vLLM-shaped tensors, against float64 (no vLLM needed: it imports none).

Caches interleave three layers per block (the layer under test sits between two others whose bytes would poison a
misaddressed read), in vLLM's storage dtypes; queries come as vLLM's pair with a strided ``q_pe``; index rows are
2048 or 2176 wide (a pooled indexer's width) with valid counts (0 included) and out-of-range junk past them.
"""
import pytest
import torch

from sparsemla.formats import UnsupportedFormat
from sparsemla.integrations.vllm import contract
from sparsemla.integrations.vllm.contract import LayerAttention, Workspace, resolve_format, vllm_row_bytes
from sparsemla.integrations.vllm.testing import LayeredCache, assert_close, cat_query, query_pair, reference, topk_rows

SCALE = 0.0723  # a model's softmax scale (not head_dim ** -0.5)

# (vLLM cache dtype, head size, top-k width, heads, block size, valid counts)
CASES = [
    ("fp8_ds_mla", 576, 2048, 16, 64, [37, 0, 130]),
    ("fp8_ds_mla", 512, 2176, 8, 64, [2051, 5]),
    ("nvfp4_ds_mla", 576, 2176, 16, 64, [64, 1, 0]),
    ("nvfp4_ds_mla", 512, 2048, 8, 16, [90, 33]),
    ("bfloat16", 576, 2048, 8, 64, [48, 7]),
    ("auto", 512, 2176, 8, 32, [17, 0, 60]),
    ("fp8", 576, 2048, 16, 64, [55, 3]),
    ("fp8_e4m3", 512, 2048, 8, 128, [70, 2]),
]


def _setup(kv_cache_dtype, head, width, heads, block_size, counts, k_scale=1.0, max_tokens=8, seed=0):
    fmt = resolve_format(kv_cache_dtype, head)
    num_blocks = max(4, -(-max(counts + [1]) // block_size) + 2)
    cache = LayeredCache(fmt, kv_cache_dtype, num_blocks, block_size, k_scale=k_scale, seed=seed)
    ws = Workspace(fmt, max_tokens, heads, width, "cpu")
    layer = LayerAttention(ws, kv_cache_dtype, head, SCALE)
    idx, vc = topk_rows(cache, counts, width, seed=seed + 1)
    return fmt, cache, ws, layer, idx, vc


@pytest.mark.parametrize("kv_cache_dtype,head,width,heads,block_size,counts", CASES,
                         ids=[f"{c[0]}-{c[1]}-k{c[2]}-h{c[3]}" for c in CASES])
def test_forward_matches_float64(kv_cache_dtype, head, width, heads, block_size, counts):
    fmt, cache, ws, layer, idx, vc = _setup(kv_cache_dtype, head, width, heads, block_size, counts)
    assert fmt.bytes_per_token == vllm_row_bytes(kv_cache_dtype, head)
    pair = query_pair(len(counts), heads, fmt.rope_dim, head_major=head == 512)
    out, lse = layer.forward(pair, cache.view, idx, vc, 1.0)
    assert out.shape == (len(counts), heads, 512) and lse.shape == (len(counts), heads)
    assert out.data_ptr() == ws.out.data_ptr() and lse.data_ptr() == ws.lse.data_ptr()
    ref_out, ref_lse = reference(cache, cat_query(pair, fmt.rope_dim), idx, vc, SCALE)
    assert_close(out, lse, ref_out, ref_lse, f"{fmt.id}")


def test_nope_pair_is_read_in_place():
    """A NoPE pair's ql_nope goes to the kernels as it is (any strides), with no copy."""
    fmt, cache, ws, layer, idx, vc = _setup("fp8_ds_mla", 512, 2048, 8, 64, [20, 9])
    ql, qp = query_pair(2, 8, 0, head_major=True)
    assert contract.assemble_query((ql, qp), fmt, ws, 2) is ql
    assert contract.query_parts((ql, qp), fmt, ws, 2) == (ql, None)
    layer.forward((ql, qp), cache.view, idx, vc)
    assert ws.q is None  # no query buffer was needed


def test_rope_pair_is_read_in_place_and_agrees_with_one_tensor():
    """The (ql_nope, strided q_pe) pair goes to the kernels as it is (no copy, no query buffer); one [T, H, 576]
    tensor (the form after a gather across ranks) gives bitwise the same result, and so does a q_pe whose last dim
    is strided (copied into the workspace's query buffer, allocated then)."""
    fmt, cache, ws, layer, idx, vc = _setup("fp8_ds_mla", 576, 2048, 16, 64, [40, 11])
    pair = query_pair(2, 16, 64)
    assert not pair[1].is_contiguous() and pair[1].stride(2) == 1
    qq, qpe = contract.query_parts(pair, fmt, ws, 2)
    assert qq is pair[0] and qpe is pair[1]
    out1 = layer.forward(pair, cache.view, idx, vc)[0].clone()
    assert ws.q is None
    out2 = layer.forward(torch.cat(pair, -1), cache.view, idx, vc)[0].clone()
    assert torch.equal(out1, out2)
    pe_strided = torch.empty(2, 16, 128, dtype=torch.bfloat16)[..., ::2]
    pe_strided.copy_(pair[1])
    out3 = layer.forward((pair[0], pe_strided), cache.view, idx, vc)[0]
    assert ws.q is not None and torch.equal(ws.q[:2], torch.cat(pair, -1))
    assert torch.equal(out1, out3)


@pytest.mark.parametrize("kv_cache_dtype,head", [("fp8", 576), ("fp8_ds_mla", 576), ("nvfp4_ds_mla", 512),
                                                 ("bfloat16", 576)])
def test_k_scale(kv_cache_dtype, head):
    """k_scale scales the plain fp8 rows (written as value / k_scale); the other formats ignore it."""
    fmt, cache, ws, layer, idx, vc = _setup(kv_cache_dtype, head, 2048, 8, 64, [30, 4], k_scale=0.5)
    pair = query_pair(2, 8, fmt.rope_dim)
    out, lse = layer.forward(pair, cache.view, idx, vc, 0.5)
    ref_out, ref_lse = reference(cache, cat_query(pair, fmt.rope_dim), idx, vc, SCALE)
    assert_close(out, lse, ref_out, ref_lse, f"{fmt.id} k_scale 0.5")
    if fmt.name != "fp8":
        out1 = layer.forward(pair, cache.view, idx, vc, 1.0)[0]
        assert torch.equal(out, out1)


def test_functional_api_backend():
    """backend='reference' runs the call through sparsemla's functional API (float64) into the same buffers."""
    fmt, cache, ws, _, idx, vc = _setup("nvfp4_ds_mla", 576, 2176, 8, 64, [25, 0])
    layer = LayerAttention(ws, "nvfp4_ds_mla", 576, SCALE, backend="reference")
    pair = query_pair(2, 8, 64)
    out, lse = layer.forward(pair, cache.view, idx, vc, decode=False)
    assert out.data_ptr() == ws.out.data_ptr()
    ref_out, ref_lse = reference(cache, cat_query(pair, 64), idx, vc, SCALE)
    assert_close(out, lse, ref_out, ref_lse, "reference backend")


def test_vllm_row_bytes():
    table = {("fp8_ds_mla", 576): 656, ("fp8_ds_mla", 512): 656, ("nvfp4_ds_mla", 576): 352,
             ("nvfp4_ds_mla", 512): 352, ("auto", 576): 1152, ("bfloat16", 512): 1024, ("fp8", 576): 576,
             ("fp8_e4m3", 512): 512}
    for (name, head), size in table.items():
        assert vllm_row_bytes(name, head) == size
        assert resolve_format(name, head).bytes_per_token == size


@pytest.mark.parametrize("name,head,size,words", [
    ("nvfp4_ds_mla", 512, 288, "compact"),          # this library's own NoPE layout, not vLLM's
    ("fp8_ds_mla", 512, 528, "DSv4.1"),             # FlashMLA's MXFP8 record size
    ("nvfp4_ds_mla", 576, 416, "352"),              # a fork's other size for the name
    ("fp8_e5m2", 576, 576, "e5m2"),
    ("auto", 576, 1152, "model_dtype"),
])
def test_refused_formats_say_why(name, head, size, words):
    model_dtype = torch.float16 if name == "auto" else torch.bfloat16
    with pytest.raises(UnsupportedFormat) as exc:
        resolve_format(name, head, size, model_dtype)
    assert words in str(exc.value)


def test_cache_of_another_size_is_refused():
    """The format is checked against the tensor's actual row size, once per tensor."""
    fmt, cache, ws, layer, idx, vc = _setup("nvfp4_ds_mla", 512, 2048, 8, 64, [3])
    odd = torch.zeros(4, 64, 288, dtype=torch.uint8)
    with pytest.raises(ValueError, match="288"):
        layer.forward(query_pair(1, 8, 0), odd, idx, vc)


def test_bad_arguments_name_the_argument():
    fmt, cache, ws, layer, idx, vc = _setup("fp8_ds_mla", 576, 2048, 16, 64, [3, 4])
    pair = query_pair(2, 16, 64)
    with pytest.raises(ValueError, match="indices"):
        layer.forward(pair, cache.view, idx.to(torch.int64), vc)
    with pytest.raises(ValueError, match="indices"):
        layer.forward(pair, cache.view, torch.full((2, 4096), -1, dtype=torch.int32), vc)
    with pytest.raises(ValueError, match="valid_counts"):
        layer.forward(pair, cache.view, idx, vc[:1])
    with pytest.raises(ValueError, match=r"q\[1\]"):
        layer.forward((pair[0], pair[1][..., :32]), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q\[0\]"):
        layer.forward(query_pair(2, 8, 64), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q\[0\]"):
        layer.forward((pair[0].float(), pair[1]), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q\[1\]"):
        layer.forward((pair[0], pair[1].half()), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q\[0\]"):
        layer.forward((pair[0][:1], pair[1]), cache.view, idx, vc)
    with pytest.raises(ValueError, match="pair"):
        layer.forward((pair[0], pair[1], pair[1]), cache.view, idx, vc)
    with pytest.raises(ValueError, match="q:"):
        layer.forward(torch.cat(pair, -1)[..., :575], cache.view, idx, vc)
    with pytest.raises(ValueError, match="q:"):
        layer.forward(torch.cat(pair, -1).float(), cache.view, idx, vc)
    with pytest.raises(ValueError, match="max_tokens"):
        layer.forward(pair, cache.view, torch.full((9, 2048), -1, dtype=torch.int32),
                      torch.zeros(9, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_heads"):
        Workspace(fmt, 4, 129, 2048, "cpu")
    with pytest.raises(ValueError, match="head_size"):
        LayerAttention(ws, "fp8_ds_mla", 512, SCALE)


def test_workspace_prepare_plans_ahead():
    fmt = resolve_format("fp8_ds_mla", 576)
    ws = Workspace(fmt, 64, 16, 2048, "cpu")
    ws.prepare(0, 3, 64, 65)
    plan = ws.plan(3)
    assert plan is ws.plan(3)  # cached: the same object
    assert plan.num_splits >= 1 and ws.split.numel() >= 1
    assert "fp8_ds_mla" in repr(ws)


def test_workspace_reuses_views_and_plans_until_a_kernel_is_marked_unavailable():
    """A call looks its output views and plan up instead of slicing and planning again (host time), and a kernel
    that fails to build later is not planned from the cache."""
    from sparsemla import plan as P
    fmt = resolve_format("fp8_ds_mla", 576)
    ws = Workspace(fmt, 8, 16, 2048, "cpu")
    ws.facts = ((9, 0), 132, False)  # plan as for an H200 (planning is host-only): a Gluon kernel to lose
    out, lse = ws.views(3)
    assert ws.views(3)[0] is out and ws.views(3)[1] is lse
    assert out.shape == (3, 16, 512) and out.data_ptr() == ws.out.data_ptr() and lse.shape == (3, 16)
    p = ws.plan(3, True, True)
    assert ws.plan(3, True, True) is p and ws.plan(3, True, False) is not p
    assert p.kernel.startswith("sm90-")
    facts = ws.facts
    assert p == P.plan_attention(fmt, 3, 16, 2048, capability=facts[0], num_sms=facts[1], interpret=facts[2],
                                 q_aligned=True, kv_aligned=True, unavailable=P.unavailable_set())
    try:
        P.mark_unavailable(p.kernel, "a simulated build failure")
        p2 = ws.plan(3, True, True)
        assert p2.kernel != p.kernel and ws.plan(3, True, True) is p2
    finally:
        P.clear_unavailable()
