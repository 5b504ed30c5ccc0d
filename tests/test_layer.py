"""DSAAttention layer, tiny DSA model, accuracy report (CPU, tiny shapes).

Most tests run the layer on its PyTorch paths (TRITON_INTERPRET=0: cache writes by the format encoders,
indexer scores by the float64 reference on the fp8 operands) because they are fast; one test runs the
Triton kernels (interpreter on CPU, real kernels on a GPU) and checks they give the same caches and
results.
"""
import pytest
import torch

from sparsemla.cache import PagedKVCache
from sparsemla.indices import pooled_valid_counts
from sparsemla.layer import (DSAAttention, DSAConfig, DSAMetadata, IndexKeyCache, init_dsa_weights_,
                             realistic_hidden)
from sparsemla.layer.accuracy import accuracy_report, format_table, rel_err
from sparsemla.layer.model import DSAModel, ModelConfig, generate, init_model_weights_, make_block_table
from sparsemla.reference.indexer import topk_overlap


@pytest.fixture
def torch_paths(monkeypatch):
    """Run the layer's PyTorch fallbacks instead of the Triton interpreter (fast)."""
    import sparsemla._device as d
    monkeypatch.setattr(d, "_INTERPRET", False)  # the library's view: CPU tensors then take the PyTorch paths


def make_layer(rope=True, kpool=1, dtype=torch.float32, seed=0, device="cpu", **kw):
    cfg = DSAConfig.tiny(rope, index_kpool=kpool, **kw)
    layer = DSAAttention(cfg, dtype=dtype, device=device, attn_backend="reference")
    return init_dsa_weights_(layer, torch.Generator().manual_seed(seed))


def setup_seq(layer, seq_len, block_size=8, seed=1, fmt=None, device="cpu"):
    c = layer.config
    gen = torch.Generator().manual_seed(seed)
    x = realistic_hidden(seq_len, c.hidden_size, gen).to(device=device, dtype=layer.wq_a.weight.dtype)
    bt, nb = make_block_table(1, seq_len, block_size, seed=seed, device=device)
    fmt = fmt or ("bf16" if c.qk_rope_head_dim else "bf16-nope")
    return x, bt, PagedKVCache(fmt, nb, block_size, device), IndexKeyCache(nb, block_size, device)


def test_config_checks():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DSAConfig(kv_lora_rank=256)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        DSAConfig(qk_rope_head_dim=32)
    with pytest.raises(ValueError, match="index_topk"):
        DSAConfig(index_topk=30, index_kpool=4)
    c = DSAConfig()
    assert (c.head_dim, c.index_n_heads, c.index_topk, c.index_rope_dim) == (576, 64, 2048, 64)
    assert abs(c.sm_scale - 192 ** -0.5) < 1e-15
    assert DSAConfig(qk_rope_head_dim=0).head_dim == 512


def test_metadata_slots_follow_the_block_table():
    bt = torch.tensor([[5, 2, 7], [0, 6, 1]], dtype=torch.int32)
    m = DSAMetadata.from_lists([3, 2], [7, 15], bt, 8)
    assert m.positions.tolist() == [7, 8, 9, 15, 16]
    assert m.req_id.tolist() == [0, 0, 0, 1, 1]
    assert m.context_lens.tolist() == [8, 9, 10, 16, 17]
    assert m.slot_mapping.tolist() == [5 * 8 + 7, 2 * 8 + 0, 2 * 8 + 1, 6 * 8 + 7, 1 * 8 + 0]
    assert m.max_context == 24 and not m.decode
    assert DSAMetadata.from_lists([1, 1], [3, 4], bt, 8).decode
    with pytest.raises(ValueError, match="start_positions"):
        DSAMetadata.from_lists([2], [23], bt, 8)


@pytest.mark.parametrize("rope", [True, False])
def test_weight_absorption_equals_plain_mla(rope):
    layer = make_layer(rope)
    x, *_ = setup_seq(layer, 24)
    qpos = torch.tensor([0, 9, 23])
    a, topk = layer.reference_forward(x, qpos)
    b, _ = layer.reference_forward(x, qpos, topk, absorbed=False)
    assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("rope,kpool", [(True, 1), (False, 1), (True, 4)])
def test_layer_matches_float64_reference(torch_paths, rope, kpool):
    layer = make_layer(rope, kpool)
    s = 40
    x, bt, kv, ic = setup_seq(layer, s)
    meta = DSAMetadata.from_lists([s], [0], bt, kv.block_size)
    with torch.no_grad():
        out, topk = layer(x, meta, kv, ic, return_indices=True)
    ctx = meta.context_lens
    k = layer.config.index_topk
    want = torch.minimum(ctx, torch.tensor(k)) if kpool == 1 else pooled_valid_counts(ctx, k, kpool)
    assert torch.equal((topk >= 0).sum(1).to(torch.int32), want)
    assert ((topk < ctx[:, None]) | (topk == -1)).all()  # causal
    ref, _ = layer.reference_forward(x, torch.arange(s), topk)
    assert rel_err(out, ref) < 2e-2  # bf16 query and bf16 cache against float64
    _, topk64 = layer.reference_forward(x, torch.arange(s))
    assert topk_overlap(topk, topk64).mean() > 0.9


def test_chunked_prefill_and_decode_match_one_prefill(torch_paths):
    layer = make_layer()
    s, n0 = 36, 28
    x, bt, kv, ic = setup_seq(layer, s)
    with torch.no_grad():
        full, topk_full = layer(x, DSAMetadata.from_lists([s], [0], bt, 8), kv, ic, return_indices=True)
        _, bt2, kv2, ic2 = setup_seq(layer, s, seed=2)  # other blocks, fresh caches
        layer(x[:12], DSAMetadata.from_lists([12], [0], bt2, 8), kv2, ic2)
        layer.write_cache(x[12:n0], DSAMetadata.from_lists([n0 - 12], [12], bt2, 8), kv2, ic2)
        outs, topks = [], []
        for p in range(n0, s):
            o, t = layer(x[p:p + 1], DSAMetadata.from_lists([1], [p], bt2, 8), kv2, ic2, return_indices=True)
            outs.append(o)
            topks.append(t)
    assert rel_err(torch.cat(outs), full[n0:]) < 1e-2
    assert topk_overlap(torch.cat(topks), topk_full[n0:]).mean() > 0.95


def test_kernel_path_matches_torch_path(device, monkeypatch):
    """Triton kernels (interpreter on CPU) write the same cache bytes and pick the same tokens as the
    PyTorch fallbacks."""
    layer = make_layer(seed=3)
    s = 24
    results = {}
    for mode, dev in (("torch", "cpu"), ("triton", device)):
        import sparsemla._device as d
        # CPU tensors take the PyTorch fallbacks when the library does not interpret its kernels
        monkeypatch.setattr(d, "_INTERPRET", mode != "torch" and dev == "cpu")
        lay = layer.to(dev)
        x, bt, kv, ic = setup_seq(lay, s, fmt="fp8_ds_mla", device=dev)
        with torch.no_grad():
            out, topk = lay(x, DSAMetadata.from_lists([s], [0], bt, 8), kv, ic, return_indices=True)
        results[mode] = (out.cpu(), topk.cpu(), kv.rows.cpu(), ic.data.cpu())
    (o1, t1, r1, i1), (o2, t2, r2, i2) = results["torch"], results["triton"]
    # Same inputs on the CPU: identical bytes.  On a GPU the float32 projections round a little differently,
    # which may move a rare value across an fp8 rounding boundary.
    allowed = 0.0 if device == "cpu" else 1e-3
    assert (i1 != i2).float().mean() <= allowed, "index-key cache bytes differ"
    assert (r1 != r2).float().mean() <= allowed, "KV cache bytes differ"
    assert topk_overlap(t2, t1).mean() > 0.97
    assert rel_err(o2, o1) < 2e-2


def test_forward_checks_arguments(torch_paths):
    layer = make_layer()
    x, bt, kv, ic = setup_seq(layer, 8)
    meta = DSAMetadata.from_lists([8], [0], bt, 8)
    with pytest.raises(ValueError, match="x"):
        layer(x[:, :16], meta, kv, ic)
    with pytest.raises(ValueError, match="meta"):
        layer(x[:4], meta, kv, ic)
    with pytest.raises(ValueError, match="kv_cache"):
        layer(x, meta, PagedKVCache("bf16-nope", kv.num_blocks, 8), ic)


def test_tiny_model_generates_deterministically(torch_paths):
    cfg = ModelConfig.tiny()
    model = init_model_weights_(DSAModel(cfg, dtype=torch.float32, attn_backend="reference"), seed=0)
    prompts = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(block_size=8, prefill_chunk=12)
    ref = generate(model, prompts, 4, "bf16", **kw)
    assert ref.tokens.shape == (2, 4) and (ref.margins >= 0).all()
    again = generate(model, prompts, 4, "bf16", force_tokens=ref.tokens, **kw)
    assert torch.equal(again.tokens, ref.tokens)
    other = generate(model, prompts, 4, "nvfp4_ds_mla", force_tokens=ref.tokens, **kw)
    assert other.tokens.shape == (2, 4)
    with pytest.raises(ValueError, match="fmt"):
        generate(model, prompts, 2, "bf16-nope", **kw)
    with pytest.raises(ValueError, match="cuda_graph"):
        generate(model, prompts, 2, "bf16", cuda_graph=True, **kw)


def test_accuracy_report_quick_rows(torch_paths):
    rows = accuracy_report(quick=True, device="cpu", formats=["bf16", "fp8_ds_mla"], context_len=40, num_eval=4,
                           prompt_len=16, gen_tokens=2, batch=1)
    assert [r["format"] for r in rows] == ["bf16", "fp8_ds_mla", "bf16-nope", "fp8_ds_mla-nope"]
    for r in rows:
        assert 0.0 <= r["topk_overlap_min"] <= r["topk_overlap"] <= 1.0
        assert 0.0 <= r["token_agreement"] <= 1.0
        assert r["topk_same_across_formats"]
        assert r["layer_err_vs_f64"] < 0.2
    assert rows[0]["layer_err_vs_bf16"] == 0.0 and rows[0]["token_agreement"] == 1.0
    assert 1e-4 < rows[1]["layer_err_vs_bf16"] < 0.2  # fp8 costs something, not everything
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "fp8_ds_mla-nope" in table
