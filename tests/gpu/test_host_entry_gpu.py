"""The compiled host entry (``sparsemla.host_entry``) on the GPU: it builds, a configuration is recorded at its first
call, and a replayed call gives the Python path's outputs bit for bit (the same kernels with the same arguments)
for every kernel the plans choose, with and without valid counts, given or allocated outputs, splits merged by the
combine kernel; calls it must not replay (capture, another stream, a launch hook) take the Python path."""
import os
import sys

import pytest
import torch

import sparsemla.attention as A
from sparsemla import host_entry, sparse_mla_decode, sparse_mla_prefill
from sparsemla.kernels import attention as KA

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import make_case  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module():
    m = host_entry.build()
    assert m is not None, host_entry.status()
    return m


@pytest.fixture
def counted(monkeypatch, module):
    """The Python path's calls, counted."""
    calls = []
    real = A._call
    monkeypatch.setattr(A, "_call", lambda *a: calls.append(a[0]) or real(*a))
    module.clear()
    return calls


# (format, tokens, heads, top-k): the plans' kernels at these shapes: the few-head kernel with splits (b 1), the
# conversion kernels (64 / 128 heads), bf16 rows above 32 heads, an odd head count, NoPE rows, plain fp8 with k_scale
CASES = [("fp8_ds_mla", 1, 16, 512), ("fp8_ds_mla", 40, 16, 256), ("fp8_ds_mla", 3, 64, 256),
         ("nvfp4_ds_mla", 2, 128, 256), ("bf16", 2, 64, 256), ("fp8", 5, 33, 256), ("fp8_ds_mla-nope", 2, 48, 128),
         ("bf16", 1, 16, 2048)]


def _python(q, cache, idx, scale, fn=sparse_mla_decode, **kw):
    """The same call on the Python path (the entry bypassed)."""
    saved = host_entry.call
    host_entry.call = host_entry._no_entry
    try:
        return fn(q, cache, idx, scale, **kw)
    finally:
        host_entry.call = saved


@pytest.mark.parametrize("fmt,t,h,k", CASES)
@pytest.mark.parametrize("vc,given", [(False, False), (True, True)])
def test_a_replayed_call_gives_the_python_paths_outputs(counted, module, fmt, t, h, k, vc, given):
    c = make_case(fmt, t, h, k, device="cuda", k_scale=0.75 if fmt == "fp8" else 1.0)
    cache, q, idx = c["cache"], c["q"], c["indices"]
    if not vc:  # (the case holds rows past a valid count that are not rows of the cache)
        idx = torch.where(idx >= cache.num_rows, -1, idx)
    kw = dict(valid_counts=c["valid_counts"] if vc else None, k_scale=0.75 if fmt == "fp8" else 1.0)

    def outs():
        if not given:
            return {}
        return dict(out=torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda"),
                    lse=torch.full((t, h), float("nan"), device="cuda"))
    _python(q, cache, idx, 0.07, **kw, **outs())  # compiles the kernels (a launch through Triton is not recorded)
    counted.clear()
    sparse_mla_decode(q, cache, idx, 0.07, **kw, **outs())  # recorded
    assert counted == ["decode"] and module.size() == 1, host_entry.status()
    q2 = torch.randn_like(q.float()).mul(3).to(torch.bfloat16)  # new tensors of the configuration
    o = outs()
    out, lse = sparse_mla_decode(q2, cache, idx.clone(), 0.05, **kw, **o)
    assert counted == ["decode"], "not replayed"
    if given:
        assert out is o["out"] and lse is o["lse"]
    ref_out, ref_lse = _python(q2, cache, idx.clone(), 0.05, **kw, **outs())
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(lse.nan_to_num(), ref_lse.nan_to_num())
    assert torch.isfinite(out).all()


def test_prefill_over_a_cache_is_replayed(counted, module):
    c = make_case("fp8_ds_mla", 64, 16, 256, device="cuda")
    args = (c["q"], c["cache"], c["indices"], 0.1)
    a = _python(*args, fn=sparse_mla_prefill, valid_counts=c["valid_counts"])  # compiles
    counted.clear()
    sparse_mla_prefill(*args, valid_counts=c["valid_counts"])  # recorded
    b = sparse_mla_prefill(*args, valid_counts=c["valid_counts"])  # replayed
    torch.cuda.synchronize()
    assert counted == ["prefill"] and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_capture_another_stream_and_a_launch_hook_take_the_python_path(counted, module):
    from triton import knobs
    c = make_case("fp8_ds_mla", 1, 16, 256, device="cuda")  # (one token: every index a row of the cache)
    args = (c["q"], c["cache"], c["indices"], 0.1)
    ref = _python(*args)  # compiles
    counted.clear()
    sparse_mla_decode(*args)  # recorded
    sparse_mla_decode(*args)  # replayed
    assert counted == ["decode"]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        sparse_mla_decode(*args)  # another stream: recorded for it
        sparse_mla_decode(*args)
    torch.cuda.synchronize()
    assert counted == ["decode"] * 2 and module.size() == 2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        sparse_mla_decode(*args)
        with torch.cuda.graph(g, stream=s):
            out, lse = sparse_mla_decode(*args)
    assert counted == ["decode"] * 3  # captured through Python (per-call partials, never the cached scratch)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref[0])
    seen = []
    knobs.runtime.launch_enter_hook.add(lambda *a: seen.append(1))
    try:
        sparse_mla_decode(*args)
    finally:
        knobs.runtime.launch_enter_hook.remove(knobs.runtime.launch_enter_hook.calls[-1])
    assert counted == ["decode"] * 4 and seen


def test_the_custom_op_never_replays_through_the_cached_scratch(counted, module):
    c = make_case("fp8_ds_mla", 1, 16, 256, device="cuda")
    with KA.per_call_partials():
        sparse_mla_decode(c["q"], c["cache"], c["indices"], 0.1)
        sparse_mla_decode(c["q"], c["cache"], c["indices"], 0.1)
    assert counted == ["decode"] * 2 and module.size() == 0


def test_a_runners_later_layers_give_the_python_paths_outputs(module):
    """Two layers of a decode, a prefill and a mixed step: the second replayed, bit for bit the Python path's."""
    from sparsemla import PagedKVCache, SparseMLA
    from sparsemla.runner import BatchMetadata
    gen = torch.Generator(device="cuda").manual_seed(5)
    for lens in ([1] * 6, [40, 90], [1, 1, 1, 1, 40, 90]):
        caches = []
        for _ in range(2):
            c = PagedKVCache("fp8_ds_mla", 64, 64, "cuda")
            n = c.num_slots
            c.write(torch.randn(n, 512, generator=gen, device="cuda").to(torch.bfloat16),
                    torch.randn(n, 64, generator=gen, device="cuda").to(torch.bfloat16),
                    torch.arange(n, dtype=torch.int32, device="cuda"))
            caches.append(c)
        r = len(lens)
        ctx = [300 + 17 * i for i in range(r)]
        table = torch.randperm(64, generator=gen, device="cuda")[:r * 8].view(r, 8).to(torch.int32)
        md = BatchMetadata.from_lists(lens, ctx, table.tolist(), device="cuda")
        runner = SparseMLA(sum(lens), r, 8, 64, 576, 256, "fp8_ds_mla", sm_scale=0.07, device="cuda")
        runner.plan(md)
        t = sum(lens)
        topk = torch.randint(0, 300, (t, 256), generator=gen, device="cuda", dtype=torch.int32)
        q = torch.randn(t, 64, 576, generator=gen, device="cuda").to(torch.bfloat16)
        runner._run(q, caches[0], topk, 1.0, None, None, None)  # compiles
        module.clear()
        runner.run(q, caches[0], topk)  # recorded
        assert module.size() == 1, host_entry.status()
        out, lse = (x.clone() for x in runner.run(q, caches[1], topk, 0.5))  # replayed
        ref = runner._run(q, caches[1], topk, 0.5, None, None, None)
        torch.cuda.synchronize()
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), lens


@pytest.mark.parametrize("fmt_name,head,heads,counts", [("fp8_ds_mla", 576, 16, [37, 0, 130]),
                                                        ("fp8_ds_mla", 576, 64, [2048]),
                                                        ("nvfp4_ds_mla", 576, 128, [300, 2]),
                                                        ("fp8", 576, 33, [90, 5]),
                                                        ("bfloat16", 512, 64, [64, 7])])
def test_a_vllm_layers_replayed_call_gives_the_python_paths_outputs(module, fmt_name, head, heads, counts):
    """Two layers of one cache tensor (vLLM's layout), the second replayed, bit for bit the Python path's."""
    from sparsemla.integrations.vllm import contract
    from sparsemla.integrations.vllm.contract import LayerAttention, Workspace, resolve_format
    from sparsemla.integrations.vllm.testing import LayeredCache, query_pair, topk_rows
    fmt = resolve_format(fmt_name, head)
    first = LayeredCache(fmt, fmt_name, 40, 64, layer=0, seed=0, device="cuda")
    second = LayeredCache(fmt, fmt_name, 40, 64, layer=1, seed=1, storage=first.storage, device="cuda")
    ws = Workspace(fmt, 8, heads, 2048, "cuda")
    layers = [LayerAttention(ws, fmt_name, head, 0.07), LayerAttention(ws, fmt_name, head, 0.09)]
    t = len(counts)
    pair = tuple(x.cuda() for x in query_pair(t, heads, fmt.rope_dim, seed=4)) if fmt.rope_dim else None
    q = pair if pair is not None else torch.randn(t, heads, head, device="cuda").to(torch.bfloat16)
    idx, vc = (x.cuda() for x in topk_rows(first, counts, 2048, seed=3))
    layers[0].forward(q, first.view, idx, vc, 1.0)  # compiles
    module.clear()
    layers[0].forward(q, first.view, idx, vc, 1.0)  # recorded
    assert module.size() == 1, host_entry.status()
    seen = []
    real = contract._launch
    contract._launch = lambda *a: seen.append(1) or real(*a)
    try:
        out, lse = (x.clone() for x in layers[1].forward(q, second.view, idx, vc, 0.5))  # replayed
        assert not seen, "not replayed"
        module.clear()
        ref = [x.clone() for x in layers[1].forward(q, second.view, idx, vc, 0.5)]
        assert seen
    finally:
        contract._launch = real
    torch.cuda.synchronize()
    assert torch.equal(out, ref[0]) and torch.equal(lse.nan_to_num(), ref[1].nan_to_num())
    assert torch.isfinite(out).all()
