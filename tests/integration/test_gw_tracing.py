"""OpenTelemetry tracing through the gateway in front of fake vLLM backends (real sockets).

Spans go to the SDK's ``InMemorySpanExporter``; the fake backend records the headers it
received. What a user would notice if it broke: the span tree an operator sees in Jaeger
(server span -> tokenize + one upstream span per attempt), the routing decision on it, the
client's trace continued (its ``traceparent``), vLLM handed the upstream span's context, and
failures (502, 504, a broken stream) shown as errors while a client disconnect is not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine_sim.fake_vllm import FakeBackend, ServedApp, ServedBackend
from sal_gateway.app import create_app
from sal_gateway.config import TracingConfig
from sal_gateway.tracing import build_tracing
from tests.gw_fake_support import DEATH_UNNOTICED, MODEL, gateway_config, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@dataclass
class TracedRig:
    served: list[ServedBackend]
    url: str
    spans: InMemorySpanExporter

    @property
    def fakes(self) -> list[FakeBackend]:
        return [s.backend for s in self.served]

    def server_spans(self, n: int = 1) -> list[ReadableSpan]:
        """The first `n` finished server spans (waits for them: a span ends after the
        response's last byte, which the client may see first)."""
        wait_until(lambda: len(self._servers()) >= n)
        return self._servers()[:n]

    def _servers(self) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.kind is SpanKind.SERVER]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        assert parent.context is not None
        return sorted(
            (
                s
                for s in self.spans.get_finished_spans()
                if s.parent is not None and s.parent.span_id == parent.context.span_id
            ),
            key=lambda s: s.start_time or 0,
        )


@contextmanager
def traced_rig(
    n_backends: int = 1, sample_ratio: float = 1.0, **config_kw: Any
) -> Iterator[TracedRig]:
    exporter = InMemorySpanExporter()
    tracing = build_tracing(
        TracingConfig(enabled=True, sample_ratio=sample_ratio), {}, exporter=exporter
    )
    with ExitStack() as stack:
        served = []
        for i in range(n_backends):
            backend = ServedBackend(FakeBackend(name=chr(ord("a") + i), model=MODEL))
            stack.enter_context(backend)
            served.append(backend)
        config = gateway_config([s.url for s in served], **config_kw)
        gateway = ServedApp(create_app(config, tracing=tracing), lifespan=True)
        url = stack.enter_context(gateway)
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=5.0).status_code == 200, 60.0)
        yield TracedRig(served, url, exporter)


def _chat(url: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        timeout=30.0,
        headers=headers,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
    )


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_span_tree_attributes_and_propagated_context() -> None:
    with traced_rig(2) as rig:
        resp = _chat(
            rig.url, headers={"traceparent": TRACEPARENT, "tracestate": "vendor=v1"}, max_tokens=3
        )
        assert resp.status_code == 200
        (server,) = rig.server_spans()
        assert server.context is not None
        assert server.parent is not None
        # The client's trace is continued, under its span.
        assert _hex(server.context.trace_id, 32) == TRACE_ID
        assert _hex(server.parent.span_id, 16) == PARENT_ID
        assert server.name == "POST /v1/chat/completions"
        assert server.status.status_code is StatusCode.UNSET
        attrs = _attrs(server)
        backends = {s.url for s in rig.served}
        assert attrs["http.request.method"] == "POST"
        assert attrs["http.route"] == "/v1/chat/completions"
        assert attrs["http.response.status_code"] == 200
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.request.max_tokens"] == 3
        assert attrs["sal.request.stream"] is False
        assert attrs["sal.routing.policy"] == "sal"
        assert attrs["sal.routing.backend"] in backends
        assert isinstance(attrs["sal.routing.score"], float)
        assert attrs["sal.routing.attempts"] == 1
        assert attrs["sal.routing.retries"] == 0
        assert attrs["gen_ai.usage.output_tokens"] == resp.json()["usage"]["completion_tokens"]
        assert attrs["sal.request_id"] == resp.headers["x-request-id"]

        tokenize, upstream = rig.children(server)
        assert tokenize.name == "sal.tokenize"
        assert tokenize.kind is SpanKind.INTERNAL
        assert _attrs(tokenize)["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.input_tokens"]
        assert attrs["gen_ai.usage.input_tokens"] > 0
        assert upstream.kind is SpanKind.CLIENT
        assert upstream.status.status_code is StatusCode.UNSET
        up = _attrs(upstream)
        assert up["url.full"] == attrs["sal.routing.backend"] + "/v1/chat/completions"
        assert up["http.response.status_code"] == 200
        assert up["sal.attempt"] == 1
        assert up["sal.routing.score"] == attrs["sal.routing.score"]

        # The backend got the upstream span's context (same trace), not the client's header.
        fake = next(
            f for s, f in zip(rig.served, rig.fakes, strict=True) if s.url in up["url.full"]
        )
        assert upstream.context is not None
        assert fake.last_headers["traceparent"] == (
            f"00-{TRACE_ID}-{_hex(upstream.context.span_id, 16)}-01"
        )
        assert fake.last_headers["tracestate"] == "vendor=v1"


def test_stream_span_lasts_until_the_last_byte() -> None:
    with traced_rig(1) as rig:
        rig.fakes[0].behaviour.chunk_delay_s = 0.05
        resp = httpx.post(
            f"{rig.url}/v1/completions",
            timeout=30.0,
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True},
        )
        assert resp.status_code == 200
        assert resp.text.endswith("data: [DONE]\n\n")
        (server,) = rig.server_spans()
        assert server.parent is None  # no incoming traceparent: a new trace
        attrs = _attrs(server)
        assert attrs["sal.request.stream"] is True
        assert attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.usage.output_tokens"] == 4  # usage asked for on the client's behalf
        _tokenize, upstream = rig.children(server)
        assert upstream.end_time is not None
        assert server.end_time is not None
        assert upstream.end_time - upstream.start_time >= 3 * 0.05 * 1e9  # the whole stream
        assert server.end_time >= upstream.end_time
        assert upstream.status.status_code is StatusCode.UNSET


def test_retry_gives_one_upstream_span_per_attempt() -> None:
    with traced_rig(2, routing=DEATH_UNNOTICED) as rig:
        dead = rig.served[0]
        dead.stop()  # the pollers will not notice for seconds: the first attempt fails
        resp = _chat(rig.url, headers={"traceparent": TRACEPARENT})
        assert resp.status_code == 200
        (server,) = rig.server_spans()
        attrs = _attrs(server)
        assert attrs["sal.routing.attempts"] == 2
        assert attrs["sal.routing.retries"] == 1
        assert attrs["sal.routing.backend"] == rig.served[1].url
        _tokenize, failed, retried = rig.children(server)
        assert _attrs(failed)["url.full"].startswith(dead.url)
        assert _attrs(failed)["sal.attempt"] == 1
        assert failed.status.status_code is StatusCode.ERROR
        assert _attrs(failed)["error.type"].startswith("ClientConnector")
        assert "http.response.status_code" not in _attrs(failed)
        assert _attrs(retried)["url.full"].startswith(rig.served[1].url)
        assert _attrs(retried)["sal.attempt"] == 2
        assert retried.status.status_code is StatusCode.UNSET
        assert server.status.status_code is StatusCode.UNSET
        assert retried.context is not None
        assert rig.fakes[1].last_headers["traceparent"] == (
            f"00-{TRACE_ID}-{_hex(retried.context.span_id, 16)}-01"
        )


def test_backend_502_is_an_error_on_both_spans() -> None:
    with traced_rig(1) as rig:
        rig.fakes[0].behaviour.fail_status = 502
        assert _chat(rig.url).status_code == 502
        (server,) = rig.server_spans()
        assert server.status.status_code is StatusCode.ERROR
        assert _attrs(server)["error.type"] == "502"
        _tokenize, upstream = rig.children(server)
        assert upstream.status.status_code is StatusCode.ERROR
        assert _attrs(upstream)["http.response.status_code"] == 502


def test_backend_4xx_is_an_error_of_the_upstream_span_only() -> None:
    with traced_rig(1) as rig:
        rig.fakes[0].behaviour.fail_status = 422
        assert _chat(rig.url).status_code == 422
        (server,) = rig.server_spans()
        assert server.status.status_code is StatusCode.UNSET  # the client's fault
        _tokenize, upstream = rig.children(server)
        assert upstream.status.status_code is StatusCode.ERROR


def test_stream_header_timeout_is_a_504_error() -> None:
    with traced_rig(1, proxy={"stream_header_timeout_s": 1.0}) as rig:
        rig.fakes[0].behaviour.hang = True
        assert _chat(rig.url, stream=True).status_code == 504
        (server,) = rig.server_spans()
        assert server.status.status_code is StatusCode.ERROR
        assert _attrs(server)["http.response.status_code"] == 504
        _tokenize, upstream = rig.children(server)
        assert upstream.status.status_code is StatusCode.ERROR
        assert _attrs(upstream)["error.type"] == "header_timeout"


def test_stream_broken_after_headers_is_an_error() -> None:
    with traced_rig(1) as rig:
        rig.fakes[0].behaviour.close_after_chunks = 2
        resp = _chat(rig.url, stream=True, max_tokens=10)
        assert resp.status_code == 200
        assert '"error"' in resp.text
        (server,) = rig.server_spans()
        assert server.status.status_code is StatusCode.ERROR
        assert _attrs(server)["http.response.status_code"] == 200
        _tokenize, upstream = rig.children(server)
        assert upstream.status.status_code is StatusCode.ERROR
        assert _attrs(server)["error.type"] == _attrs(upstream)["error.type"]


def test_client_disconnect_ends_spans_without_error() -> None:
    with traced_rig(1) as rig:
        fake = rig.fakes[0]
        fake.behaviour.chunk_delay_s = 0.2
        with httpx.stream(
            "POST",
            f"{rig.url}/v1/completions",
            timeout=30.0,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True},
        ) as resp:
            assert next(resp.iter_bytes()).startswith(b"data: ")
        (server,) = rig.server_spans()
        assert _attrs(server)["sal.client_disconnected"] is True
        assert server.status.status_code is StatusCode.UNSET
        _tokenize, upstream = rig.children(server)
        assert _attrs(upstream)["sal.client_disconnected"] is True
        assert upstream.status.status_code is StatusCode.UNSET


def test_client_giving_up_before_the_answer_ends_spans() -> None:
    with traced_rig(1) as rig:
        rig.fakes[0].behaviour.hang = True
        with pytest.raises(httpx.ReadTimeout):
            _chat_with_timeout(rig.url, read_timeout_s=0.5)
        (server,) = rig.server_spans()
        assert _attrs(server)["http.response.status_code"] == 499
        assert server.status.status_code is StatusCode.UNSET
        _tokenize, upstream = rig.children(server)
        assert _attrs(upstream)["sal.client_disconnected"] is True


def _chat_with_timeout(url: str, read_timeout_s: float) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=httpx.Timeout(5.0, read=read_timeout_s),
    )


def test_rejected_request_and_probes() -> None:
    with traced_rig(1) as rig:
        assert httpx.get(f"{rig.url}/health", timeout=5.0).status_code == 200
        httpx.get(f"{rig.url}/metrics", timeout=5.0)
        resp = _chat(rig.url, headers={"traceparent": TRACEPARENT}, messages="not a list")
        assert resp.status_code == 400
        (server,) = rig.server_spans()  # probes have none; the 400 has one
        assert _attrs(server)["http.response.status_code"] == 400
        assert server.status.status_code is StatusCode.UNSET
        assert rig.children(server) == []  # never reached tokenization or a backend
        unknown = httpx.post(f"{rig.url}/v1/no-such-thing/42", json={}, timeout=5.0)
        assert unknown.status_code == 404
        _first, second = rig.server_spans(2)
        assert second.name == "POST"  # unknown paths do not become span names


def test_unsampled_trace_still_propagates_context() -> None:
    with traced_rig(1, sample_ratio=0.0) as rig:
        unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
        assert _chat(rig.url, headers={"traceparent": unsampled}).status_code == 200
        header = rig.fakes[0].last_headers["traceparent"]
        version, trace_id, span_id, flags = header.split("-")
        assert (version, trace_id, flags) == ("00", TRACE_ID, "00")
        assert span_id != PARENT_ID  # the gateway's own (unrecorded) span
        assert rig.spans.get_finished_spans() == ()


def test_tracing_off_passes_the_client_context_through() -> None:
    from tests.gw_fake_support import gateway_rig

    with gateway_rig(1) as rig:
        resp = _chat(rig.url, headers={"traceparent": TRACEPARENT, "tracestate": "a=b"})
        assert resp.status_code == 200
        assert rig.fakes[0].last_headers["traceparent"] == TRACEPARENT
        assert rig.fakes[0].last_headers["tracestate"] == "a=b"
        assert json.loads(resp.text)["usage"]["prompt_tokens"] > 0


def test_request_refused_by_the_front_door_has_a_span() -> None:
    with traced_rig(1, extra={"auth": {"api_keys": ["sk-good"]}}) as rig:
        resp = _chat(rig.url, headers={"traceparent": TRACEPARENT, "authorization": "Bearer no"})
        assert resp.status_code == 401
        (server,) = rig.server_spans()
        assert server.context is not None
        assert _hex(server.context.trace_id, 32) == TRACE_ID
        assert _attrs(server)["http.response.status_code"] == 401
        assert rig.children(server) == []
        assert rig.fakes[0].generation_requests == 0
