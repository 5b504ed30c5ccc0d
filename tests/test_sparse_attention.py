"""Native sparse-attention kernels vs the float64 reference, under the Triton interpreter (small shapes).

The same checks run at real sizes on the H200 in tests/gpu/test_sparse_attention_gpu.py.
"""
import pytest
import torch

import sparsemla
from sparsemla.formats import get_format
from sparsemla.kernels.staging import gather_topk_fp8
from sparsemla.reference import sparse_mla

from attn_cases import SEED, lse_err, lse_ref_err, make_case, rel_err, run_kernel

FORMATS = ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16-nope", "fp8-nope", "fp8_ds_mla-nope",
           "nvfp4_ds_mla-nope"]
TOL = 1e-2


def _run_native(c, sm_scale, k_scale=1.0, **kw):
    return run_kernel(c["q"], c["cache"].rows, c["fmt"], c["indices"], sm_scale, c["valid_counts"], k_scale, **kw)


def _run_staged(c, staged, sm_scale, k_scale, num_splits=None):
    fp8 = get_format("fp8", c["fmt"].rope_dim)
    rows8 = staged.view(torch.uint8).view(-1, staged.shape[2])
    return run_kernel(c["q"], rows8, fp8, c["indices"], sm_scale, c["valid_counts"], k_scale, num_splits=num_splits,
                      staged=True)


def _check(out, lse, c, sm_scale, k_scale=1.0, tol=TOL):
    ref_o, ref_l = sparse_mla(c["q"].double(), c["cache"], c["indices"], sm_scale, c["valid_counts"], k_scale)
    assert torch.isfinite(out.float()).all(), f"non-finite output (seed {SEED})"
    assert rel_err(out, ref_o) <= tol, (rel_err(out, ref_o), SEED)
    assert lse_ref_err(lse, ref_l) <= tol, (lse_ref_err(lse, ref_l), SEED)
    empty = c["valid_counts"] == 0
    if empty.any():
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [1, 5, 20])
def test_native_matches_reference(fmt, heads, device):
    c = make_case(fmt, 3, heads, 48, device=device)
    out, lse = _run_native(c, 0.07, num_splits=2)
    _check(out, lse, c, 0.07)


@pytest.mark.parametrize("fmt", FORMATS + ["staged"])
def test_many_heads_wide_kernel(fmt, device):
    """More than 32 heads run the wide kernel (64 heads per program, tiles converted once to bf16); 40 heads
    leave 24 masked rows in the head block."""
    if fmt == "staged":
        c = make_case("fp8_ds_mla", 3, 40, 48, device=device)
        staged = gather_topk_fp8(c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"], 1.0)
        out, lse = _run_staged(c, staged, 0.07, 1.0, num_splits=2)
        ref_o, ref_l = _staged_reference(c, staged, 0.07, 1.0)
        assert rel_err(out, ref_o) <= TOL and lse_ref_err(lse, ref_l) <= TOL
        return
    c = make_case(fmt, 3, 40, 48, device=device, k_scale=0.5 if fmt == "fp8" else 1.0)
    ks = 0.5 if fmt == "fp8" else 1.0
    out, lse = _run_native(c, 0.07, k_scale=ks, num_splits=2)
    _check(out, lse, c, 0.07, ks)


@pytest.mark.parametrize("splits", [1, 3])
def test_split_kv_and_combine(splits, device):
    c = make_case("fp8_ds_mla", 3, 16, 96, device=device)
    out, lse = _run_native(c, 0.05, num_splits=splits)
    _check(out, lse, c, 0.05)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_k_scale_is_applied_once(fmt, device):
    """k_scale changes the values of the plain fp8 format only; a missing or doubled 1/k_scale fails here."""
    c1 = make_case(fmt, 3, 4, 32, device=device, seed=SEED + 1, k_scale=1.0)
    c5 = make_case(fmt, 3, 4, 32, device=device, seed=SEED + 1, k_scale=0.5)
    o1, l1 = _run_native(c1, 0.1, k_scale=1.0, num_splits=1)
    o5, l5 = _run_native(c5, 0.1, k_scale=0.5, num_splits=1)
    _check(o1, l1, c1, 0.1, 1.0)
    _check(o5, l5, c5, 0.1, 0.5)
    # Same source data: the two caches decode to (nearly, for fp8 rounding) the same tokens -- unless a value
    # saturated at 448 * k_scale in the k_scale-0.5 cache (the heavy-tailed outlier channel can reach it;
    # each result was checked against its own float64 reference above)
    saturated = fmt == "fp8" and bool((c1["fmt"].decode(c1["cache"].rows, 1.0).abs() >= 232).any())
    if not saturated:
        assert rel_err(o5, o1) < 0.1, SEED
    if fmt != "fp8":
        # The cache bytes do not depend on k_scale, and neither may the result.
        assert torch.equal(c1["cache"].rows, c5["cache"].rows)
        assert torch.equal(o1, o5)
    # Wrong k_scale at read time must be visible (guards against the factor being ignored).
    ow, _ = _run_native(c5, 0.1, k_scale=1.0, num_splits=1)
    if fmt == "fp8":
        assert rel_err(ow, o5) > 0.2
    else:
        assert torch.equal(ow, o5)


def _staged_reference(c, staged, sm_scale, k_scale):
    """float64 attention over the staged e4m3 values themselves (what the staged kernel must compute)."""
    t, k, d = staged.shape
    ws = staged.to(torch.float64).reshape(t * k, d) * k_scale
    rows = torch.arange(t * k, device=staged.device).view(t, k)
    idx = torch.where(c["indices"] >= 0, rows, torch.full_like(rows, -1))
    return sparse_mla(c["q"].double(), ws, idx, sm_scale, c["valid_counts"])


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "nvfp4_ds_mla-nope", "bf16"])
@pytest.mark.parametrize("k_scale", [1.0, 0.5])
def test_staged_path(fmt, k_scale, device):
    """The staged backend: exact on the staged values; equal to the native kernel where staging loses
    nothing (plain fp8 with the cache's own k_scale is a byte copy)."""
    ks_cache = k_scale if fmt == "fp8" else 1.0
    c = make_case(fmt, 3, 5, 40, device=device, k_scale=ks_cache)
    staged = gather_topk_fp8(c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"], k_scale)
    o_s, l_s = _run_staged(c, staged, 0.08, k_scale, num_splits=2)
    ref_o, ref_l = _staged_reference(c, staged, 0.08, k_scale)
    assert rel_err(o_s, ref_o) <= TOL and lse_ref_err(l_s, ref_l) <= TOL
    if fmt == "fp8":
        o_n, l_n = _run_native(c, 0.08, k_scale=k_scale)
        assert rel_err(o_s, o_n) < 2e-2 and lse_err(l_s, l_n) < 1e-3


def test_no_valid_entry_anywhere(device):
    c = make_case("fp8_ds_mla", 2, 3, 16, device=device)
    c["indices"].fill_(-1)
    out, lse = _run_native(c, 0.1)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_bad_arguments(device):
    c = make_case("bf16", 2, 2, 16, device=device)
    with pytest.raises(ValueError, match="q: expected shape"):
        sparsemla.sparse_mla_decode(c["q"][..., :512].contiguous(), c["cache"], c["indices"], 0.1)
    with pytest.raises(TypeError, match="q: expected dtype"):
        sparsemla.sparse_mla_decode(c["q"].float(), c["cache"], c["indices"], 0.1)
    with pytest.raises(TypeError, match="indices: expected dtype"):
        sparsemla.sparse_mla_decode(c["q"], c["cache"], c["indices"].long(), 0.1)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla", "fp8-nope"])
def test_prefill_through_bf16_workspace_matches_native(fmt, device):
    """The prefill recipe for quantized caches: upconvert each request's context to a bf16 workspace,
    map top-k positions to workspace rows, run the bf16 kernel.  Same result as reading the cache natively."""
    from sparsemla.indices import convert_indices
    from sparsemla.kernels.staging import upconvert_context

    c = make_case(fmt, 3, 6, 40, ctx=64, device=device, pad_frac=0.0)
    cache = c["cache"]
    gen = c["gen"]
    nblk = 64 // cache.block_size
    # Rebuild each token's request-local positions from its rows (make_case gives request t the blocks
    # in a shuffled table; recover them from the rows).
    rows = c["indices"].long()
    blk = rows // cache.block_stride_rows
    off = rows % cache.block_stride_rows
    num_req = 3
    table = torch.full((num_req, nblk), -1, dtype=torch.int32, device=device)
    topk_local = torch.full_like(c["indices"], -1)
    for t in range(num_req):
        n = int(c["valid_counts"][t])
        used = torch.unique(blk[t, :n][rows[t, :n] >= 0]) if n else blk[t, :0]
        # assign table slots in order of first use; positions = slot * block_size + offset
        for j, b in enumerate(used.tolist()):
            table[t, j] = b
        for k in range(n):
            if rows[t, k] >= 0:
                j = (used == blk[t, k]).nonzero()[0, 0]
                topk_local[t, k] = j * cache.block_size + off[t, k]
    seq_lens = torch.full((num_req,), nblk * cache.block_size, dtype=torch.int32, device=device)
    ws, ws_start = upconvert_context(cache.rows, c["fmt"], table, seq_lens, cache.block_size, cache.block_stride_rows)
    ws_rows = convert_indices(topk_local, torch.arange(num_req, dtype=torch.int32, device=device), table,
                              cache.block_size, cache.block_stride_rows, workspace_start=ws_start)
    bf = get_format("bf16", c["fmt"].rope_dim)
    o_ws, l_ws = run_kernel(c["q"], ws.view(torch.uint8), bf, ws_rows, 0.1, c["valid_counts"])
    o_n, l_n = _run_native(c, 0.1)
    assert rel_err(o_ws, o_n) < 1e-2
    assert lse_err(l_ws, l_n) < 1e-2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("heads", [5, 40])
def test_query_in_two_tensors_is_read_in_place(fmt, heads, device):
    """``q_pe=``: the query's RoPE part in a tensor of its own (an engine's ``(q_nope, q_pe)`` pair, q_pe a strided
    view of a wider projection, q_nope with its own strides) gives bitwise the output of the one concatenated
    query, few-heads and wide kernels, and matches the reference."""
    from sparsemla.kernels.attention import attention_fwd

    c = make_case(fmt, 3, heads, 48, device=device)
    q = c["q"]
    proj = torch.randn(q.shape[1], q.shape[0], 192, device=device).to(q.dtype).transpose(0, 1)  # [T, H, 192]
    proj[..., 128:] = q[..., 512:]
    q_pe = proj[..., 128:]  # token stride 192 H, head stride 192: a view, not a copy
    q_nope = torch.empty(q.shape[1], q.shape[0], 512, device=device, dtype=q.dtype).transpose(0, 1)
    q_nope.copy_(q[..., :512])
    assert q_pe.stride() == (192, 192 * q.shape[0], 1) and not q_nope.is_contiguous()
    ref = attention_fwd(q, c["cache"].rows, c["fmt"], c["indices"], 0.07, valid_counts=c["valid_counts"])
    got = attention_fwd(q_nope, c["cache"].rows, c["fmt"], c["indices"], 0.07, valid_counts=c["valid_counts"],
                        q_pe=q_pe)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    _check(*got, c, 0.07)


class _Recorder:
    """A stand-in for the launcher's ``Launch``: records each launch offered to the direct path (declined, as if
    not compiled yet, so that the regular launch follows) and each regular launch, as (name, "direct" / "regular",
    grid, key, arguments with tensors as their addresses) into ``seen``; the regular launch's addresses must be
    those it was given."""
    built = True
    direct = True

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def launch_in(self, ctx, gx, gy, gz, key, addrs):
        assert ctx == ("device", "stream")  # the context both launches share
        self.seen.append((self.name, "direct", (gx, gy, gz), key, tuple(addrs)))
        return False

    def __call__(self, grid, args, key=None, addrs=None):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        as_addrs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        assert addrs is None or tuple(addrs) == as_addrs, (self.name, addrs, as_addrs)
        self.seen.append((self.name, "regular", grid, key, as_addrs))


@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "three-splits"])
def test_the_direct_launch_passes_what_the_regular_launch_does(monkeypatch, device, splits):
    """A launch first offers the compiled specialization its key and addresses (``Launch.launch_in``, the
    host-time path, with the device and stream read once for both launches); when that declines, the regular
    launch gets the tensors.  Both must describe the same launch: the same grid, key and arguments (tensors as
    their addresses), for the attention kernel and for the combine that follows a split call."""
    from sparsemla.kernels import attention as attn_mod

    c = make_case("fp8_ds_mla", 3, 16, 48, device=device)
    q, rows, idx, vc = (c["q"].clone(), c["cache"].rows, c["indices"].clone(), c["valid_counts"].clone())
    plan = attn_mod.plan_for(q, rows, c["fmt"], 48, num_splits=splits)
    assert plan.num_splits == splits
    seen = []
    monkeypatch.setattr(attn_mod, "_launch_for", lambda p, f, has_vc: _Recorder("attention", seen))
    monkeypatch.setattr(attn_mod, "_combine_launch", lambda ns, pdl: _Recorder("combine", seen))
    monkeypatch.setattr(attn_mod, "_BOUND", {})
    contexts = []
    monkeypatch.setattr(attn_mod, "direct_context", lambda: contexts.append(1) or ("device", "stream"))
    for t in (q, rows, idx, vc):
        assert t.data_ptr() % 16 == 0  # aligned: the direct path is offered
    for _ in range(2):  # the second call finds its bound launch
        seen.clear()
        attn_mod.attention_fwd(q, rows, c["fmt"], idx, 0.07, plan=plan, valid_counts=vc)
        names = ["attention"] + (["combine"] if splits > 1 else [])
        assert [s[0] for s in seen] == [n for n in names for _ in (0, 1)]
        assert len(contexts) == 1  # read once a call
        contexts.clear()
        for n in names:
            direct, regular = [s[2:] for s in seen if s[0] == n]
            assert direct == regular, n
        key = [s for s in seen if s[0] == "attention"][0][3]
        # q's strides, then those of its RoPE part (here q[..., 512:]: the same), the index rows' stride
        assert key[:5] == (*q.stride()[:2], *q.stride()[:2], idx.stride(0)) and key[-4:][:2] == (16, 48)
        addrs = [s for s in seen if s[0] == "attention"][0][4]
        assert addrs[3] == q.data_ptr() + 1024  # the RoPE part's address: 512 bf16 values into each q row


def test_a_persistent_plan_launches_a_program_per_sm_and_passes_the_item_count():
    """A persistent plan (bf16 rows, more work items than SMs) launches at most one program per SM and gives the
    kernel the call's item count (tokens x splits x head groups) as its last argument, which is part of the
    launch's key; a plan of one item a program launches one program per item and passes the count as well."""
    from sparsemla.kernels import attention as attn_mod
    from sparsemla.plan import plan_attention
    fmt = get_format("bf16")
    strides = ((128 * 576, 576), (128 * 576, 576), 2048, (128 * 512, 512), (128, 1))
    p = plan_attention(fmt, 4096, 128, 2048, capability=(9, 0), num_sms=132)
    b = attn_mod._Bound(p, fmt, True, 4096, 128, 2048, *strides, torch.device("cpu"))
    assert p.persistent and b.launch.meta["PS"] and b.gx == 132 and b.items == (8192, ) and b.key[-1] == 8192
    q = plan_attention(fmt, 128, 64, 2048, capability=(9, 0), num_sms=132)
    b = attn_mod._Bound(q, fmt, True, 128, 64, 2048, *strides, torch.device("cpu"))
    assert not q.persistent and not b.launch.meta["PS"] and b.gx == 128 and b.items == (128, )


def test_a_fused_plan_is_one_launch_when_its_partials_persist(monkeypatch, device):
    """A plan with ``fused_combine`` launches the kernel's FUSED variant and no combine where its partials live in a
    buffer that persists (a runner's ``split_buffers``; the launcher's scratch on a GPU): the partials start
    ``HEADER`` words into it, the header (the grid barrier's words) is zeroed at the buffer's first use, and the
    final out / lse with their strides follow the common arguments.  Partials in a fresh allocation (here: no
    runner off the GPU) go through the unfused kernel and the combine.  A runner buffer without room for the
    header is refused."""
    from sparsemla import plan as plan_mod
    from sparsemla.kernels import attention as attn_mod

    c = make_case("fp8_ds_mla", 3, 16, 256, device=device)
    q, rows, idx, vc, fmt = c["q"], c["cache"].rows, c["indices"], c["valid_counts"], c["fmt"]
    plan = plan_mod.plan_attention(fmt, 3, 16, 256, capability=(9, 0), num_sms=132, fused_combine=True)
    assert plan.kernel == "sm90-few" and plan.num_splits == 2 and plan.fused_combine
    seen = []
    monkeypatch.setattr(attn_mod, "_launch_for", lambda p, f, has_vc, fused=False: _Recorder(
        "fused" if fused else "attention", seen))
    monkeypatch.setattr(attn_mod, "_combine_launch", lambda ns, pdl: _Recorder("combine", seen))
    monkeypatch.setattr(attn_mod, "_BOUND", {})
    monkeypatch.setattr(attn_mod, "direct_context", lambda: ("device", "stream"))
    n = attn_mod.split_elements(plan, 3, 16)
    n_o = 3 * 2 * 16 * 512
    assert n == attn_mod.HEADER + n_o + 3 * 2 * 16
    buf = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(3, 16, dtype=torch.float32, device=device)
    attn_mod.attention_fwd(q, rows, fmt, idx, 0.07, plan=plan, valid_counts=vc, out=out, lse=lse, split_buffers=buf)
    assert [(s[0], s[1]) for s in seen] == [("fused", "direct"), ("fused", "regular")]
    assert torch.equal(buf[:attn_mod.HEADER], torch.zeros(attn_mod.HEADER, device=device))
    addrs = seen[0][4]
    assert addrs[10] == buf.data_ptr() + 4 * attn_mod.HEADER  # the partial outputs, after the header
    assert addrs[14] == buf.data_ptr() + 4 * (attn_mod.HEADER + n_o)  # the partial lse
    assert addrs[-6:] == (out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr(), lse.stride(0), lse.stride(1))
    seen.clear()
    attn_mod.attention_fwd(q, rows, fmt, idx, 0.07, plan=plan, valid_counts=vc, out=out, lse=lse)
    assert [s[0] for s in seen] == ["attention", "attention", "combine", "combine"]
    with pytest.raises(ValueError, match=f"split_buffers: {n - 1} fp32 elements, this call needs {n}"):
        attn_mod.attention_fwd(q, rows, fmt, idx, 0.07, plan=plan, valid_counts=vc, out=out, lse=lse,
                               split_buffers=buf[:n - 1])


def test_a_fused_variant_that_does_not_build_leaves_its_kernel_serving(monkeypatch, device):
    """A FUSED variant whose first launch raises is recorded as ``fused-combine`` (not its kernel): the same call,
    and every later one, runs the kernel's plain variant and the combine kernel."""
    from sparsemla import plan as plan_mod
    from sparsemla.kernels import attention as attn_mod

    c = make_case("fp8_ds_mla", 3, 16, 256, device=device)
    q, rows, idx, vc, fmt = c["q"], c["cache"].rows, c["indices"], c["valid_counts"], c["fmt"]
    plan = plan_mod.plan_attention(fmt, 3, 16, 256, capability=(9, 0), num_sms=132, fused_combine=True)
    seen = []

    class Broken(_Recorder):
        built = False

        def __call__(self, grid, args, key=None, addrs=None):
            seen.append((self.name, "raised"))
            raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(attn_mod, "_launch_for", lambda p, f, has_vc, fused=False: (
        Broken("fused", seen) if fused else _Recorder("attention", seen)))
    monkeypatch.setattr(attn_mod, "_combine_launch", lambda ns, pdl: _Recorder("combine", seen))
    monkeypatch.setattr(attn_mod, "_BOUND", {})
    monkeypatch.setattr(attn_mod, "direct_context", lambda: ("device", "stream"))
    buf = torch.zeros(attn_mod.split_elements(plan, 3, 16), dtype=torch.float32, device=device)
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(3, 16, dtype=torch.float32, device=device)
    plan_mod.clear_unavailable()
    try:
        for _ in range(2):
            seen.clear()
            attn_mod.attention_fwd(q, rows, fmt, idx, 0.07, plan=plan, valid_counts=vc, out=out, lse=lse,
                                   split_buffers=buf)
            names = [s[0] for s in seen if s[1] != "direct"]
            assert names[-2:] == ["attention", "combine"] and "sm90-few" not in plan_mod.unavailable_kernels()
        assert "PassManager::run failed" in plan_mod.unavailable_kernels()[plan_mod.FUSED_COMBINE]
        assert [s for s in seen if s[0] == "fused"] == []  # the second call does not try it again
        assert not plan_mod.plan_attention(fmt, 3, 16, 256, capability=(9, 0), num_sms=132, fused_combine=True,
                                           unavailable=plan_mod.unavailable_set()).fused_combine
    finally:
        plan_mod.clear_unavailable()


def test_launch_call_plans_once_per_shape_alignment_and_unavailable_set(monkeypatch, device):
    """``launch_call`` (the backends' path) caches the plan with the launch's bound arguments: a repeated call plans
    nothing; q at an address that is not 16-byte aligned, or a kernel found unavailable since, gets a plan of its
    own (both change what the plan may choose); the outputs are those of ``plan_for`` + ``attention_fwd``."""
    from sparsemla import plan as plan_mod
    from sparsemla.kernels import attention as attn_mod

    c = make_case("fp8_ds_mla", 3, 16, 48, device=device)
    rows, fmt, idx, vc = c["cache"].rows, c["fmt"], c["indices"], c["valid_counts"]
    real, planned = attn_mod.plan_for, []

    def spy(q, rows, fmt, topk, **kw):
        planned.append(q.data_ptr() & 15)
        return real(q, rows, fmt, topk, **kw)

    monkeypatch.setattr(attn_mod, "plan_for", spy)
    monkeypatch.setattr(attn_mod, "_BOUND", {})

    def call(q):
        out = torch.full((3, 16, 512), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((3, 16), float("nan"), dtype=torch.float32, device=device)
        attn_mod.launch_call(q, rows, fmt, idx, 0.07, vc, 1.0, out, lse)
        return out, lse

    ref = attn_mod.attention_fwd(c["q"], rows, fmt, idx, 0.07, plan=real(c["q"], rows, fmt, 48), valid_counts=vc)
    for _ in range(2):
        got = call(c["q"])
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert planned == [0]
    # q two bytes past a 16-byte boundary: planned again, same values
    buf = torch.empty(c["q"].numel() + 8, dtype=torch.bfloat16, device=device)
    q_odd = buf[1:1 + c["q"].numel()].view_as(c["q"])
    q_odd.copy_(c["q"])
    got = call(q_odd)
    assert planned == [0, 2] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    plan_mod.mark_unavailable("sm90-few", "test")
    try:
        call(c["q"])
        assert planned == [0, 2, 0]
    finally:
        plan_mod.clear_unavailable()
    _check(*got, c, 0.07)


def test_a_kernel_that_does_not_build_falls_back_to_the_portable_kernels(monkeypatch, device):
    """A Hopper kernel whose first launch raises (it did not build on the installed Triton) is recorded as
    unavailable and the call runs the portable kernels; later plans skip it.  (The plan is forced here: on this
    machine the Hopper kernels are never planned.)"""
    import dataclasses
    from sparsemla import plan as plan_mod
    from sparsemla.kernels import attention as attn_mod

    c = make_case("fp8_ds_mla", 3, 16, 48, device=device)
    portable = attn_mod.plan_for(c["q"], c["cache"].rows, c["fmt"], 48)
    forced = dataclasses.replace(portable, kernel="sm90-few", heads_per_program=16, num_groups=1)

    class Broken:
        built = False
        direct = False

        def launch_in(self, ctx, gx, gy, gz, key, addrs):
            return False  # never compiled

        def __call__(self, grid, args, key=None, addrs=None):
            raise RuntimeError("error encountered during parsing")

    monkeypatch.setattr(attn_mod, "_sm90_launch", lambda plan, fmt, has_vc, fused: Broken())
    monkeypatch.setattr(attn_mod, "_LAUNCHES", {})
    monkeypatch.setattr(attn_mod, "_BY_PLAN", {})
    monkeypatch.setattr(attn_mod, "_BOUND", {})
    plan_mod.clear_unavailable()
    try:
        out, lse = attn_mod.attention_fwd(c["q"], c["cache"].rows, c["fmt"], c["indices"], 0.07, plan=forced,
                                          valid_counts=c["valid_counts"])
        _check(out, lse, c, 0.07)
        assert "error encountered during parsing" in plan_mod.unavailable_kernels()["sm90-few"]
        assert "sm90-few" in plan_mod.unavailable_set()
    finally:
        plan_mod.clear_unavailable()
