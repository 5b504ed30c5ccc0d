"""The step packing kernel (``kernels/step_pack.py``) against the runner's PyTorch packing, under the interpreter
(or on the GPU when there is one)."""
import pytest
import torch

from sparsemla.kernels.step_pack import step_pack
from sparsemla.runner import BatchMetadata, SparseMLA


def _runner(device, *, max_tokens=40, max_requests=9, width=7, topk=96, index_topk=None, kpool=1):
    return SparseMLA(max_tokens, max_requests, width, 4, 576, topk, "bf16", backend="reference", device=device,
                     sm_scale=0.1, index_topk=index_topk, kpool=kpool, graph_capture=False)


def _buffers(attn):
    return [b.clone() for b in (attn._query_start_loc, attn._seq_lens, attn._block_table, attn._req_id,
                                attn._valid_counts)]


@pytest.mark.parametrize("kpool, index_topk, topk", [(1, 64, 64), (1, 32, 96), (4, 64, 67)])
def test_step_pack_matches_torch(device, kpool, index_topk, topk):
    g = torch.Generator().manual_seed(kpool * 100 + topk)
    attn = _runner(device, topk=topk, index_topk=index_topk, kpool=kpool)
    for step in range(4):
        r = int(torch.randint(1, 10, (1,), generator=g))
        qlens = [1] * (r // 2) + [int(x) for x in torch.randint(1, 6, (r - r // 2,), generator=g)]
        seqs = [q + int(torch.randint(0, 300, (1,), generator=g)) for q in qlens]
        width = int(torch.randint(1, 8, (1,), generator=g))
        table = torch.randint(-1, 50, (r, width), generator=g, dtype=torch.int32)
        ql = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
        t = int(ql[-1])
        req = torch.repeat_interleave(torch.arange(r, dtype=torch.int32), torch.tensor(qlens))
        if step == 3:
            req[0] = 17  # not a request of the table: request 0, no valid entry
            req[-1] = -2
        bt = table.t().contiguous().t() if step % 2 else table  # a strided table
        md = BatchMetadata(ql.to(device), torch.tensor(seqs, dtype=torch.int32).to(device), bt.to(device),
                           req.to(device), t, r, r // 2, r // 2)
        # poison the buffers before each version packs
        for buf in (attn._query_start_loc, attn._seq_lens, attn._block_table, attn._req_id, attn._valid_counts):
            buf.fill_(-7)
        ref_req = req.clone()
        ref_req[(ref_req < 0) | (ref_req >= r)] = 0
        ref_md = BatchMetadata(md.query_start_loc, md.seq_lens, md.block_table, ref_req.to(device), t, r, r // 2, r // 2)
        attn._pack_with_torch(ref_md, t, r, width)
        ref = _buffers(attn)
        bad = (req < 0) | (req >= r)
        ref[4][:t][bad.to(ref[4].device)] = 0
        for buf in (attn._query_start_loc, attn._seq_lens, attn._block_table, attn._req_id, attn._valid_counts):
            buf.fill_(-7)
        step_pack(md.query_start_loc, md.seq_lens, md.block_table, md.req_id_per_token, t,
                  out_query_start_loc=attn._query_start_loc, out_seq_lens=attn._seq_lens,
                  out_block_table=attn._block_table, out_req_id=attn._req_id, out_valid_counts=attn._valid_counts,
                  index_topk=attn.index_topk, kpool=attn.kpool, topk=attn.topk)
        got = _buffers(attn)
        for name, a, b in zip(("query_start_loc", "seq_lens", "block_table", "req_id", "valid_counts"), got, ref):
            assert torch.equal(a.cpu(), b.cpu()), f"{name} differs at step {step}"
        assert (got[4][:t].cpu() >= 0).all() and (got[4][:t].cpu() <= topk).all()


def test_plan_uses_one_launch_for_device_metadata(device, monkeypatch):
    """A batch already on the runner's device is packed by the kernel (the PyTorch packing is not called)."""
    import sparsemla.runner.runner as R
    attn = _runner(device)
    calls = []
    monkeypatch.setattr(R.SparseMLA, "_pack_with_torch", lambda *a: calls.append(a))
    md = BatchMetadata.from_lists([1, 2], [5, 70], [[3], [5, 1]], device=device)
    md = BatchMetadata.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, num_tokens=3,
                                    num_decode_tokens=1, num_decode_requests=1)
    attn.plan(md, seq_lens_upper_bound=[5, 70])
    assert not calls
    assert attn.valid_counts[:3].tolist() == [5, 69, 70]
