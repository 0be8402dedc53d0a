"""One emulated replica: an `EngineModel` stepped on the wall clock, with token streams.

A background task (`ReplicaRuntime.start`) steps the engine while it has work; each step
ends its modelled duration times `time_scale` after it started (wall seconds per modelled
second: 0.1 runs ten times faster than the modelled GPU). Tokens produced by a step are
delivered to their streams at that moment, when the modelled iteration would have finished.
The HTTP layer (`engine_sim.emulator`) calls `submit`, reads the returned queue, and calls
`abort` when the client goes away. All of it runs on one event loop; nothing blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine_sim.engine import EngineModel, SimRequest
from sal_core.stats import ReplicaStats

logger = logging.getLogger(__name__)

_MAX_LAG_S = 0.010
"""How far behind its timeline the stepping task may run before it stops catching up."""


def _log_crash(task: asyncio.Task[None]) -> None:
    # A dead stepping task would leave every request hanging: make it loud.
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine stepping task crashed", exc_info=task.exception())


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens for one choice of an HTTP request; `finished` on its last event."""

    index: int
    tokens: int
    finished: bool


@dataclass(slots=True)
class _Sink:
    queue: asyncio.Queue[TokenEvent]
    index: int


@dataclass(slots=True)
class ReplicaCounters:
    """Cumulative counters for `/metrics` (vLLM names in `engine_sim.emulator`)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0


class ReplicaRuntime:
    """Drives one `EngineModel` on the wall clock; one per emulated replica."""

    def __init__(self, engine: EngineModel, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.engine = engine
        self.time_scale = time_scale
        self.counters = ReplicaCounters()
        self._sinks: dict[str, _Sink] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._start_monotonic = time.monotonic()
        self._ids = itertools.count()

    def now_s(self) -> float:
        """The engine's clock: modelled seconds since start (wall seconds / time_scale)."""
        return (time.monotonic() - self._start_monotonic) / self.time_scale

    def start(self) -> None:
        """Start the stepping task (call once, inside the running loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._drive(), name="engine-sim-replica")
            self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        """Cancel the stepping task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(
        self,
        prompt_tokens: int,
        output_tokens: int,
        queue: asyncio.Queue[TokenEvent],
        index: int,
        block_keys: Sequence[int] = (),
        adapter: str | None = None,
    ) -> str:
        """Queue one generation in the engine; its tokens go to `queue` tagged `index`.
        `block_keys`: its prompt's full blocks (`engine_sim.prompt_blocks`), for the prefix
        cache; keys past the counted prompt are dropped. `adapter`: its LoRA adapter (the
        engine's ``max_loras`` slots apply).

        Returns the engine request id (for `abort`). `ValueError` if the engine can never
        hold it.
        """
        request_id = f"req-{next(self._ids)}"
        keys = list(block_keys[: prompt_tokens // self.engine.config.block_size])
        self.engine.add_request(
            SimRequest(
                request_id,
                self.now_s(),
                prompt_tokens,
                output_tokens,
                block_keys=keys,
                adapter=adapter,
            )
        )
        self._sinks[request_id] = _Sink(queue, index)
        self.counters.prompt_tokens += prompt_tokens
        self._wakeup.set()
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone); no-op once it finished."""
        if self._sinks.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.counters.requests_aborted += 1

    def stats(self) -> ReplicaStats:
        """The `/stats` snapshot, stamped with the current Unix time."""
        return replace(self.engine.stats(self.now_s()), time=time.time())

    async def _drive(self) -> None:
        # Steps are laid on an absolute timeline: a step starts when the previous one's
        # modelled duration has elapsed, so the time spent in Python (scheduling, token
        # delivery, HTTP writes) is absorbed instead of adding up step after step. After a
        # stall longer than `_MAX_LAG_S` the timeline restarts from the present.
        engine = self.engine
        next_start = time.monotonic()
        while True:
            if not engine.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                next_start = time.monotonic()
                continue
            start = max(next_start, time.monotonic() - _MAX_LAG_S)
            result = engine.step((start - self._start_monotonic) / self.time_scale)
            next_start = start + result.duration_s * self.time_scale
            # Sleep even when late (0 s) so HTTP handlers get the loop.
            await asyncio.sleep(max(0.0, next_start - time.monotonic()))
            sinks = self._sinks
            for request_id, tokens in result.new_tokens:
                sink = sinks.get(request_id)
                if sink is not None:
                    self.counters.generation_tokens += tokens
                    finished = engine.get(request_id) is None
                    if finished:
                        del sinks[request_id]
                        self.counters.requests_finished += 1
                    sink.queue.put_nowait(TokenEvent(sink.index, tokens, finished))
