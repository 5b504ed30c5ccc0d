"""Backend registry, selection rules and reasons, and the functional API's argument checks (CPU)."""
import logging

import pytest
import torch

from sparsemla.attention import sparse_mla_decode, sparse_mla_prefill
from sparsemla.backends import (AttentionConfig, Backend, clear_selection_cache, get_backend, list_backends,
                                make_config, register, select)
from sparsemla.backends import registry
from sparsemla.cache import PagedKVCache
from sparsemla.indices import convert_indices_torch
from sparsemla.formats import all_formats, get_format
from sparsemla.reference import sparse_mla

SM90, SM80, SM100 = (9, 0), (8, 0), (10, 0)


def cfg(fmt="fp8_ds_mla", mode="decode", heads=16, topk=2048, cap=SM90, **kw):
    dev = "cpu" if cap is None else "cuda"
    return AttentionConfig(mode, get_format(fmt), heads, topk, dev, cap, **kw)


@pytest.fixture(autouse=True)
def _fresh_selection():
    clear_selection_cache()
    yield
    clear_selection_cache()


def random_cache(fmt, num_blocks=4, block_size=64, stride=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(fmt, num_blocks, block_size, block_stride_rows=stride)
    n = cache.num_slots
    kv_c = torch.randn(n, 512, generator=g)
    k_pe = torch.randn(n, cache.fmt.rope_dim, generator=g) if cache.fmt.rope_dim else None
    # The format's PyTorch encoder (fast on CPU; cache writes have their own tests).
    slots = torch.randperm(n, generator=g)
    cache.rows[cache.slot_to_row(slots)] = cache.fmt.encode(kv_c, k_pe, 0.5 if cache.fmt.name == "fp8" else 1.0)
    return cache


def random_rows(cache, t, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, cache.num_slots, (t, k), generator=g)
    rows = cache.slot_to_row(slots).to(torch.int32)
    rows[torch.rand(t, k, generator=g) < 0.2] = -1
    return rows


# --------------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------------
def test_builtin_backends_listed_in_order():
    names = list(list_backends())
    assert names[:7] == ["triton", "triton-portable", "triton-staged", "reference", "flashmla", "flashinfer",
                         "triton-fp8qk"]
    assert list_backends()["reference"] is None  # always usable


def test_cpu_auto_selects_reference_for_every_format_and_mode():
    for fmt in all_formats():
        for mode in ("decode", "prefill"):
            assert select(cfg(fmt, mode, cap=None)).name == "reference"


def test_forced_backend_that_cannot_serve_quotes_its_reason():
    with pytest.raises(ValueError, match=r"backend 'flashmla' cannot serve .*runs on CUDA devices, not CPU"):
        select(cfg(cap=None), "flashmla")
    with pytest.raises(ValueError, match=r"compute capability >= 9\.0"):
        select(cfg(cap=SM80), "flashmla")


def test_unknown_backend_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'fastest'.*reference"):
        select(cfg(cap=None), "fastest")
    with pytest.raises(TypeError, match="backend"):
        get_backend(3)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    import sparsemla._device as d
    monkeypatch.setattr(d, "_INTERPRET", False)
    reason = get_backend("triton").why_not(cfg(cap=None))
    assert "TRITON_INTERPRET" in reason
    monkeypatch.setattr(d, "_INTERPRET", True)
    assert get_backend("triton").why_not(cfg(cap=None)) is None


def test_triton_declared_capabilities():
    t = get_backend("triton")
    assert t.why_not(cfg("fp8_ds_mla", cap=SM90)) is None
    assert t.why_not(cfg("nvfp4_ds_mla-nope", "prefill", heads=1, topk=2112, cap=SM90)) is None
    assert "8.9" in t.why_not(cfg("fp8_ds_mla", cap=SM80))       # no e4m3 conversions on Ampere
    assert t.why_not(cfg("bf16", cap=SM80)) is None
    assert "1..128 query heads" in t.why_not(cfg(heads=129))
    assert "up to 32768" in t.why_not(cfg(topk=32769))
    assert t.why_not(cfg(graph_capture=True)) is None


def test_triton_fp8qk_is_opt_in_and_declares_its_rules():
    f = get_backend("triton-fp8qk")
    assert "reads only fp8" in f.why_not(cfg("nvfp4_ds_mla"))
    assert "reads only fp8" in f.why_not(cfg("bf16"))
    assert "compute capability <= 9.0" in f.why_not(cfg(cap=SM100))
    assert ">= 9.0" in f.why_not(cfg(cap=SM80))
    assert "bf16 workspace" in f.why_not(cfg("fp8", "prefill", kv_source="workspace"))
    # never in a priority list: the default path stays the default
    for order in list(registry.PRIORITY.values()) + list(registry.FORMAT_PRIORITY.values()):
        assert "triton-fp8qk" not in order
    for fmt in ("fp8", "fp8_ds_mla", "fp8_ds_mla-nope"):
        assert select(cfg(fmt, cap=SM90)).name != "triton-fp8qk"


def test_reference_serves_everything_but_capture():
    r = get_backend("reference")
    assert r.why_not(cfg("nvfp4_ds_mla", "prefill", heads=128, topk=33000)) is None
    assert "CUDA graph" in r.why_not(cfg(graph_capture=True))


def test_flashmla_declared_rules():
    f = get_backend("flashmla")
    assert "fp8_ds_mla paged cache" in f.why_not(cfg("bf16", "decode"))
    assert "bf16 rows with RoPE" in f.why_not(cfg("fp8_ds_mla", "prefill"))
    assert "multiple of 64" in f.why_not(cfg("fp8_ds_mla", topk=2051))
    assert "compute capability <= 9.0" in f.why_not(cfg(cap=SM100))
    assert "CUDA graph" in f.why_not(cfg(graph_capture=True))
    # Everything declared holds: the answer is the probe's (flash_mla is not installed on CI machines).
    reason = f.why_not(cfg("fp8_ds_mla", heads=16))
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        assert "flash_mla" in reason and "sgl-flash-mla" in reason


def test_flashinfer_declared_rules():
    f = get_backend("flashinfer")
    assert "reads only bf16" in f.why_not(cfg("nvfp4_ds_mla"))
    assert "upper bounds" in f.why_not(cfg("bf16", exact_host_lengths=False))
    assert "SparseMLA runner" in f.why_not(cfg("bf16", graph_capture=True))
    assert "not importable" in f.why_not(cfg("bf16", graph_capture=True, runner=True)) or _has_flashinfer()


def _has_flashinfer():
    try:
        import flashinfer.mla  # noqa: F401
        return True
    except Exception:
        return False


class _Fake(Backend):
    def __init__(self, name, reason=None, **attrs):
        super().__init__()
        self.name = name
        self._reason = reason
        for k, v in attrs.items():
            setattr(self, k, v)

    def _probe(self, config):
        return self._reason

    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        raise AssertionError("not run")


def test_priority_walks_to_the_first_backend_that_serves(monkeypatch):
    register(_Fake("fake-down", reason="its library is missing"), replace_existing=True)
    register(_Fake("fake-narrow", formats=("bf16",)), replace_existing=True)
    register(_Fake("fake-any"), replace_existing=True)
    monkeypatch.setitem(registry.PRIORITY, "sm90", ("fake-down", "fake-narrow", "fake-any", "reference"))
    monkeypatch.setitem(registry.FORMAT_PRIORITY, ("sm90", "nvfp4_ds_mla"), ("fake-any",))
    for name in ("bf16", "fp8", "fp8_ds_mla"):
        monkeypatch.delitem(registry.FORMAT_PRIORITY, ("sm90", name), raising=False)
    clear_selection_cache()
    assert select(cfg("bf16")).name == "fake-narrow"
    assert select(cfg("fp8_ds_mla")).name == "fake-any"
    assert select(cfg("nvfp4_ds_mla")).name == "fake-any"
    with pytest.raises(ValueError, match="its library is missing"):
        select(cfg("bf16"), "fake-down")
    monkeypatch.setitem(registry.PRIORITY, "sm90", ("fake-down",))
    clear_selection_cache()
    with pytest.raises(ValueError, match=r"no backend serves .*fake-down: its library is missing"):
        select(cfg("fp8_ds_mla"))


def test_each_choice_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="sparsemla.backends")
    select(cfg(cap=None))
    select(cfg(cap=None))
    select(cfg("bf16", cap=None))
    msgs = [r.getMessage() for r in caplog.records if r.name == "sparsemla.backends"]
    assert len(msgs) == 2 and all("'reference'" in m for m in msgs)


def test_a_probe_that_raises_becomes_a_reason():
    class Broken(_Fake):
        def _probe(self, config):
            raise RuntimeError("driver exploded")
    b = Broken("fake-broken")
    assert "driver exploded" in b.why_not(cfg())


def test_make_config_reads_the_call():
    cache = PagedKVCache("nvfp4_ds_mla-nope", 1, 64)
    q = torch.zeros(2, 20, 512, dtype=torch.bfloat16)
    c = make_config("decode", q, cache, torch.zeros(2, 128, dtype=torch.int32))
    assert (c.fmt.id, c.num_heads, c.topk, c.device_type, c.kv_source) == ("nvfp4_ds_mla-nope", 20, 128, "cpu", "cache")
    ws = torch.zeros(10, 576, dtype=torch.bfloat16)
    c = make_config("prefill", torch.zeros(2, 20, 576, dtype=torch.bfloat16), ws, torch.zeros(2, 64, dtype=torch.int32))
    assert (c.fmt.id, c.kv_source) == ("bf16", "workspace")


# --------------------------------------------------------------------------------------------------------
# functional API: dispatch and argument checks
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla-nope", "fp8"])
def test_decode_matches_reference_and_ignores_entries_past_valid_counts(fmt):
    cache = random_cache(fmt, stride=80)
    t, h, k = 4, 5, 64
    q = torch.randn(t, h, cache.fmt.head_dim).bfloat16()
    idx = random_rows(cache, t, k)
    vc = torch.tensor([64, 17, 0, 40], dtype=torch.int32)
    garbage = idx.clone()
    garbage[1, 17:] = cache.num_rows + 5  # out of range, but past the valid count: never read
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16)
    o, l = sparse_mla_decode(q, cache, garbage, 0.07, vc, k_scale=0.5, out=out)
    assert o is out
    masked = idx.clone()
    masked[torch.arange(k)[None, :] >= vc[:, None]] = -1
    ro, rl = sparse_mla(q, cache, masked, 0.07, k_scale=0.5)
    assert torch.equal(o, ro) and torch.equal(l, rl)
    assert torch.all(o[2] == 0) and torch.all(l[2] == float("-inf"))


def test_prefill_on_cache_and_on_workspace():
    cache = random_cache("bf16")
    q = torch.randn(3, 16, 576).bfloat16()
    idx = random_rows(cache, 3, 64)
    o1, l1 = sparse_mla_prefill(q, cache, idx, 0.05)
    ws = cache.rows.view(torch.bfloat16)  # a bf16 cache's rows are a bf16 workspace
    o2, l2 = sparse_mla_prefill(q, ws, idx, 0.05)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_native_backend_dispatch_under_the_interpreter():
    """The triton backend's plumbing: a cache with k_scale, and a bf16 workspace passed as bf16 rows."""
    cache = random_cache("fp8", num_blocks=2)
    q = torch.randn(3, 16, 576).bfloat16()
    idx = random_rows(cache, 3, 64)
    vc = torch.tensor([64, 9, 0], dtype=torch.int32)
    o, l = sparse_mla_decode(q, cache, idx, 0.05, vc, k_scale=0.5, backend="triton")
    ro, rl = sparse_mla_decode(q, cache, idx, 0.05, vc, k_scale=0.5, backend="reference")
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2
    assert torch.allclose(l[:2], rl[:2], atol=1e-2) and torch.all(l[2] == float("-inf")) and torch.all(o[2] == 0)
    ws = torch.randn(100, 512).bfloat16()
    q = torch.randn(2, 16, 512).bfloat16()
    idx = torch.randint(-1, 100, (2, 64), dtype=torch.int32)
    o, l = sparse_mla_prefill(q, ws, idx, 0.05, backend="triton")
    ro, rl = sparse_mla_prefill(q, ws, idx, 0.05, backend="reference")
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2
    assert torch.allclose(l, rl, atol=1e-2)


def test_empty_batch_returns_empty_outputs():
    cache = random_cache("fp8_ds_mla")
    o, l = sparse_mla_decode(torch.zeros(0, 8, 576, dtype=torch.bfloat16), cache,
                             torch.zeros(0, 64, dtype=torch.int32), 0.1)
    assert o.shape == (0, 8, 512) and l.shape == (0, 8)


_SMALL_CACHE = None


@pytest.fixture(autouse=True, scope="module")
def _small_cache():
    global _SMALL_CACHE
    _SMALL_CACHE = random_cache("fp8_ds_mla", num_blocks=2)


def _args(cache=None, **over):
    cache = _SMALL_CACHE if cache is None else cache
    a = dict(q=torch.zeros(2, 16, 576, dtype=torch.bfloat16), cache=cache,
             indices=torch.zeros(2, 64, dtype=torch.int32), sm_scale=0.1)
    a.update(over)
    return a


@pytest.mark.parametrize("over, exc, pattern", [
    (dict(q=torch.zeros(2, 16, 576)), TypeError, r"q: expected dtype torch\.bfloat16"),
    (dict(q=torch.zeros(2, 16, 512, dtype=torch.bfloat16)), ValueError, r"q: expected shape \[T, H, 576\]"),
    (dict(q=torch.zeros(2, 129, 576, dtype=torch.bfloat16)), ValueError, r"q: expected 1\.\.128 heads"),
    (dict(q=torch.zeros(2, 0, 576, dtype=torch.bfloat16)), ValueError, r"q: expected 1\.\.128 heads"),
    (dict(q=torch.zeros(2, 576, 16, dtype=torch.bfloat16).transpose(1, 2)), ValueError, "q: the last dim"),
    (dict(cache=torch.zeros(4, 656, dtype=torch.uint8)), TypeError, "cache: expected a PagedKVCache"),
    (dict(indices=torch.zeros(2, 64, dtype=torch.int64)), TypeError, r"indices: expected dtype torch\.int32"),
    (dict(indices=torch.zeros(3, 64, dtype=torch.int32)), ValueError, r"indices: expected shape \[2, K\]"),
    (dict(indices=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "indices: expected at least one column"),
    (dict(indices=torch.zeros(64, 2, dtype=torch.int32).t()), ValueError, "indices: rows must be contiguous"),
    (dict(indices=torch.full((2, 64), -2, dtype=torch.int32)), ValueError, r"indices: entries must be -1"),
    (dict(indices=torch.full((2, 64), 128, dtype=torch.int32)), ValueError, r"indices: entries must be < 128"),
    (dict(valid_counts=torch.zeros(2, dtype=torch.int64)), TypeError, "valid_counts: expected dtype"),
    (dict(valid_counts=torch.zeros(3, dtype=torch.int32)), ValueError, r"valid_counts: expected shape \[2\]"),
    (dict(valid_counts=torch.full((2,), -1, dtype=torch.int32)), ValueError, "valid_counts: entries must be >= 0"),
    (dict(out=torch.zeros(2, 16, 512)), TypeError, "out: expected dtype"),
    (dict(out=torch.zeros(2, 16, 576, dtype=torch.bfloat16)), ValueError, r"out: expected shape \[2, 16, 512\]"),
    (dict(lse=torch.zeros(2, 16, dtype=torch.float64)), TypeError, "lse: expected dtype"),
    (dict(k_scale=float("nan")), ValueError, "k_scale"),
    (dict(k_scale=0.0), ValueError, "k_scale"),
    (dict(k_scale="1"), TypeError, "k_scale"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(backend="nope"), ValueError, "unknown backend 'nope'"),
])
def test_decode_argument_errors_name_the_argument(over, exc, pattern):
    # index values are checked only with the debug option (a device sync); everything else always
    with pytest.raises(exc, match=pattern):
        sparse_mla_decode(**_args(**over), check=True)


def test_index_values_are_not_read_by_default():
    """A default call reads nothing back from the device: out-of-range rows go unchecked (the debug option
    finds them); the kernels still never read past the cache for -1 or rows past the valid count."""
    a = _args(indices=torch.full((2, 64), -2, dtype=torch.int32), valid_counts=torch.zeros(2, dtype=torch.int32))
    o, l = sparse_mla_decode(**a)
    assert torch.all(l == float("-inf"))


def test_out_of_range_rows_past_the_valid_count_are_accepted():
    a = _args(indices=torch.full((2, 64), 10_000, dtype=torch.int32), valid_counts=torch.zeros(2, dtype=torch.int32))
    o, l = sparse_mla_decode(**a)
    assert torch.all(l == float("-inf"))


@pytest.mark.parametrize("kv, exc, pattern", [
    (torch.zeros(10, 576), TypeError, r"kv: expected dtype torch\.bfloat16"),
    (torch.zeros(10, 600, dtype=torch.bfloat16), ValueError, r"kv: expected a bf16 workspace \[rows, 576 or 512\]"),
    (torch.zeros(576, 10, dtype=torch.bfloat16).t(), ValueError, "kv: expected a contiguous tensor"),
    ([1, 2], TypeError, "kv: expected a PagedKVCache or a bf16"),
])
def test_prefill_workspace_errors(kv, exc, pattern):
    with pytest.raises(exc, match=pattern):
        sparse_mla_prefill(torch.zeros(2, 4, 576, dtype=torch.bfloat16), kv, torch.zeros(2, 64, dtype=torch.int32), 0.1)


def test_forced_backend_error_comes_from_the_functional_api():
    with pytest.raises(ValueError, match=r"backend 'flashinfer' cannot serve this call \(decode of fp8_ds_mla"):
        sparse_mla_decode(**_args(backend="flashinfer"))


# --------------------------------------------------------------------------------------------------------
# peers: the glue around FlashMLA and FlashInfer, exercised on CPU with stand-in libraries that follow their
# documented conventions (head counts 64/128, slot numbering, +inf lse for empty queries, base-2 lse, page
# tables).  The real libraries are checked against the native backend on the H200 (tests/gpu).
# --------------------------------------------------------------------------------------------------------
import math  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

from sparsemla.backends.peers.flashinfer import FlashInferPeer  # noqa: E402
from sparsemla.backends.peers.flashmla import FlashMLAPeer  # noqa: E402
from sparsemla.formats import get_format as _gf  # noqa: E402

LN2 = math.log(2.0)


def _attend(q, ws, idx, sm_scale):
    """(out float [T, H, 512], natural lse [T, H]) over float rows ``ws`` (reference math)."""
    return sparse_mla(q.float(), ws.float(), idx, sm_scale)


def _fake_flash_mla():
    mod = types.ModuleType("flash_mla")
    calls = []

    def get_mla_metadata(*args, **kwargs):
        return object(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                               indices=None, topk_length=None, kv_format=None, use_legacy=False):
        b, s_q, h, d = q.shape
        assert h in (64, 128) and is_fp8_kvcache and indices is not None and not causal and head_dim_v == 512
        assert indices.shape[-1] % 64 == 0
        calls.append(dict(use_legacy=use_legacy, kv_format=kv_format, h=h))
        fmt = _gf("fp8_ds_mla", 0 if kv_format == "V32_NO_ROPE" else 64)
        rows = k_cache.reshape(-1, k_cache.shape[-1])  # slot = page * page_size + offset
        ws = fmt.decode(rows)
        idx = indices.reshape(b * s_q, -1).clone()
        if topk_length is not None:
            idx[torch.arange(idx.shape[1])[None, :] >= topk_length[:, None]] = -1
        o, l = _attend(q.reshape(b * s_q, h, d), ws, idx, softmax_scale)
        l = torch.where(torch.isinf(l), torch.full_like(l, float("inf")), l)  # FlashMLA: +inf when empty
        return o.to(torch.bfloat16).view(b, s_q, h, 512), l.view(b, s_q, h).transpose(1, 2)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        s_q, h, d = q.shape
        assert h in (64, 128) and kv.dtype == torch.bfloat16 and kv.shape[1] == 1
        idx = indices[:, 0].clone()
        if topk_length is not None:
            idx[torch.arange(idx.shape[1])[None, :] >= topk_length[:, None]] = -1
        o, l = _attend(q, kv[:, 0], idx, sm_scale)
        l2 = torch.where(torch.isinf(l), torch.full_like(l, float("inf")), l / LN2)  # a base-2 lse build
        return o.to(torch.bfloat16), torch.zeros_like(l), l2

    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    mod.calls = calls
    return mod


class _CpuFlashMLA(FlashMLAPeer):
    name = "flashmla-cpu-standin"
    device_types = ("cuda", "cpu")

    def __init__(self):
        super().__init__()
        self._probe_device = "cpu"


@pytest.mark.parametrize("fmt, heads", [("fp8_ds_mla", 16), ("fp8_ds_mla", 100), ("fp8_ds_mla-nope", 64)])
def test_flashmla_glue_decode(monkeypatch, fmt, heads):
    fake = _fake_flash_mla()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    peer = _CpuFlashMLA()
    assert peer.why_not(cfg(fmt, heads=heads, topk=128, cap=None)) is None  # includes the tiny call
    cache = random_cache(fmt, num_blocks=3, stride=70)  # stride > block size: rows still equal slots
    q = torch.randn(5, heads, cache.fmt.head_dim).bfloat16()
    idx = random_rows(cache, 5, 128)
    vc = torch.tensor([128, 0, 50, 128, 1], dtype=torch.int32)
    o, l = peer.forward("decode", q, cache, idx, 0.06, vc, 1.0, None, None)
    masked = idx.clone()
    masked[torch.arange(128)[None, :] >= vc[:, None]] = -1
    ro, rl = sparse_mla(q, cache, masked, 0.06)
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2
    assert torch.allclose(l, rl, atol=1e-3, rtol=0) and l[1].eq(float("-inf")).all() and o[1].eq(0).all()
    assert fake.calls[-1]["h"] == (64 if heads <= 64 else 128)
    assert fake.calls[-1]["kv_format"] is None  # vLLM's NoPE rows are read as rope rows, q zero-padded


def test_flashmla_glue_prefill_learns_a_base2_lse(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla())
    peer = _CpuFlashMLA()
    assert peer.why_not(cfg("bf16", "prefill", heads=64, topk=64, cap=None, kv_source="workspace")) is None
    assert LN2 in peer._lse_scale.values()
    ws = torch.randn(300, 576).bfloat16()
    q = torch.randn(4, 64, 576).bfloat16()
    idx = torch.randint(-1, 300, (4, 64), dtype=torch.int32)
    o, l = peer.forward("prefill", q, ws, idx, 0.05, None, 1.0, None, None)
    ro, rl = sparse_mla(q, ws, idx, 0.05)
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2
    assert torch.allclose(l, rl, atol=1e-3, rtol=0)


def test_flashmla_probe_reports_a_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    assert "sgl-flash-mla" in _CpuFlashMLA().why_not(cfg(cap=None, topk=128))


def _fake_flashinfer():
    pkg, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")

    class BatchMLAPagedAttentionWrapper:
        def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                     kv_indices=None, kv_len_arr=None, backend="auto"):
            assert backend == "fa3"
            self.graph, self.kv_indices_buf = use_cuda_graph, kv_indices

        def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
                 page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
            assert page_size == 1 and not causal and head_dim_ckv == 512 and q_data_type == torch.bfloat16
            self.qo, self.kvp, self.lens = (x.cpu().tolist() for x in (qo_indptr, kv_indptr, kv_len_arr))
            if self.graph:  # graph mode: the kernel reads the buffer given at construction
                self.kv_indices_buf[: kv_indices.numel()].copy_(kv_indices)
            else:
                self.kv_indices_buf = kv_indices
            self.sm_scale, self.kv_dtype = sm_scale, kv_data_type

        def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
            assert ckv_cache.dtype == self.kv_dtype and q_nope.is_contiguous() and q_pe.is_contiguous()
            q = torch.cat([q_nope, q_pe], -1).double()
            for b in range(len(self.qo) - 1):
                a, e = self.qo[b], self.qo[b + 1]
                pages = self.kv_indices_buf[self.kvp[b]: self.kvp[b] + self.lens[b]].long()
                k = torch.cat([ckv_cache[pages, 0].double(), kpe_cache[pages, 0].double()], -1)
                s = torch.einsum("thd,nd->thn", q[a:e], k) * self.sm_scale
                l = torch.logsumexp(s, -1)
                out[a:e] = torch.einsum("thn,nd->thd", torch.softmax(s, -1), k[:, :512]).to(out.dtype)
                lse[a:e] = (l / LN2).float()  # a build without return_lse_base_on_e: base 2
            return (out, lse) if return_lse else out

    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    pkg.mla = mla
    return pkg, mla


class _CpuFlashInfer(FlashInferPeer):
    name = "flashinfer-cpu-standin"
    device_types = ("cuda", "cpu")

    def __init__(self):
        super().__init__()
        self._probe_device = "cpu"


@pytest.fixture
def fake_flashinfer(monkeypatch):
    pkg, mla = _fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr("sparsemla.backends.peers.flashinfer.FLOAT_WORKSPACE_BYTES", 1024)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-nope"])
def test_flashinfer_glue_functional(fake_flashinfer, fmt):
    peer = _CpuFlashInfer()
    assert peer.why_not(cfg(fmt, heads=8, topk=64, cap=None)) is None  # tiny call: learns the base-2 lse
    cache = random_cache(fmt, num_blocks=3)
    ks = 0.5 if fmt.startswith("fp8") else 1.0
    q = torch.randn(4, 8, cache.fmt.head_dim).bfloat16()
    idx = random_rows(cache, 4, 64)
    vc = torch.tensor([64, 0, 33, 7], dtype=torch.int32)
    o, l = peer.forward("decode", q, cache, idx, 0.06, vc, ks, None, None)
    masked = idx.clone()
    masked[torch.arange(64)[None, :] >= vc[:, None]] = -1
    ro, rl = sparse_mla(q, cache, masked, 0.06, k_scale=ks)
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 2e-2
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(l), fin) and torch.allclose(l[fin], rl[fin], atol=2e-2, rtol=0)
    assert o[1].eq(0).all()


def test_flashinfer_glue_in_the_runner(fake_flashinfer):
    from sparsemla.runner import BatchMetadata, SparseMLA

    peer = _CpuFlashInfer()
    cache = random_cache("bf16", num_blocks=6, block_size=16)
    runner = SparseMLA(8, 4, 8, 4, 576, 32, "bf16", backend=peer, block_size=16, sm_scale=0.07, device="cpu")
    assert runner.decode_backend is peer and runner.prefill_backend is peer
    md = BatchMetadata.from_lists([1, 1, 3], [40, 3, 20], [[5, 0, 2], [1], [3, 4]], block_size=16)
    g = torch.Generator().manual_seed(0)
    ctx = md.context_lens_host()
    topk = torch.full((6, 32), -1, dtype=torch.int32)
    for i, c in enumerate(ctx):
        topk[i, : min(c, 32)] = torch.randperm(c, generator=g)[:32].to(torch.int32)
    runner.plan(md, num_tokens_padded=6)
    q = torch.randn(6, 4, 576, generator=g).bfloat16()
    o, l = runner.run(q, cache, topk)
    rows = convert_indices_torch(topk[:5], md.req_id_per_token, md.block_table, 16)
    ro, rl = sparse_mla(q[:5], cache, rows, 0.07)
    assert ((o[:5].float() - ro.float()).norm() / ro.float().norm()).item() < 2e-2
    assert torch.allclose(l[:5], rl, atol=2e-2, rtol=0)
    assert o[5].eq(0).all() and l[5].eq(float("-inf")).all()
    dev_md = BatchMetadata.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, num_tokens=5,
                                        num_decode_tokens=2, num_decode_requests=2)
    with pytest.raises(ValueError, match="upper bounds"):
        runner.plan(dev_md, seq_lens_upper_bound=[41, 4, 21])
