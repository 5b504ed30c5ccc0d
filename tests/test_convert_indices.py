"""Index-conversion kernel (kernels/convert_indices.py) against the PyTorch reference
(indices.convert_indices_torch), entry by entry, under the Triton interpreter: -1 padding, positions
whose block lies outside the table or whose table entry is negative, valid counts, compaction (order
kept), the prefill-workspace mode, empty rows, widths that are not powers of two (2051 -> 2112),
strided inputs, block_stride_rows > block_size, and the public dispatcher.
"""
import pytest
import torch

from sparsemla.indices import convert_indices, convert_indices_torch, pooled_width
from sparsemla.kernels.convert_indices import convert_indices_triton


def make_case(t, k, n_req, max_blocks, block_size, seed, device, valid_prefix=True, table_holes=True):
    """Random request-local top-k rows: mostly a valid prefix then -1, some positions past the block
    table, some table entries negative, one all -1 row."""
    g = torch.Generator().manual_seed(seed)
    ctx = max_blocks * block_size
    pos = torch.randint(0, ctx + 3 * block_size, (t, k), generator=g)          # some beyond the table
    if valid_prefix:
        n_valid = torch.randint(0, k + 1, (t,), generator=g)
        pos = torch.where(torch.arange(k)[None, :] < n_valid[:, None], pos, torch.full_like(pos, -1))
    else:
        pos = torch.where(torch.rand(t, k, generator=g) < 0.3, torch.full_like(pos, -1), pos)
    if t > 1:
        pos[1] = -1                                                             # an empty row
    req = torch.randint(0, n_req, (t,), generator=g)
    table = torch.randperm(max(n_req * max_blocks, 1), generator=g)[: n_req * max_blocks].reshape(n_req, max_blocks)
    if table_holes and table.numel():
        table = torch.where(torch.rand(table.shape, generator=g) < 0.15, torch.full_like(table, -1), table)
    dev = lambda x: x.to(torch.int32).to(device)
    return dev(pos), dev(req), dev(table)


def assert_same(got, want):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape
            assert torch.equal(a.cpu(), b.cpu()), f"first difference at {(a.cpu() != b.cpu()).nonzero()[:3].tolist()}"
    else:
        assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got.cpu(), want.cpu()), f"first difference at {(got.cpu() != want.cpu()).nonzero()[:3].tolist()}"


@pytest.mark.parametrize("k", [1, 37, 64, 2051, pooled_width(2048, 4)])
@pytest.mark.parametrize("compact", [False, True])
def test_matches_reference(k, compact, device):
    pos, req, table = make_case(6, k, 3, 5, 16, seed=k, device=device, valid_prefix=(k != 37))
    for counts in (False, True):
        want = convert_indices_torch(pos, req, table, 16, 16, counts, compact)
        got = convert_indices_triton(pos, req, table, 16, 16, counts, compact)
        assert_same(got, want)


@pytest.mark.parametrize("compact", [False, True])
def test_strided_blocks_and_odd_block_size(compact, device):
    """block_size 3 (not a power of two), blocks 7 rows apart; positions anywhere (not a prefix)."""
    pos, req, table = make_case(5, 50, 2, 9, 3, seed=2, device=device, valid_prefix=False)
    want = convert_indices_torch(pos, req, table, 3, 7, True, compact)
    assert_same(convert_indices_triton(pos, req, table, 3, 7, True, compact), want)


@pytest.mark.parametrize("compact", [False, True])
def test_workspace_mode(compact, device):
    """Requests with workspace_start >= 0 index the workspace (start + position, table ignored);
    the others go through the block table."""
    pos, req, table = make_case(8, 40, 4, 3, 8, seed=3, device=device, valid_prefix=False)
    ws = torch.tensor([100, -1, 0, -5], dtype=torch.int32, device=device)
    want = convert_indices_torch(pos, req, table, 8, 8, True, compact, ws)
    assert_same(convert_indices_triton(pos, req, table, 8, 8, True, compact, ws), want)
    ws64 = ws.to(torch.int64)
    assert_same(convert_indices_triton(pos, req, table, 8, 8, True, compact, ws64), want)


def test_valid_counts_and_compaction_semantics(device):
    """Hand-made rows: count = shortest prefix holding every valid entry; compaction keeps order."""
    table = torch.tensor([[2, -1, 0]], dtype=torch.int32, device=device)        # block 1 missing
    pos = torch.tensor([[0, 5, -1, 9, 13, 30, -1, 1],                           # 5 -> block 1 (missing); 30 -> outside
                        [-1, -1, -1, -1, -1, -1, -1, -1],
                        [4, -1, -1, -1, -1, -1, -1, 8]], dtype=torch.int32, device=device)
    req = torch.zeros(3, dtype=torch.int32, device=device)
    rows, counts = convert_indices_triton(pos, req, table, 4, 4, True, False)
    assert rows.cpu().tolist() == [[8, -1, -1, 1, -1, -1, -1, 9], [-1] * 8, [-1, -1, -1, -1, -1, -1, -1, 0]]
    assert counts.cpu().tolist() == [8, 0, 8]
    rows, counts = convert_indices_triton(pos, req, table, 4, 4, True, True)
    assert rows.cpu().tolist() == [[8, 1, 9, -1, -1, -1, -1, -1], [-1] * 8, [0, -1, -1, -1, -1, -1, -1, -1]]
    assert counts.cpu().tolist() == [3, 0, 1]


def test_int64_and_strided_inputs(device):
    pos, req, table = make_case(7, 33, 3, 4, 16, seed=4, device=device)
    wide = torch.full((7, 70), -7, dtype=torch.int64, device=device)
    wide[:, ::2][:, :33] = pos.to(torch.int64)
    pos_strided = wide[:, ::2][:, :33]                                          # column stride 2
    table_t = table.t().contiguous().t()                                       # column-major table
    want = convert_indices_torch(pos, req, table, 16, 16, True, True)
    got = convert_indices_triton(pos_strided, req.to(torch.int64), table_t.to(torch.int64), 16, 16, True, True)
    assert_same(got, want)


def test_empty_table_and_empty_inputs(device):
    pos, req, _ = make_case(3, 10, 2, 2, 4, seed=5, device=device)
    empty_table = torch.zeros(2, 0, dtype=torch.int32, device=device)
    assert_same(convert_indices_triton(pos, req, empty_table, 4, 4, True, True),
                convert_indices_torch(pos, req, empty_table, 4, 4, True, True))
    z = torch.zeros(0, 5, dtype=torch.int32, device=device)
    rows, counts = convert_indices_triton(z, torch.zeros(0, dtype=torch.int32, device=device),
                                          torch.zeros(1, 2, dtype=torch.int32, device=device), 4, 4, True)
    assert rows.shape == (0, 5) and counts.shape == (0,)
    z = torch.zeros(3, 0, dtype=torch.int32, device=device)
    rows, counts = convert_indices_triton(z, torch.zeros(3, dtype=torch.int32, device=device),
                                          torch.zeros(1, 2, dtype=torch.int32, device=device), 4, 4, True)
    assert rows.shape == (3, 0) and counts.cpu().tolist() == [0, 0, 0]


def test_public_dispatch_uses_kernel(device, monkeypatch):
    """indices.convert_indices runs the kernel wherever Triton runs (here: the interpreter or CUDA)."""
    import sparsemla.indices as ci
    calls = []
    real = ci.convert_indices_triton
    monkeypatch.setattr(ci, "convert_indices_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    pos, req, table = make_case(4, 20, 2, 3, 8, seed=6, device=device)
    got = convert_indices(pos, req, table, 8, 8, return_valid_counts=True, compact=True)
    assert calls == [1]
    assert_same(got, convert_indices_torch(pos, req, table, 8, 8, True, True))


# --------------------------------------------------------------------------------------------
# out=, the debug check, no host reads
# --------------------------------------------------------------------------------------------
class _NoHostRead(Exception):
    pass


def forbid_host_reads(monkeypatch):
    """Make every way of reading a tensor value on the host (a device sync on CUDA) raise."""
    def boom(*a, **k):
        raise _NoHostRead("a tensor value was read on the host")
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)


@pytest.mark.parametrize("counts", [False, True])
@pytest.mark.parametrize("compact", [False, True])
def test_out_buffers_are_written_in_place(counts, compact, device):
    """``out`` (a row slice of a wider buffer: a row stride other than K) and ``counts_out`` are the
    returned tensors, filled with the reference's values."""
    pos, req, table = make_case(6, 37, 3, 5, 16, seed=8, device=device)
    wide = torch.full((8, 50), -9, dtype=torch.int32, device=device)
    out = wide[1:7, :37]
    cnt = torch.full((6,), -9, dtype=torch.int32, device=device)
    kw = {"counts_out": cnt} if counts else {}
    got = convert_indices(pos, req, table, 16, 16, counts, compact=compact, out=out, **kw)
    want = convert_indices_torch(pos, req, table, 16, 16, counts, compact)
    rows = got[0] if counts else got
    assert rows.data_ptr() == out.data_ptr()
    if counts:
        assert got[1].data_ptr() == cnt.data_ptr()
    assert_same(got, want)
    assert bool((wide[0] == -9).all()) and bool((wide[:, 37:] == -9).all())


def test_default_call_reads_nothing_on_the_host(device, monkeypatch):
    """A default call (given outputs) validates shapes and dtypes only: no tensor value is read on the
    host, which on CUDA would synchronize (the launch itself is replaced by a stub here)."""
    import sparsemla.kernels.convert_indices as ci
    pos, req, table = make_case(4, 20, 2, 3, 8, seed=9, device=device)
    ws = torch.tensor([0, -1], dtype=torch.int32, device=device)
    out = torch.empty(4, 20, dtype=torch.int32, device=device)
    cnt = torch.empty(4, dtype=torch.int32, device=device)
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(grid)

    monkeypatch.setattr(ci, "_convert_indices_kernel", Stub())
    monkeypatch.setattr(ci, "_LAUNCHES", {})  # launches are cached per variant: start from none
    forbid_host_reads(monkeypatch)
    convert_indices(pos, req, table, 8, 8, True, compact=True, workspace_start=ws, out=out, counts_out=cnt)
    assert launches == [(4,)]


def test_bad_request_ids_give_empty_rows(device):
    """A request id that is not a row of the block table reads nothing from it: every entry of that token
    is -1 (kernel and reference agree); ``check=True`` raises instead."""
    pos, req, table = make_case(5, 30, 3, 4, 8, seed=10, device=device)
    req = req.clone()
    req[0], req[3] = 3, -2
    ws = torch.tensor([5, -1, 40], dtype=torch.int32, device=device)
    for kw in ({}, {"workspace_start": ws}):
        want = convert_indices_torch(pos, req, table, 8, 8, True, True, kw.get("workspace_start"))
        assert bool((want[0][[0, 3]] == -1).all()) and want[1][[0, 3]].tolist() == [0, 0]
        assert_same(convert_indices_triton(pos, req, table, 8, 8, True, True, kw.get("workspace_start")), want)
        assert_same(convert_indices(pos, req, table, 8, 8, True, compact=True, **kw), want)
    with pytest.raises(ValueError, match="req_id_per_token"):
        convert_indices(pos, req, table, 8, 8, check=True)
    bad = pos.clone()
    bad[2, 0] = -3
    with pytest.raises(ValueError, match="topk_local"):
        convert_indices(bad, req.clamp(0, 2), table, 8, 8, check=True)


def test_argument_errors(device):
    pos, req, table = make_case(4, 10, 2, 3, 8, seed=11, device=device)
    with pytest.raises(TypeError, match="out"):
        convert_indices(pos, req, table, 8, out=torch.empty(4, 10, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="out"):
        convert_indices(pos, req, table, 8, out=torch.empty(4, 11, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out.*stride"):
        convert_indices(pos, req, table, 8, out=torch.empty(10, 4, dtype=torch.int32, device=device).t())
    with pytest.raises(ValueError, match="counts_out"):
        convert_indices(pos, req, table, 8, counts_out=torch.empty(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="counts_out"):
        convert_indices(pos, req, table, 8, return_valid_counts=True,
                        counts_out=torch.empty(5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="req_id_per_token"):
        convert_indices(pos, req[:3], table, 8)
    with pytest.raises(TypeError, match="topk_local"):
        convert_indices(pos.float(), req, table, 8)
    with pytest.raises(ValueError, match="block_stride_rows"):
        convert_indices(pos, req, table, 8, 4)
