"""Micro-benchmark: what the tracing hooks cost one request, tracing off and on.

``python -m bench.tracing_bench [--requests N] [--repeats R]`` runs the exact hook sequence
one proxied request goes through (`sal_gateway.tracing`: middleware start, ``trace_of``,
the tokenize span, ``admitted``, ``routed``, one upstream span with ``inject``,
``response`` and ``end``, the server span's end) and prints the best-of-R time per request:

* ``baseline``: building the fake scope alone (subtract it from the others);
* ``off``: tracing disabled, the no-op hooks (what every request pays by default);
* ``on``: a live SDK tracer, spans handed to a ``BatchSpanProcessor`` whose exporter drops
  them (the request path's share; the export itself runs on the SDK's own thread);
* ``on, sampled out``: ``sample_ratio: 0`` (the spans exist but record nothing).

``--e2e N`` also sends N sequential chat requests through two in-process gateways in front of
one fake backend, tracing off and on, alternating, and prints the median latency of each.

Set ``off - baseline`` and ``on - baseline`` against the gateway's own CPU time per request
(docs/gateway.md, "Tracing").
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from sal_core.percentile import percentile
from sal_gateway.config import TracingConfig
from sal_gateway.request_body import Endpoint, InboundRequest
from sal_gateway.tokenizer import PromptCount
from sal_gateway.tracing import STATE_KEY, Tracing, build_tracing, trace_of

_INBOUND = InboundRequest(
    endpoint=Endpoint.CHAT,
    body={},
    model="tiny",
    stream=False,
    max_tokens=16,
    messages=({"role": "user", "content": "hi"},),
)
_COUNT = PromptCount((42,), estimated=False)
_HEADERS = {"content-type": "application/json", "x-request-id": "r1"}


class _Request:
    """What `trace_of` reads of a Starlette request."""

    __slots__ = ("scope",)

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope


def _scope() -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "scheme": "http",
        "client": ("127.0.0.1", 50000),
        "headers": [(b"content-type", b"application/json")],
        "state": {"request_id": "r1"},
    }


def one_request(tracing: Tracing | None) -> None:
    """The hooks of one successful non-streamed request, in the order the gateway calls them."""
    scope = _scope()
    if tracing is not None:  # TracingMiddleware
        scope["state"][STATE_KEY] = tracing.start_request(scope)
    trace = trace_of(_Request(scope))
    with trace.tokenize() as span:
        span.counted(_COUNT)
    trace.admitted(_INBOUND, _COUNT)
    trace.routed("sal", "http://127.0.0.1:8001", 0.25)
    upstream = trace.upstream("http://127.0.0.1:8001", "/v1/chat/completions")
    upstream.inject(_HEADERS)
    upstream.response(200)
    upstream.end(200, None, (42, 16))
    if tracing is not None:
        trace.end(200, None, "r1")


def no_hooks() -> None:
    """The baseline: what `one_request` does besides calling the hooks."""
    _Request(_scope())


def _per_request_ns(run: Callable[[], None], requests: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter_ns()
        for _ in range(requests):
            run()
        best = min(best, (time.perf_counter_ns() - started) / requests)
    return best


def _dropping_tracing(sample_ratio: float) -> Tracing:
    """Live tracing with the gateway's batching processor and an exporter that drops all."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    config = TracingConfig(enabled=True, sample_ratio=sample_ratio)
    tracing = build_tracing(config, {}, exporter=Drop(), batch=True)
    assert tracing is not None
    return tracing


def _latencies_ms(url: str, client: Any, n: int) -> list[float]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    result = []
    for _ in range(n):
        started = time.perf_counter()
        resp = client.post(f"{url}/v1/chat/completions", json=body)
        result.append((time.perf_counter() - started) * 1000)
        assert resp.status_code == 200, resp.text
    return result


def end_to_end(requests: int, block: int = 100) -> dict[str, float]:
    """Median latency (ms) of sequential non-streamed chat requests through two gateways in
    front of the same fake backend, tracing off and on, alternating in blocks of `block` so
    the machine's load drifts equally over both."""
    import httpx

    from engine_sim.fake_vllm import FakeBackend, ServedApp, ServedBackend
    from sal_gateway.app import create_app
    from sal_gateway.config import build_config

    with ServedBackend(FakeBackend(model="tiny")) as backend:
        config = build_config(
            {"models": [{"name": "tiny", "backends": [backend]}], "listen": {"port": 0}}
        )
        tracing = _dropping_tracing(1.0)
        gateways = {
            "off": ServedApp(create_app(config), lifespan=True),
            "on": ServedApp(create_app(config, tracing=tracing), lifespan=True),
        }
        urls = {label: served.start() for label, served in gateways.items()}
        samples: dict[str, list[float]] = {label: [] for label in gateways}
        try:
            with httpx.Client(timeout=30.0) as client:
                for url in urls.values():  # warm-up: connections, first polls
                    _wait_ready(client, url)
                    _latencies_ms(url, client, 50)
                for _ in range(max(1, requests // block)):
                    for label, url in urls.items():
                        samples[label] += _latencies_ms(url, client, block)
        finally:
            for served in gateways.values():
                served.stop()
    return {label: percentile(values, 50) for label, values in samples.items()}


def _wait_ready(client: Any, url: str) -> None:
    deadline = time.monotonic() + 30
    while client.get(f"{url}/ready").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready")
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_bench", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--e2e",
        type=int,
        default=0,
        metavar="N",
        help="also send N requests through a gateway with tracing off and one with it on",
    )
    args = parser.parse_args(argv)
    # Room for every span of a run: the bench outpaces the exporting thread on a busy machine,
    # and a full queue would drop spans (cheaper than keeping them: a flattering number).
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", str(4 * args.requests * args.repeats))
    rows = [
        ("baseline", _per_request_ns(no_hooks, args.requests, args.repeats)),
        ("off", _per_request_ns(functools.partial(one_request, None), args.requests, args.repeats)),
    ]
    for label, ratio in (("on", 1.0), ("on, sampled out", 0.0)):
        tracing = _dropping_tracing(ratio)
        try:
            run = functools.partial(one_request, tracing)
            rows.append((label, _per_request_ns(run, args.requests, args.repeats)))
        finally:
            tracing.shutdown()
    for label, ns in rows:
        print(f"{label:>16}: {ns / 1000:8.2f} us per request")
    if args.e2e:
        medians = end_to_end(args.e2e)
        for label, ms in medians.items():
            print(f"end to end, tracing {label:>3}: median {ms:.3f} ms per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
