"""The idle bound of a relayed stream that knows a queued request from a hung replica.

vLLM sends nothing for a stream while its request waits in the engine's queue, and nothing
while the replica is frozen: from the bytes alone the two look the same. `IdleWatch` ends a
stream after ``proxy.stream_idle_timeout_s`` without content only when the replica is not
demonstrably alive (`StateTable.is_live`: fresh polls, and an engine whose heartbeat and step
advance); a silence on a live engine is a queued request, left to wait (bounded by the total
timeout). SSE comments (``: keep-alive``, vLLM's ``--sse-keep-alive-interval``) are not
content: an API server whose engine froze keeps sending them.

One watch per relayed stream, driven by the event loop's timers (no task, no per-chunk
timer): `touch()` per content chunk is one float store; the timer fires at most once per
`recheck_s` while the stream is silent. A check held up by a stall of the gateway's own
process waits `stall_guard.GRACE_S` more (at most the bound), once per silence, so that
content which arrived during the stall is relayed (and counted) first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sal_gateway.stall_guard import GRACE_S, held_up_by_stall

RECHECK_S = 1.0
"""While a silent stream's replica is live, how often it is judged again."""


class IdleWatch:
    """Calls `on_idle()` once, when no content came for `idle_s` and `live()` is False.

    `live` is None: every silence of `idle_s` ends the stream (the literal bound)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_s: float,
        live: Callable[[], bool] | None,
        on_idle: Callable[[], None],
        last_content_s: float | None = None,
    ) -> None:
        self._loop = loop
        self._idle_s = idle_s
        self._live = live
        self._on_idle = on_idle
        self.last_content_s = loop.time() if last_content_s is None else last_content_s
        """Loop time of the last content byte (or of the headers)."""
        self.fired = False
        self.sending = False
        """The relay is handing a chunk to the client: a slow client's silence, not the
        backend's (the backend's bytes wait in the connection's buffer meanwhile)."""
        self._timer: asyncio.TimerHandle | None = None
        self._due_s = 0.0
        self._extended = False
        """This silence's check was held up by a stall once already."""

    def start(self) -> None:
        self._schedule(self.last_content_s + self._idle_s - self._loop.time())

    def touch(self, chunk: bytes) -> None:
        """`chunk` was relayed (call after the client took it); content (not an SSE
        comment) restarts the silence."""
        if not chunk.startswith(b":"):
            self.last_content_s = self._loop.time()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, delay_s: float) -> None:
        self._due_s = self._loop.time() + max(0.0, delay_s)
        self._timer = self._loop.call_at(self._due_s, self._check)

    def _check(self) -> None:
        self._timer = None
        now_s = self._loop.time()
        silent_s = now_s - self.last_content_s
        if self.sending:
            self._schedule(self._idle_s)
        elif silent_s < self._idle_s:
            self._extended = False  # content came: a new silence
            self._schedule(self._idle_s - silent_s)
        elif not self._extended and held_up_by_stall(self._due_s, now_s):
            self._extended = True  # what the stall's I/O woke runs first
            self._schedule(min(GRACE_S, self._idle_s))
        elif self._live is not None and self._live():
            self._schedule(min(RECHECK_S, self._idle_s))
        else:
            self.fired = True
            self._on_idle()
