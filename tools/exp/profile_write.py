"""Run one 65,536-token cache write a few times (for Nsight Compute on the H200):

    ncu -k regex:_cache_write -c 1 --set full python3 tools/exp/profile_write.py --fmt nvfp4_ds_mla
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_movement import write_workload  # noqa: E402

from sparsemla.formats import get_format  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fmt", default="nvfp4_ds_mla")
ap.add_argument("--pattern", default="scatter")
a = ap.parse_args()
nbytes, run, extra = write_workload(get_format(a.fmt), n=65536, pattern=a.pattern)
fn = run(None)
for _ in range(3):
    fn()
torch.cuda.synchronize()
print("done")
