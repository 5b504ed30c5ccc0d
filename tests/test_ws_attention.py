"""The warp-specialized Gluon kernels compile for sm_90 on a machine without a GPU (Gluon does not run under
the interpreter; tests/gpu/test_ws_attention_gpu.py checks their numbers on the H200), fit Hopper's shared
memory, do not spill (the pair kernel once spilled 536 bytes of hoisted wgmma descriptors), and are only
chosen where they apply."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sparsemla.kernels import sparse_attention as sa
from sparsemla.kernels import ws_attention as ws

HOPPER_SMEM = 232448  # bytes of shared memory one block may use on sm_90


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = os.path.join(os.path.dirname(__file__), "ws_compile_probe.py")
    res = subprocess.run([sys.executable, probe], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["pair-64", "pair-0", "tile-64", "tile-0",
                                  "few-ds-64", "few-ds-0", "few-fp8-64", "few-fp8-0",
                                  "few-fp4-64", "few-fp4-0", "few-ds8-64", "few-ds8-0", "few-fp88-64", "few-fp88-0",
                                  "wide-ds-64", "wide-ds-0", "wide-fp8-64", "wide-fp8-0",
                                  "wide-ds8-64", "wide-ds8-0", "wide-fp88-64", "wide-fp88-0"])
def test_compiles_for_sm90_within_limits(compiled, name):
    r = compiled[name]
    assert r["smem"] <= HOPPER_SMEM, r
    assert r["setmaxnreg"] and r["mbarrier_cp_async"], r  # warp-specialized, mbarrier-fed
    # the wide kernel for quantized rows keeps part of its loop state (the normaliser's partial sums, 7-26
    # words) in local memory: measured with it (BENCHMARKS sections 9-10; 80-104 bytes in this probe, which
    # compiles without the launcher's divisibility specializations); more than that would be a new spill
    # (its FP8-arithmetic variant: 128 bytes in this probe; the loop's local loads as many as the default's)
    limit = 64
    if name.startswith("wide"):
        limit = 144 if name[5:].startswith(("ds8", "fp88")) else 112
    assert r["stack"] <= limit, r
    # the few-heads kernel once had every wgmma serialized by ptxas (a wait that named accumulators
    # still in flight): 2x slower, and only visible in ptxas' info output
    assert not r.get("serialized", False), r


def test_not_chosen_off_hopper_or_for_other_formats():
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 1152, dtype=torch.uint8)
    assert not ws.supported(q, kv, "bf16", 64)  # CPU tensors
    assert not sa._ws_ok(q, kv, "bf16", 64, None)
    assert not ws.supported(q, kv, "fp8_ds_mla", 64)
    q16 = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    kv16 = torch.zeros(4, 656, dtype=torch.uint8)
    assert not ws.few_supported(q16, kv16, "fp8_ds_mla", 16)  # CPU tensors
    assert not sa._few_ok(q16, kv16, "fp8_ds_mla", 16, None)
    # above 32 heads: the few-heads kernel while tokens x ceil(H / 16) programs fit in FEW_WAVES waves (132 SMs),
    # then the wide kernel for fp8 / fp8_ds_mla (nvfp4: the Triton wide kernel)
    for kind in ("fp8", "fp8_ds_mla"):
        assert ws.few_planned(kind, 16, 128) and not ws.wide_q_planned(kind, 16, 128)
        assert not ws.few_planned(kind, 17, 128) and ws.wide_q_planned(kind, 17, 128)
        assert ws.few_planned(kind, 33, 64) and ws.wide_q_planned(kind, 34, 64)
        assert ws.few_planned(kind, 1000, 32) and not ws.wide_q_planned(kind, 1000, 32)
        assert ws.few_planned(kind, 8, 128, num_sms=64) and not ws.few_planned(kind, 9, 128, num_sms=64)
    assert ws.few_planned("nvfp4_ds_mla", 66, 128) and not ws.few_planned("nvfp4_ds_mla", 67, 128)
    assert not ws.wide_q_planned("nvfp4_ds_mla", 67, 128) and not ws.few_planned("bf16", 1, 16)
    q64 = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    assert not ws.wide_q_supported(q64, kv16, "fp8_ds_mla", 64)  # CPU tensors
    assert not sa._wide_q_ok(q64, kv16, "fp8_ds_mla", 64, None)
    # the split plan only changes for the quantized kernels' kinds on an sm_90 device
    assert sa.plan_splits(128, 16, 2048, kind="fp8_ds_mla") == sa.plan_splits(128, 16, 2048)
    assert sa.plan_splits(2, 128, 2048, kind="fp8_ds_mla") == sa.plan_splits(2, 128, 2048)


def test_unknown_config_is_an_error():
    with pytest.raises(ValueError, match="config"):
        ws.launch((1,), (), 1152, 64, 1, False, config="nope")


def test_wide_output_relabelling_matches_the_accumulator_dims():
    """ws_wide writes its output through shared memory after relabelling O^T's accumulator rows as output
    dims (``_unpermute``: a reshape into bits, a permute, a reshape back).  That permutation must be the
    inverse of ``ws_few._dims`` (accumulator row -> dim, which the PV operands follow): both are read from
    the kernels' source and compared on every row, so neither can change alone."""
    import inspect
    import re

    import numpy as np

    from sparsemla.kernels import ws_few, ws_wide
    dims_expr = re.search(r"return (.+)", inspect.getsource(ws_few._dims.fn)).group(1)
    m = np.arange(128)
    dim_of_row = eval(dims_expr, {"m": m})  # noqa: S307 (the kernel's own expression, integer ops only)
    assert sorted(dim_of_row) == list(range(128))
    src = inspect.getsource(ws_wide._unpermute.fn)
    order = [int(v) for v in re.search(r"\.permute\(([\d, ]+)\)\.reshape\(\[128, 64\]\)", src).group(1).split(",")]
    assert order[-1] == 7  # the head axis stays last
    row_at_dim = m.reshape([2] * 7).transpose(order[:-1]).reshape(128)  # position d holds accumulator row m
    assert (dim_of_row[row_at_dim] == np.arange(128)).all()
