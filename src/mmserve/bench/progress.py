"""A plain-text progress bar on stderr (no tqdm): redrawn in place on a terminal, else a line per 10%."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30


class ProgressBar:
    """Counts finished requests of one run; `update()` per request, `close()` once at the end."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()
        self.interactive = self.stream.isatty()
        self._last_decile = -1

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        if not self.enabled:
            return
        if self.interactive:
            self._draw("\r")
        elif (decile := self.done * 10 // max(self.total, 1)) != self._last_decile:
            self._last_decile = decile
            self._draw("")
            self.stream.write("\n")

    def close(self) -> None:
        if self.enabled and self.interactive:
            self._draw("\r")
            self.stream.write("\n")
        self.stream.flush()

    def line(self) -> str:
        """`label  12/32 [#######        ]  37%  3.1 s  (1 failed)`."""
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        failed = f"  ({self.failed} failed)" if self.failed else ""
        return (f"{self.label} {self.done:>{len(str(self.total))}}/{self.total} "
                f"[{'#' * filled}{' ' * (BAR_WIDTH - filled)}] {100 * self.done // max(self.total, 1):3d}%  "
                f"{time.perf_counter() - self.start:.1f} s{failed}")

    def _draw(self, prefix: str) -> None:
        self.stream.write(prefix + self.line())
        self.stream.flush()
