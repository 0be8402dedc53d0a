"""The event loop's own health: how late it wakes up, and how many tasks it holds.

`watch_loop()` runs for the app's lifetime (started in the lifespan): it sleeps
``interval_s`` and records how much later than asked it woke up in
``sal_event_loop_lag_seconds``; that overshoot is the time something held the loop (a
blocking call, a long synchronous render, a GIL-holding thread). It also sets
``sal_event_loop_tasks`` (about once a second: counting tasks walks all of them).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Gauge, Histogram

DEFAULT_INTERVAL_S = 0.05


async def watch_loop(lag: Histogram, tasks: Gauge, interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Measure loop lag forever (cancel to stop)."""
    every = max(1, round(1.0 / interval_s))
    n = 0
    while True:
        start = time.perf_counter()
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, time.perf_counter() - start - interval_s))
        if n % every == 0:
            tasks.set(len(asyncio.all_tasks()))
        n += 1
