"""The compiled host entry (``sparsemla.host_entry``) on the CPU: built with the machine's C++ compiler, driven on
CPU tensors with a stand-in for Triton's launch functions (the real ones need a GPU).  A replayed call must make
exactly the launches the Python path makes for the same tensors, and every call the entry does not handle must
take the Python path."""
import shutil

import pytest
import torch

import sparsemla.attention as A
import sparsemla.host_entry as H
from sparsemla import PagedKVCache, sparse_mla_decode, sparse_mla_prefill
from sparsemla.kernels import attention as KA
from sparsemla.kernels import convert_indices as CI
from sparsemla.kernels import launch as L

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def module():
    try:
        return H._build()
    except RuntimeError as exc:  # a compiler without this Python's headers: the entry cannot exist here
        if "Python.h" in str(exc):
            pytest.skip(f"the host entry cannot be built here: {exc}")
        raise


class _Launches:
    """Stands in for Triton's C launch functions: every Launch is direct, its ``go`` records what it is called with
    (as Triton's function would receive it: flat, or with the arguments packed in one tuple as on Triton 3.8)."""

    def __init__(self, packed: bool):
        self.packed, self.calls, self.gos = packed, [], {}

    def fn(self, *args):
        self.calls.append(args)

    def compiled(self, launch, ctx, key):
        go = self.gos.get((id(launch), key))
        if go is None:
            head, tail = ("fn", id(launch) % 1000, None), ("tail", 3)
            if self.packed:
                def go(gx, gy, gz, stream, addrs):
                    self.fn(gx, gy, gz, stream, *head, (*addrs, *tail))
            else:
                def go(gx, gy, gz, stream, addrs):
                    self.fn(gx, gy, gz, stream, *head, *addrs, *tail)
            go.parts = (self.fn, head, tail, self.packed)
            self.gos[(id(launch), key)] = go
        return go


@pytest.fixture(params=[False, True], ids=["flat", "packed"])
def entry(request, module, monkeypatch):
    fake = _Launches(request.param)
    buf = torch.zeros(1 << 21, dtype=torch.float32)

    def launch_in(self, ctx, gx, gy, gz, key, addrs):
        if ctx is None:
            return False
        fake.compiled(self, ctx, key)(gx, gy, gz, ctx[1], addrs)
        return True

    def scratch(q, n_o, n_all, ctx=None):  # the cached scratch of a CUDA call
        return (*KA._partials(buf, n_o, n_all), True)

    def launch(self, grid, args, key=None, addrs=None):  # every launch direct, the arguments as addresses
        addrs = addrs if addrs is not None else [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        return launch_in(self, (-1, 5), grid[0], 1, 1, key, addrs)

    monkeypatch.setattr(L.Launch, "direct", property(lambda self: True))
    monkeypatch.setattr(L.Launch, "launch_in", launch_in)
    monkeypatch.setattr(L.Launch, "__call__", launch)
    monkeypatch.setattr(CI, "direct_context", lambda: (-1, 5))
    monkeypatch.setattr(L.Launch, "compiled", lambda self, ctx, key: fake.compiled(self, ctx, key))
    monkeypatch.setattr(KA, "direct_context", lambda: (-1, 5))
    monkeypatch.setattr(KA, "_scratch", scratch)
    select = A.registry.select_call  # "auto" on CPU tensors is the reference: make it the Triton kernels
    monkeypatch.setattr(A.registry, "select_call", lambda *a: select(*a[:-1], "triton-portable" if a[-1] == "auto"
                                                                      else a[-1]))
    _cpu(module)
    monkeypatch.setattr(H, "_module", module)
    monkeypatch.setattr(H, "call", module.call)
    monkeypatch.setattr(H, "run", module.run)
    monkeypatch.setattr(H, "layer", module.layer)
    python_calls = []
    real_call = A._call
    monkeypatch.setattr(A, "_call", lambda *a: python_calls.append(a[0]) or real_call(*a))
    yield module, fake, python_calls
    module.clear()
    H._configure(module, allow_cpu=False)


class _Hooks:
    def __init__(self):
        self.calls = []


class _Runtime:
    def __init__(self):
        self.launch_enter_hook, self.launch_exit_hook = _Hooks(), _Hooks()


def _cpu(module, dev=-1, stream=5, capturing=False, runtime=None):
    """The entry on CPU tensors (device index -1), with stand-ins for the current device, stream and capture."""
    H._configure(module, allow_cpu=True, get_device=lambda: dev, get_stream=lambda d: stream,
                 capturing=lambda: capturing, runtime=runtime or _Runtime())


def _tensors(seed, t=1, h=16, k=96, fmt="fp8_ds_mla", vc=False):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(fmt, num_blocks=4, block_size=64)
    q = torch.randn((t, h, cache.fmt.head_dim), generator=g).to(torch.bfloat16)
    idx = torch.randint(0, cache.rows.shape[0], (t, k), generator=g, dtype=torch.int32)
    counts = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if vc else None
    return cache, q, idx, counts


def _normalized(calls, tensors):
    """The launches' arguments with the addresses of ``tensors`` (name -> tensor) replaced by their names."""
    names = {t.data_ptr(): n for n, t in tensors.items()}
    names.update({t.data_ptr() + 1024: n + "+1024" for n, t in tensors.items() if n == "q"})

    def norm(a):
        if isinstance(a, tuple):
            return tuple(norm(x) for x in a)
        return names.get(a, a) if type(a) is int else a
    return [norm(c) for c in calls]


@pytest.mark.parametrize("t,vc,given", [(1, False, False), (1, True, False), (64, False, True), (3, True, True)])
def test_a_replayed_call_launches_what_the_python_path_launches(entry, t, vc, given):
    module, fake, python_calls = entry
    cache, q, idx, counts = _tensors(0, t=t, vc=vc)
    kw = dict(valid_counts=counts)
    if given:
        kw.update(out=torch.empty((t, 16, 512), dtype=torch.bfloat16), lse=torch.empty((t, 16)))
    sparse_mla_decode(q, cache, idx, 0.07, **kw)  # served by Python, recorded
    assert python_calls == ["decode"] and module.size() == 1
    # new tensors of the same configuration: replayed
    _, q2, idx2, counts2 = _tensors(1, t=t, vc=vc)
    kw2 = dict(valid_counts=counts2)
    if given:
        kw2.update(out=torch.empty((t, 16, 512), dtype=torch.bfloat16), lse=torch.empty((t, 16)))
    fake.calls.clear()
    out, lse = sparse_mla_decode(q2, cache, idx2, 0.07, **kw2)
    assert python_calls == ["decode"], "the second call took the Python path"
    replayed = _normalized(fake.calls, dict(q=q2, rows=cache.rows, idx=idx2, out=out, lse=lse,
                                            **({"vc": counts2} if vc else {})))
    assert out.shape == (t, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (t, 16)
    assert lse.dtype == torch.float32
    if given:
        assert out is kw2["out"] and lse is kw2["lse"]
    # the same tensors through the Python path
    module.clear()
    fake.calls.clear()
    out3, lse3 = sparse_mla_decode(q2, cache, idx2, 0.07, **(kw2 if given else dict(valid_counts=counts2)))
    assert python_calls == ["decode", "decode"]
    direct = _normalized(fake.calls, dict(q=q2, rows=cache.rows, idx=idx2, out=out3, lse=lse3,
                                          **({"vc": counts2} if vc else {})))
    assert replayed == direct and len(direct) in (1, 2)
    assert any("q" in str(a) for a in direct[0])  # the addresses were found (the comparison is not vacuous)


def test_the_scales_are_passed_per_call(entry):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0, fmt="fp8")
    sparse_mla_decode(q, cache, idx, 0.25, k_scale=2.0)
    fake.calls.clear()
    sparse_mla_decode(q, cache, idx, 0.5, k_scale=3.0)
    assert python_calls == ["decode"]
    args = fake.calls[0] if not fake.packed else fake.calls[0][-1]
    assert 0.5 * KA.LOG2E in args and 3.0 in args and 0.25 * KA.LOG2E not in args


def test_prefill_over_a_cache_is_replayed_and_a_workspace_is_not(entry):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0, t=5, fmt="bf16")
    sparse_mla_prefill(q, cache, idx, 0.1)
    sparse_mla_prefill(q, cache, idx, 0.1)
    assert python_calls == ["prefill"]
    ws = torch.zeros((256, 576), dtype=torch.bfloat16)
    sparse_mla_prefill(q, ws, idx, 0.1)
    sparse_mla_prefill(q, ws, idx, 0.1)
    assert python_calls == ["prefill"] * 3


def test_calls_the_entry_does_not_handle_take_the_python_path(entry):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0)
    sparse_mla_decode(q, cache, idx, 0.1)
    assert python_calls == ["decode"]
    n = 1
    for kw in (dict(check=True), dict(backend="reference"), dict(sm_scale=1), dict(k_scale=torch.tensor(1.0))):
        sm = kw.pop("sm_scale", 0.1)
        for _ in range(2):  # (never recorded: each call takes the Python path)
            sparse_mla_decode(q, cache, idx, sm, **kw)
            n += 1
            assert len(python_calls) == n, kw
    from sparsemla.backends import get_backend
    for backend in ("triton-portable", get_backend("triton-portable")):  # the library's kernels, named: recorded
        sparse_mla_decode(q, cache, idx, 0.1, backend=backend)
        sparse_mla_decode(q, cache, idx, 0.1, backend=backend)
        n += 1
        assert len(python_calls) == n, backend
    sparse_mla_decode(q, cache, idx[:, :64].contiguous(), 0.1)  # another configuration: Python, then recorded
    sparse_mla_decode(q, cache, idx[:, :64].contiguous(), 0.1)
    assert len(python_calls) == n + 1
    sparse_mla_decode(q[:, :, :].clone(), cache, idx, 0.1)  # the first configuration again: replayed
    assert len(python_calls) == n + 1


def test_wrong_arguments_raise_as_before(entry):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0)
    sparse_mla_decode(q, cache, idx, 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        sparse_mla_decode(q, cache, idx, -1.0)
    with pytest.raises(TypeError, match="q"):
        sparse_mla_decode(q.float(), cache, idx, 0.1)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, cache, idx[:, ::2], 0.1)
    with pytest.raises(ValueError, match="valid_counts"):
        sparse_mla_decode(q, cache, idx, 0.1, valid_counts=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="cache"):
        sparse_mla_decode(q, object(), idx, 0.1)


def test_no_context_no_replay_and_changes_of_the_plan_inputs_forget_records(entry, monkeypatch):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0)
    sparse_mla_decode(q, cache, idx, 0.1)
    assert module.size() == 1
    _cpu(module, capturing=True)  # a CUDA graph being captured
    sparse_mla_decode(q, cache, idx, 0.1)
    assert python_calls == ["decode"] * 2 and module.size() == 0
    for hook in ("launch_enter_hook", "launch_exit_hook"):  # a profiler's launch hook
        rt = _Runtime()
        getattr(rt, hook).calls.append(print)
        _cpu(module, runtime=rt)
        sparse_mla_decode(q, cache, idx, 0.1)
        sparse_mla_decode(q, cache, idx, 0.1)
        assert module.size() == 0
    rt = _Runtime()
    rt.launch_enter_hook = print  # a plain callable (an older Triton)
    _cpu(module, runtime=rt)
    sparse_mla_decode(q, cache, idx, 0.1)
    assert module.size() == 0 and len(python_calls) == 7
    _cpu(module)
    with KA.per_call_partials():  # the custom ops: partials per call
        sparse_mla_decode(q, cache, idx, 0.1)
        sparse_mla_decode(q, cache, idx, 0.1)
    assert module.size() == 0 and len(python_calls) == 9
    sparse_mla_decode(q, cache, idx, 0.1)
    assert module.size() == 1
    from sparsemla import plan
    plan.clear_unavailable()
    assert module.size() == 0
    sparse_mla_decode(q, cache, idx, 0.1)
    from sparsemla.backends import registry
    registry.clear_selection_cache()
    assert module.size() == 0


def test_another_stream_or_device_is_another_configuration(entry):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0)
    sparse_mla_decode(q, cache, idx, 0.1)
    sparse_mla_decode(q, cache, idx, 0.1)
    assert len(python_calls) == 1
    _cpu(module, stream=6)
    sparse_mla_decode(q, cache, idx, 0.1)
    assert len(python_calls) == 2
    _cpu(module, dev=0)  # q is not on the current device
    sparse_mla_decode(q, cache, idx, 0.1)
    assert len(python_calls) == 3

    def no_such_device(d):  # (torch raises for a stream of a device that does not exist)
        raise RuntimeError(f"Device index value {d} is out of index range")
    H._configure(module, allow_cpu=True, get_device=lambda: 1, get_stream=no_such_device, capturing=lambda: False,
                 runtime=_Runtime())
    sparse_mla_decode(q, cache, idx, 0.1)  # the current device is not q's: the Python path, no stream asked for
    assert len(python_calls) == 4


def test_cpu_tensors_are_not_replayed_outside_tests(module):
    H._configure(module, allow_cpu=False, get_device=lambda: -1, get_stream=lambda d: 5, capturing=lambda: False,
                 runtime=_Runtime())
    cache, q, idx, _ = _tensors(0)
    assert module.call(0, q, cache, idx, 0.1, None, 1.0, "auto", None, None, False) is None
    H._configure(module, allow_cpu=False)


def test_status_and_switches(monkeypatch):
    monkeypatch.setattr(H, "_module", None)
    monkeypatch.setattr(H, "_disabled", False)
    monkeypatch.setenv(H.ENV, "0")
    assert H.load() is None and "disabled" in H.status()
    monkeypatch.setenv(H.ENV, "1")
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(H, "_name", lambda: "sparsemla_host_entry_never_built")
    assert H.load() is None and "could not be built" in H.status()
    # a call on CPU tensors never loads it
    monkeypatch.setattr(H, "call", H._first_call)
    cache, q, idx, _ = _tensors(0)
    assert H.call(0, q, cache, idx, 0.1, None, 1.0, "auto", None, None, False) is None
    H.disable()
    assert "disabled" in H.status() and H.call is H._no_entry
    H.enable()
    assert H.call is H._first_call


def test_tensors_without_strides_take_the_python_path(entry):
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0)
    sparse_mla_decode(q, cache, idx, 0.1)
    assert module.call(0, q.to_sparse(), cache, idx, 0.1, None, 1.0, "auto", None, None, False) is None
    assert module.call(0, q, cache, idx.to_sparse(), 0.1, None, 1.0, "auto", None, None, False) is None
    assert module.call(0, q, cache, idx, 0.1, None, 1.0, "auto", None, None, False).__class__ is tuple


def test_a_process_with_records_exits_cleanly(module, tmp_path):
    """Records hold Python references: they must not be released after the interpreter has gone."""
    import subprocess
    import sys
    code = (
        "import torch, sparsemla.host_entry as H\n"
        "from sparsemla import PagedKVCache\n"
        "m = H._build()\n"
        "H._configure(m, allow_cpu=True, get_device=lambda: -1, get_stream=lambda d: 0, capturing=lambda: False)\n"
        "m.record(bytes(256), 0, (object(), torch.zeros(3)), ((print, (1, 2), (0, 0), None, None),), None, None, -1)\n"
        "assert m.size() == 1\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _flat(call: tuple, packed: bool) -> tuple:
    """A recorded launch's arguments, the packed ones (Triton 3.8's layout) unpacked."""
    return (*call[:-1], *call[-1]) if packed else call


def _runner_step(backend="triton-portable", fmt="fp8_ds_mla", query_lens=(1, 1, 1, 1, 1), workspace=0):
    from test_runner import BS, STRIDE, make_cache, random_batch
    from sparsemla import SparseMLA
    caches = [make_cache(fmt, 40, seed=s) for s in (0, 1)]  # two layers of one geometry
    runner = SparseMLA(16, 6, 8, 5, caches[0].fmt.head_dim, 32, fmt, backend=backend, block_size=BS,
                       block_stride_rows=STRIDE, sm_scale=0.06, device="cpu", prefill_workspace_tokens=workspace)
    md, topk_local, _ = random_batch(list(query_lens), 100, 40, 32, 32, 1, seed=3)
    runner.plan(md)
    return runner, caches, md, topk_local


@pytest.mark.parametrize("query_lens", [(1, 1, 1, 1, 1), (3, 5), (1, 1, 1, 1, 3, 5)], ids=["decode", "prefill", "mixed"])
def test_a_runners_later_layers_are_replayed(entry, monkeypatch, query_lens):
    module, fake, _ = entry
    runner, caches, md, topk_local = _runner_step(query_lens=query_lens)
    python_runs = []
    real = type(runner)._run
    monkeypatch.setattr(type(runner), "_run", lambda self, *a: python_runs.append(1) or real(self, *a))
    q = torch.randn(md.num_tokens, 5, 576).bfloat16()
    runner.run(q, caches[0], topk_local)  # the first layer: Python, recorded
    assert len(python_runs) == 1 and module.size() == 1
    q2, topk2 = torch.randn_like(q.float()).bfloat16(), topk_local.clone()
    fake.calls.clear()
    o, lse = runner.run(q2, caches[1], topk2, k_scale=0.5)  # the next layer: replayed
    assert len(python_runs) == 1
    names = dict(q=q2, rows=caches[1].rows, topk=topk2, out=o, lse=lse)
    replayed = _normalized(fake.calls, names)
    module.clear()
    fake.calls.clear()
    o2, lse2 = runner.run(q2, caches[1], topk2, k_scale=0.5)
    assert len(python_runs) == 2 and o2 is o and lse2 is lse  # the runner's own buffers, both ways
    direct = _normalized(fake.calls, names)
    assert replayed == direct and len(direct) >= 2  # the conversion, the attention call(s) (and the combine)
    assert "topk" in _flat(direct[0], fake.packed) and 0.5 in _flat(direct[1], fake.packed)
    # given outputs are per-call slots
    out = torch.empty_like(o)
    lse_out = torch.empty_like(lse)
    runner.run(q2, caches[1], topk2, out=out, lse=lse_out)
    fake.calls.clear()
    r = runner.run(q2, caches[0], topk2, out=out, lse=lse_out)
    assert len(python_runs) == 3 and r[0] is out and r[1] is lse_out
    assert any("out" in _flat(c, fake.packed) for c in _normalized(fake.calls, dict(out=out, lse=lse_out)))


def test_a_runners_records_go_with_its_step(entry, monkeypatch):
    import gc
    module, fake, _ = entry
    runner, caches, md, topk_local = _runner_step()
    q = torch.randn(md.num_tokens, 5, 576).bfloat16()
    runner.run(q, caches[0], topk_local)
    assert module.size() == 1
    runner.plan(md)  # the next step: the previous step's records are useless
    assert module.size() == 0
    runner.run(q, caches[0], topk_local)
    assert module.size() == 1
    del runner
    gc.collect()
    assert module.size() == 0
    runner, caches, md, topk_local = _runner_step()
    runner.run(q, caches[0], topk_local)
    small = PagedKVCache("fp8_ds_mla", 2, 16, block_stride_rows=24)  # too few blocks for the step: Python raises
    with pytest.raises(ValueError):
        runner.run(q, small, topk_local)
    with pytest.raises(ValueError):
        runner.run(q[:, :4].contiguous(), caches[0], topk_local)


def test_a_runner_on_another_backend_upconverting_or_unaligned_is_not_recorded(entry):
    module, fake, _ = entry
    # the reference; a prefill through the bf16 workspace; a mixed step whose prefill tokens' lse starts 60 bytes in
    # (3 decode tokens x 5 heads x 4 bytes: the Python path launches it through Triton, unaligned)
    for backend, lens, ws in (("reference", (1, 1, 1, 1, 1), 0), ("triton", (1, 3, 5), 4096),
                              ("triton-portable", (1, 1, 1, 3, 5), 0)):
        runner, caches, md, topk_local = _runner_step(backend=backend, query_lens=lens, workspace=ws)
        assert (runner._ws_rows is not None) == bool(ws)
        q = torch.randn(md.num_tokens, 5, 576).bfloat16()
        runner.run(q, caches[0], topk_local)
        runner.run(q, caches[0], topk_local)
        assert module.size() == 0, (backend, lens)


@pytest.mark.parametrize("t,k,launches", [(1, 2048, 2), (300, 32, 1)])  # split (partials, combine), and not
def test_a_record_does_not_keep_the_calls_outputs(entry, t, k, launches):
    import gc
    import weakref
    module, fake, python_calls = entry
    cache, q, idx, _ = _tensors(0, t=t, k=k)
    fake.calls.clear()
    out, lse = sparse_mla_decode(q, cache, idx, 0.1)
    assert module.size() == 1 and len(fake.calls) == launches
    refs = weakref.ref(out), weakref.ref(lse)
    del out, lse
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4_ds_mla", "fp8_ds_mla-nope", "bf16-nope"])
@pytest.mark.parametrize("t,h", [(1, 33), (7, 64), (200, 16)])
def test_every_format_and_strided_q_replays_what_python_launches(entry, fmt, t, h):
    """q as a view into a wider tensor (token and head strides of its own), every format's argument list."""
    module, fake, python_calls = entry
    g = torch.Generator().manual_seed(t * h)
    cache = PagedKVCache(fmt, num_blocks=4, block_size=64)
    d = cache.fmt.head_dim

    def args():
        wide = torch.randn((t, h + 3, d + 64), generator=g).to(torch.bfloat16)
        q = wide[:, 1:h + 1, 32:32 + d]  # 64-byte offset: still 16-byte aligned
        idx = torch.randint(0, cache.rows.shape[0], (t, 48), generator=g, dtype=torch.int32)
        return q, idx
    q, idx = args()
    sparse_mla_decode(q, cache, idx, 0.3, k_scale=0.5)  # recorded
    q2, idx2 = args()
    fake.calls.clear()
    out, lse = sparse_mla_decode(q2, cache, idx2, 0.3, k_scale=0.5)
    assert python_calls == ["decode"]
    names = dict(q=q2, rows=cache.rows, idx=idx2, out=out, lse=lse)
    replayed = _normalized(fake.calls, names)
    module.clear()
    fake.calls.clear()
    out3, lse3 = sparse_mla_decode(q2, cache, idx2, 0.3, k_scale=0.5)
    direct = _normalized(fake.calls, dict(q=q2, rows=cache.rows, idx=idx2, out=out3, lse=lse3))
    assert replayed == direct and python_calls == ["decode"] * 2
    assert "q" in _flat(direct[0], fake.packed) and "idx" in _flat(direct[0], fake.packed)


@pytest.mark.parametrize("fmt_name,head,pair", [("fp8_ds_mla", 576, True), ("fp8_ds_mla", 576, False),
                                                 ("fp8", 576, True), ("bfloat16", 512, False)])
@pytest.mark.parametrize("counts", [[37, 0, 130], [2048]], ids=["t3", "t1-split"])
def test_a_vllm_layers_later_calls_are_replayed(entry, monkeypatch, fmt_name, head, pair, counts):
    """LayerAttention.forward (native backend): the first layer's call of a token count is recorded, the next layer's
    (same settings, another cache view of the same tensor, new q, indices, counts and k_scale) is replayed with
    exactly the Python path's launches, into the workspace's views."""
    from sparsemla.integrations.vllm import contract
    from sparsemla.integrations.vllm.contract import LayerAttention, Workspace, resolve_format
    from sparsemla.integrations.vllm.testing import LayeredCache, query_pair, topk_rows
    module, fake, _ = entry
    fmt = resolve_format(fmt_name, head)
    first = LayeredCache(fmt, fmt_name, 40, 64, layer=0, seed=0)
    second = LayeredCache(fmt, fmt_name, 40, 64, layer=1, seed=1, storage=first.storage)
    ws = Workspace(fmt, 8, 16, 2048, "cpu")
    layers = [LayerAttention(ws, fmt_name, head, 0.07), LayerAttention(ws, fmt_name, head, 0.09)]
    python = []
    real = contract._launch
    monkeypatch.setattr(contract, "_launch", lambda *a: python.append(1) or real(*a))
    t = len(counts)

    def query(seed):
        if pair:
            return query_pair(t, 16, fmt.rope_dim, seed=seed)
        return torch.randn((t, 16, head), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    idx, vc = topk_rows(first, counts, 2048, seed=3)
    out, lse = layers[0].forward(query(4), first.view, idx, vc, 1.0)  # Python, recorded
    assert python == [1] and module.size() == 1
    q2 = query(5)
    idx2, vc2 = topk_rows(second, counts, 2048, seed=6)
    fake.calls.clear()
    r = layers[1].forward(q2, second.view, idx2, vc2, 0.5)
    assert python == [1], "not replayed"
    assert r[0] is out and r[1] is lse  # the workspace's views, as the Python path returns them
    qs = dict(q=q2[0], q_pe=q2[1]) if pair else dict(q=q2)
    names = dict(**qs, rows=second.view, indices=idx2, vc=vc2, out=out, lse=lse)
    replayed = _normalized(fake.calls, names)
    module.clear()
    fake.calls.clear()
    r2 = layers[1].forward(q2, second.view, idx2, vc2, 0.5)
    assert python == [1, 1] and r2[0] is out and r2[1] is lse
    direct = _normalized(fake.calls, names)
    assert replayed == direct and len(direct) >= 1  # (the kernel, and the combine where it splits)
    flat = _flat(direct[0], fake.packed)
    assert {"q", "rows", "indices", "vc"} <= set(flat) and 0.09 * 1.4426950408889634 in flat
    assert ("q_pe" in flat) == pair and (0.5 in flat or fmt_name != "fp8")


def test_a_vllm_layer_call_the_entry_must_not_replay(entry, monkeypatch):
    """Another backend, another workspace, a NoPE pair, unaligned q, a cache of another geometry, an int k_scale:
    the Python path (which raises where an argument is wrong)."""
    import gc

    from sparsemla.integrations.vllm import contract
    from sparsemla.integrations.vllm.contract import LayerAttention, Workspace, resolve_format
    from sparsemla.integrations.vllm.testing import LayeredCache, query_pair, topk_rows
    module, fake, _ = entry
    fmt = resolve_format("fp8_ds_mla", 576)
    cache = LayeredCache(fmt, "fp8_ds_mla", 40, 64, seed=0)
    ws = Workspace(fmt, 8, 16, 2048, "cpu")
    layer = LayerAttention(ws, "fp8_ds_mla", 576, 0.07)
    idx, vc = topk_rows(cache, [40, 3], 2048, seed=3)
    q = query_pair(2, 16, 64)
    python = []
    real = contract._launch
    monkeypatch.setattr(contract, "_launch", lambda *a: python.append(1) or real(*a))
    layer.forward(q, cache.view, idx, vc)
    layer.forward(q, cache.view, idx, vc)
    assert python == [1] and module.size() == 1
    # a workspace of its own: its own record
    ws2 = Workspace(fmt, 8, 16, 2048, "cpu")
    layer.forward(q, cache.view, idx, vc, workspace=ws2)
    assert python == [1, 1] and module.size() == 2
    # unaligned q_pe (the Python path serves it, nothing recorded)
    pe = torch.empty(2, 16, 72, dtype=torch.bfloat16)[..., 1:65]
    pe.copy_(q[1])
    layer.forward((q[0], pe), cache.view, idx, vc)
    layer.forward((q[0], pe), cache.view, idx, vc)
    assert python == [1, 1, 1, 1] and module.size() == 2
    # an int k_scale, a cache view of another geometry: the Python path
    layer.forward(q, cache.view, idx, vc, 1)
    small = LayeredCache(fmt, "fp8_ds_mla", 20, 64, seed=0)
    layer.forward(q, small.view, torch.where(idx < 20 * 64, idx, -1), vc)
    assert python == [1, 1, 1, 1, 1, 1]
    # a wrong argument still raises (the Python path serves it)
    with pytest.raises(ValueError):
        layer.forward(q, cache.view, idx[:, :1000].clone(), vc[:1])
    # other settings: a layer on the reference backend is never recorded
    ref = LayerAttention(ws, "fp8_ds_mla", 576, 0.07, backend="reference")
    n = module.size()
    ref.forward(q, cache.view, idx, vc)
    assert module.size() == n
    # a workspace that goes takes its records with it
    del ws2
    gc.collect()
    assert module.size() == n - 1


def test_a_first_call_builds_in_the_background(monkeypatch, module):
    """Where the entry must be compiled, the first CUDA call starts the build in a thread and takes the Python path;
    calls meanwhile too; the builder installs the entry points when done (or the Python path for good where the
    build failed)."""
    import threading
    import time
    import types
    gate = threading.Event()
    calls = []

    def slow_build():
        calls.append(1)
        gate.wait(30)
        return module

    for name, value in (("_module", None), ("_disabled", False), ("_builder", None), ("call", H._first_call),
                        ("run", H._first_run), ("layer", H._first_layer), ("_path", lambda: "/nonexistent/x.so"),
                        ("_build", slow_build), ("_configure", lambda m, **k: None)):
        monkeypatch.setattr(H, name, value)
    monkeypatch.setenv(H.ENV, "1")
    q = types.SimpleNamespace(is_cuda=True)
    assert H.call(0, q) is None and H.run(None, q) is None and H.layer(None, None, (q,)) is None
    assert "being built" in H.status() and H.call is H._first_call
    builder = H._builder
    gate.set()
    builder.join(30)
    assert calls == [1] and H.call is module.call and H.run is module.run and H.layer is module.layer
    assert H._builder is None and H.status().startswith("in use")
    # a build that fails: every later call takes the Python path, and status() says why
    monkeypatch.setattr(H, "_module", None)
    monkeypatch.setattr(H, "call", H._first_call)

    def failing_build():
        raise RuntimeError("c++ exited with 1: no compiler")
    monkeypatch.setattr(H, "_build", failing_build)
    assert H.call(0, q) is None
    for _ in range(3000):  # (the builder may be done already)
        if H._builder is None:
            break
        time.sleep(0.01)
    assert H.call is H._no_entry and "could not be built" in H.status()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_process_forked_during_the_build_starts_afresh(monkeypatch):
    """The child of a fork made while the build runs has no builder thread and fresh locks."""
    import os
    import threading
    monkeypatch.setattr(H, "_builder", threading.Thread(target=lambda: None))
    H._lock.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 where the state was reset
            ok = H._builder is None and H._lock.acquire(timeout=5)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        H._lock.release()
    assert os.waitstatus_to_exitcode(status) == 0
