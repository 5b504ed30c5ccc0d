"""The ``SPARSEMLA`` attention backend for vLLM 0.33: sparse MLA (DeepSeek-V3.2, GLM-5.x) on sparsemla's kernels.

A thin shell over :mod:`.contract`.  vLLM's sparse MLA layer does the rest as for its own sparse backends: it
writes the cache, runs the indexer, converts the top-k positions to rows of the flat cache view and counts the
valid entries (``SparseMLACommonImpl.forward_mqa``), then calls :meth:`SparseMLAImpl._forward_mqa_kernel`, which
hands those tensors to the contract unchanged.

Serves (:meth:`SparseMLABackend.supports_combination` gives the reason for everything else):
    model dtype bf16; MLA with kv_lora_rank 512 and RoPE 64 (head size 576) or NoPE (head size 512); sparse
    (the model has an indexer); 1..128 query heads per GPU, no padding;
    ``--kv-cache-dtype`` ``auto`` / ``bfloat16``, ``fp8`` / ``fp8_e4m3`` (per-tensor k_scale), ``fp8_ds_mla``
    (656 B), ``nvfp4_ds_mla`` (352 B), each at the row size vLLM gives it (checked against the spec and the
    tensor: a fork's other sizes are refused);
    compute capability 8.0 or newer (the fp8 formats 8.9 or newer: e4m3 conversions); Hopper (9.0) runs the
    warp-specialized kernels, other GPUs the portable Triton kernels;
    any block size and block stride (the kernels read flat rows; layouts that interleave the layers per block
    included);
    full CUDA graphs of uniform decode batches (``AttentionCGSupport.UNIFORM_BATCH``).
Refuses: other cache dtypes, fp16 models, decode / prefill context parallelism, HiSparse, sliding window,
ALiBi, logits soft cap, sinks.

CUDA graphs.  All device buffers of a call (outputs, the assembled query, split-KV partials) live in one
:class:`~.contract.Workspace` per attention shape, a persistent resource of vLLM's workspace manager (shared by
the layers, one per micro-batch), allocated when the first layer is built, so vLLM's memory profile counts it.
The kernel plan of a step is a host function of its token count alone (the valid counts stay on the device and
the kernel clamps them), so the metadata builder plans each step when it builds the metadata, outside capture; a
captured forward launches kernels only, with no allocation and no host sync.

Prefill.  Prefill tokens take the same kernel over the paged cache.  vLLM's dense-MHA prefill (short prompts)
stays on for bf16, fp8 and fp8_ds_mla with RoPE; it is turned off where it would gather the cache through a path
that does not read the format: nvfp4_ds_mla, and the NoPE rows of fp8_ds_mla (656 B rows, 512-dim workspace).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.workspace import current_workspace_manager

from ...formats import UnsupportedFormat
from . import BACKEND_NAME
from .contract import MAX_HEADS, LayerAttention, Workspace, resolve_format, vllm_row_bytes

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla")
_E4M3_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla")
MIN_CAPABILITY = (8, 0)
E4M3_CAPABILITY = (8, 9)
_HEAD_SIZES = {576: 64, 512: 0}


def _why_not_cache(kv_cache_dtype: Optional[str], head_size: int, dtype: torch.dtype,
                   capability: Optional[DeviceCapability]) -> Optional[str]:
    """The reason SPARSEMLA cannot read this cache on this GPU, or None."""
    name = kv_cache_dtype or "auto"
    if name not in KV_CACHE_DTYPES:
        try:
            resolve_format(name, head_size, None, dtype)
        except UnsupportedFormat as exc:
            return f"{BACKEND_NAME} cannot read a {name} cache ({exc})"
        return f"{BACKEND_NAME} reads {', '.join(KV_CACHE_DTYPES)} caches, not {name}"
    if dtype != torch.bfloat16:
        return f"{BACKEND_NAME} runs bfloat16 models (queries and outputs in bf16), not {dtype}"
    try:
        resolve_format(name, head_size, vllm_row_bytes(name, head_size, dtype), dtype)
    except UnsupportedFormat as exc:
        return f"{BACKEND_NAME} cannot read this cache: {exc}"
    if capability is not None:
        cap = (capability.major, capability.minor)
        if cap < MIN_CAPABILITY:
            return (f"{BACKEND_NAME}'s kernels need compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                    f"(bf16 tensor cores), this GPU is {cap[0]}.{cap[1]}")
        if name in _E4M3_DTYPES and cap < E4M3_CAPABILITY:
            return (f"{BACKEND_NAME} reads {name} rows with e4m3 conversions, which Triton has only on compute "
                    f"capability >= {E4M3_CAPABILITY[0]}.{E4M3_CAPABILITY[1]}; this GPU is {cap[0]}.{cap[1]}")
    return None


def _why_not_model(vllm_config: Optional[VllmConfig], head_size: int) -> Optional[str]:
    """The reason SPARSEMLA cannot serve the configured model, or None (no model configured: None)."""
    if vllm_config is None or vllm_config.model_config is None:
        return None
    hf = vllm_config.model_config.hf_text_config
    rank = getattr(hf, "kv_lora_rank", None)
    if rank != 512:
        return f"{BACKEND_NAME} needs kv_lora_rank 512 (the 512 latent dims of DeepSeek-V3.2 / GLM-5.x), got {rank}"
    rope = getattr(hf, "qk_rope_head_dim", None)
    if rope not in (64, 0):
        return f"{BACKEND_NAME} needs qk_rope_head_dim 64 or 0 (NoPE), got {rope}"
    if head_size in _HEAD_SIZES and _HEAD_SIZES[head_size] != rope:
        return f"{BACKEND_NAME}: head size {head_size} does not fit qk_rope_head_dim {rope} (512 + rope dims)"
    if getattr(hf, "index_topk", None) is None:
        return f"{BACKEND_NAME} serves sparse MLA models (with an indexer: index_topk), this model has none"
    heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
    if not 1 <= heads <= MAX_HEADS:
        return f"{BACKEND_NAME}'s kernels serve 1..{MAX_HEADS} query heads per GPU, this model has {heads}"
    attention_config = getattr(vllm_config, "attention_config", None)
    if attention_config is not None and getattr(attention_config, "hisparse_config", None) is not None:
        return f"{BACKEND_NAME} does not serve HiSparse (host-offloaded) caches"
    return None


class SparseMLABackend(AttentionBackend):
    """Sparse MLA on sparsemla's kernels (module docstring: what it serves)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type["SparseMLAMetadataBuilder"]:
        return SparseMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["SparseMLAImpl"]:
        return SparseMLAImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # The kernels read rows of the flat cache view, so any block size works.
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(_HEAD_SIZES)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype, block_size: Optional[int],
                             use_mla: bool, has_sink: bool, use_sparse: bool, use_mm_prefix: bool,
                             device_capability: DeviceCapability) -> Optional[str]:
        if not use_mla or not use_sparse:
            return f"{BACKEND_NAME} serves sparse MLA layers only"
        if head_size not in _HEAD_SIZES:
            return f"{BACKEND_NAME} serves head size 576 (512 latent + 64 RoPE) or 512 (NoPE), not {head_size}"
        reason = _why_not_cache(kv_cache_dtype, head_size, dtype, device_capability)
        if reason is None:
            reason = _why_not_model(get_current_vllm_config_or_none(), head_size)
        return reason

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Check the spec's row size against the format (a fork may give a dtype name another size), and keep
        blocks a whole number of rows apart (the kernels read the flat row view)."""
        name = getattr(spec, "cache_dtype_str", None) or "auto"
        try:
            resolve_format(name, spec.head_size, spec.state_content_size_bytes, spec.dtype)
        except UnsupportedFormat as exc:
            raise ValueError(f"{BACKEND_NAME}: the KV cache spec cannot be read: {exc}") from exc
        return align_blocks_to_rows(spec)


@dataclass
class SparseMLAMetadata(SparseMLACommonMetadata):
    """vLLM's sparse MLA metadata (request ids per token, block table, decode / prefill split)."""


class SparseMLAMetadataBuilder(SparseMLACommonMetadataBuilder[SparseMLAMetadata]):
    """vLLM's sparse MLA metadata, plus the step's kernel plans made on the host when the metadata is built."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    metadata_cls = SparseMLAMetadata

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first; a query of up to 1 + num_speculative_tokens tokens counts as a decode.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        impl = vllm_config.compilation_config.static_forward_context[layer_names[0]].impl
        if not isinstance(impl, SparseMLAImpl):
            raise TypeError(f"SparseMLAMetadataBuilder needs layers built with SparseMLAImpl, got {type(impl).__name__}")
        self._impl = impl

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparseMLAMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        # The kernel calls of this step take the decode tokens or all of them (MQA prefill).
        self._impl.workspace().prepare(metadata.num_decode_tokens, metadata.num_actual_tokens)
        return metadata


class SparseMLAImpl(SparseMLACommonImpl[SparseMLAMetadata]):
    """vLLM's sparse MLA impl whose kernel call is sparsemla's (:meth:`_forward_mqa_kernel`)."""

    # Context parallelism (prefill or decode) hands the kernel call other shapes (gathered heads, per-rank
    # shards, an lse for the merge) that no test here covers: refused through vLLM's own validation.
    supports_pcp: ClassVar[bool] = False
    supports_dcp: ClassVar[bool] = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, topk_indices_buffer: Optional[torch.Tensor] = None,
                 indexer=None, **mla_args) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not serve ALiBi, sliding window or logits soft cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} serves decoder self-attention only, not {attn_type}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, indexer=indexer,
                         topk_indices_buffer=topk_indices_buffer, **mla_args)
        buffer = self.topk_indices_buffer
        if buffer is None:
            raise ValueError(f"{BACKEND_NAME} needs the model's top-k index buffer (a sparse MLA model)")
        vllm_config = get_current_vllm_config()
        model_dtype = vllm_config.model_config.dtype if vllm_config.model_config is not None else torch.bfloat16
        self.supports_quant_query_input = False  # the kernels take a bf16 query
        self.fmt = resolve_format(kv_cache_dtype, head_size, None, model_dtype)
        if self.fmt.name == "nvfp4_ds_mla" or (self.fmt.name == "fp8_ds_mla" and not self.fmt.rope_dim):
            # vLLM's dense-MHA prefill would gather these rows through paths that do not read them.
            self.supports_dense_mha_prefill = False
        self._ws_key = ("sparsemla", self.fmt.id, num_heads, int(buffer.shape[0]), int(buffer.shape[1]),
                        str(buffer.device))
        self._manager = current_workspace_manager()
        self._layer = LayerAttention(self.workspace(), kv_cache_dtype, head_size, self.scale,
                                     model_dtype=model_dtype)

    def _new_workspace(self) -> Workspace:
        _, fmt_id, heads, max_tokens, topk, device = self._ws_key
        return Workspace(self.fmt, max_tokens, heads, topk, device)

    def workspace(self) -> Workspace:
        """The buffers of this attention shape for the current micro-batch (vLLM's workspace manager)."""
        return self._manager.get_persistent_resource(self._ws_key, self._new_workspace)

    def reserve_workspace(self) -> None:
        self.workspace()

    def _forward_mqa_kernel(self, q, kv_cache: torch.Tensor, topk_indices: torch.Tensor,
                            valid_counts: torch.Tensor, *, layer: AttentionLayer, block_size: int,
                            is_decode: bool):
        out, _ = self._layer.forward(q, kv_cache, topk_indices, valid_counts, layer._k_scale_float,
                                     decode=is_decode, workspace=self.workspace())
        return out, None


__all__ = ["SparseMLABackend", "SparseMLAMetadata", "SparseMLAMetadataBuilder", "SparseMLAImpl", "KV_CACHE_DTYPES"]
