"""Run one decode configuration a few times (for Nsight Compute on the H200):

    ncu --clock-control none -k regex:_fwd_ -c 1 --section SpeedOfLight --section WarpStateStats \
        --section Occupancy python3 benchmarks/profile_one.py --fmt fp8_ds_mla --heads 16
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import build, heavy  # noqa: E402

from sparsemla.formats import get_format  # noqa: E402
from sparsemla.kernels import sparse_attention as sa  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fmt", default="fp8_ds_mla")
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--batch", type=int, default=128)
ap.add_argument("--s-q", type=int, default=1, help="query tokens per request (prefill: --batch 1 --s-q 2048)")
a = ap.parse_args()
fmt = get_format(a.fmt)
cache, idx = build(fmt, a.batch, s_q=a.s_q)
q = heavy(idx.shape[0], a.heads, fmt.head_dim).to(torch.bfloat16)
for _ in range(3):
    sa.sparse_mla_fwd(q, cache.rows, fmt, idx, 0.04)
torch.cuda.synchronize()
print("done")
