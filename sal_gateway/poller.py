"""Background polling of every backend's state (one asyncio task per backend).

Each task calls `Poller.poll_once()` every ``poll_interval_s`` (jittered by +-10% so that
pollers of many backends do not synchronise) and writes the result into the `StateTable`.
A poll reads ``GET /stats`` (sal-stats/1); a 404 there means stock vLLM, and the poll reads
``GET /metrics`` instead (and keeps doing so while it works). Every request has the
``poll_timeout_s`` timeout; a timeout, a connection error, a non-2xx answer or a body that
breaks the contract is a failed poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable

import aiohttp

from sal_gateway.config import RoutingConfig
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.state import StateTable
from sal_gateway.stats import ReplicaStats, StatsSchemaError, parse_stats
from sal_gateway.vllm_metrics import MetricsParseError, parse_vllm_metrics

logger = logging.getLogger("sal_gateway.poller")

_JITTER = 0.1


def make_poll_session() -> aiohttp.ClientSession:
    """The pollers' own client: at most 2 connections per backend, kept alive between polls
    (4 s idle limit, below uvicorn's/vLLM's 5 s, so a reused connection is never one the
    backend is closing)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=2, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector)


class PollFailed(Exception):
    """One poll did not produce usable state (the message says why)."""


class Poller:
    """Owns the polling tasks; `start()`/`stop()` follow the pool's membership."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        table: StateTable,
        metrics: GatewayMetrics,
        routing: RoutingConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._table = table
        self._metrics = metrics
        self._routing = routing
        self._clock = clock
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._stock_vllm: set[tuple[str, str]] = set()
        """Backends whose /stats answered 404: polled on /metrics until that fails."""
        self._rng = random.Random()
        self._timeout = aiohttp.ClientTimeout(total=routing.poll_timeout_s)

    def start(self, model: str, url: str) -> None:
        """Start polling `url` (no-op when it is already polled)."""
        key = (model, url)
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(self._run(model, url), name=f"poll {url}")

    async def stop(self, model: str, url: str) -> None:
        """Stop polling `url` and wait for its task to end."""
        self._stock_vllm.discard((model, url))
        task = self._tasks.pop((model, url), None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def cancel(self, model: str, url: str) -> None:
        """Stop polling `url` without waiting (for synchronous callers such as discovery)."""
        self._stock_vllm.discard((model, url))
        task = self._tasks.pop((model, url), None)
        if task is not None:
            task.cancel()

    async def stop_all(self) -> None:
        for model, url in list(self._tasks):
            await self.stop(model, url)

    async def _run(self, model: str, url: str) -> None:
        interval_s = self._routing.poll_interval_s
        while True:
            await self.poll_once(model, url)
            await asyncio.sleep(interval_s * (1.0 + self._rng.uniform(-_JITTER, _JITTER)))

    async def poll_once(self, model: str, url: str) -> bool:
        """Poll one backend once and record the outcome; True on success."""
        if self._table.get(model, url) is None:
            return False
        try:
            if (model, url) in self._stock_vllm:
                stats, source = await self._read_metrics(model, url), "metrics"
            else:
                stats, source = await self._read_stats(model, url)
                if source == "metrics":
                    self._stock_vllm.add((model, url))
        except PollFailed as exc:
            # The next poll asks /stats first again (the replica may have been upgraded).
            self._stock_vllm.discard((model, url))
            if self._table.record_poll_failure(model, url):
                self._metrics.ejections.labels(model=model, backend=url).inc()
                logger.warning("ejected backend %s (model %s): %s", url, model, exc)
            else:
                logger.debug("poll of %s failed: %s", url, exc)
            return False
        if self._table.record_poll_success(model, url, stats, source, self._clock()):
            logger.info("backend %s (model %s) is eligible again", url, model)
        return True

    async def _get(self, url: str) -> tuple[int, bytes]:
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PollFailed(f"GET {url}: {type(exc).__name__}: {exc}") from None

    async def _read_stats(self, model: str, url: str) -> tuple[ReplicaStats, str]:
        status, body = await self._get(url + "/stats")
        if status == 404:
            return await self._read_metrics(model, url), "metrics"
        if status != 200:
            raise PollFailed(f"GET {url}/stats answered {status}")
        try:
            return parse_stats(json.loads(body)), "stats"
        except (ValueError, StatsSchemaError) as exc:
            raise PollFailed(f"GET {url}/stats: {exc}") from None

    async def _read_metrics(self, model: str, url: str) -> ReplicaStats:
        status, body = await self._get(url + "/metrics")
        if status != 200:
            raise PollFailed(f"GET {url}/metrics answered {status}")
        try:
            return parse_vllm_metrics(body.decode("utf-8", "replace"), model, time.time())
        except MetricsParseError as exc:
            raise PollFailed(f"GET {url}/metrics: {exc}") from None
