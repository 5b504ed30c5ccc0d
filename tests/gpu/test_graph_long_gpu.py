"""H200: 10,000 CUDA-graph replays of the runner with changing batches, equal to eager execution.

Runners for several formats and head counts (the kernels they take: few heads, head groups, bf16 64-head
programs, pooled top-k widths, a cache whose blocks sit further apart than their size) each capture one
decode step per padded batch size (as an engine captures a few sizes).  Then every step, round-robin over
the runners: a new random batch (1..16 requests of 1..2 query tokens, new context lengths, block tables
drawn fresh from the shuffled cache, distinct top-k positions with garbage past each valid count, new q),
``plan`` on the host, replay of the graph of the smallest captured size that holds the batch, then the same
``run`` eagerly into other buffers.  The replay must equal the eager run bitwise (the same kernels run) and
leave the padding tokens at 0 / -inf; every 250 steps the real tokens are also checked against the float64
reference and against an eager functional call (``sparse_mla_decode`` on the same rows: another split plan,
so within the suite's tolerance).  Every 40 steps a runner's cache gets new contents between replays.

Mismatches are counted on the device and read back every 500 steps.  Steps: ``RELIAB_GRAPH_STEPS``
(default 10,000); seed: ``RELIAB_SEED`` (default fresh, printed, and in ``$OUT/reliability/graph_long.json``).
Also: the benchmarks' graph replay (``bench.timing.graph_replay``) keeps alive what its graph reads and writes.

Run: ``python3 -m pytest -m gpu tests/gpu/test_graph_long_gpu.py -q -s`` (about 30-40 s on an H200 once the
kernels are compiled).
"""
import math
import os
import random
import sys
import time

import pytest
import torch

import sparsemla

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import reliab_cases as rc  # noqa: E402
import reliab_property as rp  # noqa: E402
import reliab_runner  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = int(os.environ.get("RELIAB_GRAPH_STEPS", "10000"))
MAX_REQ, MAX_QUERY = 16, 2
MAX_TOKENS = MAX_REQ * MAX_QUERY
SIZES = (8, MAX_TOKENS)  # captured batch sizes (padded token counts)

# format id, heads, top-k width, index_topk, kpool, max context, block size, block stride (rows)
RUNNERS = [
    ("fp8_ds_mla", 16, 512, 512, 1, 1024, 64, 64),
    ("nvfp4_ds_mla", 16, 515, 512, 4, 1100, 64, 64),      # a pooled width: 512 + 4 - 1
    ("bf16", 128, 512, 512, 1, 1024, 64, 64),
    ("fp8", 64, 320, 320, 1, 700, 32, 48),                 # blocks 48 rows apart, k_scale 0.5
    ("fp8_ds_mla-nope", 16, 1027, 1024, 4, 1500, 64, 64),
    ("nvfp4_ds_mla-nope", 128, 256, 256, 1, 600, 64, 64),
]


class Lane:
    """One runner with its cache, input buffers, batch source and captured graphs."""

    def __init__(self, spec, device, seed, use_graphs):
        fid, heads, topk, itk, kpool, max_ctx, bs, stride = spec
        self.fmt = sparsemla.get_format(fid)
        self.k_scale = 0.5 if self.fmt.uses_k_scale else 1.0
        self.sm_scale = 1.0 / math.sqrt(192)
        self.device, self.max_ctx = device, max_ctx
        nblk = MAX_REQ * -(-max_ctx // bs) + 8
        self.cache = sparsemla.PagedKVCache(self.fmt, nblk, bs, device, block_stride_rows=stride)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.refill()
        self.runner = reliab_runner.make_runner(
            self.cache, max_tokens=MAX_TOKENS, max_requests=MAX_REQ, max_blocks_per_request=-(-max_ctx // bs),
            num_heads=heads, head_dim=self.fmt.head_dim, topk=topk, fmt=self.fmt, block_size=bs, device=device,
            block_stride_rows=stride, sm_scale=self.sm_scale, index_topk=itk, kpool=kpool)
        self.batches = reliab_runner.DecodeBatches(seed, self.cache, topk, MAX_REQ, MAX_QUERY, max_ctx, device,
                                                   index_topk=itk, kpool=kpool)
        d = self.fmt.head_dim
        self.q = torch.zeros(MAX_TOKENS, heads, d, dtype=torch.bfloat16, device=device)
        self.topk = torch.full((MAX_TOKENS, topk), -1, dtype=torch.int32, device=device)
        self.e_out = torch.empty(MAX_TOKENS, heads, 512, dtype=torch.bfloat16, device=device)
        self.e_lse = torch.empty(MAX_TOKENS, heads, dtype=torch.float32, device=device)
        self.graphs = {}
        self.use_graphs = use_graphs
        for size in SIZES:
            self.load(0, size)
            out, lse = self.runner.run(self.q[:size], self.cache, self.topk[:size], self.k_scale)  # compiles
            if use_graphs:
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out, lse = self.runner.run(self.q[:size], self.cache, self.topk[:size], self.k_scale)
                self.graphs[size] = (g, out, lse)

    def refill(self, n=None):
        """New contents for ``n`` random slots (all when None)."""
        c = self.cache
        slots = (torch.arange(c.num_slots, device=self.device) if n is None
                 else torch.randperm(c.num_slots, generator=self.gen, device=self.device)[:n])
        slots = slots.to(torch.int32)
        m = slots.numel()
        kv = rc.kv_values(self.gen, m, 512, "heavy", self.k_scale, self.device)
        pe = rc.kv_values(self.gen, m, self.fmt.rope_dim, "heavy", 1.0, self.device) if self.fmt.rope_dim else None
        rc.write_tokens(c, kv.to(torch.bfloat16), None if pe is None else pe.to(torch.bfloat16), slots, self.k_scale)

    def load(self, step, size):
        md, topk_local, seq, tables, counts = self.batches.step(step, size)
        t = md.num_tokens
        self.q[:size].copy_(rc.heavy(self.gen, size, *self.q.shape[1:], device=self.device))
        self.topk[:size] = torch.randint(0, self.max_ctx, (size, self.topk.shape[1]), generator=self.gen,
                                         device=self.device, dtype=torch.int32)
        self.topk[:t] = topk_local
        reliab_runner.plan(self.runner, md, self.cache, num_tokens_padded=size)
        self.batch = (md, seq, tables, counts)
        return t

    def eager(self, size):
        self.e_out[:size].fill_(float("nan"))
        return self.runner.run(self.q[:size], self.cache, self.topk[:size], self.k_scale,
                               out=self.e_out[:size], lse=self.e_lse[:size])

    def rows(self, t):
        """Cache rows of the real tokens' valid entries (-1 elsewhere), from the host's tables."""
        md, seq, tables, counts = self.batch
        bs, stride = self.cache.block_size, self.cache.block_stride_rows
        req = md.req_id_per_token.tolist()
        width = max(len(x) for x in tables)
        table = torch.full((len(tables), width), -1, dtype=torch.int64)
        for i, x in enumerate(tables):
            table[i, : len(x)] = torch.tensor(x)
        pos = self.topk[:t].cpu().to(torch.int64)
        blk = table[torch.tensor(req)[:, None], (pos // bs).clamp(max=width - 1)]
        rows = blk * stride + pos % bs
        k = torch.arange(pos.shape[1])
        rows = torch.where(k[None, :] < torch.tensor(counts)[:, None], rows, torch.full_like(rows, -1))
        return rows.to(torch.int32).to(self.device), torch.tensor(counts, dtype=torch.int32, device=self.device)


def run_graph_long(device, steps, seed, use_graphs=True, check_every=250, sync_every=500):
    lanes = [Lane(spec, device, seed + i, use_graphs) for i, spec in enumerate(RUNNERS)]
    bad = torch.zeros(3, dtype=torch.int64, device=device)  # replay != eager, padding not 0/-inf, eager not finite
    checked, worst = 0, [0.0, 0.0, 0.0]
    per_lane = [0] * len(lanes)
    t0 = time.time()
    for step in range(steps):
        li = step % len(lanes)
        lane = lanes[li]
        per_lane[li] += 1
        r = random.Random(seed * 7919 + step)
        size = SIZES[0] if r.random() < 0.5 else SIZES[1]
        t = lane.load(step, size)
        if step % 40 == 0:
            lane.refill(256)
        if use_graphs:
            g, g_out, g_lse = lane.graphs[size]
            g_out.fill_(float("nan"))
            g.replay()
        else:
            g_out, g_lse = lane.runner.run(lane.q[:size], lane.cache, lane.topk[:size], lane.k_scale)
        e_out, e_lse = lane.eager(size)
        bad[0] += ((g_out.view(torch.int16) != e_out.view(torch.int16)).any()
                   | (g_lse.view(torch.int32) != e_lse.view(torch.int32)).any()).long()
        bad[1] += ((g_out[t:] != 0).any() | (g_lse[t:] != float("-inf")).any()).long()
        bad[2] += (~torch.isfinite(e_out[:t].float())).any().long()
        if step % check_every == 0:
            rows, counts = lane.rows(t)
            q = lane.q[:t]
            ref_o, ref_l = sparsemla.reference.sparse_mla(q.double(), lane.cache, rows, lane.sm_scale, counts,
                                                          lane.k_scale)
            f_out, f_lse = sparsemla.sparse_mla_decode(q, lane.cache, rows, lane.sm_scale, counts, lane.k_scale)
            for k, (o, l) in enumerate(((g_out[:t], g_lse[:t]), (f_out, f_lse))):
                case = {"spec": _Spec(), "indices": rows, "valid_counts": counts}
                m = rc.measure(case, o, l, ref_o, ref_l).tolist()
                assert rc.passed(m), (f"step {step} ({lane.fmt.id}, {'replay' if k == 0 else 'functional'}): "
                                      f"{dict(zip(rc.METRICS, m))}, seed {seed}")
                worst = [max(a, b) for a, b in zip(worst, m[:3])]
            checked += 1
        if step % sync_every == sync_every - 1 or step == steps - 1:
            b = bad.tolist()
            assert b[0] == 0, f"by step {step}: {b[0]} replays differ from the eager run (seed {seed})"
            assert b[1] == 0, f"by step {step}: {b[1]} replays left padding tokens other than 0 / -inf (seed {seed})"
            assert b[2] == 0, f"by step {step}: {b[2]} eager runs gave non-finite outputs (seed {seed})"
    return {"seed": seed, "steps": steps, "steps_per_runner": dict(zip([x[0] for x in RUNNERS], per_lane)),
            "sizes": SIZES, "reference_checks": checked, "worst": dict(zip(rc.METRICS[:3], worst)),
            "mismatches": bad.tolist(), "seconds": round(time.time() - t0, 1), "graphs": use_graphs,
            "backends": {lane.fmt.id: getattr(getattr(lane.runner, "decode_backend", None), "name", "?") for lane in lanes}}


class _Spec:
    backend = "auto"


def test_10000_graph_replays_equal_eager_runs():
    s = os.environ.get("RELIAB_SEED")
    seed = int(s) if s else random.SystemRandom().randrange(2 ** 20)
    print(f"\ngraph run: seed {seed}, {STEPS} steps", flush=True)
    summary = run_graph_long("cuda", STEPS, seed)
    path = rp.write_summary(summary, "graph_long.json")
    print(f"graph run: {summary}; summary {path}", flush=True)
    assert summary["mismatches"] == [0, 0, 0]


def test_bench_graph_replay_keeps_what_its_graph_reads():
    """``bench.timing.graph_replay`` holds the captured call, and with it the tensors of its closure: a replay
    whose buffers were freed (the caller kept only the replay) wrote into memory the allocator had handed out
    again, and raised an illegal address once that memory was released."""
    import gc
    import weakref

    from sparsemla.bench.timing import graph_replay

    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")

    def make():
        y = torch.zeros_like(x)
        return graph_replay(lambda: y.copy_(x * 2)), weakref.ref(y)

    replay, y = make()
    gc.collect()
    torch.cuda.empty_cache()
    assert y() is not None, "the replay let go of the tensor its graph writes"
    y().zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(y(), x * 2)
