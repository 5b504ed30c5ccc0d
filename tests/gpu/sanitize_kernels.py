"""Run every kernel once on small shapes, for compute-sanitizer on the H200:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python3 tests/gpu/sanitize_kernels.py [--formats F1,F2 | fp8_qk]

Every attention kernel the plan can choose (the Hopper kernels forced where a small case would not pick them,
and the portable ones), with splits (merged by the combine kernel, and in the kernel where it has a FUSED
variant), valid counts, -1 padding and empty rows; the staged path; index conversion,
upconvert and cache writes into the last rows of an exactly sized cache.  ``fp8_qk``: only the FP8-QK variants;
``--formats``: only these formats' kernels (the FP8-QK variants of those among them), so that ``sanitize.sh`` can
run several sanitizer processes side by side (``SANITIZE_SHARDS``).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import make_case, run_kernel  # noqa: E402

from sparsemla.cache import PagedKVCache  # noqa: E402
from sparsemla.formats import get_format  # noqa: E402
from sparsemla.indices import convert_indices  # noqa: E402
from sparsemla.kernels.staging import gather_topk_fp8, upconvert_context  # noqa: E402
from sparsemla.plan import CLUSTER_KINDS, CONV_KINDS, PERSISTENT_KINDS, cluster_builds  # noqa: E402

FORMATS = ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "fp8_ds_mla-nope", "nvfp4_ds_mla-nope", "fp8-nope",
           "bf16-nope"]


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


def _attention(c, **kw):
    run_kernel(c["q"], c["cache"].rows, c["fmt"], c["indices"], 0.1, c["valid_counts"], **kw)


def main():
    args = sys.argv[1:]
    if args == ["fp8_qk"]:
        return fp8_qk()
    formats = FORMATS
    if args[:1] == ["--formats"] and len(args) == 2:
        formats = args[1].split(",")
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise SystemExit(f"--formats: unknown {unknown}; expected some of {FORMATS}")
    elif args:
        raise SystemExit("usage: sanitize_kernels.py [--formats F1,F2 | fp8_qk]")
    for fmt in formats:
        name = get_format(fmt).name
        for heads, splits in [(20, 2), (70, 1), (16, 1), (128, None)]:
            c = make_case(fmt, 3, heads, 128, ctx=256, block_size=64, device="cuda")
            _attention(c, num_splits=splits)
            _attention(c, num_splits=splits, portable=True)
            if heads > 32 and name in ("fp8", "fp8_ds_mla"):
                _attention(c, num_splits=splits, kernel="sm90-wide")  # a small batch would take sm90-few
            if heads > 32 and name in CONV_KINDS:
                _attention(c, num_splits=splits, kernel="sm90-conv")  # forced: small cases plan sm90-few
            if heads > 32 and name == "bf16":
                _attention(c, num_splits=splits, kernel="sm90-bf16")  # up to 64 heads the plan takes sm90-conv
            if splits != 1:  # the splits merged in the kernel (FUSED variants), where the plan's kernel has one
                _attention(c, num_splits=splits, fused_combine=True)
                if heads > 32 and name in CONV_KINDS:
                    _attention(c, num_splits=splits, kernel="sm90-conv", fused_combine=True)
                if heads > 32 and name == "bf16":
                    _attention(c, num_splits=splits, kernel="sm90-bf16", fused_combine=True)
            if heads > 64 and name in CLUSTER_KINDS and cluster_builds():
                _attention(c, num_splits=splits, kernel="sm90-cluster")  # only when asked for
            st = gather_topk_fp8(c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"], 1.0)
            run_kernel(c["q"], st.view(torch.uint8).view(-1, st.shape[2]), get_format("fp8", c["fmt"].rope_dim),
                       c["indices"], 0.1, c["valid_counts"], num_splits=splits, staged=True)
        if name in PERSISTENT_KINDS:  # more work items than SMs: the plan's persistent grid, empty items among them
            big = make_case(fmt, 140, 128, 192, ctx=256, block_size=64, device="cuda")
            big["valid_counts"][::7] = 0
            _attention(big)
            _attention(big, num_splits=2)
        bt = torch.randint(0, c["cache"].num_blocks, (3, 4), device="cuda", dtype=torch.int32)
        topk = torch.randint(-1, 256, (3, 128), device="cuda", dtype=torch.int32)
        convert_indices(topk, torch.arange(3, device="cuda", dtype=torch.int32), bt, 64,
                        c["cache"].block_stride_rows, True, compact=True)
        seq = torch.tensor([256, 100, 1], device="cuda", dtype=torch.int32)
        upconvert_context(c["cache"].rows, c["fmt"], bt, seq, 64, c["cache"].block_stride_rows)
        write_into_last_rows(fmt)
        torch.cuda.synchronize()
        print("ok", fmt, flush=True)
    fp8_qk([f for f in FP8_QK_FORMATS if f in formats])


FP8_QK_FORMATS = ["fp8", "fp8_ds_mla", "fp8-nope", "fp8_ds_mla-nope"]


def fp8_qk(formats=FP8_QK_FORMATS):
    """The FP8-QK variants of both Hopper kernels for e4m3 rows (few heads, head groups, 64 heads a program)."""
    for fmt in formats:
        for heads, splits in [(16, 1), (20, 2), (70, 1), (128, None)]:
            c = make_case(fmt, 3, heads, 256, ctx=512, block_size=64, device="cuda")
            _attention(c, num_splits=splits, fp8_qk=True)
            if heads > 32:
                _attention(c, num_splits=splits, fp8_qk=True, kernel="sm90-wide")
        torch.cuda.synchronize()
        print("ok fp8_qk", fmt, flush=True)


if __name__ == "__main__":
    main()
