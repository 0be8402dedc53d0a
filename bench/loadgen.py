"""Closed-loop HTTP load generator for the gateway benchmarks (aiohttp + uvloop).

Runs in its own process so that its CPU time is not charged to the server under test:
`bench.gateway_bench` starts it as ``python -m bench.loadgen ...`` and reads one JSON object
(`LoadResult.to_dict()`) from its stdout. ``concurrency`` workers each send one request after
another on their own keep-alive connection, for ``requests`` requests in total or until
``duration_s`` passes, whichever comes first. Every worker's first request is a warm-up and is
not recorded (it pays for the TCP connect).

Per request it records the latency to the last byte (``latency_s``) and, for SSE streams, to
the first ``data:`` event (``ttft_s``), plus the number of SSE events received. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import uvloop


@dataclass
class LoadResult:
    """Raw samples of one load run (percentiles are computed by the caller)."""

    concurrency: int
    stream: bool
    wall_s: float = 0.0
    """Time from the first recorded request's start to the last one's end."""
    latency_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    sse_events: int = 0
    errors: int = 0
    error_sample: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> LoadResult:
        return cls(**obj)

    @property
    def requests_per_s(self) -> float:
        return len(self.latency_s) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def events_per_s(self) -> float:
        return self.sse_events / self.wall_s if self.wall_s > 0 else 0.0


_WORDS = ("the", "token", "request", "gpu", "cache", "hello", "world", "prompt", "kalo", "vozu")


def completion_body(model: str, max_tokens: int, stream: bool, prompt_words: int = 0) -> bytes:
    """A `/v1/completions` request body: a short fixed prompt, or ``prompt_words`` words."""
    if prompt_words > 0:
        rng = random.Random(prompt_words)
        prompt = " ".join(rng.choice(_WORDS) for _ in range(prompt_words))
    else:
        prompt = "hello world, a small benchmark prompt"
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    return json.dumps(body).encode()


async def _one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool
) -> tuple[float, float | None, int]:
    """Send one request; return (latency_s, ttft_s or None, SSE events)."""
    start = time.perf_counter()
    first: float | None = None
    events = 0
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        if resp.status != 200:
            text = await resp.text()
            raise RuntimeError(f"HTTP {resp.status}: {text[:200]}")
        if stream:
            async for chunk in resp.content.iter_any():
                n = chunk.count(b"data:")
                if n and first is None:
                    first = time.perf_counter() - start
                events += n
        else:
            await resp.read()
    return time.perf_counter() - start, first, events


async def run_load(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    requests: int,
    duration_s: float,
    stream: bool,
) -> LoadResult:
    """Drive ``url`` with ``concurrency`` closed-loop workers; see the module docstring."""
    result = LoadResult(concurrency=concurrency, stream=stream)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60.0)
    remaining = requests
    starts: list[float] = []
    ends: list[float] = []

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up: one request per worker opens every connection before measuring.
        warm = await asyncio.gather(
            *(_one_request(session, url, body, stream) for _ in range(concurrency)),
            return_exceptions=True,
        )
        for outcome in warm:
            if isinstance(outcome, BaseException):
                result.errors += 1
                result.error_sample = result.error_sample or f"warm-up: {outcome!r}"
        deadline = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0 and time.perf_counter() < deadline:
                remaining -= 1
                starts.append(time.perf_counter())
                try:
                    latency, ttft, events = await _one_request(session, url, body, stream)
                except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
                    result.errors += 1
                    result.error_sample = result.error_sample or repr(exc)
                    continue
                ends.append(time.perf_counter())
                result.latency_s.append(latency)
                if ttft is not None:
                    result.ttft_s.append(ttft)
                result.sse_events += events

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if starts and ends:
        result.wall_s = max(ends) - min(starts)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="closed-loop load generator (JSON on stdout)")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--prompt-words", type=int, default=0, help="long prompt of N words (0: short prompt)"
    )
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        parser.error("the load generator only sends traffic to loopback")
    body = completion_body(args.model, args.max_tokens, args.stream, args.prompt_words)
    result = uvloop.run(
        run_load(
            args.url,
            body,
            concurrency=args.concurrency,
            requests=args.requests,
            duration_s=args.duration_s,
            stream=args.stream,
        )
    )
    json.dump(result.to_dict(), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
