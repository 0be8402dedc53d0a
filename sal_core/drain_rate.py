"""How fast an engine drains its prefill backlog, measured by the engine itself (pure).

The tail-guarded LARRY (`sal_core.larry_tail`) and the adaptive-aging baseline need a
scheduler-side estimate of "how long would this backlog take under FCFS": queued prefill
tokens divided by the rate at which the engine actually prefills while requests wait. That
rate is not a constant of the hardware: it falls when KV memory, not compute, holds the
queue back (every admission then waits for a running request to finish), and it is exactly
the rate FCFS would drain the queue at. So it is measured, over the engine's recent
*backlogged* time only (steps that started with a request waiting), with an exponential
window on time.

Callers: the vLLM scheduler once per ``schedule()`` (interval = wall time since the
previous call, tokens = prefill tokens that call scheduled), the engine model once per step
(interval = the step's modelled duration). No clock reads, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class DrainRateEstimator:
    """Exponentially weighted prefill tokens per backlogged second.

    ``rate_tokens_s`` is ``sum(w_i * tokens_i) / sum(w_i * interval_i)`` over the observed
    backlogged steps, with weights ``exp(-age_i / window_s)`` (age in backlogged seconds), so
    a burst of slow steps pulls it down within about one window. None until
    `min_observed_s` backlogged seconds were seen (no estimate from a handful of steps).
    """

    window_s: float = 30.0
    """Time constant of the exponential window (backlogged seconds)."""
    min_observed_s: float = 0.5
    """Backlogged seconds needed before the estimate is reported."""
    _tokens: float = 0.0
    _seconds: float = 0.0
    _observed_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s must be a finite number > 0, got {self.window_s!r}")
        if not (math.isfinite(self.min_observed_s) and self.min_observed_s >= 0):
            raise ValueError(f"min_observed_s must be >= 0, got {self.min_observed_s!r}")

    def observe(self, interval_s: float, prefill_tokens: int, backlogged: bool) -> None:
        """One step of `interval_s` seconds that prefilled `prefill_tokens` tokens.

        Steps that started with nothing waiting (`backlogged` False) say nothing about the
        drain rate and are ignored, as are non-positive or non-finite intervals (a clock
        that stepped back).
        """
        if not backlogged or not (math.isfinite(interval_s) and interval_s > 0):
            return
        decay = math.exp(-interval_s / self.window_s)
        self._tokens = self._tokens * decay + max(0, prefill_tokens)
        self._seconds = self._seconds * decay + interval_s
        self._observed_s += interval_s

    @property
    def rate_tokens_s(self) -> float | None:
        """Prefill tokens per backlogged second, or None before enough was observed."""
        if self._observed_s < self.min_observed_s or self._seconds <= 0:
            return None
        return self._tokens / self._seconds
