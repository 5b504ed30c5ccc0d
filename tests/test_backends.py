"""Backend registry, selection rules and reasons, and the functional API's argument checks (CPU)."""
import logging

import pytest
import torch

from sparsemla.attention import sparse_mla_decode, sparse_mla_prefill
from sparsemla.backends import (AttentionConfig, Backend, clear_selection_cache, get_backend, list_backends,
                                make_config, register, select)
from sparsemla.backends import registry
from sparsemla.cache import PagedKVCache
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
    assert names[:5] == ["triton", "triton-staged", "reference", "flashmla", "flashinfer"]
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
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = get_backend("triton").why_not(cfg(cap=None))
    assert "TRITON_INTERPRET" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
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
    with pytest.raises(exc, match=pattern):
        sparse_mla_decode(**_args(**over))


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
