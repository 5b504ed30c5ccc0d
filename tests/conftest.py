"""Test set-up shared by the CPU (interpreter) suite and the GPU suite.

With no GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before the first
``import triton`` anywhere, so it is set here, at collection time.  ``pytest -m gpu`` selects the
H200 suite; GPU tests are skipped (with a reason) where no GPU is present.
"""
import os

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        # Triton decides at decoration whether a kernel runs in the interpreter: import every kernel module now,
        # so that a test that turns the interpreter off for a while (``no_interpreter``) cannot be the first to
        # import one (a kernel decorated then stays compiled-only and fails under the interpreter later)
        import pkgutil
        import sparsemla.kernels
        for _m in pkgutil.walk_packages(sparsemla.kernels.__path__, "sparsemla.kernels."):
            if ".sm90" not in _m.name:  # the Gluon kernels never run in the interpreter (compiled on purpose)
                __import__(_m.name)


def pytest_configure(config):
    workers = getattr(config, "workerinput", {}).get("workercount")  # set in pytest-xdist's workers
    if _HAS_CUDA and workers and "OMP_NUM_THREADS" not in os.environ:
        # GPU suite under pytest-xdist: a worker's intra-op thread pool (and torch.compile's compile workers)
        # would otherwise take every core.  With 12 workers of two groups on 16 cores, tests of the vLLM contract
        # whose float64 checks take 0.2 s on one core were found inside those checks after 150 s.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """After each GPU test, hand the memory PyTorch's caching allocator keeps back to the driver: the GPU suite
    runs several pytest processes on one GPU, and a process holding the reserve of its largest test (tens of
    GB) made the others' allocations fail."""
    yield
    if _HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    """The device the CPU suite runs kernels on (cpu under the interpreter, else cuda)."""
    return "cuda" if _HAS_CUDA else "cpu"
