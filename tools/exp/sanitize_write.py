"""The NVFP4 cache writes alone under compute-sanitizer memcheck (a faster subset of tests/gpu/sanitize_kernels.py):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/exp/sanitize_write.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from sparsemla.cache import PagedKVCache  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402

for fid in ("nvfp4_ds_mla", "nvfp4_ds_mla-nope"):
    f = get_format(fid)
    small = PagedKVCache(f, 2, 64, "cuda")
    slots = torch.tensor([127 - i for i in range(20)] + [-1], dtype=torch.int32, device="cuda")
    for dt in (torch.bfloat16, torch.float32):
        kv = torch.randn(21, 512, device="cuda").to(dt)
        pe = torch.randn(21, f.rope_dim, device="cuda").to(dt) if f.rope_dim else None
        small.write(kv, pe, slots)
        big = torch.randn(21, 576, device="cuda").to(dt)          # row-strided input (a fused projection)
        small.write(big[:, :512], big[:, 512:] if f.rope_dim else None, slots)
    torch.cuda.synchronize()
    print("ok", fid, flush=True)
