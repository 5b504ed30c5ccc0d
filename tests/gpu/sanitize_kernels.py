"""Run every kernel once on small shapes, for compute-sanitizer memcheck on the H200:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 tests/gpu/sanitize_kernels.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import make_case  # noqa: E402

from sparsemla.cache import PagedKVCache  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.indices import convert_indices  # noqa: E402
from sparsemla.kernels.sparse_attention import sparse_mla_fwd, sparse_mla_fwd_staged  # noqa: E402
from sparsemla.kernels.staging import gather_topk_fp8, upconvert_context  # noqa: E402


def write_into_last_rows(fid: str, strided: bool = False):
    """Cache writes into the last rows of an exactly sized cache: 21 tokens (not a multiple of the kernel's
    tokens per program), one skipped, bf16 and fp32 input (the word-store and pair paths); ``strided``
    adds a row-strided input (the kv_c / k_pe slices of a fused [N, 576] projection)."""
    f = get_format(fid)
    small = PagedKVCache(f, 2, 64, "cuda")
    slots = torch.tensor([127 - i for i in range(20)] + [-1], dtype=torch.int32, device="cuda")
    for dt in (torch.bfloat16, torch.float32):
        kv = torch.randn(21, 512, device="cuda").to(dt)
        pe = torch.randn(21, f.rope_dim, device="cuda").to(dt) if f.rope_dim else None
        small.write(kv, pe, slots)
        if strided:
            big = torch.randn(21, 576, device="cuda").to(dt)
            small.write(big[:, :512], big[:, 512:] if f.rope_dim else None, slots)


def main():
    if sys.argv[1:] == ["fp8_arith"]:  # only the FP8-arithmetic mode's kernels
        return fp8_arith()
    from sparsemla.kernels import ws_attention
    # the small cases below then run the wide kernel for quantized rows (not the few-heads kernel's head groups)
    waves = ws_attention.FEW_WAVES
    ws_attention.FEW_WAVES = dict.fromkeys(waves, 0)
    for fmt in ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "fp8_ds_mla-nope", "nvfp4_ds_mla-nope", "fp8-nope"]:
        for heads, splits in [(20, 2), (70, 1), (16, 1)]:
            c = make_case(fmt, 3, heads, 128, ctx=256, block_size=64, device="cuda")
            sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], 0.1, c["valid_counts"],
                           num_splits=splits)
            st = gather_topk_fp8(c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"], 1.0)
            sparse_mla_fwd_staged(c["q"], st, c["indices"], 0.1, c["valid_counts"], num_splits=splits)
        bt = torch.randint(0, c["cache"].num_blocks, (3, 4), device="cuda", dtype=torch.int32)
        topk = torch.randint(-1, 256, (3, 128), device="cuda", dtype=torch.int32)
        convert_indices(topk, torch.arange(3, device="cuda", dtype=torch.int32), bt, 64,
                        c["cache"].block_stride_rows, True, compact=True)
        seq = torch.tensor([256, 100, 1], device="cuda", dtype=torch.int32)
        upconvert_context(c["cache"].rows, c["fmt"], bt, seq, 64, c["cache"].block_stride_rows)
        write_into_last_rows(fmt)
        torch.cuda.synchronize()
        print("ok", fmt, flush=True)
    # the few-heads kernel's head groups above 32 heads (its small-batch dispatch)
    ws_attention.FEW_WAVES = waves
    for fmt in ["fp8", "fp8_ds_mla", "nvfp4_ds_mla", "fp8_ds_mla-nope"]:
        for heads, splits in [(70, 1), (128, None)]:
            c = make_case(fmt, 3, heads, 256, ctx=512, block_size=64, device="cuda")
            sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], 0.1, c["valid_counts"],
                           num_splits=splits)
        torch.cuda.synchronize()
        print("ok few groups", fmt, flush=True)
    fp8_arith()


def fp8_arith():
    """The FP8-arithmetic mode (opt-in): the few-heads kernel (few heads and head groups), then the wide
    kernel (the same small cases with the few-heads kernel's small-batch dispatch off)."""
    from sparsemla.kernels import ws_attention
    waves = ws_attention.FEW_WAVES
    for few_waves in (waves, dict.fromkeys(waves, 0)):
        ws_attention.FEW_WAVES = few_waves
        for fmt in ["fp8", "fp8_ds_mla", "fp8-nope", "fp8_ds_mla-nope"]:
            for heads, splits in [(16, 1), (20, 2), (70, 1), (128, None)]:
                c = make_case(fmt, 3, heads, 256, ctx=512, block_size=64, device="cuda")
                sparse_mla_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], 0.1, c["valid_counts"],
                               num_splits=splits, fp8_arith=True)
            torch.cuda.synchronize()
            print("ok fp8_arith", fmt, "wide" if few_waves is not waves else "few", flush=True)
    ws_attention.FEW_WAVES = waves


if __name__ == "__main__":
    main()
