"""The sm_90 bf16 kernel (sparsemla/kernels/sm90/bf16.py, plan kernel ``sm90-bf16``) on the H200: RoPE and
NoPE rows, 33-128 heads (odd counts, partial head groups), -1 padding, valid counts with garbage past them,
empty rows, splits; against the float64 reference and the portable Triton kernels.  Run with `pytest -m gpu`."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import make_case  # noqa: E402
from sm90_gpu import check_case, meta_variant, named_hand_off, skip_unless_sm90  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["bf16", "bf16-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, 4), (100, 64, 1), (33, 2051, 3),
                                               (128, 192, None)])
def test_bf16_matches_reference(fmt, heads, topk, splits):
    skip_unless_sm90()
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda")
    check_case(c, c["fmt"].head_dim ** -0.5, "sm90-bf16", splits)


@pytest.mark.parametrize("fmt", ["bf16", "bf16-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, 4), (33, 2051, 3), (128, 192, None)])
def test_bf16_named_hand_off_matches_reference(fmt, heads, topk, splits):
    """The pair kernel with its four hand-offs a pair through named barriers (``bf16.meta(named=True)``): the
    same checks as the default's."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import bf16
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda")
    with named_hand_off(bf16, "sm90-bf16"):
        check_case(c, c["fmt"].head_dim ** -0.5, "sm90-bf16", splits)


@pytest.mark.parametrize("fmt", ["bf16", "bf16-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, 4), (33, 2051, 3), (128, 192, None)])
def test_bf16_rows128_matches_reference(fmt, heads, topk, splits):
    """The pair kernel gathering 128 contiguous bytes of 4 rows a warp instruction (``bf16.meta(rows128=True)``):
    the same checks as the default's."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import bf16
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda")
    with meta_variant(bf16, "sm90-bf16", rows128=True):
        check_case(c, c["fmt"].head_dim ** -0.5, "sm90-bf16", splits)


@pytest.mark.parametrize("fmt", ["bf16", "bf16-nope"])
@pytest.mark.parametrize("heads,topk,splits", [(64, 2048, 1), (128, 2048, 4), (33, 2051, 3), (128, 192, None),
                                               (100, 64, 1)])
@pytest.mark.parametrize("named", [False, True])
def test_bf16_tile_out_and_thread_frees_match_reference(fmt, heads, topk, splits, named):
    """The pair kernel with its bf16 output through a tile (``smem_out``; one split: the tiles each warpgroup alone
    reads, block 0's left and block 1's right half), each consumer thread arriving on the free mbarriers itself
    (``thread_free``), the 128-byte gather, with and without the named-barrier hand-offs: the default's checks."""
    skip_unless_sm90()
    from sparsemla.kernels.sm90 import bf16
    c = make_case(fmt, 5, heads, topk, ctx=4096 if topk > 64 else 256, block_size=64, device="cuda")
    with meta_variant(bf16, "sm90-bf16", rows128=True, smem_out=True, thread_free=True, named=named):
        check_case(c, c["fmt"].head_dim ** -0.5, "sm90-bf16", splits)
