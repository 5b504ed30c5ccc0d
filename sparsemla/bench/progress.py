"""A progress bar for long steps: tqdm when it is installed, else a plain one on stderr.

Both are used the same way::

    with progress(total=n, desc="write fp8_ds_mla") as bar:
        ...
        bar.update(k)

``enabled=False`` (or a stderr that is not a terminal, for the plain bar) prints nothing, so
tests and logs stay clean.
"""
from __future__ import annotations

import sys
import time


class _PlainBar:
    """Redraws one stderr line at most ~5 times a second."""

    def __init__(self, total: int, desc: str, enabled: bool, stream=None):
        self.total = max(int(total), 1)
        self.desc = desc
        self.n = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._last = 0.0
        self._t0 = time.perf_counter()

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.2 or self.n >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.n / self.total, 1.0)
        width = 30
        fill = int(round(frac * width))
        self.stream.write(f"\r{self.desc}: [{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}% "
                          f"{now - self._t0:6.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def progress(total: int, desc: str = "", enabled: bool = True):
    """A context-managed bar with ``update(k)``."""
    try:
        from tqdm import tqdm  # optional
    except ImportError:
        tqdm = None
    if tqdm is not None:
        return tqdm(total=total, desc=desc, disable=not enabled, leave=False, file=sys.stderr)
    return _PlainBar(total, desc, enabled and sys.stderr.isatty())


class NullBar:
    """A bar that does nothing (the default of functions that accept one)."""

    def update(self, k: int = 1) -> None:
        pass


__all__ = ["progress", "NullBar"]
