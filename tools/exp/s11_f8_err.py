"""Eleventh session: the FP8-arithmetic mode's error against the float64 reference on the test suite's cases
(tests/attn_cases.make_case: shuffled strided cache, -1 padding, valid counts with garbage, an empty row),
next to the default path's, for heavy-tailed data (the suite's) and plain Gaussian data.  One JSON line per case.

    python tools/exp/s11_f8_err.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import attn_cases  # noqa: E402
from attn_cases import lse_err, make_case, rel_err  # noqa: E402

from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402
from sparsemla.reference import sparse_mla  # noqa: E402

HEAVY = attn_cases.heavy


def gauss(gen, *shape, device="cpu"):
    return torch.randn(*shape, generator=gen, device=device)


for data in ("heavy", "gauss"):
    attn_cases.heavy = HEAVY if data == "heavy" else gauss
    for fmt in ("fp8_ds_mla", "fp8_ds_mla-nope", "fp8", "fp8-nope"):
        for heads, topk in [(1, 64), (16, 2048), (20, 2051), (64, 2048), (128, 2048), (16, 64)]:
            k_scale = 0.5 if fmt.startswith("fp8-") or fmt == "fp8" else 1.0
            c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda",
                          k_scale=k_scale)
            sm = c["fmt"].head_dim ** -0.5
            ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm, c["valid_counts"], k_scale)
            r = dict(data=data, fmt=fmt, h=heads, k=topk, lse_max=round(ref_l[torch.isfinite(ref_l)].abs().max().item(), 1))
            for f8 in (False, True):
                out = torch.full((5, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                lse = torch.full((5, heads), float("nan"), dtype=torch.float32, device="cuda")
                sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm, c["valid_counts"], k_scale,
                               out=out, lse=lse, fp8_arith=f8)
                empty = c["valid_counts"] == 0
                tag = "f8" if f8 else "def"
                r[tag] = dict(rel=float(f"{rel_err(out, ref_o):.3e}"), lse=float(f"{lse_err(lse, ref_l):.3e}"),
                              finite=bool(torch.isfinite(out.float()).all()),
                              empty_ok=bool((out[empty] == 0).all() and torch.isneginf(lse[empty]).all()))
            print(json.dumps(r), flush=True)
