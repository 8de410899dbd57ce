"""Progress lines for long CLI operations: redrawn on a terminal, silent otherwise or with --quiet."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, *, quiet: bool = False) -> None:
        self.stream = sys.stderr
        self.enabled = not quiet and self.stream.isatty()
        self.label = label
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / max(now - self.t0, 1e-9) / 1e6
        self.stream.write(f"\r{self.label}: {pct:5.1f}%  {done / 1e6:,.1f}/{total / 1e6:,.1f} MB  {rate:,.0f} MB/s ")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def say(args, text: str) -> None:
    """Print a result line unless --quiet."""
    if not getattr(args, "quiet", False):
        print(text, flush=True)
