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
    import sparsemla.kernels.convert_indices as ci
    calls = []
    real = ci.convert_indices_triton
    monkeypatch.setattr(ci, "convert_indices_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    pos, req, table = make_case(4, 20, 2, 3, 8, seed=6, device=device)
    got = convert_indices(pos, req, table, 8, 8, return_valid_counts=True, compact=True)
    assert calls == [1]
    assert_same(got, convert_indices_torch(pos, req, table, 8, 8, True, True))
