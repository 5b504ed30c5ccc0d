"""The data-movement kernels compile for sm_90 without a GPU (tests/movement_compile_probe.py, run in a
process without the interpreter): every format's cache write (both conversion paths), the staging
gathers, index conversion and the indexer kernels.  The GPU path of the NaN-propagating group maxima
(the non-finite rule of formats/base.py) must lower to ``max.NaN``: a plain max drops NaN on the GPU."""
import json
import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(__file__), "movement_compile_probe.py")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, PROBE], capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0 and "GPUTarget" in res.stderr:
        pytest.skip(f"this Triton cannot compile for a target without a GPU: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_variant_compiles(compiled):
    errors = {k: v["error"] for k, v in compiled.items() if "error" in v}
    assert not errors, errors
    assert sum(k.startswith("cache_write/") for k in compiled) == 33   # 10 formats x 3, nvfp4 fp32 emulated x 3
    assert any(k.startswith("gather/") for k in compiled) and any(k.startswith("upconvert/") for k in compiled)


def test_group_maxima_propagate_nan_on_the_gpu(compiled):
    for name, v in compiled.items():
        if name.startswith("cache_write/") and ("ds_mla" in name) and not name.endswith("bf16/emulate"):
            assert v["max_nan"], name
