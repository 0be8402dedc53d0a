"""Tracked streaming load for fault experiments: every request by id, and what it ended as.

Used by the soak benchmark (`bench.soak`) and the real-process fault tests
(``tests/integration/test_faults_*.py``). Each request is a streaming completion with a unique
id in its ``user`` field (the gateway forwards bodies unchanged, so a fake backend can record
it) and ends as exactly one `Outcome` kind:

* ``ok`` — HTTP 200, content events, ``data: [DONE]``, no error event, at most ``max_tokens``
  output tokens and one ``finish_reason``;
* ``error_event`` — HTTP 200, an SSE ``data: {"error": ...}`` event, then ``[DONE]``;
* ``http_error`` — a non-200 answer whose body is an OpenAI-shaped error;
* ``lost`` — anything else: a stream cut without ``[DONE]``, a transport error, no answer
  within ``hang_s`` (a hang), a non-OpenAI error body;
* ``duplicated`` — an answer that carries more than one generation (a second ``[DONE]`` or
  ``finish_reason``, or more output tokens than asked for).

`TrackedLoad` sends them open-loop at ``rate_per_s`` with at most ``concurrency`` in flight;
`MetricsTimeline` scrapes the gateway's ``/metrics`` periodically so that a test can tell
when the gateway stopped routing to a backend (`avoid_time_s`). Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

MetricKey = tuple[str, frozenset[tuple[str, str]]]
OUTCOME_KINDS = ("ok", "error_event", "http_error", "lost", "duplicated")


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one tracked request ended (see the module docstring for the kinds)."""

    request_id: str
    kind: str
    sent_s: float
    """`time.monotonic()` when the request was sent."""
    latency_s: float
    """Seconds from sending to the end of the answer (or to giving up)."""
    status: int
    backend: str | None
    """Who generated it, when the backend says so (the fake's ``backend`` field)."""
    detail: str = ""


def _error_shaped(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and "message" in error and "type" in error


def _classify_stream(lines: list[str], max_tokens: int) -> tuple[str, str | None, str]:
    """(kind, backend, detail) of a 200 stream's ``data:`` lines."""
    done = errors = finishes = tokens = 0
    backend = None
    detail = ""
    for line in lines:
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            done += 1
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            return "lost", backend, f"not JSON: {payload[:80]}"
        if "error" in event:
            errors += 1
            detail = str(event["error"].get("message", ""))[:200]
            continue
        backend = event.get("backend", backend)
        for choice in event.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            tokens += 1 if text else 0  # every backend we test sends >= 1 token per event
            finishes += choice.get("finish_reason") is not None
    if done > 1 or finishes > 1 or tokens > max_tokens:
        return "duplicated", backend, f"done={done} finishes={finishes} tokens={tokens}"
    if done == 1 and errors >= 1:
        return "error_event", backend, detail
    if done == 1 and finishes == 1:
        return "ok", backend, ""
    return "lost", backend, f"done={done} errors={errors} finishes={finishes}"


async def tracked_stream(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str,
    request_id: str,
    prompt: str = "hello there",
    max_tokens: int = 16,
    hang_s: float = 30.0,
    extra: Mapping[str, object] | None = None,
) -> Outcome:
    """Send one streaming completion and classify how it ended (never raises)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "user": request_id,
        **(extra or {}),
    }
    sent = time.monotonic()
    status = 0
    try:
        async with asyncio.timeout(hang_s):
            async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
                status = resp.status_code
                if status != 200:
                    raw = await resp.aread()
                    kind = "http_error" if _error_shaped(raw) else "lost"
                    return Outcome(
                        request_id,
                        kind,
                        sent,
                        time.monotonic() - sent,
                        status,
                        None,
                        raw[:200].decode(errors="replace"),
                    )
                lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
    except TimeoutError:
        return Outcome(request_id, "lost", sent, time.monotonic() - sent, status, None, "hang")
    except httpx.HTTPError as exc:
        detail = f"{type(exc).__name__}: {exc}"
        return Outcome(request_id, "lost", sent, time.monotonic() - sent, status, None, detail)
    kind, backend, detail = _classify_stream(lines, max_tokens)
    return Outcome(request_id, kind, sent, time.monotonic() - sent, status, backend, detail)


@dataclass
class TrackedLoad:
    """Open-loop streaming load at ``rate_per_s`` with at most ``concurrency`` in flight."""

    base_url: str
    model: str = "tiny"
    rate_per_s: float = 10.0
    concurrency: int = 16
    max_tokens: int = 16
    hang_s: float = 30.0
    prompt: str = "hello there"
    id_prefix: str = "r"
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Send until `stop` is set, then wait for every request in flight to end."""
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(
            max_connections=self.concurrency, max_keepalive_connections=self.concurrency
        )
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.hang_s), limits=limits) as client:
            for n in itertools.count():
                if stop.is_set():
                    break
                await slots.acquire()
                task = asyncio.create_task(self._one(client, f"{self.id_prefix}{n}", slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self.sent += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0 / self.rate_per_s)
            if tasks:
                await asyncio.gather(*tasks)

    async def _one(
        self, client: httpx.AsyncClient, request_id: str, slots: asyncio.Semaphore
    ) -> None:
        try:
            outcome = await tracked_stream(
                client,
                self.base_url,
                model=self.model,
                request_id=request_id,
                prompt=self.prompt,
                max_tokens=self.max_tokens,
                hang_s=self.hang_s,
            )
            self.outcomes.append(outcome)
        finally:
            slots.release()


def parse_metrics(text: str) -> dict[MetricKey, float]:
    """Prometheus text into ``{(sample name, labels): value}``."""
    samples: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric_sum(samples: Mapping[MetricKey, float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


@dataclass
class MetricsTimeline:
    """The gateway's ``/metrics`` every ``interval_s``: ``[(monotonic time, samples)]``."""

    base_url: str
    interval_s: float = 0.1
    points: list[tuple[float, dict[MetricKey, float]]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not stop.is_set():
                try:
                    resp = await client.get(f"{self.base_url}/metrics")
                    self.points.append((time.monotonic(), parse_metrics(resp.text)))
                except httpx.HTTPError:
                    pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.interval_s)

    def avoid_time_s(
        self, backend: str, since_s: float, until_s: float | None = None, model: str = "tiny"
    ) -> float:
        """Seconds from `since_s` until the last scrape (before `until_s`, when the fault
        ended) that saw a new routing decision for `backend` (0 when none came after
        `since_s`): an upper bound, at scrape resolution, on how long the gateway kept sending
        requests to it."""
        last_change = since_s
        previous: float | None = None
        for t, samples in self.points:
            value = metric_sum(samples, "sal_routing_decisions_total", model=model, backend=backend)
            in_fault = t > since_s and (until_s is None or t <= until_s)
            if previous is not None and value > previous and in_fault:
                last_change = t
            previous = value
        return last_change - since_s

    def first_time(self, since_s: float, name: str, value: float, **labels: str) -> float | None:
        """Seconds from `since_s` to the first scrape where ``name{labels}`` sums to `value`."""
        for t, samples in self.points:
            if t >= since_s and metric_sum(samples, name, **labels) == value:
                return t - since_s
        return None
