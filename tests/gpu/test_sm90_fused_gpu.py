"""The split partials merged inside the sm_90 kernels (their FUSED variants; plan ``fused_combine``,
``common.combine_in_kernel``) on the H200: against the float64 reference and against the same kernel merged by
the combine kernel, for every kernel with the variant (sm90-few, sm90-conv with quantized and bf16 rows,
sm90-bf16); -1 padding, garbage past a valid count, empty rows, split counts up to the largest a plan makes,
head counts that leave the last group part-empty; the grid barrier reused call after call and grid after grid
(its count back at zero, its generation one further per call), in the launcher's scratch and in a runner buffer
captured in a CUDA graph.  Run with `pytest -m gpu`."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_cases import SEED, lse_err, lse_scale, make_case, rel_err  # noqa: E402
from sm90_gpu import check_reference, num_sms, skip_unless_sm90  # noqa: E402

from sparsemla.kernels import attention as attn_mod  # noqa: E402
from sparsemla.plan import plan_attention, unavailable_kernels  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _built():
    """A kernel that fails to build is recorded and its calls go to the portable kernels, which would pass the
    checks: every test also asserts that no sm_90 kernel was found unavailable."""
    yield
    assert not unavailable_kernels(), unavailable_kernels()


def _plan(c, kernel, fused, splits=None):
    t, h = c["q"].shape[:2]
    p = plan_attention(c["fmt"], t, h, c["indices"].shape[1], capability=(9, 0), num_sms=num_sms(), kernel=kernel,
                       fused_combine=fused, num_splits=splits)
    assert p.kernel == kernel and p.fused_combine == fused and (p.num_splits > 1 or not fused), p
    return p


def _run(c, sm_scale, plan, k_scale=1.0, split_buffers=None):
    t, h = c["q"].shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device="cuda")
    return attn_mod.attention_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm_scale, plan=plan,
                                  valid_counts=c["valid_counts"], k_scale=k_scale, out=out, lse=lse,
                                  split_buffers=split_buffers)


def _barrier_words():
    """(count, generation) of the scratch of the current device and stream (the words before its partials)."""
    dev = torch.cuda.current_device()
    buf = attn_mod._SCRATCH[(dev, torch.cuda.current_stream().cuda_stream)]
    return tuple(int(x) for x in buf[:2].view(torch.int32).tolist())


# (format, tokens, heads, kernel, forced splits or None, top-k); every grid within one program per SM
CASES = [("fp8_ds_mla", 1, 16, "sm90-few", None, 2048), ("nvfp4_ds_mla", 3, 16, "sm90-few", None, 2048),
         ("fp8", 2, 32, "sm90-few", None, 2048), ("fp8_ds_mla-nope", 2, 24, "sm90-few", 32, 2048),
         ("nvfp4_ds_mla", 1, 64, "sm90-conv", None, 2048), ("fp8_ds_mla", 3, 128, "sm90-conv", None, 2048),
         ("fp8", 2, 96, "sm90-conv", 5, 2048), ("nvfp4_ds_mla-nope", 1, 33, "sm90-conv", 64, 4096),
         ("bf16", 1, 64, "sm90-conv", None, 2048), ("bf16", 3, 128, "sm90-bf16", None, 2048),
         ("bf16-nope", 2, 100, "sm90-bf16", 7, 2048)]


@pytest.mark.parametrize("fmt,tokens,heads,kernel,splits,topk", CASES)
def test_fused_matches_reference_and_the_combine_kernel(fmt, tokens, heads, kernel, splits, topk):
    skip_unless_sm90()
    k_scale = 0.5 if fmt.split("-")[0] == "fp8" else 1.0
    c = make_case(fmt, tokens, heads, topk, ctx=2 * topk, block_size=64, device="cuda", k_scale=k_scale)
    sm = c["fmt"].head_dim ** -0.5
    fused = _plan(c, kernel, True, splits)
    if splits is not None:
        assert fused.num_splits == min(splits, topk // 64), fused
    out, lse = _run(c, sm, fused, k_scale)
    check_reference(c, sm, out, lse, k_scale)
    o2, l2 = _run(c, sm, _plan(c, kernel, False, splits), k_scale)
    # the same partials merged by the same arithmetic in another order: bf16 outputs within a rounding
    assert rel_err(out, o2) <= 4e-3 and lse_err(lse, l2) <= 1e-5 * lse_scale(l2), (rel_err(out, o2), SEED)


def test_the_barrier_is_reused_call_after_call_and_grid_after_grid():
    """Fused calls of different grid sizes back to back on one stream, with unfused calls between them: every
    result correct, and afterwards the scratch's barrier count is 0 and its generation one further per fused
    call (a barrier that left its count off by one would hang or pass the next call's barrier early)."""
    skip_unless_sm90()
    cases = [make_case(f, t, h, 2048, ctx=4096, block_size=64, device="cuda", seed=SEED + i)
             for i, (f, t, h) in enumerate((("fp8_ds_mla", 1, 16), ("nvfp4_ds_mla", 2, 64), ("fp8_ds_mla", 4, 16)))]
    kernels = ("sm90-few", "sm90-conv", "sm90-few")
    plans = [_plan(c, k, True) for c, k in zip(cases, kernels)]
    sm = [c["fmt"].head_dim ** -0.5 for c in cases]
    refs = [_run(c, s, _plan(c, k, False)) for c, s, k in zip(cases, sm, kernels)]
    _run(cases[0], sm[0], plans[0])  # the scratch exists from here on
    torch.cuda.synchronize()
    count0, gen0 = _barrier_words()
    assert count0 == 0
    n = 0
    for _ in range(100):
        for c, s, p, k in zip(cases, sm, plans, kernels):
            got = _run(c, s, p)
            n += 1
            _run(c, s, _plan(c, k, False))  # the unfused kernel on the same scratch: leaves the header alone
    torch.cuda.synchronize()
    for c, s, p, (o, l) in zip(cases, sm, plans, refs):
        got = _run(c, s, p)
        n += 1
        assert rel_err(got[0], o) <= 4e-3 and lse_err(got[1], l) <= 1e-5 * lse_scale(l)
    torch.cuda.synchronize()
    count, gen = _barrier_words()
    assert count == 0 and (gen - gen0) % 2 ** 32 == n, (count, gen, gen0, n)


def test_fused_in_a_cuda_graph_with_a_runner_buffer():
    """A runner's split buffer (allocated without zeroing: the launcher zeroes its header at the first use, here
    before capture), a fused call captured in a CUDA graph and replayed: each replay correct, the barrier back at
    zero with one generation per replay."""
    skip_unless_sm90()
    c = make_case("nvfp4_ds_mla", 2, 128, 2048, ctx=4096, block_size=64, device="cuda")
    sm = c["fmt"].head_dim ** -0.5
    plan = _plan(c, "sm90-conv", True)
    buf = torch.full((attn_mod.split_elements(plan, 2, 128),), float("nan"), dtype=torch.float32, device="cuda")
    out = torch.full((2, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((2, 128), float("nan"), dtype=torch.float32, device="cuda")

    def call():
        attn_mod.attention_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm, plan=plan,
                               valid_counts=c["valid_counts"], out=out, lse=lse, split_buffers=buf)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # warm-up: builds the kernel, zeroes the header
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    check_reference(c, sm, out, lse)
    gen0 = int(buf[:2].view(torch.int32)[1])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for i in range(20):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    check_reference(c, sm, out, lse)
    count, gen = (int(x) for x in buf[:2].view(torch.int32).tolist())
    assert count == 0 and (gen - gen0) % 2 ** 32 == 20, (count, gen, gen0)
