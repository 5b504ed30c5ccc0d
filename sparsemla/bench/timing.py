"""Timing: median of N runs after warm-up, L2 flushed between runs.

On CUDA each run is bracketed by CUDA events, after writing a buffer larger than L2 (256 MB at
least) so that the cache starts cold, as it does in a serving step where other layers ran in
between -- and then reading half of it back, so that L2 is left holding clean lines.  Without the
read, the flush's last ~60 MB stay dirty in L2 and are written back *inside* the timed run as the
kernel's own traffic evicts them, which charges a memory-bound kernel up to one L2 of extra DRAM
writes and makes cache-write timings bimodal.  Everything the call launches (split-KV partials and
the combine, index conversion) lies between the two events.  The flush itself lies outside them.

On CPU (no GPU: the scaled-down path) the same loop uses ``time.perf_counter``; there is no
cache flush, and the figures only say how long the CPU path takes, nothing about kernels.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List

import torch

FLUSH_BYTES = 256 * 1024 * 1024  # larger than any GPU's L2 today (H200: 60 MB)
_flush_buffers: dict = {}


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median (the figure we report), min, 20th/80th percentile, mean."""

    median_s: float
    min_s: float
    p20_s: float
    p80_s: float
    mean_s: float
    reps: int
    method: str          # "cuda-events" or "perf_counter"
    l2_flushed: bool

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(times: List[float], method: str, flushed: bool) -> Timing:
    ts = sorted(times)
    n = len(ts)

    def pct(p):
        return ts[min(n - 1, max(0, int(round(p * (n - 1)))))]

    return Timing(median_s=statistics.median(ts), min_s=ts[0], p20_s=pct(0.2), p80_s=pct(0.8),
                  mean_s=statistics.fmean(ts), reps=n, method=method, l2_flushed=flushed)


def flush_buffer(device) -> torch.Tensor:
    """A cached int8 buffer bigger than the device's L2 (at least :data:`FLUSH_BYTES`)."""
    device = torch.device(device)
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    buf = _flush_buffers.get(key)
    if buf is None:
        nbytes = FLUSH_BYTES
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
        nbytes = max(nbytes, 4 * int(l2))
        buf = torch.empty(nbytes, dtype=torch.int8, device=device)
        _flush_buffers[key] = buf
    return buf


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` (a CUDA call with no arguments, the same work every time) run once, captured in a CUDA graph,
    and returned as the graph's replay: timed, it is the GPU time without Python launch overhead (what an
    engine that captures its decode step sees).  The replay holds ``fn`` (and so the tensors its closure
    holds): the graph reads and writes their memory, which must not be freed while the replay lives."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay() -> None:
        g.replay()
    replay.captured = (g, fn)
    return replay


def time_fn(fn: Callable[[], object], *, device=None, reps: int = 50, warmup: int = 5,
            flush_l2: bool = True) -> Timing:
    """Time ``fn()`` (no arguments; its result is ignored).

    Args:
        fn: the call to time; it must do the same work every time.
        device: where it runs (``cuda...`` -> CUDA events, anything else -> perf_counter).
        reps: timed runs (the benchmark standard is >= 30; the median is reported).
        warmup: untimed runs first (compilation, autotuning, allocator warm-up).
        flush_l2: write a buffer larger than L2, then read half of it, before each timed run (CUDA only).
    """
    return time_fns([fn], device=device, reps=reps, warmup=warmup, flush_l2=flush_l2)[0]


def time_fns(fns: List[Callable[[], object]], *, device=None, reps: int = 50, warmup: int = 5,
             flush_l2: bool = True) -> List[Timing]:
    """Time several calls interleaved: ``warmup`` untimed runs of each, then ``reps`` rounds, each running every
    call once in turn (``time_fn``'s arguments otherwise).  The calls whose times are compared see the same
    device state (clocks, temperature) over the same span, where timing them one after the other puts whatever
    drifts during a process into their ratios."""
    if reps < 1:
        raise ValueError(f"reps: expected >= 1, got {reps}")
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return _time_cuda(fns, device, reps, warmup, flush_l2)
    return _time_cpu(fns, reps, warmup)


def _time_cuda(fns, device, reps, warmup, flush_l2) -> List[Timing]:
    with torch.cuda.device(device):
        buf = flush_buffer(device) if flush_l2 else None
        for fn in fns:
            for _ in range(warmup):
                fn()
        torch.cuda.synchronize()
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                  for _ in fns]
        for i in range(reps):
            for fn, ev in zip(fns, events):
                if buf is not None:
                    buf.zero_()
                    buf[: buf.numel() // 2].view(torch.float32).amax()  # read back: clean lines in L2
                ev[i][0].record()
                fn()
                ev[i][1].record()
        torch.cuda.synchronize()
        return [_summary([s.elapsed_time(e) * 1e-3 for s, e in ev], "cuda-events", buf is not None) for ev in events]


def _time_cpu(fns, reps, warmup) -> List[Timing]:
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [_summary(ts, "perf_counter", False) for ts in times]


__all__ = ["Timing", "time_fn", "time_fns", "flush_buffer", "FLUSH_BYTES"]
