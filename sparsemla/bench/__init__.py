"""Benchmark harness: standard configurations, realistic workloads, timing, ceilings, accounting, runner.

    from sparsemla.bench import select_configs, run_benchmarks, format_table
    report = run_benchmarks(select_configs("D-h16,D-h128"), formats="fp8_ds_mla,nvfp4_ds_mla", out_dir="out")
    print(format_table(report["results"]))

The rules (configurations, FLOP/byte accounting, timing) are those of ``docs/benchmarking.md``.
"""
from .accounting import Ceilings, Work, achieved, attention_flops, attention_work, cache_write_work, sol_seconds
from .ceilings import format_ceilings, measure_ceilings
from .configs import STANDARD_CONFIGS, BenchConfig, list_configs, select_configs
from .runner import ALL_FORMATS, DEFAULT_FORMATS, format_table, resolve_backends, resolve_formats, run_benchmarks
from .timing import Timing, time_fn
from .workload import Workload, build_cache, build_queries, build_workload, make_layout

__all__ = ["Ceilings", "Work", "achieved", "attention_flops", "attention_work", "cache_write_work", "sol_seconds",
           "format_ceilings", "measure_ceilings", "STANDARD_CONFIGS", "BenchConfig", "list_configs",
           "select_configs", "ALL_FORMATS", "DEFAULT_FORMATS", "format_table", "resolve_backends",
           "resolve_formats", "run_benchmarks", "Timing", "time_fn", "Workload", "build_cache", "build_queries",
           "build_workload", "make_layout"]
