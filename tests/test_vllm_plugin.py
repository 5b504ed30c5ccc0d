"""The SPARSEMLA vLLM backend inside vLLM 0.33 on the CPU (no GPU, no weights, no hub).

Needs vLLM installed (``scripts/ci_vllm.sh`` makes that venv); skipped otherwise.  vLLM's own Triton kernels (the
top-k conversion) and sparsemla's run under the Triton interpreter.  What is checked:
- the ``vllm.general_plugins`` entry point and an idempotent ``register()``;
- vLLM's backend validation (``validate_configuration``, and the platform's selection of a named backend) for
  every cache dtype x head size x compute capability, with the reason of each refusal;
- a ``VllmConfig`` built offline from tiny DeepSeek-V3.2-shaped configs;
- vLLM's MLA layer built on the backend, its KV cache spec, the metadata builder, and the impl's
  ``forward_mqa`` (vLLM converts the request-local top-k positions, sparsemla attends) on caches whose blocks
  interleave layers, with vLLM's query pair, top-k widths 2048 and 2176, against float64.
"""
import json
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    # vLLM on a machine without a GPU: the CPU platform, and vLLM's Triton kernels under the interpreter (an
    # empty CUDA_VISIBLE_DEVICES lets vllm.triton_utils keep the real Triton with no active driver).
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

vllm = pytest.importorskip("vllm")

from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.cache import KV_CACHE_DTYPES  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

import sparsemla.integrations.vllm as plugin  # noqa: E402
from sparsemla.integrations.vllm.testing import LayeredCache, assert_close, query_pair, reference  # noqa: E402

CAPS = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
SERVED = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla")
E4M3 = ("fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla")


def _model_dir(root: str, name: str, **overrides) -> str:
    """A DeepSeek-V3.2-shaped config.json (tiny: no weights are ever loaded)."""
    cfg = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 256,
           "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 4, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": 128,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048,
           "index_n_heads": 4, "index_head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "rope_theta": 10000, "tie_word_embeddings": False}
    cfg.update(overrides)
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _vllm_config(path: str, cache_dtype: str = "auto") -> VllmConfig:
    mc = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=64, cache_dtype=cache_dtype))


@pytest.fixture(scope="module")
def models():
    root = tempfile.mkdtemp(prefix="sparsemla-vllm-")
    return {"dsv32": _vllm_config(_model_dir(root, "dsv32")),
            "nope": _vllm_config(_model_dir(root, "nope", qk_rope_head_dim=0, qk_nope_head_dim=192)),
            "rank256": _vllm_config(_model_dir(root, "rank256", kv_lora_rank=256)),
            "dense": _vllm_config(_model_dir(root, "dense", index_topk=None))}


@pytest.fixture(scope="module")
def runtime(models):
    """One process-wide vLLM runtime on the CPU: a single-rank process group and the workspace manager."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    plugin.register()
    with set_current_vllm_config(models["dsv32"]):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            initialize_model_parallel(1, 1)
        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))
    return models


# --- entry point and registration ----------------------------------------------------------------------------
def test_entry_point():
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("sparsemla") == "sparsemla.integrations.vllm:register", (
        "install sparsemla (pip install -e '.[vllm]'): its vllm.general_plugins entry point is missing")


def test_register_is_idempotent():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    plugin.register()
    plugin.register()
    member = AttentionBackendEnum["SPARSEMLA"]
    from sparsemla.integrations.vllm.backend import SparseMLABackend
    assert member.get_class() is SparseMLABackend
    assert SparseMLABackend.get_name() == "SPARSEMLA"


def test_register_refuses_a_name_taken_by_another_class():
    from vllm.v1.attention.backends import registry

    plugin.register()
    member = AttentionBackendEnum["SPARSEMLA"]
    saved = registry._ATTN_OVERRIDES[member]
    registry._ATTN_OVERRIDES[member] = "other.package.Backend"
    try:
        with pytest.raises(RuntimeError, match="other.package.Backend"):
            plugin.register()
    finally:
        registry._ATTN_OVERRIDES[member] = saved


def _doc_commands():
    """The ``vllm serve`` lines of docs/serving-vllm.md (backslash continuations joined)."""
    import re

    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "serving-vllm.md")
    with open(path) as f:
        text = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [" ".join(b.replace("\\\n", " ").split()) for b in blocks if b.lstrip().startswith("vllm serve")]


def test_doc_command_lines_parse():
    """Every command line of the serving page is one vLLM's parser takes, and selects SPARSEMLA."""
    import shlex

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    commands = _doc_commands()
    assert len(commands) >= 4
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    for cmd in commands:
        args = parser.parse_args(shlex.split(cmd)[1:])
        backend = args.attention_backend
        assert backend is AttentionBackendEnum["SPARSEMLA"] or str(backend).upper() == "SPARSEMLA", (cmd, backend)
        assert args.kv_cache_dtype in ("fp8_ds_mla", "nvfp4_ds_mla", "auto", "fp8"), cmd
        assert args.tensor_parallel_size * args.data_parallel_size == 8, cmd


# --- vLLM's validation -----------------------------------------------------------------------------------------
def _validate(head, dtype, kv, cap, **flags):
    from sparsemla.integrations.vllm.backend import SparseMLABackend

    args = dict(head_size=head, dtype=dtype, kv_cache_dtype=kv, block_size=64, use_mla=True, has_sink=False,
                use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(*cap), attn_type="decoder")
    args.update(flags)
    return SparseMLABackend.validate_configuration(**args)


def _expected_ok(head, dtype, kv, cap):
    return (kv in SERVED and head in (576, 512) and dtype == torch.bfloat16 and cap >= (8, 0)
            and (kv not in E4M3 or cap >= (8, 9)))


def test_validation_every_combination():
    """Every (cache dtype, head size, capability, model dtype): served exactly when expected; every refusal
    carries a SPARSEMLA reason that names what is wrong."""
    refused = 0
    for kv in KV_CACHE_DTYPES:
        for head in (576, 512, 320):
            for cap in CAPS:
                for dtype in (torch.bfloat16, torch.float16):
                    reasons = _validate(head, dtype, kv, cap)
                    if _expected_ok(head, dtype, kv, cap):
                        assert reasons == [], (kv, head, cap, dtype, reasons)
                        continue
                    refused += 1
                    ours = [r for r in reasons if r.startswith("SPARSEMLA")]
                    assert ours, (kv, head, cap, dtype, reasons)
                    text = ours[0]
                    if head == 320:
                        assert "head size" in text
                    elif kv not in SERVED:
                        assert kv in text
                    elif dtype != torch.bfloat16:
                        assert "bfloat16" in text
                    elif cap < (8, 0):
                        assert "compute capability" in text
                    else:
                        assert "e4m3" in text and "8.9" in text
    assert refused > 0


def test_validation_of_vllm_features():
    """Features the backend does not serve are refused by vLLM's own hooks."""
    cap = (9, 0)
    assert "DCP not supported" in _validate(576, torch.bfloat16, "fp8_ds_mla", cap, use_dcp=True)
    assert "PCP not supported" in _validate(576, torch.bfloat16, "fp8_ds_mla", cap, use_pcp=True)
    assert "attention sinks not supported" in _validate(576, torch.bfloat16, "auto", cap, has_sink=True)
    assert "sliding window not supported" in _validate(576, torch.bfloat16, "auto", cap, has_sliding_window=True)
    assert "sparse not supported" not in _validate(576, torch.bfloat16, "auto", cap)
    assert "non-sparse not supported" in _validate(576, torch.bfloat16, "auto", cap, use_sparse=False)
    for bs in (1, 16, 64, 128, 256):
        assert _validate(576, torch.bfloat16, "nvfp4_ds_mla", cap, block_size=bs) == []


def test_named_backend_resolves_and_validates():
    """What vLLM's CUDA platform does for --attention-backend SPARSEMLA (its module needs libcuda, so the two steps
    are taken here): resolve the enum member to the class, then run its validate_configuration; on an H200."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    plugin.register()
    cls = AttentionBackendEnum["SPARSEMLA"].get_class()
    assert f"{cls.__module__}.{cls.__qualname__}" == plugin.BACKEND_PATH
    for kv in ("nvfp4_ds_mla", "fp8_ds_mla", "fp8", "auto"):
        assert _validate(576, torch.bfloat16, kv, (9, 0)) == []
    assert any(r.startswith("SPARSEMLA cannot read a fp8_e5m2 cache") and "e5m2" in r
               for r in _validate(576, torch.bfloat16, "fp8_e5m2", (9, 0)))
    # vLLM's own FlashMLA sparse backend serves nvfp4_ds_mla only on SM100: the gap this backend fills.
    reasons = FlashMLASparseBackend.validate_configuration(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype="nvfp4_ds_mla", block_size=64, use_mla=True,
        has_sink=False, use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0), attn_type="decoder")
    assert any("SM100" in r for r in reasons)


def test_validation_reads_the_model(runtime):
    """With a model configured, its geometry is checked too."""
    cap = (9, 0)
    with set_current_vllm_config(runtime["dsv32"]):
        assert _validate(576, torch.bfloat16, "nvfp4_ds_mla", cap) == []
        assert any("head size 512" in r for r in _validate(512, torch.bfloat16, "nvfp4_ds_mla", cap))
    with set_current_vllm_config(runtime["nope"]):
        assert _validate(512, torch.bfloat16, "fp8_ds_mla", cap) == []
    with set_current_vllm_config(runtime["rank256"]):
        assert any("kv_lora_rank 512" in r for r in _validate(576, torch.bfloat16, "auto", cap))
    with set_current_vllm_config(runtime["dense"]):
        assert any("index_topk" in r for r in _validate(576, torch.bfloat16, "auto", cap))


# --- the layer, the spec, the builder and the forward ---------------------------------------------------------
_LAYERS = iter(range(10_000))


def _layer(vc: VllmConfig, kv_cache_dtype: str, width: int, num_heads: int = 16):
    """vLLM's MLA layer on the SPARSEMLA backend (as the model builds it), with a top-k buffer ``width`` wide."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from sparsemla.integrations.vllm.backend import SparseMLABackend

    hf = vc.model_config.hf_text_config
    rope, nope = hf.qk_rope_head_dim, hf.qk_nope_head_dim
    n = next(_LAYERS)
    with set_current_vllm_config(vc):
        kv_b = ColumnParallelLinear(512, num_heads * (nope + 128), bias=False, prefix=f"layers.{n}.kv_b_proj")
        buf = torch.full((vc.scheduler_config.max_num_batched_tokens, width), -1, dtype=torch.int32)
        layer = MLAAttention(num_heads=num_heads, scale=0.0723, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                             v_head_dim=128, q_lora_rank=128, kv_lora_rank=512, kv_b_proj=kv_b,
                             cache_config=CacheConfig(block_size=64, cache_dtype=kv_cache_dtype),
                             prefix=f"model.layers.{n}.self_attn.attn", attn_backend=SparseMLABackend,
                             use_sparse=True, topk_indices_buffer=buf)
    # vLLM's index group converts on a side stream with events, which the CPU has not: convert per layer.
    layer.impl.group_conversion_decode_only = True
    return layer, buf


def _metadata(vc, layer, spec, query_lens, seq_lens, block_table):
    from sparsemla.integrations.vllm.backend import SparseMLAMetadataBuilder

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    t = int(qsl[-1])
    cam = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
                                  num_reqs=len(query_lens), num_actual_tokens=t, max_query_len=max(query_lens),
                                  max_seq_len=max(seq_lens), block_table_tensor=block_table,
                                  slot_mapping=torch.zeros(t, dtype=torch.int64), seq_lens_cpu_upper_bound=seq.clone())
    with set_current_vllm_config(vc):
        builder = SparseMLAMetadataBuilder(spec, [layer.layer_name], vc, torch.device("cpu"))
        assert builder.get_cudagraph_support(vc, spec) == AttentionCGSupport.UNIFORM_BATCH
        return builder, builder.build(0, cam)


# (model, cache dtype, top-k buffer width, query lengths of the requests (1 = decode), counts cap)
FORWARD = [
    ("dsv32", "fp8_ds_mla", 2048, [1, 1, 1], 48),
    ("dsv32", "nvfp4_ds_mla", 2176, [1, 1], 40),
    ("dsv32", "auto", 2048, [1, 3], 24),
    ("dsv32", "fp8", 2176, [1, 1], 32),
    ("nope", "fp8_ds_mla", 2176, [1, 1], 40),
    ("nope", "nvfp4_ds_mla", 2048, [1, 2], 30),
    ("nope", "bfloat16", 2048, [1, 1], 20),
]


@pytest.mark.parametrize("model,kv_cache_dtype,width,query_lens,cap", FORWARD,
                         ids=[f"{m}-{k}-k{w}-q{'_'.join(map(str, q))}" for m, k, w, q, _ in FORWARD])
def test_layer_forward(runtime, model, kv_cache_dtype, width, query_lens, cap):
    from sparsemla.integrations.vllm.backend import SparseMLABackend

    vc = runtime[model]
    layer, buf = _layer(vc, kv_cache_dtype, width)
    impl = layer.impl
    fmt = impl.fmt
    spec = SparseMLABackend.customize_spec(layer.get_kv_cache_spec(vc))
    assert spec.state_content_size_bytes == fmt.bytes_per_token
    assert impl.supports_dense_mha_prefill == (fmt.name != "nvfp4_ds_mla"
                                               and not (fmt.name == "fp8_ds_mla" and not fmt.rope_dim))
    k_scale = 0.5 if fmt.name == "fp8" else 1.0
    layer._k_scale_float = k_scale
    # the block size vLLM's configuration holds (its CPU platform sets 16 for every MLA model, whatever was asked)
    block_size = vc.cache_config.block_size
    seq_lens = [70 + 45 * i for i in range(len(query_lens))]
    width_blocks = -(-max(seq_lens) // block_size)
    num_blocks = width_blocks * len(query_lens) + 1
    cache = LayeredCache(fmt, kv_cache_dtype, num_blocks, block_size, num_layers=3, layer=2, k_scale=k_scale)
    gen = torch.Generator().manual_seed(3)
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:width_blocks]
                               for _ in query_lens]).to(torch.int32)
    builder, md = _metadata(vc, layer, spec, query_lens, seq_lens, block_table)
    decode = all(q == 1 for q in query_lens)
    assert md.num_decode_tokens == (sum(query_lens) if decode else sum(1 for q in query_lens if q == 1))
    # request-local top-k positions per query token (causal: within its context), -1 padded
    t = sum(query_lens)
    req_of, ctx_of = [], []
    for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for j in range(ql):
            req_of.append(r)
            ctx_of.append(sl - ql + j + 1)
    counts = [min(cap, c) - (i % 2) * 3 for i, c in enumerate(ctx_of)]
    buf[:t].fill_(-1)
    for i, (c, ctx) in enumerate(zip(counts, ctx_of)):
        buf[i, :c] = torch.randperm(ctx, generator=gen)[:c].to(torch.int32)
    pair = query_pair(t, 16, fmt.rope_dim)
    with set_current_vllm_config(vc):
        out, lse = impl.forward_mqa(pair, cache.view, md, layer)
    assert lse is None and out.shape == (t, 16, 512)
    # float64: the same positions mapped through the block table to rows of the layer's flat view
    rows = torch.full((t, width), -1, dtype=torch.int32)
    for i in range(t):
        pos = buf[i, :counts[i]].long()
        slots = block_table[req_of[i], pos // block_size].long() * block_size + pos % block_size
        rows[i, :counts[i]] = cache.slot_rows(slots).to(torch.int32)
    q = pair[0] if not fmt.rope_dim else torch.cat(pair, -1)
    ref_out, ref_lse = reference(cache, q, rows, torch.tensor(counts), impl.scale)
    assert_close(out, impl.workspace().lse[:t], ref_out, ref_lse, f"{fmt.id} through vLLM's forward_mqa")


def test_layers_share_one_workspace(runtime):
    vc = runtime["dsv32"]
    a, _ = _layer(vc, "nvfp4_ds_mla", 2048)
    b, _ = _layer(vc, "nvfp4_ds_mla", 2048)
    c, _ = _layer(vc, "fp8_ds_mla", 2048)
    assert a.impl.workspace() is b.impl.workspace()
    assert a.impl.workspace() is not c.impl.workspace()
    ws = a.impl.workspace()
    assert ws.max_tokens == vc.scheduler_config.max_num_batched_tokens and ws.topk == 2048


def test_spec_of_another_row_size_is_refused(runtime):
    """A fork that gives nvfp4_ds_mla another row size gets a reason, not a misread cache."""
    import dataclasses

    from sparsemla.integrations.vllm.backend import SparseMLABackend

    layer, _ = _layer(runtime["nope"], "nvfp4_ds_mla", 2048)
    spec = layer.get_kv_cache_spec(runtime["nope"])
    assert spec.state_content_size_bytes == 352
    fork = dataclasses.replace(spec, state_content_bytes=288)
    with pytest.raises(ValueError, match="288"):
        SparseMLABackend.customize_spec(fork)
