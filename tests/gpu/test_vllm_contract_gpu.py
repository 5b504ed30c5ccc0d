"""The vLLM contract module on the GPU with vLLM-shaped tensors (vLLM itself is not installed there).

- Eager against CUDA-graph replay: three layers interleaved per block, one graph per batch size (as vLLM captures
  uniform decode batches), 1,000 steps with a changing batch, fresh top-k rows and valid counts (zeros and padding
  tokens included); every replay must equal the eager call bit for bit, and every 100th step both must match float64.
  Eager calls run under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync), and neither a replay nor an
  eager call may make a device allocation.
- Host overhead is measured by ``benchmarks/host_overhead.py`` (rows H-vllm-*: the contract's call against the bare
  launch of its plan), not by a timed test on a machine busy with other tests.
- A short run of every kind of call for compute-sanitizer (``-k sanitizer``).
"""

import pytest
import torch

from sparsemla.integrations.vllm.contract import LayerAttention, Workspace, resolve_format
from sparsemla.integrations.vllm.testing import assert_close, layered_caches, reference

pytestmark = pytest.mark.gpu

SCALE = 0.0723
BLOCK = 64
NUM_BLOCKS = 96        # 6144 slots per layer
LAYERS = 3
GRAPH_SIZES = (1, 2, 4, 8, 16, 32)
WIDTH = {576: 2048, 512: 2176}   # DeepSeek-V3.2 / GLM-5.x, and a pooled indexer's width
FORMATS = [("fp8_ds_mla", 576), ("nvfp4_ds_mla", 576), ("nvfp4_ds_mla", 512), ("fp8_ds_mla", 512),
           ("bfloat16", 576), ("fp8", 576)]
HEADS = (8, 16, 32, 64, 128)


class Step:
    """Static inputs of one graph size: vLLM's query pair (q_pe a strided view of the projection), top-k rows,
    valid counts; and per-layer outputs the graph copies the shared workspace outputs into."""

    def __init__(self, size, heads, fmt, width, dev):
        self.size = size
        self.ql = torch.zeros(size, heads, 512, dtype=torch.bfloat16, device=dev)
        self.proj = torch.zeros(size, heads, 128 + fmt.rope_dim, dtype=torch.bfloat16, device=dev)
        self.q_pe = self.proj[..., 128:]
        self.idx = torch.full((size, width), -1, dtype=torch.int32, device=dev)
        self.vc = torch.zeros(size, dtype=torch.int32, device=dev)
        self.out = torch.zeros(LAYERS, size, heads, 512, dtype=torch.bfloat16, device=dev)
        self.lse = torch.zeros(LAYERS, size, heads, dtype=torch.float32, device=dev)

    def run(self, layers, caches):
        for i, (layer, cache) in enumerate(zip(layers, caches)):
            out, lse = layer.forward((self.ql, self.q_pe), cache.view, self.idx, self.vc, cache.k_scale)
            self.out[i].copy_(out)
            self.lse[i].copy_(lse)

    def fill(self, real, caches, gen):
        """New contents for ``real`` tokens (the rest are padding: no valid entry), on the device."""
        dev = self.idx.device
        self.ql.normal_(generator=gen)
        self.proj.normal_(generator=gen)
        width = self.idx.shape[1]
        n = NUM_BLOCKS * BLOCK
        slots = torch.randint(0, n, (self.size, width), device=dev, generator=gen)
        rows = caches[0].slot_rows(slots).to(torch.int32)
        counts = torch.randint(0, width + 1, (self.size,), device=dev, generator=gen, dtype=torch.int32)
        counts[torch.rand(self.size, device=dev, generator=gen) < 0.15] = 0
        counts[real:] = 0
        pos = torch.arange(width, device=dev)[None, :]
        junk = torch.where(pos < counts[:, None] + 8, torch.full_like(rows, -1), rows)
        self.idx.copy_(torch.where(pos < counts[:, None], rows, junk))
        self.vc.copy_(counts)


def _setup(name, head, heads, dev, max_tokens=GRAPH_SIZES[-1]):
    fmt = resolve_format(name, head)
    width = WIDTH[head]
    k_scale = 0.5 if fmt.name == "fp8" else 1.0
    caches = layered_caches(fmt, name, NUM_BLOCKS, BLOCK, LAYERS, k_scale, dev, seed=10)  # one tensor, 3 layers
    ws = Workspace(fmt, max_tokens, heads, width, dev)
    layers = [LayerAttention(ws, name, head, SCALE) for _ in range(LAYERS)]
    return fmt, width, caches, ws, layers


def _check_reference(step, caches, fmt, real, what, tokens=4):
    """The first ``tokens`` real tokens of every layer against float64."""
    n = min(real, tokens)
    q = step.ql if not fmt.rope_dim else torch.cat((step.ql, step.q_pe), -1)
    for i, cache in enumerate(caches):
        ref_out, ref_lse = reference(cache, q[:n], step.idx[:n].cpu(), step.vc[:n].cpu(), SCALE)
        assert_close(step.out[i, :n], step.lse[i, :n], ref_out, ref_lse, f"{what}, layer {i}")


def _allocations() -> int:
    """Device allocations made so far by this process (the caching allocator's counter; no sync)."""
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def _graph_vs_eager(name, head, heads, steps, seed=0):
    dev = torch.device("cuda")
    fmt, width, caches, ws, layers = _setup(name, head, heads, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    graphs = {}
    for size in GRAPH_SIZES:
        step = Step(size, heads, fmt, width, dev)
        step.fill(size, caches, gen)
        ws.prepare(size)                       # the host plan, outside capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm up (compiles) off the capture
            step.run(layers, caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.run(layers, caches)
        graphs[size] = (graph, step)
    torch.cuda.synchronize()
    eager = {size: Step(size, heads, fmt, width, dev) for size in GRAPH_SIZES}
    rng = torch.Generator().manual_seed(seed + 1)
    for i in range(steps):
        real = int(torch.randint(1, GRAPH_SIZES[-1] + 1, (1,), generator=rng))
        size = next(s for s in GRAPH_SIZES if s >= real)
        graph, step = graphs[size]
        step.fill(real, caches, gen)
        e = eager[size]
        for a, b in ((e.ql, step.ql), (e.proj, step.proj), (e.idx, step.idx), (e.vc, step.vc)):
            a.copy_(b)
        allocations = _allocations()
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")
        try:
            e.run(layers, caches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert _allocations() == allocations, f"step {i}: the replay or the eager call allocated device memory"
        what = f"{fmt.id} H={heads} step {i} (batch {real} in graph {size})"
        assert torch.equal(step.out, e.out), f"{what}: replay output differs from the eager call"
        assert torch.equal(step.lse, e.lse), f"{what}: replay lse differs from the eager call"
        if i % 100 == 0 or i == steps - 1:
            _check_reference(step, caches, fmt, real, what)
            pad = step.lse[:, real:]
            assert torch.isinf(pad).all() and (step.out[:, real:] == 0).all(), f"{what}: padding tokens not empty"
    torch.cuda.synchronize()


@pytest.mark.parametrize("heads", HEADS, ids=[f"h{h}" for h in HEADS])
@pytest.mark.parametrize("name,head", FORMATS, ids=[f"{n}-{h}" for n, h in FORMATS])
def test_graph_replay_matches_eager(name, head, heads):
    _graph_vs_eager(name, head, heads, steps=1000)


@pytest.mark.parametrize("name,head", FORMATS, ids=[f"{n}-{h}" for n, h in FORMATS])
def test_sanitizer_short_run(name, head):
    """A few steps of every format at 16 and 128 heads: small enough to run under compute-sanitizer."""
    for heads in (16, 128):
        _graph_vs_eager(name, head, heads, steps=4, seed=5)


def test_query_on_another_device_is_refused():
    """A query part on the host (or another GPU) is refused with the part named, before any launch."""
    fmt = resolve_format("fp8_ds_mla", 576)
    dev = torch.device("cuda", torch.cuda.current_device())
    cache = layered_caches(fmt, "fp8_ds_mla", 4, BLOCK, 1, 1.0, dev, seed=3)[0]
    ws = Workspace(fmt, 4, 16, 2048, dev)
    layer = LayerAttention(ws, "fp8_ds_mla", 576, SCALE)
    idx = torch.full((2, 2048), -1, dtype=torch.int32, device=dev)
    vc = torch.zeros(2, dtype=torch.int32, device=dev)
    ql = torch.zeros(2, 16, 512, dtype=torch.bfloat16, device=dev)
    q_pe = torch.zeros(2, 16, 64, dtype=torch.bfloat16, device=dev)
    layer.forward((ql, q_pe), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q\[0\].*cuda"):
        layer.forward((ql.cpu(), q_pe), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q\[1\].*cuda"):
        layer.forward((ql, q_pe.cpu()), cache.view, idx, vc)
    with pytest.raises(ValueError, match=r"q:.*cuda"):
        layer.forward(torch.cat((ql, q_pe), -1).cpu(), cache.view, idx, vc)
    with pytest.raises(ValueError, match="valid_counts"):
        layer.forward((ql, q_pe), cache.view, idx, vc.cpu())
    torch.cuda.synchronize()
