"""What one poll reads: ``GET /stats`` (sal-stats/1), or stock vLLM's ``GET /metrics``.

`StateFetcher.fetch()` returns a backend's state or raises `PollFailed` with a reason from
`REASONS`. A 404 on ``/stats`` means stock vLLM: the fetcher reads ``/metrics`` instead and
keeps doing so while it works. Every request has the poll timeout, stall-tolerant
(`stall_guard.stall_tolerant_timeout`: an answer that came while the gateway's process was
not scheduled is a good poll, not a timeout that would make a healthy replica look stale
with its poller on time), and reads at most `MAX_BODY_BYTES`; JSON is decoded without
NaN/Infinity, and a body nested too deep is a ``bad_body``, not an exception that escapes.
Used on the poller's own thread and event loop (`sal_gateway.poller`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp

from sal_core.stats import ReplicaStats, StatsSchemaError, parse_stats
from sal_gateway.stall_guard import stall_tolerant_timeout
from sal_gateway.vllm_metrics import MetricsParseError, parse_vllm_metrics

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest ``/stats`` or ``/metrics`` body read (a sal-stats/1 body is ~400 bytes; vLLM's
``/metrics`` some 100 KB)."""
REASONS = ("timeout", "connect", "http_status", "bad_body", "schema", "no_progress", "internal")
"""Values of ``sal_poll_errors_total``'s ``reason`` label."""


def make_poll_session() -> aiohttp.ClientSession:
    """The pollers' own client (call on the poll thread's loop): at most 2 connections per
    backend, kept alive between polls (4 s idle limit, below uvicorn's/vLLM's 5 s, so a
    reused connection is never one the backend is closing)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=2, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector)


class PollFailed(Exception):
    """One poll did not produce usable state; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class StateFetcher:
    """Reads backends' state over one session (the poll thread's); not thread-safe."""

    def __init__(
        self, session: aiohttp.ClientSession, timeout_s: float, wall_clock: Callable[[], float]
    ) -> None:
        self._session = session
        self._timeout_s = timeout_s
        self._no_own_timeout = aiohttp.ClientTimeout(total=None)
        """aiohttp's bounds are off: `stall_tolerant_timeout` bounds each request."""
        self._wall_clock = wall_clock
        self._stock_vllm: set[tuple[str, str]] = set()
        """Backends whose /stats answered 404: read on /metrics until that fails."""

    def forget(self, model: str, url: str) -> None:
        """`url` left the pool: ask its ``/stats`` first if it ever comes back."""
        self._stock_vllm.discard((model, url))

    async def fetch(self, model: str, url: str) -> tuple[ReplicaStats, str]:
        """The backend's state and its source (``"stats"`` or ``"metrics"``)."""
        key = (model, url)
        try:
            if key in self._stock_vllm:
                return await self._read_metrics(model, url), "metrics"
            stats, source = await self._read_stats(model, url)
        except PollFailed:
            # The next poll asks /stats first again (the replica may have been upgraded).
            self._stock_vllm.discard(key)
            raise
        if source == "metrics":
            self._stock_vllm.add(key)
        return stats, source

    async def _get(self, url: str) -> tuple[int, bytes]:
        try:
            async with (
                stall_tolerant_timeout(self._timeout_s),
                self._session.get(url, timeout=self._no_own_timeout) as resp,
            ):
                return resp.status, await _read_capped(resp, url)
        except TimeoutError:
            raise PollFailed(
                "timeout", f"GET {url}: no answer within {self._timeout_s} s"
            ) from None
        except aiohttp.ClientPayloadError as exc:
            raise PollFailed("bad_body", f"GET {url}: {type(exc).__name__}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise PollFailed("connect", f"GET {url}: {type(exc).__name__}: {exc}") from None

    async def _read_stats(self, model: str, url: str) -> tuple[ReplicaStats, str]:
        status, body = await self._get(url + "/stats")
        if status == 404:
            return await self._read_metrics(model, url), "metrics"
        if status != 200:
            raise PollFailed("http_status", f"GET {url}/stats answered {status}")
        try:
            obj = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise PollFailed("bad_body", f"GET {url}/stats: not usable JSON: {exc}") from None
        try:
            return parse_stats(obj), "stats"
        except StatsSchemaError as exc:
            raise PollFailed("schema", f"GET {url}/stats: {exc}") from None

    async def _read_metrics(self, model: str, url: str) -> ReplicaStats:
        status, body = await self._get(url + "/metrics")
        if status != 200:
            raise PollFailed("http_status", f"GET {url}/metrics answered {status}")
        try:
            return parse_vllm_metrics(body.decode("utf-8", "replace"), model, self._wall_clock())
        except MetricsParseError as exc:
            raise PollFailed("schema", f"GET {url}/metrics: {exc}") from None


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number the gateway accepts")


async def _read_capped(resp: aiohttp.ClientResponse, url: str) -> bytes:
    """The body, or `PollFailed` (bad_body) past `MAX_BODY_BYTES` (declared or actual)."""
    declared = resp.content_length
    if declared is not None and declared > MAX_BODY_BYTES:
        raise PollFailed("bad_body", f"GET {url}: body of {declared} bytes is too large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise PollFailed("bad_body", f"GET {url}: body larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
