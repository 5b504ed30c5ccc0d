"""``sparsemla capacity``: how many tokens of KV cache fit per GPU, per format, for a model geometry.

Arithmetic only (no GPU needed):

    KV budget per GPU = GPU memory x utilisation - weights / TP - reserve
    tokens per GPU    = budget / (layers x (bytes_per_token + indexer bytes per token)), in whole blocks

When the weights leave no room (budget <= 0) the answer is 0 tokens for every format, with the smallest
tensor-parallel size that leaves room.

MLA keeps one latent KV head, so every tensor-parallel rank stores every token of its requests:
the capacity of a TP group equals that of one GPU.  The defaults are DeepSeek-V3.2 (61 layers, 128
heads, 671B parameters stored in FP8 at about one byte each, and the lightning indexer's key cache: 128 e4m3
values plus one fp32 scale, 132 bytes per token per layer) on 8 H200s.
"""
from __future__ import annotations

import json

from ..formats import FORMAT_NAMES, get_format

GIB = 2 ** 30
PRESETS = {
    # layers, query heads, parameters (for the weight estimate), bytes per parameter
    "deepseek-v3.2": {"layers": 61, "heads": 128, "params": 671e9, "bytes_per_param": 1.0, "indexer_bytes": 132},
}
DEFAULT_GPU_GIB = 140.0  # H200 (141 GB); measured memory on CUDA machines is used instead when present


def add_parser(sub, name, help_):
    p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="deepseek-v3.2",
                   help="geometry preset (default deepseek-v3.2); the flags below override it")
    p.add_argument("--layers", type=int, help="attention layers holding a KV cache")
    p.add_argument("--heads", type=int, help="query heads of the model (shown per GPU)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs sharing the weights (default 8)")
    p.add_argument("--gpu-mem-gib", type=float,
                   help=f"memory per GPU in GiB (default: this GPU's, else {DEFAULT_GPU_GIB:g} for an H200)")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    p.add_argument("--weights-gib", type=float,
                   help="total weight size in GiB over all TP ranks (default: preset parameters x bytes each)")
    p.add_argument("--reserve-gib", type=float, default=0.0,
                   help="per-GPU memory kept for activations, CUDA graphs, workspaces (default 0)")
    p.add_argument("--indexer-bytes", type=int, default=None,
                   help="extra bytes per token per layer for the indexer's key cache (default: the preset's, "
                        "132 for deepseek-v3.2; 0 for a model without one)")
    p.add_argument("--nope", action="store_true", help="NoPE geometry (512-dim keys): the -nope formats")
    p.add_argument("--block-size", type=int, default=64, help="tokens per cache page (default 64)")
    p.add_argument("--context", type=int, default=32768, help="context length for the 'contexts' column")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


def _gpu_mem_gib() -> tuple:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB, "this GPU"
    except Exception:
        pass
    return DEFAULT_GPU_GIB, "H200 default"


def compute(args) -> dict:
    """The capacity table as a dict (see ``run`` for the text form)."""
    preset = PRESETS[args.model]
    layers = args.layers if args.layers is not None else preset["layers"]
    heads = args.heads if args.heads is not None else preset["heads"]
    for name, v in (("layers", layers), ("tp", args.tp), ("block-size", args.block_size), ("context", args.context)):
        if v < 1:
            raise ValueError(f"--{name}: expected a positive integer, got {v}")
    if not 0 < args.utilization <= 1:
        raise ValueError(f"--utilization: expected a fraction in (0, 1], got {args.utilization}")
    indexer = preset.get("indexer_bytes", 0) if args.indexer_bytes is None else args.indexer_bytes
    if indexer < 0 or args.reserve_gib < 0:
        raise ValueError("--indexer-bytes and --reserve-gib: expected >= 0")
    if args.gpu_mem_gib is not None:
        mem, mem_src = args.gpu_mem_gib, "given"
    else:
        mem, mem_src = _gpu_mem_gib()
    if args.weights_gib is not None:
        weights, w_src = args.weights_gib, "given"
    else:
        weights = preset["params"] * preset["bytes_per_param"] / GIB
        w_src = f"{preset['params'] / 1e9:.0f}B parameters x {preset['bytes_per_param']:g} B"
    budget = mem * args.utilization - weights / args.tp - args.reserve_gib
    out = {"model": args.model, "layers": layers, "heads": heads, "heads_per_gpu": heads / args.tp, "tp": args.tp,
           "gpu_mem_gib": mem, "gpu_mem_source": mem_src, "utilization": args.utilization,
           "weights_gib": weights, "weights_source": w_src, "weights_per_gpu_gib": weights / args.tp,
           "reserve_gib": args.reserve_gib, "kv_budget_gib": budget, "indexer_bytes": indexer,
           "block_size": args.block_size, "context": args.context, "formats": []}
    if budget <= 0:
        room = mem * args.utilization - args.reserve_gib  # per GPU before weights
        min_tp = int(weights // room) + 1 if room > 0 else None
        out["no_room"] = (f"no memory left for a KV cache at TP {args.tp}: {mem:.1f} GiB x {args.utilization:g} - "
                          f"{weights / args.tp:.1f} GiB of weights per GPU - {args.reserve_gib:g} GiB reserve <= 0; "
                          + (f"the weights leave room from TP {min_tp} on" if min_tp else
                             "the reserve alone exceeds the usable memory"))
        out["min_tp"] = min_tp
    for name in FORMAT_NAMES:
        fmt = get_format(name, 0 if args.nope else 64)
        per_token = layers * (fmt.bytes_per_token + indexer)
        tokens = max(0, int(budget * GIB // per_token) // args.block_size * args.block_size)
        out["formats"].append({"format": fmt.id, "bytes_per_token_layer": fmt.bytes_per_token,
                               "bytes_per_token_model": per_token, "tokens_per_gpu": tokens,
                               "contexts": tokens // args.context})
    by = {f["format"].replace("-nope", ""): f for f in out["formats"]}
    for f in out["formats"]:
        for ref in ("bf16", "fp8", "fp8_ds_mla"):
            f[f"vs_{ref}"] = by[ref]["bytes_per_token_model"] / f["bytes_per_token_model"]
    return out


def render(c: dict) -> str:
    lines = [f"model {c['model']}: {c['layers']} layers, {c['heads']} query heads "
             f"({c['heads_per_gpu']:g} per GPU at TP {c['tp']})",
             f"weights {c['weights_gib']:.1f} GiB ({c['weights_source']}) = {c['weights_per_gpu_gib']:.1f} GiB per GPU",
             f"KV budget per GPU: {c['gpu_mem_gib']:.1f} GiB ({c['gpu_mem_source']}) x {c['utilization']:g} - "
             f"{c['weights_per_gpu_gib']:.1f} GiB weights - {c['reserve_gib']:g} GiB reserve = {c['kv_budget_gib']:.1f} GiB"]
    if "no_room" in c:
        lines.append(c["no_room"] + ".")
        return "\n".join(lines)
    lines.append("MLA keeps one latent KV head: every TP rank stores every token, so per GPU = per TP group.")
    if c["indexer_bytes"]:
        lines.append(f"each token also holds {c['indexer_bytes']} B per layer of indexer keys (counted below).")
    lines.append("")
    head = (f"{'format':<18} {'B/token/layer':>13} {'KiB/token':>10} {'tokens per GPU':>15} "
            f"{str(c['context'] // 1024) + 'K contexts':>13} {'vs bf16':>8} {'vs fp8':>7} {'vs fp8_ds_mla':>13}")
    lines += [head, "-" * len(head)]
    for f in c["formats"]:
        lines.append(f"{f['format']:<18} {f['bytes_per_token_layer']:>13} {f['bytes_per_token_model'] / 1024:>10.1f} "
                     f"{f['tokens_per_gpu']:>15,} {f['contexts']:>13,} "
                     f"{f['vs_bf16']:>7.2f}x {f['vs_fp8']:>6.2f}x {f['vs_fp8_ds_mla']:>12.2f}x")
    nv = next(f for f in c["formats"] if f["format"].startswith("nvfp4_ds_mla"))
    lines.append("")
    lines.append(f"nvfp4_ds_mla holds {nv['vs_fp8_ds_mla']:.2f}x the tokens of fp8_ds_mla and {nv['vs_fp8']:.2f}x "
                 f"those of fp8 ({nv['vs_bf16']:.2f}x bf16)"
                 + ("" if c["indexer_bytes"] else "; no indexer key cache counted (--indexer-bytes)") + ".")
    return "\n".join(lines)


def run(args) -> int:
    c = compute(args)
    print(json.dumps(c, indent=1) if args.json else render(c))
    return 0
