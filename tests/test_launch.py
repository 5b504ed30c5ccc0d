"""``kernels.launch.Launch`` on the CPU: its direct path is driven with a stand-in for Triton (the real one needs a
GPU), to pin when a launch goes through Triton and when through the kept compiled kernel."""
import pytest

from sparsemla.kernels import launch as L


class _FakeTriton:
    """``fn[grid](*args, **meta)`` records the launch and returns a compiled-kernel stand-in."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.calls.append((tuple(grid), args))
            return type("Compiled", (), {"packed_metadata": None})()
        return run


@pytest.fixture
def direct(monkeypatch):
    gone = []
    hooks = [False]
    monkeypatch.setattr(L, "_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda dev: 7)
    monkeypatch.setattr(L, "_hooks", lambda: hooks[0])
    monkeypatch.setattr(L, "_direct_launch", lambda k, tail: lambda gx, gy, gz, s, addrs: gone.append(
        ((gx, gy, gz), s, tuple(addrs))))
    fake = _FakeTriton()
    launch = L.Launch.__new__(L.Launch)
    launch.fn, launch.meta, launch._compiled, launch.built = fake, {}, {}, False
    launch._direct, launch._n_runtime, launch._tail = True, 2, ()
    return launch, fake, gone, hooks


def test_first_launch_through_triton_then_the_kept_kernel(direct):
    launch, fake, gone, hooks = direct
    launch((3, 2), (11, 22), key=("k",))
    assert fake.calls == [((3, 2), (11, 22))] and not gone and launch.built
    launch((3, 2), (11, 22), key=("k",))
    assert len(fake.calls) == 1 and gone == [((3, 2, 1), 7, (11, 22))]
    assert launch.launch_known(5, 1, 1, ("k",), (1, 2)) and gone[-1] == ((5, 1, 1), 7, (1, 2))
    assert not launch.launch_known(5, 1, 1, ("other",), (1, 2))  # not compiled: the caller launches


def test_an_installed_hook_sends_every_launch_through_triton(direct):
    launch, fake, gone, hooks = direct
    launch((1,), (1, 2), key=("k",))
    hooks[0] = True
    assert not launch.launch_known(1, 1, 1, ("k",), (1, 2))
    launch((1,), (1, 2), key=("k",))
    assert len(fake.calls) == 2 and not gone


def test_without_a_key_the_arguments_give_it(direct):
    launch, fake, gone, hooks = direct
    launch((1,), (16, 3))
    launch((1,), (32, 5))  # the same specialization (divisible by 16; neither 1 nor divisible): kept kernel
    launch((1,), (17, 3))  # another one: through Triton
    assert [c[1] for c in fake.calls] == [(16, 3), (17, 3)] and gone == [((1, 1, 1), 7, (32, 5))]


def test_launch_in_takes_the_device_and_stream_it_is_given(direct):
    launch, fake, gone, hooks = direct
    launch((1,), (1, 2), key=("k",))  # compiled on device 0
    assert launch.launch_in((0, 9), 4, 1, 1, ("k",), (5, 6)) and gone[-1] == ((4, 1, 1), 9, (5, 6))
    assert not launch.launch_in(None, 4, 1, 1, ("k",), (5, 6))  # no context (a hook is installed)
    assert not launch.launch_in((1, 9), 4, 1, 1, ("k",), (5, 6))  # not compiled on device 1
    assert not launch.launch_in((0, 9), 4, 1, 1, ("other",), (5, 6))
    assert len(gone) == 1


def test_direct_context_is_none_while_a_hook_is_installed(direct):
    launch, fake, gone, hooks = direct
    assert launch.direct and L.direct_context() == (0, 7)
    hooks[0] = True
    assert L.direct_context() is None

