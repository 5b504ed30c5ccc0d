"""H200: caches larger than 2^31 bytes, every format: the tested rows lie past the 2 GiB offset.

For each format a cache just over 2 GiB (``RELIAB_BIG_GIB``, default 2.01; two formats also just over 4 GiB,
where a 32-bit unsigned byte offset would wrap too) gets heavy-tailed tokens written through
``PagedKVCache.write`` into its last 40 blocks, the block that straddles byte 2^31 and its first block.  Then:

- the written bytes equal the format's PyTorch encoder, and no other row of the touched blocks changed;
- decode and prefill through the public API (default backend; the staged and portable backends where
  registered) at 16 and 128 heads over rows past 2 GiB match the float64 reference (the suite's tolerances);
- ``convert_indices`` maps request-local positions to rows past 2 GiB exactly, and the runner
  (``SparseMLA`` plan / run) with block tables that point there matches the reference;
- the staging kernels (top-k FP8 gather, context upconvert) read those rows exactly.

One cache is alive at a time (freed before the next format).  Run:
``python3 -m pytest -m gpu tests/gpu/test_large_cache_gpu.py -q`` (about 20-40 s on an H200; kernels shared
with the attention GPU suite are compiled there first when it runs in the same call).
"""
import gc
import os
import sys

import pytest
import torch

import sparsemla

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import reliab_cases as rc  # noqa: E402
import reliab_property as rp  # noqa: E402
import reliab_runner  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
BS = 64
GIB = 2 ** 30
BIG = float(os.environ.get("RELIAB_BIG_GIB", "2.01"))
FORMATS = rc.format_ids()
# (format, size in GiB): every format just past 2 GiB, two formats also just past 4 GiB
SIZES = [(f, BIG) for f in FORMATS] + [(f, 4.01) for f in ("fp8_ds_mla", "nvfp4_ds_mla") if f in FORMATS]
SUMMARY = {}


def _big_cache(fmt, gib):
    f = sparsemla.get_format(fmt)
    rows = int(gib * GIB) // f.bytes_per_token + 1
    nblocks = -(-rows // BS)
    cache = sparsemla.PagedKVCache(f, nblocks, BS, DEV)
    assert cache.rows.numel() > int(gib * GIB) >= 2 ** 31
    return cache


def _tested_slots(cache):
    """Slots of the last 40 blocks, the block holding byte 2^31 and the first block (8 tokens)."""
    bpt = cache.fmt.bytes_per_token
    straddle = (2 ** 31 // bpt) // BS
    last = torch.arange((cache.num_blocks - 40) * BS, cache.num_blocks * BS)
    mid = torch.arange(straddle * BS, (straddle + 1) * BS)
    return torch.cat([last, mid, torch.arange(8)]).to(torch.int32), straddle


def _assert_offsets(rows, bpt):
    """The last 40 blocks start past byte 2^31; the next block holds byte 2^31."""
    first_mid = int(rows[40 * BS])
    assert int(rows[0]) * bpt >= 2 ** 31 and first_mid * bpt <= 2 ** 31 < (first_mid + BS) * bpt


@pytest.fixture(scope="module", autouse=True)
def _write_summary():
    yield
    rp.write_summary(SUMMARY, "large_cache.json")


def _check(case, out, lse, ref):
    m = rc.measure(case, out, lse, *ref).tolist()
    assert rc.passed(m), dict(zip(rc.METRICS, m))
    return m


@pytest.mark.parametrize("fmt, gib", SIZES, ids=[f"{f}-{g}GiB" for f, g in SIZES])
def test_rows_past_2gib_write_and_attend(fmt, gib):
    gen = torch.Generator(device=DEV).manual_seed(17)
    cache = _big_cache(fmt, gib)
    f = cache.fmt
    bpt = f.bytes_per_token
    try:
        slots, straddle = _tested_slots(cache)
        n = slots.numel()
        kv = rc.kv_values(gen, n, 512, "heavy", 1.0, DEV)
        pe = rc.kv_values(gen, n, f.rope_dim, "heavy", 1.0, DEV) if f.rope_dim else None
        k_scale = 0.5 if f.uses_k_scale else 1.0
        kv16, pe16 = kv.to(torch.bfloat16), None if pe is None else pe.to(torch.bfloat16)
        cache.write(kv16, pe16, slots.to(DEV), k_scale)
        rows = cache.slot_to_row(slots.to(DEV))
        _assert_offsets(rows, bpt)

        # bytes: equal to the encoder, and nothing else in the touched blocks written
        want = f.encode(kv16.cpu(), None if pe16 is None else pe16.cpu(), k_scale)
        assert torch.equal(cache.rows[rows].cpu(), want), f"{fmt}: written bytes past 2 GiB differ from the encoder"
        untouched = torch.arange(8, BS, device=DEV)  # the rest of block 0
        assert (cache.rows[untouched] == 0).all()

        # attention over rows past 2 GiB (and the straddling block)
        past = rows[: 40 * BS]
        t, k = 6, 2048
        idx = torch.stack([past[torch.randperm(past.numel(), generator=gen, device=DEV)[:k]] for _ in range(t)])
        idx[1, :64] = rows[40 * BS: 41 * BS]   # the block across byte 2^31
        idx[2, 100:] = -1                       # -1 padding
        idx = idx.to(torch.int32).contiguous()
        vc = torch.tensor([k, k, k, 700, 1, 0], dtype=torch.int32, device=DEV)
        figures = {}
        for heads in (16, 128):
            q = (rc.heavy(gen, t, heads, f.head_dim, device=DEV)).to(torch.bfloat16)
            case = {"spec": type("S", (), {"backend": "auto"})(), "indices": idx, "valid_counts": vc}
            ref = sparsemla.reference.sparse_mla(q.double(), cache, idx, 0.05, vc, k_scale)
            for name, fn in (("decode", sparsemla.sparse_mla_decode), ("prefill", sparsemla.sparse_mla_prefill)):
                out, lse = fn(q, cache, idx, 0.05, vc, k_scale)
                figures[f"{name}-h{heads}"] = _check(case, out, lse, ref)
            for backend in ("triton-portable",):
                if backend in sparsemla.list_backends():
                    out, lse = sparsemla.sparse_mla_decode(q, cache, idx, 0.05, vc, k_scale, backend=backend)
                    figures[f"{backend}-h{heads}"] = _check(case, out, lse, ref)

        # the staged backend (its own reference: the staged e4m3 rows) and the staging kernels
        from sparsemla.kernels.staging import gather_topk_fp8, upconvert_context
        staged = gather_topk_fp8(cache.rows, f, idx, vc, k_scale)
        dec = f.decode(cache.rows[idx[0].long()], k_scale)
        from sparsemla.formats import get_format
        fp8 = get_format("fp8", f.rope_dim)
        restaged = fp8.encode(dec[:, :512], dec[:, 512:] if f.rope_dim else None, k_scale)
        assert torch.equal(staged[0].view(torch.uint8), restaged), f"{fmt}: staged rows past 2 GiB differ"
        q = (rc.heavy(gen, t, 16, f.head_dim, device=DEV)).to(torch.bfloat16)
        case = {"spec": type("S", (), {"backend": "triton-staged"})(), "indices": idx, "valid_counts": vc}
        sp = rc.Spec(fmt=fmt, backend="triton-staged", mode="decode", heads=16, tokens=t, width=k, block_size=BS,
                     stride_extra=0, ctx=(k,) * t, counts="full", pad="prefix", dup=False, garbage="minus1",
                     kv="heavy", in_dtype="bfloat16", k_scale=k_scale, sm_scale=0.05, q_scale=1.0,
                     q_layout="contiguous", idx_layout="contiguous", out="none", lse="none", seed=0)
        full = dict(spec=sp, fmt=f, cache=cache, kv=cache, q=q, indices=idx, valid_counts=vc)
        out, lse = sparsemla.sparse_mla_decode(q, cache, idx, 0.05, vc, k_scale, backend="triton-staged")
        figures["staged-h16"] = _check(case, out, lse, rc.reference(full))

        # request-local positions -> rows past 2 GiB: convert_indices, upconvert, the runner
        last_blocks = torch.arange(cache.num_blocks - 40, cache.num_blocks, dtype=torch.int32)
        table = torch.stack([last_blocks[torch.randperm(40)[:32]] for _ in range(2)] +
                            [torch.cat([torch.tensor([straddle], dtype=torch.int32), last_blocks[:31]])])
        seq = [32 * BS, 32 * BS - 5, 32 * BS]
        topk_local = torch.full((3, k), -1, dtype=torch.int32)
        for i, s_ in enumerate(seq):
            topk_local[i, : min(s_, k)] = torch.randperm(s_)[:k].to(torch.int32)
        req = torch.arange(3, dtype=torch.int32)
        got = sparsemla.convert_indices(topk_local.to(DEV), req.to(DEV), table.to(DEV), BS)
        p = topk_local.long().clamp(min=0)
        want_rows = table.long()[req[:, None].long(), p // BS] * BS + p % BS
        want_rows = torch.where(topk_local >= 0, want_rows, torch.full_like(want_rows, -1))
        assert torch.equal(got.cpu().long(), want_rows), f"{fmt}: convert_indices rows past 2 GiB"
        ws, start = upconvert_context(cache.rows, f, table.to(DEV), torch.tensor(seq, dtype=torch.int32, device=DEV),
                                      BS, BS, k_scale)
        r0 = want_rows[0].to(DEV)
        assert torch.equal(ws[start[0].long() + topk_local[0].long().to(DEV)],
                           f.decode(cache.rows[r0], k_scale).to(torch.bfloat16)), f"{fmt}: upconvert past 2 GiB"

        md = sparsemla.BatchMetadata.from_lists([1, 1, 1], seq, table.tolist(), block_size=BS)
        runner = reliab_runner.make_runner(cache, max_tokens=8, max_requests=4, max_blocks_per_request=32,
                                           num_heads=16, head_dim=f.head_dim, topk=k, fmt=f, block_size=BS,
                                           device=DEV, sm_scale=0.05)
        reliab_runner.plan(runner, md, cache)
        q3 = (rc.heavy(gen, 3, 16, f.head_dim, device=DEV)).to(torch.bfloat16)
        out, lse = runner.run(q3, cache, topk_local.to(DEV), k_scale)
        rows3 = want_rows.to(torch.int32).to(DEV)
        counts = torch.tensor([min(s, k) for s in seq], dtype=torch.int32, device=DEV)
        ref = sparsemla.reference.sparse_mla(q3.double(), cache, rows3, 0.05, counts, k_scale)
        case = {"spec": type("S", (), {"backend": "auto"})(), "indices": rows3, "valid_counts": counts}
        figures["runner-h16"] = _check(case, out, lse, ref)
        SUMMARY[f"{fmt}-{gib}GiB"] = {"bytes": cache.rows.numel(), "rows": cache.num_rows,
                                      "first_tested_byte": int(rows[0]) * bpt, "metrics": figures}
    finally:
        del cache
        gc.collect()
        torch.cuda.empty_cache()
