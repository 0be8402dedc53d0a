"""LARRY with a tail guard: LARRY's order until a request's FCFS wait is due (pure).

Paper LARRY (`sal_core.larry`) wins the median by serving small prompts first, and pays at
the tail for two separate reasons (issue 10): *ordering* — large prompts are deferred to
the end of busy periods — and *KV packing* — small prompts fill every free block, decode
growth then forces recompute preemption (FCFS's blocked head request had kept some blocks
free by accident). This module fixes both with what a vLLM scheduler knows:

* **Pinning (ordering).** Every waiting request gets a *due time*; once it is due, it is
  pinned: pinned requests go first, earliest due first, then the others in LARRY order.
  Two rules for the due time (`PIN_RULES`):

  - ``"adaptive_aging"`` (the default; the rule issue 10 names as the baseline to beat):
    one threshold for all requests, ``margin_s + slack * max(recent FCFS-wait
    estimates)``, an estimate being queued prefill tokens / drain rate when the order is
    computed, the max over the last `memory_s` seconds. Pinned requests are then in
    arrival order. FCFS's p99 is set by the requests that arrive at the peak backlog, so
    one threshold relative to that peak lets every request reorder freely while the queue
    is shorter than the peak.
  - ``"fcfs_due"``: the FCFS wait each request would have had. When the scheduler first
    sees a request it records the prefill tokens queued ahead of it (every other waiting
    request's uncomputed tokens plus running requests' remaining prefill); it is due at
    ``arrival + margin_s + slack * ahead_tokens / drain_rate`` (at the latest after
    ``cap`` times the largest recent estimate, when `cap` > 0). It keeps more of LARRY's
    median and loses the tail more often (``docs/results/larry_tail.md``).

  ``drain_rate`` is the engine's own measured prefill rate while backlogged
  (`sal_core.drain_rate`); before there is one, nothing is due (paper LARRY).
* **Headroom (packing).** While other requests run, a waiting request is admitted only if
  `headroom` (a fraction of the KV blocks) stays free after it; with nothing running the
  engine admits whatever fits, so no request can be locked out.

`TailGuard` is the stateful object one engine holds; it is pure (no clock reads, no I/O):
the vLLM scheduler (`engine_patch.scheduler`) and the engine model
(`engine_sim.schedulers`) call it with the same arguments, once per step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from sal_core.drain_rate import DrainRateEstimator
from sal_core.larry import memory_blocks

T = TypeVar("T")

PIN_RULES = ("fcfs_due", "adaptive_aging")
"""Due-time rules (`TailParams.pin`); see the module docstring."""

MIN_DRAIN_RATE_TOKENS_S = 1.0
"""Floor of the measured drain rate (an engine that prefilled nothing for a window)."""


@dataclass(frozen=True, slots=True)
class TailParams:
    """Tunables of the tail-guarded LARRY (``--additional-config '{"larry_tail": {...}}'``)."""

    alpha: float = 1.0
    """LARRY's waiting-time weight (per second) for the requests not pinned yet."""
    pin: str = "adaptive_aging"
    """Due-time rule, one of `PIN_RULES` (the default won on the tuning windows:
    ``docs/results/larry_tail.md``)."""
    slack: float = 0.5
    """``fcfs_due``: multiplier of the request's FCFS-wait estimate; ``adaptive_aging``:
    fraction of the largest recent FCFS-wait estimate."""
    cap: float = 0.0
    """``fcfs_due`` only, 0 = off: a request is due at the latest after ``cap`` times the
    largest recent FCFS-wait estimate (bounds the worst wait when its own estimate is
    stretched by `slack`)."""
    margin_s: float = 1.0
    """Seconds added to every due time (LARRY may reorder freely within them). Longer
    margins give more of LARRY's capacity and cost the max TTFT at light loads
    (``docs/results/larry_tail.md``, ``docs/results/capacity.md``)."""
    headroom: float = 0.02
    """Fraction of the KV blocks a waiting request must leave free to be admitted while
    other requests run (0 disables)."""
    rate_window_s: float = 30.0
    """Time constant of the drain-rate estimate (backlogged seconds)."""
    memory_s: float = 60.0
    """``adaptive_aging`` only: how far back the largest FCFS-wait estimate is kept."""

    def __post_init__(self) -> None:
        if self.pin not in PIN_RULES:
            raise ValueError(f"pin must be one of {', '.join(PIN_RULES)}, got {self.pin!r}")
        for name in ("alpha", "slack", "cap", "margin_s", "memory_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (math.isfinite(self.rate_window_s) and self.rate_window_s > 0):
            raise ValueError(
                f"rate_window_s must be a finite number > 0, got {self.rate_window_s!r}"
            )
        if not (math.isfinite(self.headroom) and 0 <= self.headroom < 1):
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom!r}")


def headroom_blocks(headroom: float, num_blocks: int) -> int:
    """Blocks a `headroom` fraction of the KV cache keeps free: vLLM's admission watermark,
    ``int(watermark * num_blocks)``, `num_blocks` counting vLLM's null block."""
    return int(headroom * max(0, num_blocks))


def admits_with_headroom(
    needed_blocks: int, free_blocks: int, num_running: int, reserve_blocks: int
) -> bool:
    """Whether a request needing `needed_blocks` may be admitted now.

    It must fit; while `num_running` > 0 it must also leave `reserve_blocks` free. With
    nothing running the reserve is waived (the request could otherwise never start).
    """
    if needed_blocks > free_blocks:
        return False
    return num_running == 0 or free_blocks - needed_blocks >= reserve_blocks


class _RunningMax:
    """Max of (time, value) samples over the last `window_s` (monotonic deque)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now_s: float, value: float) -> None:
        samples = self._samples
        while samples and samples[-1][1] <= value:
            samples.pop()
        samples.append((now_s, value))

    def value(self, now_s: float) -> float:
        samples = self._samples
        while samples and samples[0][0] < now_s - self.window_s:
            samples.popleft()
        return samples[0][1] if samples else 0.0


class TailGuard:
    """One engine's tail guard: call `observe_step` every step, `order` before admitting.

    `kv_blocks_total` (usable blocks, vLLM's null block excluded) sizes the headroom;
    `block_size` turns tokens into LARRY's memory term. Deterministic for the same calls.
    """

    def __init__(self, params: TailParams, *, block_size: int, kv_blocks_total: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.params = params
        self.block_size = block_size
        # vLLM sizes its watermark on all blocks, the null block included.
        self.reserve_blocks = headroom_blocks(params.headroom, kv_blocks_total + 1)
        self.drain = DrainRateEstimator(window_s=params.rate_window_s)
        self._ahead_tokens: dict[str, int] = {}
        self._recent_wait = _RunningMax(params.memory_s)
        self.next_due_s = math.inf
        """Earliest due time among the requests `order` left unpinned (inf: none)."""

    # --- measurements -----------------------------------------------------------------

    def drain_rate_tokens_s(self) -> float | None:
        """The measured drain rate (floored), or None before there is one."""
        rate = self.drain.rate_tokens_s
        return None if rate is None else max(MIN_DRAIN_RATE_TOKENS_S, rate)

    def observe_step(self, interval_s: float, prefill_tokens: int, backlogged: bool) -> None:
        """One step of `interval_s` seconds prefilled `prefill_tokens` tokens; `backlogged`:
        a request was waiting when it started (see `DrainRateEstimator.observe`)."""
        self.drain.observe(interval_s, prefill_tokens, backlogged)

    def admits(self, needed_blocks: int, free_blocks: int, num_running: int) -> bool:
        """The headroom rule (`admits_with_headroom` with this engine's reserve)."""
        return admits_with_headroom(needed_blocks, free_blocks, num_running, self.reserve_blocks)

    # --- ordering ---------------------------------------------------------------------

    def _record_new(
        self,
        pending: list[T],
        queued_tokens: int,
        arrival_s: Callable[[T], float],
        uncomputed_tokens: Callable[[T], int],
        request_id: Callable[[T], str],
    ) -> None:
        """Remember, for requests seen for the first time, the prefill tokens ahead of them."""
        known = self._ahead_tokens
        new = [r for r in pending if request_id(r) not in known]
        if not new:
            return
        new.sort(key=lambda r: (arrival_s(r), request_id(r)))
        # Requests first seen together: each has the earlier ones of them ahead.
        behind = sum(uncomputed_tokens(r) for r in new)
        for r in new:
            behind -= uncomputed_tokens(r)
            own = uncomputed_tokens(r)
            known[request_id(r)] = max(0, queued_tokens - behind - own)

    def due_s(self, arrival: float, ahead_tokens: int, now_s: float) -> float:
        """When a request that arrived at `arrival` with `ahead_tokens` ahead is pinned."""
        p = self.params
        rate = self.drain_rate_tokens_s()
        if rate is None:
            return math.inf
        if p.pin == "fcfs_due":
            wait_s = p.slack * ahead_tokens / rate
            if p.cap > 0:
                wait_s = min(wait_s, p.cap * self._recent_wait.value(now_s))
            return arrival + p.margin_s + wait_s
        return arrival + p.margin_s + p.slack * self._recent_wait.value(now_s)

    def order(
        self,
        items: Iterable[T],
        *,
        now_s: float,
        queued_tokens: int,
        arrival_s: Callable[[T], float],
        uncomputed_tokens: Callable[[T], int],
        request_id: Callable[[T], str],
    ) -> list[T]:
        """`items` (the waiting queue) in admission order: pinned by due time, then LARRY.

        `queued_tokens`: prefill tokens queued in the engine now (waiting requests'
        uncomputed tokens plus running requests' remaining prefill; the `/stats`
        ``queued_prefill_tokens``). Requests no longer in `items` are forgotten; one that
        comes back (preempted) is seen anew, but its early arrival makes it due at once.
        """
        pending = list(items)
        rate = self.drain_rate_tokens_s()
        if rate is not None and (self.params.pin == "adaptive_aging" or self.params.cap > 0):
            self._recent_wait.add(now_s, queued_tokens / rate)
        self._record_new(pending, queued_tokens, arrival_s, uncomputed_tokens, request_id)
        ids = {request_id(r) for r in pending}
        if len(ids) < len(self._ahead_tokens):
            self._ahead_tokens = {k: v for k, v in self._ahead_tokens.items() if k in ids}
        queue_len = len(pending)
        alpha = self.params.alpha
        next_due = math.inf
        pinned: list[tuple[float, float, str, T]] = []
        free: list[tuple[float, float, str, T]] = []
        for r in pending:
            rid, arrival = request_id(r), arrival_s(r)
            due = self.due_s(arrival, self._ahead_tokens[rid], now_s)
            if due <= now_s:
                pinned.append((due, arrival, rid, r))
                continue
            next_due = min(next_due, due)
            mem = memory_blocks(uncomputed_tokens(r), self.block_size)
            score = alpha * max(0.0, now_s - arrival) - queue_len * mem
            free.append((-score, arrival, rid, r))
        self.next_due_s = next_due
        pinned.sort(key=lambda t: t[:3])
        free.sort(key=lambda t: t[:3])
        return [t[3] for t in pinned] + [t[3] for t in free]
