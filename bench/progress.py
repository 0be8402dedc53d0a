"""A dependency-free progress bar on stderr for long simulations.

`ProgressBar` is a `engine_sim.simulator.ProgressCallback`: the simulator calls it with
``(finished, total)`` about every 1% of requests; it redraws one line in place.
"""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """Redraws ``label [#####.....]  512/1000 requests`` on one line; newline when done."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._width = width
        self._last_filled = -1
        self._closed = False

    def __call__(self, finished: int, total: int) -> None:
        if self._closed:
            return
        filled = self._width if total <= 0 else self._width * finished // total
        done = finished >= total
        if filled == self._last_filled and not done:
            return
        self._last_filled = filled
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r{self._label} [{bar}] {finished}/{total} requests")
        if done:
            self._stream.write("\n")
            self._closed = True
        self._stream.flush()
