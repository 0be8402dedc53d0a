"""Upstream bounds that a stall of the gateway's own process does not trip.

When the gateway's process is not scheduled for a while (a CPU-throttled container, a paused
VM, a host whose run queue is full), its event loop stops too. When it runs again, the I/O
that completed meanwhile (a backend's response headers, a stream's next tokens) and the
timers that came due meanwhile are handled in the same pass of the loop, the timers' callbacks
before the tasks that the I/O woke: a bound that expired during the stall would fire although
its answer is already in the socket, and a healthy backend's request would be cut and
retried, or its stream ended with an error event.

A bound's timer that runs more than `STALL_S` after it was due was held up by such a stall:
instead of firing, it is re-armed once for `GRACE_S`, so that the tasks the stall's I/O woke
run first; if their answer came, the bound is over, else it fires then. One extension per
bound (`stall_tolerant_timeout`) or per silence (`idle_watch.IdleWatch`): a loop that lags
constantly cannot hold a bound off for good.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

STALL_S = 0.5
"""A timer that runs this much later than due was held up by a stall of the process (a
healthy loop runs its timers within milliseconds; `sal_event_loop_lag_seconds`)."""

GRACE_S = 1.0
"""How long a bound held up by a stall waits for what the stall's I/O woke."""


def held_up_by_stall(due_s: float, now_s: float) -> bool:
    """Whether a timer due at `due_s` that runs at `now_s` (loop times) was held up by a
    stall rather than firing on time."""
    return now_s - due_s > STALL_S


@contextlib.asynccontextmanager
async def stall_tolerant_timeout(delay_s: float) -> AsyncIterator[None]:
    """`asyncio.timeout(delay_s)` (TimeoutError when the bound expires, the body cancelled)
    except that a bound whose timer was held up by a stall of the process gets `GRACE_S`
    more, once: an answer that arrived during the stall is taken, not cut."""
    loop = asyncio.get_running_loop()
    due_s = loop.time() + delay_s
    extended = False
    handle: asyncio.TimerHandle | None = None
    async with asyncio.timeout(None) as bound:

        def check() -> None:
            nonlocal handle, extended
            now_s = loop.time()
            if not extended and held_up_by_stall(due_s, now_s):
                extended = True
                handle = loop.call_at(now_s + GRACE_S, check)
            else:
                bound.reschedule(now_s)  # expires now: the body is cancelled

        handle = loop.call_at(due_s, check)
        try:
            yield
        finally:
            handle.cancel()  # the latest one: `check` replaces it when it re-arms
