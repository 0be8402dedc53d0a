"""Background polling of every backend's state, on a thread of its own.

All pollers run on ONE dedicated thread with its own asyncio event loop (uvloop when
installed) and its own aiohttp session (at most 2 connections per backend), so a request
path that saturates the main event loop cannot delay a poll past ``poll_timeout_s`` and make
a healthy backend look stale. Each poll's outcome, with its send and receipt times taken on
the poll thread (monotonic, plus the wall clock at receipt to map the engine's timestamps),
is handed to the main loop with ``call_soon_threadsafe``; only the main loop touches the
`StateTable`, so it stays single-threaded (no locks in loop code), and a busy main loop never
ages state: its age counts from the receipt.

One task per backend polls every ``poll_interval_s`` on an absolute timeline (jittered by
+-10% so that pollers of many backends do not synchronise); what a poll reads, and how it
fails, is `sal_gateway.poll_fetch`. A poll task never dies: every failure, expected or not
(timeout, refused connection, non-200, a body that is not JSON, nested too deep, NaN, the
wrong schema, an unexpected exception), is counted in ``sal_poll_errors_total{reason}``
(`poll_fetch.REASONS`), logged at most once per `LOG_EVERY_S` per backend and reason, and
retried after a jittered exponential backoff of up to ``routing.poll_backoff_max_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import random
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from sal_core.stats import ReplicaStats
from sal_gateway.config import RoutingConfig
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.poll_fetch import PollFailed, StateFetcher, make_poll_session
from sal_gateway.state import BackendState, StateTable

logger = logging.getLogger("sal_gateway.poller")

_JITTER = 0.1
LOG_EVERY_S = 10.0
"""A failure that repeats is logged at most this often per backend and reason."""

_T = TypeVar("_T")

Key = tuple[str, str]
"""(model, backend URL)."""


@dataclass(frozen=True, slots=True)
class PollOutcome:
    """What one poll produced, with its times (taken on the poll thread)."""

    stats: ReplicaStats | None
    """The state read, or None when the poll failed."""
    source: str
    """``"stats"`` or ``"metrics"`` on success; the failure reason (`REASONS`) otherwise."""
    message: str
    sent_s: float
    """Monotonic time the poll was sent."""
    received_s: float
    """Monotonic time its answer (or failure) was received."""
    received_wall_s: float
    """Wall-clock time at `received_s` (maps the engine's ``time`` stamp onto our clock)."""


def backoff_s(interval_s: float, failures: int, max_s: float, rng: random.Random) -> float:
    """Wait before the next poll: the interval (+-10%) while polls succeed; after `failures`
    consecutive failures ``interval * 2**(failures - 1)`` capped at `max_s`, times U(0.5, 1).

    The first retry comes no later than a normal poll would (a transient failure, such as
    one timed-out poll of a busy replica, must not make its state stale); a backend that
    keeps failing (dead, or answering garbage) is polled less and less often, down to once
    per `max_s`."""
    if failures <= 0:
        return interval_s * (1.0 + rng.uniform(-_JITTER, _JITTER))
    cap = max(max_s, interval_s)
    return min(cap, interval_s * 2.0 ** min(failures - 1, 30)) * rng.uniform(0.5, 1.0)


def longest_wait_s(interval_s: float, failures: int, max_s: float) -> float:
    """The most `backoff_s` can return for these arguments (its jitter at its top)."""
    if failures <= 0:
        return interval_s * (1.0 + _JITTER)
    return min(max(max_s, interval_s), interval_s * 2.0 ** min(failures - 1, 30))


def pollers_behind(backends: Iterable[BackendState], now_s: float, r: RoutingConfig) -> bool:
    """Whether some polled backend in `backends` is past the time its next poll outcome was
    due (its wait, `longest_wait_s`, which grows while it keeps failing, plus a poll timeout
    and a poll interval of slack): its poller has not been running (the gateway's own process
    was not scheduled), so that backend may only *look* stale. One is enough: after a stall,
    a replica that is really down has its failing poll (timed out meanwhile) booked at once,
    before the healthy replicas' next polls come back. A fleet that is down is not behind:
    its failing polls keep coming, less often, each on time. Never-polled backends do not
    count."""
    for backend in backends:
        if backend.last_outcome_s is None:
            continue
        wait_s = longest_wait_s(
            r.poll_interval_s, backend.consecutive_failures, r.poll_backoff_max_s
        )
        if now_s > backend.last_outcome_s + wait_s + r.poll_timeout_s + r.poll_interval_s:
            return True
    return False


class _RateLimitedLog:
    """Logs a repeating failure at most once per `LOG_EVERY_S` per key (main loop only)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def warning(self, key: tuple[str, str], now_s: float, message: str) -> None:
        last = self._last.get(key)
        if last is not None and now_s - last[0] < LOG_EVERY_S:
            self._last[key] = (last[0], last[1] + 1)
            return
        suppressed = f" ({last[1]} similar since last logged)" if last and last[1] else ""
        logger.warning("%s%s", message, suppressed)
        self._last[key] = (now_s, 0)

    def forget(self, url: str) -> None:
        for key in [k for k in self._last if k[0] == url]:
            del self._last[key]


def _ignore_closed_loop(callback: Callable[[], object]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed under us: shutting down
        callback()


class Poller:
    """Owns the poll thread and its tasks; `start()`/`cancel()`/`stop()` follow the pool's
    membership. Call every public method from the main event loop."""

    def __init__(
        self,
        table: StateTable,
        metrics: GatewayMetrics,
        routing: RoutingConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        session_factory: Callable[[], aiohttp.ClientSession] = make_poll_session,
        on_stats: Callable[[str, str, ReplicaStats], None] | None = None,
    ) -> None:
        self._table = table
        self.on_stats = on_stats
        """Called on the main loop with every good poll's state (the prefix tracker)."""
        self._metrics = metrics
        self._routing = routing
        self._clock = clock
        self._wall_clock = wall_clock
        self._session_factory = session_factory
        self._log = _RateLimitedLog()
        self._generations: dict[Key, int] = {}
        """Backends being polled, with the id of their current task (main loop only)."""
        self._ids = itertools.count(1)
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Poll-thread state (touched only on the poll thread once it runs).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fetcher: StateFetcher | None = None
        self._closing: asyncio.Event | None = None
        self._tasks: dict[Key, tuple[int, asyncio.Task[None]]] = {}
        self._rng = random.Random()

    # --- main-loop API ------------------------------------------------------------------

    def start(self, model: str, url: str) -> None:
        """Start polling `url` (no-op when it is already polled)."""
        key = (model, url)
        if key in self._generations:
            return
        loop = self._ensure_thread()
        generation = self._generations[key] = next(self._ids)
        loop.call_soon_threadsafe(self._start_task, key, generation)

    def cancel(self, model: str, url: str) -> None:
        """Stop polling `url` without waiting (for synchronous callers such as discovery);
        results of polls already in flight are dropped."""
        generation = self._generations.pop((model, url), None)
        self._log.forget(url)
        if generation is not None and self._loop is not None:
            loop = self._loop
            _ignore_closed_loop(
                lambda: loop.call_soon_threadsafe(self._cancel_task, (model, url), generation)
            )

    async def stop(self, model: str, url: str) -> None:
        """Stop polling `url` and wait until its task has ended."""
        generation = self._generations.pop((model, url), None)
        self._log.forget(url)
        if generation is not None and self._loop is not None:
            await self._on_thread(self._stop_task((model, url), generation))

    async def stop_all(self) -> None:
        """Stop every task, close the session, end the thread (idempotent)."""
        self._generations.clear()
        thread, loop, closing = self._thread, self._loop, self._closing
        if thread is None or loop is None or closing is None:
            return
        _ignore_closed_loop(lambda: loop.call_soon_threadsafe(closing.set))
        await asyncio.to_thread(thread.join, 10.0)
        if thread.is_alive():
            logger.error("the poll thread did not end within 10 s")
        self._thread = self._loop = None

    async def poll_once(self, model: str, url: str) -> bool:
        """Poll one backend once now, on the poll thread, and record the outcome (tests,
        tools). True on success."""
        self._ensure_thread()
        outcome = await self._on_thread(self._poll_safely(model, url))
        self._apply((model, url), None, outcome)
        return outcome.stats is not None

    def polled(self) -> set[Key]:
        """Backends being polled now."""
        return set(self._generations)

    # --- plumbing between the threads ----------------------------------------------------

    def _ensure_thread(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None:
            return self._loop
        self._main_loop = asyncio.get_running_loop()
        started: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="sal-poller", daemon=True
        )
        self._thread.start()
        self._loop = started.result(timeout=30.0)
        return self._loop

    async def _on_thread(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` on the poll thread's loop and await its result here."""
        assert self._loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _thread_main(self, started: concurrent.futures.Future[asyncio.AbstractEventLoop]) -> None:
        try:
            import uvloop

            loop_factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
            loop_factory = asyncio.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(self._thread_body(started))

    async def _thread_body(
        self, started: concurrent.futures.Future[asyncio.AbstractEventLoop]
    ) -> None:
        self._closing = asyncio.Event()
        session = self._session_factory()
        self._fetcher = StateFetcher(session, self._routing.poll_timeout_s, self._wall_clock)
        started.set_result(asyncio.get_running_loop())
        try:
            await self._closing.wait()
        finally:
            tasks = [task for _, task in self._tasks.values()]
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._fetcher = None
            await session.close()

    def _deliver(self, key: Key, generation: int, outcome: PollOutcome) -> None:
        """Hand `outcome` to the main loop (poll thread)."""
        main = self._main_loop
        if main is not None and not main.is_closed():
            _ignore_closed_loop(
                lambda: main.call_soon_threadsafe(self._apply, key, generation, outcome)
            )

    # --- the poll thread -----------------------------------------------------------------

    def _start_task(self, key: Key, generation: int) -> None:
        if key in self._tasks:  # restarted before the old task's cancel arrived
            self._tasks.pop(key)[1].cancel()
        task = asyncio.get_running_loop().create_task(
            self._run(key, generation), name=f"poll {key[1]}"
        )
        self._tasks[key] = (generation, task)

    def _cancel_task(self, key: Key, generation: int) -> asyncio.Task[None] | None:
        entry = self._tasks.get(key)
        if entry is None or entry[0] != generation:
            return None
        del self._tasks[key]
        if self._fetcher is not None:
            self._fetcher.forget(*key)
        entry[1].cancel()
        return entry[1]

    async def _stop_task(self, key: Key, generation: int) -> None:
        task = self._cancel_task(key, generation)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, key: Key, generation: int) -> None:
        """Poll `key` until cancelled; never ends otherwise."""
        model, url = key
        routing = self._routing
        interval_hist = self._metrics.poll_interval.labels(model=model)
        failures = 0
        last_start_s: float | None = None
        while True:
            start_s = self._clock()
            if last_start_s is not None:
                interval_hist.observe(start_s - last_start_s)
            last_start_s = start_s
            outcome = await self._poll_safely(model, url)
            self._deliver(key, generation, outcome)
            failures = 0 if outcome.stats is not None else failures + 1
            wait_s = backoff_s(
                routing.poll_interval_s, failures, routing.poll_backoff_max_s, self._rng
            )
            await asyncio.sleep(max(0.0, start_s + wait_s - self._clock()))

    async def _poll_safely(self, model: str, url: str) -> PollOutcome:
        """One poll; every exception but cancellation becomes a failed outcome."""
        sent_s = self._clock()
        try:
            if self._fetcher is None:
                raise PollFailed("internal", "the poller is shutting down")
            stats, source = await self._fetcher.fetch(model, url)
            message = ""
        except PollFailed as exc:
            stats, source, message = None, exc.reason, str(exc)
        except Exception as exc:  # a poll task must never die
            detail = "".join(traceback.format_exception(exc, limit=8))
            stats, source = None, "internal"
            message = f"unexpected error polling {url}: {type(exc).__name__}: {exc}\n{detail}"
        return PollOutcome(stats, source, message, sent_s, self._clock(), self._wall_clock())

    # --- the main loop: recording outcomes ------------------------------------------------

    def _apply(self, key: Key, generation: int | None, outcome: PollOutcome) -> None:
        """Record one outcome in the table and the metrics (main loop). Results of a task
        that was stopped or replaced since (`generation` no longer current) are dropped."""
        if generation is not None and self._generations.get(key) != generation:
            return
        model, url = key
        backend = self._table.get(model, url)
        if backend is None:
            return
        if outcome.stats is None:
            self._record_failure(key, outcome)
            return
        readmitted = self._table.record_poll_success(
            model,
            url,
            outcome.stats,
            outcome.source,
            outcome.received_s,
            wall_s=outcome.received_wall_s if outcome.source == "stats" else None,
            sent_s=outcome.sent_s,
        )
        if self.on_stats is not None:
            self.on_stats(model, url, outcome.stats)
        progress_age_s = backend.progress_age_s(outcome.received_s) or 0.0
        if progress_age_s > self._table.stale_after_s:
            self._metrics.poll_errors.labels(model, url, "no_progress").inc()
            self._log.warning(
                (url, "no_progress"),
                outcome.received_s,
                f"backend {url} (model {model}): its engine shows no progress for "
                f"{progress_age_s:.1f} s (frozen?); not eligible",
            )
        elif readmitted:
            logger.info("backend %s (model %s) is eligible again", url, model)

    def _record_failure(self, key: Key, outcome: PollOutcome) -> None:
        model, url = key
        self._metrics.poll_errors.labels(model, url, outcome.source).inc()
        if self._table.record_poll_failure(model, url, outcome.received_s):
            self._metrics.ejections.labels(model=model, backend=url).inc()
            logger.warning("ejected backend %s (model %s): %s", url, model, outcome.message)
        else:
            self._log.warning((url, outcome.source), outcome.received_s, outcome.message)
