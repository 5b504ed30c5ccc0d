"""H200: the reliability property runs at real sizes.

- At least 10,000 random cases (``RELIAB_GPU_CASES``) through the public API against the float64 reference,
  drawn from the space of ``tests/test_property.py`` at GPU sizes (1-96 tokens, 1-128 heads, widths up to
  2112 incl. pooled ones, every format and ``triton*`` backend), with 0 failures.  The seed is fresh per run
  unless ``RELIAB_SEED`` is set; it is printed, and the summary (seed, cases, failures with their specs,
  worst metrics, kernels compiled) is written to ``$OUT/reliability/property_gpu.json``.  Replay one case:
  ``reliab_property.replay(seed, config, case)``.
- A NaN row in a cache affects only the queries that select it, for every format on the kernels the GPU runs
  (few heads, head groups, 64-head programs, split-KV with the combine, the portable, staged and FP8-QK
  backends): other queries bitwise equal to a clean run.

Run: ``python3 -m pytest -m gpu tests/gpu/test_property_gpu.py -q -s``.  One process runs about 8 cases a
second on an H200, bound by its host work (1,557 cases in 200 s, after 69 s compiling kernel variants), so
10,000 cases take ~25 minutes in one process; ``RELIAB_GPU_PROCS=6`` runs seeds seed .. seed + 5 in six
processes side by side (8,594 cases in 390 s) and merges their summaries.  The processes share the GPU by
time-slicing: twelve ran about 14 cases a second together, no more than six.  ``RELIAB_PRECOMPILE_WORKERS``:
processes that compile the variants first (per run process; default a quarter of the CPU cores up to 4 for one
process, 2 each for several; 0 turns it off).  ``RELIAB_GPU_SECONDS`` bounds the run (after the precompile).
Where one command may not run that long, the runs of several calls (different seeds) merge into one summary:
``python3 tests/helpers/reliab_property.py merge merged.json call1/property_gpu.json call2/property_gpu.json``.
"""
import os
import random
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import reliab_cases as rc  # noqa: E402
import reliab_property as rp  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
NUM_CASES = int(os.environ.get("RELIAB_GPU_CASES", "10000"))
# a bound on the run's seconds (after the precompile), for a machine that limits one command's time: the run
# then stops, writes its summary and fails unless NUM_CASES were reached
MAX_SECONDS = float(os.environ["RELIAB_GPU_SECONDS"]) if os.environ.get("RELIAB_GPU_SECONDS") else None


def _seed() -> int:
    s = os.environ.get("RELIAB_SEED")
    return int(s) if s else random.SystemRandom().randrange(2 ** 31)


def test_10000_random_cases_match_the_reference():
    seed = _seed()
    procs = int(os.environ.get("RELIAB_GPU_PROCS", "1"))
    default_workers = min(4, (os.cpu_count() or 2) // 4) if procs == 1 else 2
    workers = int(os.environ.get("RELIAB_PRECOMPILE_WORKERS", str(default_workers)))
    print(f"\nproperty run: seed {seed}, {NUM_CASES} cases, {procs} processes, {workers} precompile workers each",
          flush=True)
    if procs > 1:  # seeds seed, seed + 1, ...: each process draws its own configurations
        summary = rp.run_parallel([seed + k for k in range(procs)], NUM_CASES, DEV, rc.GPU,
                                  precompile_workers=workers, max_seconds=MAX_SECONDS)
    else:
        summary = rp.run_many(seed, NUM_CASES, DEV, rc.GPU, precompile_workers=workers, max_seconds=MAX_SECONDS,
                              checkpoint=rp.checkpoint_name(seed))
    path = rp.write_summary(summary, "property_gpu.json")
    worst = ", ".join(f"{k} {v:.3g}" for k, v in summary["worst"].items())
    print(f"property run: seed {seed}: {summary['cases_run']} cases, {summary['failures']} failures, "
          f"{len(summary['refused_configs'])} refused configurations, {summary['seconds']} s "
          f"(precompile {summary.get('precompile')}); worst {worst}; summary {path}", flush=True)
    for f in summary["failed_cases"][:10]:
        print("FAILED", f, flush=True)
    assert summary["cases_run"] >= NUM_CASES, ("stopped by RELIAB_GPU_SECONDS" if summary["stopped_by_time"]
                                               else summary["refused_configs"])
    assert summary["failures"] == 0, f"seed {seed}: {summary['failed_cases'][:5]}"
    assert not summary["refused_configs"], summary["refused_configs"]
    assert not summary["kernels_never_planned"], f"no case reached {summary['kernels_never_planned']}"


# (backend, heads, tokens, width): few heads, head groups, 64-head programs (more than 132 programs of 16 heads;
# e4m3 rows only), portable, staged and FP8-QK kernels.  2048-row widths split over programs (the combine
# runs); 6 tokens with 16 or 128 heads are the shapes the attention GPU suite compiles too.
REGIMES = [("auto", 16, 6, 2048), ("auto", 128, 6, 2048)]
WIDE = ("auto", 64, 40, 2048)
OTHER = [("triton-portable", 16, 6, 2048), ("triton-portable", 40, 6, 300), ("triton-staged", 16, 6, 2048),
         ("triton-fp8qk", 16, 6, 2048)]


def _isolation_params():
    fmts = rc.format_ids()
    have = set(rc.attention_backends("cuda"))
    out = [(f, *r) for f in fmts for r in REGIMES]
    out += [(f, *WIDE) for f in rc.backend_formats("triton-fp8qk", fmts)]  # the e4m3-row formats
    for b, h, t, k in OTHER:
        if b in have:
            for f in rc.backend_formats(b, fmts)[:2]:
                out.append((f, b, h, t, k))
    return out


ISOLATION = _isolation_params()


@pytest.mark.parametrize("fmt, backend, heads, tokens, width", ISOLATION,
                         ids=[f"{f}-{b}-h{h}-t{t}-k{k}" for f, b, h, t, k in ISOLATION])
def test_nan_row_affects_only_the_queries_that_select_it(fmt, backend, heads, tokens, width):
    for victim_row0 in (False, True):
        c = rc.nan_isolation_case(fmt, heads, tokens, width, DEV, seed=zlib.crc32(f"{fmt}-{heads}-{tokens}".encode()),
                                  block_size=64, victim_row0=victim_row0)
        rc.check_nan_isolation(c, backend)
    if backend == "auto":
        c = rc.nan_isolation_case(fmt, heads, tokens, width, DEV, seed=7, block_size=64)
        rc.check_nan_isolation(c, backend, plant="write")
