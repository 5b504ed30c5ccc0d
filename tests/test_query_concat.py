"""``kernels.query_concat``: an engine's (q_nope, q_pe) pair copied into the one query tensor the kernels read."""
import pytest
import torch

from sparsemla.kernels.query_concat import query_concat


@pytest.mark.parametrize("tokens, heads, rope", [(1, 16, 64), (3, 20, 64), (2, 128, 64), (2, 5, 32)])
def test_matches_cat_for_strided_parts(tokens, heads, rope):
    g = torch.Generator().manual_seed(tokens * 1000 + heads)
    # q_nope head-major (a bmm output transposed), q_pe a slice of a wider projection: neither contiguous
    q_nope = torch.randn(heads, tokens, 512, generator=g).bfloat16().transpose(0, 1)
    proj = torch.randn(tokens, heads, 128 + rope, generator=g).bfloat16()
    q_pe = proj[..., 128:]
    out = torch.full((tokens + 1, heads, 512 + rope), float("nan"), dtype=torch.bfloat16)
    got = query_concat(q_nope, q_pe, out[:tokens])
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:tokens], torch.cat((q_nope, q_pe), -1))
    assert torch.isnan(out[tokens].float()).all()  # nothing written past the tokens given


def test_unaligned_parts_and_no_tokens():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2 * 7 * 512 + 3, generator=g).bfloat16()
    q_nope = base[3:].view(2, 7, 512)  # 6 bytes past an aligned address: the launcher's general path
    q_pe = torch.randn(2, 7, 64, generator=g).bfloat16()
    out = torch.zeros(2, 7, 576, dtype=torch.bfloat16)
    query_concat(q_nope, q_pe, out)
    assert torch.equal(out, torch.cat((q_nope, q_pe), -1))
    empty = torch.zeros(0, 7, 576, dtype=torch.bfloat16)
    assert query_concat(q_nope[:0], q_pe[:0], empty) is empty
