"""The accuracy report: what each KV format costs, measured on a DSA layer and on a small DSA model.

Per format (all 8 of ``sparsemla.formats.all_formats``: bf16, fp8, fp8_ds_mla, nvfp4_ds_mla, with
RoPE and NoPE), one row with:

* ``layer_err_vs_bf16``: relative error ``||out - out_bf16|| / ||out_bf16||`` of the layer output
  (``[Q, hidden]`` for the last ``Q`` tokens of a long context) against the same layer reading a bf16
  cache.  Everything but the cache format is identical (same weights, inputs and top-k), so this is
  the format's own cost.
* ``layer_err_vs_f64``: the same against the float64 layer with unquantized keys/values, given the
  same top-k (bf16 compute + the format; the indexer's choices are measured separately).
* ``layer_err_vs_f64_e2e``: against the float64 layer with its own float64 indexer (everything).
* ``topk_overlap`` / ``topk_overlap_min``: mean / worst ``|fp8 top-k ∩ float64 top-k| / |float64 top-k|``
  over the evaluated tokens (the index-key cache is the same for every KV format, so this is the fp8
  indexer's cost).
* ``token_agreement``: the small model reading this format, fed the bf16-cache model's greedy tokens
  (teacher forcing), picks the same next token this fraction of the time over ``gen_tokens`` steps.
* ``first_divergence``: mean step at which free-running greedy decoding first differs from the bf16
  run (``gen_tokens`` if never).

``accuracy_report(quick=True)`` is a CPU-sized run (seconds); the full run (DeepSeek-V3.2 layer
geometry, 32K-token contexts, 256 generated tokens) is for the GPU:
``python benchmarks/accuracy.py --out accuracy.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List, Optional, Sequence

import torch

from ..cache import PagedKVCache
from ..formats import all_formats, get_format
from ..reference.indexer import topk_overlap
from .dsa import DSAAttention, DSAConfig, DSAMetadata, init_dsa_weights_, realistic_hidden
from .indexer import IndexKeyCache
from .model import DSAModel, ModelConfig, generate, init_model_weights_, make_block_table


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref||_F / ||ref||_F`` in float64."""
    a, ref = a.to(torch.float64), ref.to(torch.float64)
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def _formats(rope: int, only: Optional[Sequence[str]]):
    fmts = [f for f in all_formats() if f.rope_dim == rope]
    if only:
        fmts = [f for f in fmts if f.id in only or f.name in only]
    return fmts


@torch.no_grad()
def layer_accuracy(config: DSAConfig, *, context_len: int, num_eval: int, device, dtype=torch.bfloat16,
                   block_size: int = 64, prefill_chunk: int = 4096, seed: int = 0, attn_backend="auto",
                   formats: Optional[Sequence[str]] = None, k_scale: float = 1.0) -> Dict[str, dict]:
    """Layer-output errors and top-k overlap per format of the config's rope dim.

    A layer with realistic random weights sees ``context_len`` tokens of realistic hidden states; the
    first ``context_len - num_eval`` are only written to the caches, the last ``num_eval`` go through
    the full layer as one prefill chunk and are compared.  Returns ``{format id: metrics}``.
    """
    gen = torch.Generator().manual_seed(seed)
    layer = init_dsa_weights_(DSAAttention(config, dtype=dtype, device=device, attn_backend=attn_backend), gen)
    x = realistic_hidden(context_len, config.hidden_size, gen, device=device).to(dtype)
    bt, num_blocks = make_block_table(1, context_len, block_size, seed=seed, device=device)
    n_ctx = context_len - num_eval
    qpos = torch.arange(n_ctx, context_len, device=device)
    fmts = _formats(config.qk_rope_head_dim, formats)
    if not any(f.name == "bf16" for f in fmts):
        fmts = [get_format("bf16", config.qk_rope_head_dim)] + fmts
    outs, topks = {}, {}
    for fmt in fmts:
        kv = PagedKVCache(fmt, num_blocks, block_size, device)
        ic = IndexKeyCache(num_blocks, block_size, device)
        for s0 in range(0, n_ctx, prefill_chunk):
            s1 = min(n_ctx, s0 + prefill_chunk)
            meta = DSAMetadata.from_lists([s1 - s0], [s0], bt, block_size)
            layer.write_cache(x[s0:s1], meta, kv, ic, k_scale=k_scale)
        meta = DSAMetadata.from_lists([num_eval], [n_ctx], bt, block_size, decode=False)
        outs[fmt.id], topks[fmt.id] = layer(x[n_ctx:], meta, kv, ic, k_scale=k_scale, return_indices=True)
        del kv, ic
    base = get_format("bf16", config.qk_rope_head_dim).id
    topk = topks[base]
    same_topk = all(torch.equal(t, topk) for t in topks.values())
    ref_same, _ = layer.reference_forward(x, qpos, topk)
    ref_e2e, topk64 = layer.reference_forward(x, qpos)
    overlap = topk_overlap(topk.cpu(), topk64.cpu())
    res = {}
    for fmt in fmts:
        out = outs[fmt.id]
        res[fmt.id] = dict(
            layer_err_vs_bf16=rel_err(out, outs[base]),
            layer_err_vs_f64=rel_err(out, ref_same),
            layer_err_vs_f64_e2e=rel_err(out, ref_e2e),
            topk_overlap=float(overlap.mean()),
            topk_overlap_min=float(overlap.min()),
            topk_same_across_formats=same_topk,
        )
    return res


@torch.no_grad()
def model_agreement(config: ModelConfig, *, prompt_len: int, gen_tokens: int, batch: int, device,
                    dtype=torch.bfloat16, block_size: int = 64, prefill_chunk: int = 4096, seed: int = 0,
                    attn_backend="auto", formats: Optional[Sequence[str]] = None, cuda_graph: bool = False,
                    k_scale: float = 1.0) -> Dict[str, dict]:
    """Greedy-token agreement of the model over each format with the same model over a bf16 cache."""
    model = init_model_weights_(DSAModel(config, dtype=dtype, device=device, attn_backend=attn_backend), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=gen)
    kw = dict(block_size=block_size, prefill_chunk=prefill_chunk, cuda_graph=cuda_graph, seed=seed, k_scale=k_scale)
    rope = config.attn.qk_rope_head_dim
    ref = generate(model, prompts, gen_tokens, get_format("bf16", rope), **kw)
    res = {}
    for fmt in _formats(rope, formats):
        forced = generate(model, prompts, gen_tokens, fmt, force_tokens=ref.tokens, **kw)
        free = ref if fmt.name == "bf16" else generate(model, prompts, gen_tokens, fmt, **kw)
        diff = free.tokens != ref.tokens
        never = torch.full((diff.shape[0],), gen_tokens, dtype=torch.int64, device=diff.device)
        first = torch.where(diff.any(1), diff.int().argmax(1), never)
        res[fmt.id] = dict(
            token_agreement=float((forced.tokens == ref.tokens).float().mean()),
            first_divergence=float(first.float().mean()),
            ref_margin_median=float(ref.margins.median()),
        )
    return res


def default_sizes(quick: bool) -> dict:
    """Sizes of the quick CPU run and of the full GPU run."""
    if quick:
        return dict(context_len=96, num_eval=8, block_size=16, prompt_len=40, gen_tokens=6, batch=2, prefill_chunk=64)
    return dict(context_len=32768, num_eval=64, block_size=64, prompt_len=32768, gen_tokens=256, batch=2,
                prefill_chunk=4096)


def accuracy_report(quick: bool = False, device=None, *, seed: int = 0, formats: Optional[Sequence[str]] = None,
                    kpool: int = 1, attn_backend="auto", cuda_graph: Optional[bool] = None, k_scale: float = 1.0,
                    log=None, **sizes) -> List[dict]:
    """Run the layer and model measurements for every format; returns one dict per format (table rows).

    ``quick`` uses tiny CPU-sized geometry; otherwise DeepSeek-V3.2's layer geometry and a 4-layer model
    of width 1024 with top-k 2048.  ``sizes`` overrides entries of :func:`default_sizes`.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    sz = default_sizes(quick)
    unknown = set(sizes) - set(sz)
    if unknown:
        raise TypeError(f"accuracy_report: unknown size arguments {sorted(unknown)}; expected some of {sorted(sz)}")
    sz.update(sizes)
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    log = log or (lambda msg: None)
    rows = []
    for rope in (64, 0):
        if quick:
            lcfg = DSAConfig.tiny(rope=bool(rope), index_kpool=kpool)
            mcfg = ModelConfig.tiny(rope=bool(rope), index_kpool=kpool)
        else:
            lcfg = DSAConfig(qk_rope_head_dim=rope, index_kpool=kpool)
            mcfg = ModelConfig(attn=DSAConfig(hidden_size=1024, num_heads=16, q_lora_rank=512, index_n_heads=16,
                                              index_topk=2048, qk_rope_head_dim=rope, index_kpool=kpool))
        t0 = time.time()
        lay = layer_accuracy(lcfg, context_len=sz["context_len"], num_eval=sz["num_eval"], device=device, dtype=dtype,
                             block_size=sz["block_size"], prefill_chunk=sz["prefill_chunk"], seed=seed,
                             attn_backend=attn_backend, formats=formats, k_scale=k_scale)
        log(f"layer (rope {rope}): {time.time() - t0:.1f} s")
        t0 = time.time()
        mod = model_agreement(mcfg, prompt_len=sz["prompt_len"], gen_tokens=sz["gen_tokens"], batch=sz["batch"],
                              device=device, dtype=dtype, block_size=sz["block_size"],
                              prefill_chunk=sz["prefill_chunk"], seed=seed, attn_backend=attn_backend,
                              formats=formats, cuda_graph=cuda_graph, k_scale=k_scale)
        log(f"model (rope {rope}): {time.time() - t0:.1f} s")
        for fid, m in mod.items():
            fmt = get_format(fid)
            row = dict(format=fid, bytes_per_token=fmt.bytes_per_token)
            row.update(lay.get(fid, {}))
            row.update(m)
            row.update(context_len=sz["context_len"], gen_tokens=sz["gen_tokens"], prompt_len=sz["prompt_len"])
            rows.append(row)
    return rows


COLUMNS = [("format", "format", "{}"), ("bytes_per_token", "B/token", "{}"),
           ("layer_err_vs_bf16", "layer err vs bf16 cache", "{:.2e}"),
           ("layer_err_vs_f64", "layer err vs fp64 (same top-k)", "{:.2e}"),
           ("layer_err_vs_f64_e2e", "layer err vs fp64 (own top-k)", "{:.2e}"),
           ("topk_overlap", "top-k overlap (mean / min)", None),
           ("token_agreement", "greedy agreement (forced)", "{:.3f}"),
           ("first_divergence", "first divergence (step)", "{:.1f}")]


def format_table(rows: List[dict]) -> str:
    """A markdown table of the rows."""
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            if key == "topk_overlap":
                cells.append(f"{r[key]:.4f} / {r['topk_overlap_min']:.4f}" if key in r else "-")
            elif key in r:
                cells.append(fmt.format(r[key]))
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> List[dict]:
    p = argparse.ArgumentParser(description="Per-format accuracy of a DSA layer and a small DSA model.")
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kpool", type=int, default=1)
    p.add_argument("--formats", nargs="*", default=None, help="format names or ids (default: all 8)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    for k in default_sizes(False):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    a = p.parse_args(argv)
    sizes = {k: getattr(a, k) for k in default_sizes(False) if getattr(a, k) is not None}
    rows = accuracy_report(a.quick, a.device, seed=a.seed, formats=a.formats, kpool=a.kpool,
                           cuda_graph=False if a.no_cuda_graph else None, log=print, **sizes)
    print(format_table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
