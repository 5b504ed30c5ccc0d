"""The many-case differential run of the GPU suite: thousands of :mod:`reliab_cases` specs back to back.

Kernel variants are compiled per distinct set of constexprs and integer specializations, which costs seconds
each, while a case costs milliseconds.  So the run first draws a pool of :class:`reliab_cases.Config` (per
format: a few-heads and a many-heads configuration of the default backend; for every other ``triton*``
backend one configuration per row kind it reads at 1-16 heads and one or two at many heads; on a GPU more
until every kernel of the plan serves one, :func:`cover_kernels`), each fixing what decides the kernel
variant (format, backend, mode, a 16-head band, a token band, the top-k width class, valid counts or not, the
q / out / lse layouts), and then draws
the cases of each configuration (exact H, T and K inside those bands, contexts, counts, -1 patterns,
garbage, block geometry, k_scale, sm_scale, data).  With ``precompile_workers`` the first cases of every
configuration run first in spawned worker processes, which fill Triton's on-disk kernel cache in parallel.

Case ``j`` of configuration ``i`` of a run with seed ``s`` is drawn from ``RandomSource(f"{s}:{i}:{j}")``
alone: :func:`replay` rebuilds it from ``(s, i, j)``.  Metrics stay on the device and are read back every
``flush`` cases, so the loop does not wait for the GPU.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Dict, List, Optional, Sequence

import torch

import reliab_cases as rc


def draw_configs(seed: int, device_type: str) -> List[rc.Config]:
    src = rc.RandomSource(f"{seed}:configs")
    fmts = rc.format_ids()
    backends = rc.attention_backends(device_type)
    first = backends[0]  # "auto" on a GPU, "triton" on the CPU
    configs = []
    for f in fmts:
        configs.append(rc.draw_config(src, f, first, many_heads=False, many_tokens=False))
        configs.append(rc.draw_config(src, f, first, many_heads=True, many_tokens=src.chance(0.5)))
    for b in backends[1:]:
        # one format of each row kind it reads (rope or NoPE at random) at 1-16 heads, then at many heads
        # one more (two when it reads fewer than four kinds)
        fl = rc.backend_formats(b, fmts)
        kinds = {}
        for f in fl:
            kinds.setdefault(rc.sparsemla.get_format(f).name, []).append(f)
        for ids in kinds.values():
            configs.append(rc.draw_config(src, src.choice(ids), b, many_heads=False, band=0, cache_rows=True))
        for _ in range(1 if len(kinds) >= 4 else 2):
            configs.append(rc.draw_config(src, src.choice(fl), b, many_heads=True))
    if device_type == "cuda":
        configs += cover_kernels(seed, configs, backends, fmts)
    return configs


def _first_kernel(seed: int, i: int, config: rc.Config) -> str:
    """The kernel ``sparsemla.plan`` gives configuration ``i``'s first case on an H200 (see rc.planned_kernel)."""
    return str(rc.planned_kernel(case_spec(seed, i, 0, config, rc.GPU)))


def cover_kernels(seed: int, configs: Sequence[rc.Config], backends: Sequence[str], fmts: Sequence[str],
                  tries: int = 400) -> List[rc.Config]:
    """Configurations to add so that every kernel of the plan serves some configuration's first case.

    The random pool above leaves a kernel that only a narrow corner of the space plans (the 64-head programs:
    many heads, many tokens and e4m3 rows) to chance: 10 of 40 seeds planned no ``sm90-wide`` case in 300
    cases.  For each kernel no configuration plans, configurations are drawn at random (from a source of their
    own, so the pool above is unchanged) until one plans it; a kernel no draw reaches within ``tries`` stays
    uncovered, and the run reports it under ``kernels_never_planned``."""
    names = rc.plan_kernel_names()
    have = {_first_kernel(seed, i, c) for i, c in enumerate(configs)}
    added: List[rc.Config] = []
    for name in names:
        if any(k.startswith(name) for k in have):
            continue
        src = rc.RandomSource(f"{seed}:cover:{name}")
        for _ in range(tries):
            b = src.choice(backends)
            fl = rc.backend_formats(b, fmts)
            if not fl:
                continue
            # 133-160 tokens only here: calls past one token per SM (132 on an H100 / H200), which the pool's
            # draws rarely reach (no call takes more than 128 heads)
            c = rc.draw_config(src, src.choice(fl), b, many_heads=src.chance(0.7), many_tokens=src.chance(0.7),
                               tokens_band=(133, 160) if src.chance(0.3) else None)
            k = _first_kernel(seed, len(configs) + len(added), c)
            if k.startswith(name):
                added.append(c)
                have.add(k)
                break
    return added


def case_spec(seed: int, i: int, j: int, config: rc.Config, profile: rc.Profile) -> rc.Spec:
    return rc.draw_spec(rc.RandomSource(f"{seed}:{i}:{j}"), profile, config=config)


def replay(seed: int, i: int, j: int, device="cuda", profile: rc.Profile = rc.GPU):
    """(spec, metrics list) of one recorded case."""
    config = draw_configs(seed, torch.device(device).type)[i]
    spec = case_spec(seed, i, j, config, profile)
    case = rc.build_case(spec, device)
    out, lse = rc.run_case(case)
    ref_o, ref_l = rc.reference(case)
    return spec, rc.measure(case, out, lse, ref_o, ref_l).tolist()


class Storage:
    """One reusable uint8 buffer for the cases' cache bytes (grown on demand)."""

    def __init__(self, device):
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def for_spec(self, spec: rc.Spec) -> torch.Tensor:
        f = rc.sparsemla.get_format(spec.fmt)
        bs = spec.block_size
        blocks = sum(-(-c // bs) for c in spec.ctx) + 2
        need = blocks * (bs + spec.stride_extra) * f.bytes_per_token
        if need > self.buf.numel():
            self.buf = torch.empty(int(need * 1.5), dtype=torch.uint8, device=self.device)
        return self.buf


def _profile(name: str) -> rc.Profile:
    """A profile by its name (what a spawned worker is handed)."""
    return rc.GPU if name == "gpu" else rc.CPU


def _worse(a: float, b: float) -> float:
    """The larger of two metrics, NaN over any number (a NaN metric is a failure that must stay visible)."""
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)


def _warm(args) -> int:
    """Worker: run the first cases of some configurations (no checks) so their kernels are compiled into
    the on-disk cache.  Returns the number of cases run."""
    seed, indices, per_config, device, profile_name = args
    profile = _profile(profile_name)
    configs = draw_configs(seed, torch.device(device).type)
    store = Storage(device)
    n = 0
    for i in indices:
        for j in range(per_config):
            spec = case_spec(seed, i, j, configs[i], profile)
            try:
                rc.run_case(rc.build_case(spec, device, store.for_spec(spec)))
                n += 1
            except Exception:  # the main run reports failures; a worker only compiles
                break
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return n


def precompile(seed: int, num_configs: int, workers: int, device, profile: rc.Profile, per_config: int = 3,
               timeout_s: float = 240.0) -> Dict:
    """Run the first ``per_config`` cases of every configuration in ``workers`` spawned processes."""
    import multiprocessing as mp
    t0 = time.time()
    chunks = [list(range(k, num_configs, workers)) for k in range(workers)]
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(workers)
    try:
        res = pool.map_async(_warm, [(seed, c, per_config, str(device), profile.name) for c in chunks if c])
        res.wait(timeout_s)
        done = sum(res.get()) if res.ready() and res.successful() else None
    finally:
        pool.terminate()
        pool.join()
    return {"workers": workers, "cases": done, "seconds": round(time.time() - t0, 1)}


def case_order(num_configs: int, per: int) -> List[tuple]:
    """``(configuration, case)`` pairs in the order a run takes them: case 0 of every configuration, then case 1
    of every configuration, and so on, so that a run its machine cuts off has reached every configuration (the
    ones :func:`cover_kernels` adds come last in the pool) once it has run as many cases as there are."""
    return [(i, j) for j in range(per) for i in range(num_configs)]


def run_many(seed: int, num_cases: int, device="cuda", profile: rc.Profile = rc.GPU, *,
             precompile_workers: int = 0, flush: int = 200, max_failures_kept: int = 50,
             max_seconds: Optional[float] = None, checkpoint: Optional[str] = None) -> Dict:
    """Run at least ``num_cases`` cases; returns the summary (see the keys below).  ``max_seconds``: stop
    after that long (counted after the precompile) with the cases run so far (``stopped_by_time`` is then
    True).  A progress line (cases, failures, seconds) is printed at every check of ``flush`` cases.
    ``checkpoint``: a file name for :func:`write_summary`, written with the summary so far at every check (with
    ``stopped_by_time`` True until the run ends), so that a run its machine cuts off still leaves a summary the
    ``merge`` command takes."""
    device = torch.device(device)
    configs = draw_configs(seed, device.type)
    per = math.ceil(num_cases / len(configs))
    summary: Dict = {"seed": seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "configs": len(configs), "cases_per_config": per}
    try:
        import triton
        summary["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    if precompile_workers > 0:
        summary["precompile"] = precompile(seed, len(configs), precompile_workers, device, profile)
    t0 = time.time()
    store = Storage(device)
    pending: List[torch.Tensor] = []
    keys: List[tuple] = []
    failures: List[Dict] = []
    per_config: Dict[int, Dict] = {}
    refused: Dict[int, str] = {}
    ran = 0
    worst = [0.0, 0.0, 0.0, 0.0]
    planned: Dict[str, int] = {}

    def result(stopped_by_time: bool) -> Dict:
        """The summary of the cases run so far."""
        return dict(summary, **{
            "cases_run": ran, "stopped_by_time": stopped_by_time, "failures": len(failures),
            "failed_cases": list(failures), "refused_configs": dict(refused),
            "worst": dict(zip(rc.METRICS, worst)), "seconds": round(time.time() - t0, 1),
            "per_config": {str(i): dict(v, config=dataclasses.asdict(configs[i])) for i, v in per_config.items()},
            "kernels_compiled": rc.compiled_kernels(),
            "kernels_planned": dict(planned),
            "kernels_never_planned": [k for k in rc.plan_kernel_names()
                                      if not any(p.startswith(k) for p in planned)],
        })

    def drain():
        nonlocal ran
        if not pending:
            return
        vals = torch.stack(pending).cpu().tolist()
        for (i, j, spec), m in zip(keys, vals):
            ran += 1
            pc = per_config.setdefault(i, {"cases": 0, "failures": 0, "worst": [0.0] * 4})
            pc["cases"] += 1
            pc["worst"] = [_worse(a, b) for a, b in zip(pc["worst"], m)]
            for k in range(4):
                worst[k] = _worse(worst[k], m[k])
            if not rc.passed(m):
                pc["failures"] += 1
                if len(failures) < max_failures_kept:
                    failures.append({"case": [seed, i, j], "metrics": dict(zip(rc.METRICS, m)),
                                     "spec": dataclasses.asdict(spec)})
                else:
                    failures.append({"case": [seed, i, j]})
        pending.clear()
        keys.clear()
        print(f"property run: {ran} cases, {len(failures)} failures, {time.time() - t0:.0f} s", flush=True)
        if checkpoint:
            write_summary(result(True), checkpoint)

    # `per` cases of every configuration, then more of the configurations that served until `num_cases` ran (a
    # refused configuration is reported, not counted)
    order = case_order(len(configs), per)
    extra = per
    stopped = False
    while True:
        for i, j in order:
            if max_seconds is not None and time.time() - t0 > max_seconds:
                stopped = True
                break
            if i in refused:
                continue
            config = configs[i]
            spec = case_spec(seed, i, j, config, profile)
            case = rc.build_case(spec, device, store.for_spec(spec))
            try:
                out, lse = rc.run_case(case)
            except rc.Refused as why:
                refused[i] = str(why)
                continue
            except Exception as e:  # an exception is a failure of this case, recorded with its spec
                drain()
                ran += 1
                failures.append({"case": [seed, i, j], "error": f"{type(e).__name__}: {e}",
                                 "spec": dataclasses.asdict(spec)})
                continue
            ref_o, ref_l = rc.reference(case)
            pending.append(rc.measure(case, out, lse, ref_o, ref_l))
            keys.append((i, j, spec))
            if device.type == "cuda":
                k = rc.planned_kernel(spec, torch.cuda.get_device_capability(device))
                planned[str(k)] = planned.get(str(k), 0) + 1
            if len(pending) >= flush:
                drain()
        drain()
        live = [i for i in range(len(configs)) if i not in refused]
        if ran >= num_cases or not live or stopped:
            break
        need = num_cases - ran
        order = [(live[k % len(live)], extra + k // len(live)) for k in range(need)]
        extra += -(-need // len(live))
    final = result(stopped)
    if checkpoint:
        write_summary(final, checkpoint)
    return final


def _run_one(args) -> Dict:
    """Worker of :func:`run_parallel`: one seed's :func:`run_many` in its own process."""
    seed, num_cases, device, profile_name, precompile_workers, max_seconds = args
    return run_many(seed, num_cases, device, _profile(profile_name), precompile_workers=precompile_workers,
                    max_seconds=max_seconds, checkpoint=checkpoint_name(seed))


def checkpoint_name(seed: int) -> str:
    """The file one process's run keeps its summary so far in (under ``$RELIAB_OUT``; see :func:`run_many`)."""
    return f"property_gpu-seed{seed}.json"


def run_parallel(seeds: Sequence[int], num_cases: int, device="cuda", profile: rc.Profile = rc.GPU, *,
                 precompile_workers: int = 0, max_seconds: Optional[float] = None) -> Dict:
    """:func:`run_many` for each seed in its own spawned process, side by side on one device (a case is small:
    one process leaves the GPU mostly idle, bound by its host work), ``ceil(num_cases / len(seeds))`` cases
    each; returns :func:`merge_summaries` of their summaries."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    per = math.ceil(num_cases / len(seeds))
    jobs = [(s, per, str(device), profile.name, precompile_workers, max_seconds) for s in seeds]
    # an executor's workers are not daemonic (a multiprocessing.Pool's are), so each can start its own
    # precompile workers
    with ProcessPoolExecutor(len(seeds), mp_context=mp.get_context("spawn")) as ex:
        return merge_summaries(list(ex.map(_run_one, jobs)))


def merge_summaries(runs: Sequence[Dict]) -> Dict:
    """One summary of several runs (different seeds): each a :func:`run_many` summary or an earlier merge (the
    runs of several calls of a machine that limits one command's time).  Counts and kernels summed, worst
    metrics the largest (NaN wins), failures and refusals kept with their seeds, a kernel never planned only if
    no run planned it; each run's own figures under ``runs``."""
    planned: Dict[str, int] = {}
    for r in runs:
        for k, n in r["kernels_planned"].items():
            planned[k] = planned.get(k, 0) + n
    worst = {k: 0.0 for k in rc.METRICS}
    for r in runs:
        worst = {k: _worse(worst[k], r["worst"][k]) for k in rc.METRICS}
    never = set(runs[0]["kernels_never_planned"]) if runs else set()
    for r in runs[1:]:
        never &= set(r["kernels_never_planned"])
    return {
        "seeds": [s for r in runs for s in r.get("seeds", [r.get("seed")])],
        "device": runs[0]["device"] if runs else None,
        "torch": runs[0].get("torch") if runs else None, "triton": runs[0].get("triton") if runs else None,
        "cases_run": sum(r["cases_run"] for r in runs),
        "stopped_by_time": any(r.get("stopped_by_time") for r in runs),
        "failures": sum(r["failures"] for r in runs),
        "failed_cases": [f for r in runs for f in r["failed_cases"]],
        # an earlier merge keys its refusals "seed:config" already
        "refused_configs": {(k if "seeds" in r else f"{r['seed']}:{k}"): why
                            for r in runs for k, why in r["refused_configs"].items()},
        "worst": worst, "seconds": max((r["seconds"] for r in runs), default=0.0),
        "kernels_planned": planned, "kernels_never_planned": sorted(never),
        "runs": [x for r in runs for x in (r["runs"] if "runs" in r else [
            {k: r.get(k) for k in ("seed", "cases_run", "failures", "seconds", "precompile", "worst",
                                   "stopped_by_time", "configs")}])],
    }


def write_summary(summary: Dict, name: str) -> Optional[str]:
    """Write ``summary`` as JSON under ``$RELIAB_OUT`` (or ``$OUT/reliability``); returns the path."""
    root = os.environ.get("RELIAB_OUT") or (os.path.join(os.environ["OUT"], "reliability") if os.environ.get("OUT")
                                            else None)
    if not root:
        return None
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, name)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path


def main(argv=None) -> int:
    """``python tests/helpers/reliab_property.py merge OUT.json IN.json ...``: the summaries of several runs
    (for instance ``property_gpu.json`` of two calls with different seeds) as one, printed as one line."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("command", choices=["merge"])
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args(argv)
    runs = []
    for path in a.inputs:
        with open(path) as f:
            runs.append(json.load(f))
    m = merge_summaries(runs)
    with open(a.out, "w") as f:
        json.dump(m, f, indent=1, default=str)
    print(f"{len(m['seeds'])} seeds {m['seeds']}: {m['cases_run']} cases, {m['failures']} failures, "
          f"{len(m['refused_configs'])} refused configurations -> {a.out}")
    return 1 if m["failures"] else 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
