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


@pytest.fixture
def device():
    """The device the CPU suite runs kernels on (cpu under the interpreter, else cuda)."""
    return "cuda" if _HAS_CUDA else "cpu"
