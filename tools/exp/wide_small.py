"""Eighth session: where the time of ws_wide goes at one or a few pairs per program (b 1 / 4, 128 heads):
CUDA-graph replay of sparse_mla_fwd for split counts 1-16, the wide kernel forced (ws_attention.FEW_WAVES = 0)
against the default dispatch (the Triton wide kernel there).

    python tools/exp/wide_small.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from decode_sweep import build, heavy, time_fn  # noqa: E402

from sparsemla.bench.timing import graph_replay  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import ws_attention  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd  # noqa: E402


def main():
    fmt = get_format("fp8_ds_mla")
    for b in (1, 4):
        cache, idx = build(fmt, b)
        for h in (128, 64):
            q = heavy(b, h, fmt.head_dim).to(torch.bfloat16)
            out = torch.empty(b, h, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(b, h, dtype=torch.float32, device="cuda")
            for forced in (False, True):
                ws_attention.FEW_WAVES = dict.fromkeys(ws_attention.FEW_WAVES, 0 if forced else 1)
                for splits in (None, 1, 2, 4, 16):
                    fn = graph_replay(lambda s=splits: sparse_mla_fwd(q, cache.rows, fmt, idx, 0.04, out=out, lse=lse,
                                                                 num_splits=s))
                    us = time_fn(fn, reps=30)
                    print(json.dumps(dict(b=b, h=h, kernel="ws_wide" if forced else "default", splits=splits,
                                          us=round(us, 2))), flush=True)
        del cache, idx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
