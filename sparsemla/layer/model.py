"""A small random-weight DSA language model and a greedy decode loop over paged caches.

The model is the end-to-end test of the library (and the engine behind ``demo``): embeddings, a few
pre-norm blocks of ``DSAAttention`` + SwiGLU MLP, a final norm and an LM head.  Its weights are
random but drawn to give realistic activation statistics (Student-t embeddings, norm weights with
outlier channels), so the KV formats see the kind of values they would in a real model.

Each layer has its own :class:`~sparsemla.cache.PagedKVCache` (any format) and
:class:`~sparsemla.layer.indexer.IndexKeyCache`; all layers share one block table.  ``generate``
prefills the prompts in chunks and then decodes one token per request per step, optionally replaying
a CUDA graph of the decode step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn

from .._validate import check_positive_int, check_tensor
from ..cache import PagedKVCache
from ..formats import get_format
from .dsa import DSAAttention, DSAConfig, DSAMetadata, channel_gains, init_dsa_weights_, student_t
from .indexer import IndexKeyCache
from .rope import RMSNorm


@dataclass
class ModelConfig:
    """A small DSA language model.  ``attn`` is the geometry of every attention layer."""

    vocab_size: int = 4096
    num_layers: int = 4
    intermediate_size: int = 2048
    attn: DSAConfig = field(default_factory=lambda: DSAConfig(
        hidden_size=1024, num_heads=16, q_lora_rank=512, index_n_heads=16, index_topk=2048))
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "intermediate_size"):
            check_positive_int(name, getattr(self, name))

    @property
    def hidden_size(self) -> int:
        return self.attn.hidden_size

    @classmethod
    def tiny(cls, rope: bool = True, **attn_kw) -> "ModelConfig":
        """CPU-test size: 2 layers, width 128, vocab 256, top-k 16."""
        return cls(vocab_size=256, num_layers=2, intermediate_size=256, attn=DSAConfig.tiny(rope, **attn_kw))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype=None, device=None):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(g) * u)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, dtype=None, device=None, attn_backend="auto"):
        super().__init__()
        h = config.hidden_size
        self.attn_norm = RMSNorm(h, config.norm_eps, dtype=dtype, device=device)
        self.attn = DSAAttention(config.attn, dtype=dtype, device=device, attn_backend=attn_backend)
        self.mlp_norm = RMSNorm(h, config.norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(h, config.intermediate_size, dtype, device)


class ModelCaches:
    """One KV cache (format ``fmt``) and one index-key cache per layer, ``num_blocks`` blocks each."""

    def __init__(self, config: ModelConfig, fmt, num_blocks: int, block_size: int = 64, device=None):
        self.fmt = get_format(fmt)
        if self.fmt.head_dim != config.attn.head_dim:
            raise ValueError(f"fmt: {self.fmt.id} rows have head_dim {self.fmt.head_dim}, the model needs "
                             f"{config.attn.head_dim} (rope {config.attn.qk_rope_head_dim})")
        self.block_size = block_size
        self.kv: List[PagedKVCache] = [PagedKVCache(self.fmt, num_blocks, block_size, device)
                                       for _ in range(config.num_layers)]
        self.index: List[IndexKeyCache] = [IndexKeyCache(num_blocks, block_size, device)
                                           for _ in range(config.num_layers)]


class DSAModel(nn.Module):
    """Embedding -> ``num_layers`` x (x + attn(norm x); x + mlp(norm x)) -> norm -> LM head."""

    def __init__(self, config: Optional[ModelConfig] = None, *, dtype=torch.bfloat16, device=None,
                 attn_backend="auto"):
        super().__init__()
        c = self.config = config if config is not None else ModelConfig()
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList([Block(c, dtype, device, attn_backend) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype=dtype, device=device)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor, meta: DSAMetadata, caches: ModelCaches, *,
                k_scale: float = 1.0) -> torch.Tensor:
        """tokens int64 ``[T]`` (laid out as ``meta``) -> float32 logits ``[T, vocab]``."""
        h = self.embed(tokens)
        for i, blk in enumerate(self.layers):
            h = h + blk.attn(blk.attn_norm(h), meta, caches.kv[i], caches.index[i], k_scale=k_scale)
            h = h + blk.mlp(blk.mlp_norm(h))
        return self.lm_head(self.norm(h)).float()


@torch.no_grad()
def init_model_weights_(model: DSAModel, seed: int = 0, *, logit_gain: float = 4.0) -> DSAModel:
    """Random weights with realistic activation statistics (drawn on the CPU from ``seed``).

    Embeddings are Student-t (df 4) rows times per-channel gains with outlier channels; every norm
    weight has outlier channels; attention layers use :func:`init_dsa_weights_`; residual branches
    are scaled by ``(2 * num_layers) ** -0.5``; the LM head gives logits with a spread of about
    ``logit_gain`` so the greedy choice has realistic margins."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    h = c.hidden_size
    emb = student_t((c.vocab_size, h), 4, gen)
    emb = emb / emb.pow(2).mean(-1, keepdim=True).sqrt() * channel_gains(h, gen, sigma=0.2)
    model.embed.weight.copy_(emb)
    res = (2 * c.num_layers) ** -0.5
    for blk in model.layers:
        blk.attn_norm.weight.copy_(channel_gains(h, gen, sigma=0.2))
        blk.mlp_norm.weight.copy_(channel_gains(h, gen, sigma=0.2))
        init_dsa_weights_(blk.attn, gen)
        blk.attn.wo.weight.mul_(res)
        blk.mlp.gate_up.weight.copy_(torch.randn(blk.mlp.gate_up.weight.shape, generator=gen) / math.sqrt(h))
        d = blk.mlp.down
        d.weight.copy_(torch.randn(d.weight.shape, generator=gen) * (res / math.sqrt(d.in_features)))
    model.norm.weight.copy_(channel_gains(h, gen, sigma=0.1, outlier_frac=0.0))
    model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) * (logit_gain / math.sqrt(h)))
    return model


@dataclass
class GenerateResult:
    """Greedy predictions ``tokens`` int64 ``[R, N]`` (prediction ``i`` follows prompt + ``i`` inputs) and
    ``margins`` float32 ``[R, N]`` (top-1 minus top-2 logit: how close each choice was)."""

    tokens: torch.Tensor
    margins: torch.Tensor


def _top2_margin(logits: torch.Tensor):
    top = logits.topk(2, dim=-1).values
    return logits.argmax(dim=-1), top[:, 0] - top[:, 1]


def make_block_table(num_requests: int, max_len: int, block_size: int, *, seed: int = 0, device=None):
    """A shuffled block table ``[R, ceil(max_len / block_size)]`` over ``R * that`` blocks (int32)."""
    nblk = -(-max_len // block_size)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_requests * nblk, generator=gen).to(torch.int32)
    return perm.view(num_requests, nblk).to(device), num_requests * nblk


@torch.no_grad()
def generate(model: DSAModel, prompts: torch.Tensor, max_new_tokens: int, fmt="bf16", *, block_size: int = 64,
             prefill_chunk: int = 4096, force_tokens: Optional[torch.Tensor] = None, k_scale: float = 1.0,
             cuda_graph: bool = False, seed: int = 0) -> GenerateResult:
    """Greedy decoding of ``R`` equal-length prompts over fresh paged caches of format ``fmt``.

    Args:
        prompts: int64 ``[R, P]`` token ids (P >= 1).
        max_new_tokens: N predictions per request (the first from the prompt's last logits).
        fmt: KV format of every layer's cache (must match the model's rope dim).
        block_size: cache block size; blocks are shuffled (seeded by ``seed``).
        prefill_chunk: prompt tokens per request per prefill forward.
        force_tokens: optional int64 ``[R, N]``: feed these as the next inputs instead of the model's own
            choices (teacher forcing, to compare predictions step by step with another run).
        cuda_graph: capture one decode step in a CUDA graph and replay it (CUDA only).

    Returns a :class:`GenerateResult`.
    """
    check_tensor("prompts", prompts, dtypes=(torch.int64,), ndim=2)
    check_positive_int("max_new_tokens", max_new_tokens)
    r, p = prompts.shape
    check_positive_int("prompt length", p)
    n = max_new_tokens
    dev = model.embed.weight.device
    if force_tokens is not None:
        check_tensor("force_tokens", force_tokens, dtypes=(torch.int64,), shape=(r, n))
    if cuda_graph and dev.type != "cuda":
        raise ValueError("cuda_graph: CUDA graphs need the model on a CUDA device")
    prompts = prompts.to(dev)
    bt, num_blocks = make_block_table(r, p + n, block_size, seed=seed, device=dev)
    caches = ModelCaches(model.config, fmt, num_blocks, block_size, dev)
    max_context = bt.shape[1] * block_size
    toks = torch.empty((r, n), dtype=torch.int64, device=dev)
    margins = torch.empty((r, n), dtype=torch.float32, device=dev)
    # Prefill in chunks; the last chunk's last token per request gives prediction 0.
    for s0 in range(0, p, prefill_chunk):
        s1 = min(p, s0 + prefill_chunk)
        meta = DSAMetadata.from_lists([s1 - s0] * r, [s0] * r, bt, block_size, max_context=max_context, decode=False)
        logits = model(prompts[:, s0:s1].reshape(-1), meta, caches, k_scale=k_scale)
    last = logits.view(r, s1 - s0, -1)[:, -1]
    toks[:, 0], margins[:, 0] = _top2_margin(last)
    forced = None if force_tokens is None else force_tokens.to(dev)

    def step_meta(i):
        return DSAMetadata.from_lists([1] * r, [p + i - 1] * r, bt, block_size, max_context=max_context, decode=True)

    def next_input(i):
        return (forced if forced is not None else toks)[:, i - 1]

    graph = None
    if cuda_graph and n > 1:
        static_meta = step_meta(1)
        static_in = next_input(1).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (compiles kernels; rewrites step 1's cache entries identically)
            model(static_in, static_meta, caches, k_scale=k_scale)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model(static_in, static_meta, caches, k_scale=k_scale)
    for i in range(1, n):
        if graph is not None:
            static_meta.copy_from(step_meta(i))
            static_in.copy_(next_input(i))
            graph.replay()
            logits = static_logits
        else:
            logits = model(next_input(i), step_meta(i), caches, k_scale=k_scale)
        toks[:, i], margins[:, i] = _top2_margin(logits)
    return GenerateResult(toks, margins)


__all__ = ["ModelConfig", "DSAModel", "ModelCaches", "GenerateResult", "init_model_weights_", "generate",
           "make_block_table"]
