"""Property-based differential tests on the CPU (Triton interpreter): sparse attention through the public API
against the float64 reference (``sparsemla.reference``) on cases drawn by hypothesis, and a NaN row in a
cache affecting only the queries that select it.

The space of cases (``tests/helpers/reliab_cases.py``): every format of ``sparsemla.all_formats()``, every
backend that runs here, decode / prefill over the cache / prefill over a bf16 workspace, 1-128 heads,
top-k widths that are no multiple of a tile (and pooled widths ``index_topk + kpool - 1`` with the pooled
valid-count rule), valid counts (none, full, random, past K, zero), -1 prefixes and holes, empty rows,
garbage past the valid counts pointing at rows nobody wrote (NaN bytes), block sizes 1-64 and block strides
past them, k_scale (it changes only the plain fp8 format), heavy-tailed keys and queries with outlier
channels, zero / constant / spiked / tiny / saturating rows, strided q / indices / out / lse views, outputs
poisoned with NaN before the call.

CI runs a bounded, reproducible number of examples (``derandomize``; ``RELIAB_EXAMPLES`` to change it); the
H200 suite runs the same space with at least 10,000 cases (``tests/gpu/test_property_gpu.py``).
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import reliab_cases as rc  # noqa: E402

EXAMPLES = int(os.environ.get("RELIAB_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@PROPERTY
@given(data=st.data())
def test_attention_matches_float64_reference(data, device):
    src = rc.HypothesisSource(data)
    dev_type = torch.device(device).type
    spec = rc.draw_spec(src, rc.CPU, backends=rc.attention_backends(dev_type))
    case = rc.build_case(spec, device)
    try:
        out, lse = rc.run_case(case)
    except rc.Refused as why:
        pytest.fail(f"{spec.short()}: a backend the space offers refused the call: {why}")
    ref_o, ref_l = rc.reference(case)
    m = rc.measure(case, out, lse, ref_o, ref_l).tolist()
    assert rc.passed(m), rc.describe_failure(spec, m)


FORMATS = rc.format_ids()
# Under the interpreter ``triton`` runs the portable kernels, as ``triton-portable`` does: one of them suffices.
CPU_BACKENDS = [b for b in rc.attention_backends("cpu")
                if not (b == "triton" and "triton-portable" in rc.attention_backends("cpu"))]


# victim: mid (a row in the middle of the context), row0 (row 0 of the cache, where kernels point masked
# entries), write (a token with a NaN value written through the cache write, where the write policy stores it)
ISOLATION = [(f, b, v) for f in FORMATS for b in CPU_BACKENDS for v in ("mid", "row0", "write")
             if rc.is_staged(b) <= (v == "mid")]


@pytest.mark.parametrize("fmt, backend, victim", ISOLATION, ids=[f"{f}-{b}-{v}" for f, b, v in ISOLATION])
def test_nan_row_affects_only_the_queries_that_select_it(fmt, backend, victim, device):
    """Eight tokens over one request's cache: tokens that select the NaN row, hold it past their valid count,
    select its neighbours, or have -1 entries; the others must be bitwise unchanged."""
    c = rc.nan_isolation_case(fmt, 3, 8, 16, device, seed=11 + FORMATS.index(fmt), victim_row0=victim == "row0")
    rc.check_nan_isolation(c, backend, plant="write" if victim == "write" else "bytes")
