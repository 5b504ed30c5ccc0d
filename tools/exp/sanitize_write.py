"""The NVFP4 cache writes alone under compute-sanitizer memcheck (a faster subset of tests/gpu/sanitize_kernels.py,
plus a row-strided input):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/exp/sanitize_write.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))
from sanitize_kernels import write_into_last_rows  # noqa: E402

for fid in ("nvfp4_ds_mla", "nvfp4_ds_mla-nope"):
    write_into_last_rows(fid, strided=True)
    torch.cuda.synchronize()
    print("ok", fid, flush=True)
