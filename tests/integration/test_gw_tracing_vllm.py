"""One trace from the client through the gateway into a real vLLM-on-CPU replica.

A small in-process OTLP/HTTP collector receives the spans of both the gateway (a CLI child
process with ``tracing.enabled``, exporting over OTLP/HTTP as configured) and vLLM (started
with ``--otlp-traces-endpoint``). What a user would notice if it broke: in Jaeger, vLLM's
``llm_request`` span hangs under the gateway's upstream span, in the trace the client began.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.types import Receive, Scope, Send

from engine_patch.replica import LocalReplica, replica_command
from engine_sim.fake_vllm import ServedApp
from tests.gateway_support import free_port, gateway_config, run_gateway
from tests.gw_fake_support import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
# Export each batch within 0.2 s instead of the SDK's 5 s (both processes read it).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str


class Collector:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) that keeps every span."""

    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = dict(scope["headers"])
        if headers.get(b"content-encoding") == b"gzip":
            body = gzip.decompress(body)
        self._keep(ExportTraceServiceRequest.FromString(body))
        answer = ExportTraceServiceResponse().SerializeToString()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-protobuf")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    collected = CollectedSpan(
                        service,
                        span.name,
                        span.kind,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                    )
                    with self._lock:
                        self.spans.append(collected)

    def find(self, name: str, service: str | None = None) -> list[CollectedSpan]:
        with self._lock:
            return [
                s
                for s in self.spans
                if s.name == name and (service is None or s.service == service)
            ]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    sink = Collector()
    with ServedApp(sink) as url:
        yield sink, url


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, collector: tuple[Collector, str]) -> Iterator[str]:
    _sink, url = collector
    port = free_port(21700, 21800)
    args = ("--served-model-name", MODEL, "--otlp-traces-endpoint", f"{url}/v1/traces")
    command = replica_command(tiny_model_dir, port, extra_args=args)
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **FAST_EXPORT}
    replica = LocalReplica(command, port, env=env)
    replica.start(timeout_s=300)
    try:
        yield replica.base_url
    finally:
        replica.stop()


@pytest.fixture(scope="module")
def gateway(replica: str, tiny_model_dir: Path, collector: tuple[Collector, str]) -> Iterator[str]:
    _sink, url = collector
    tracing = {"enabled": True, "exporter": "otlp_http", "endpoint": url, "service_name": "gw"}
    config = gateway_config(
        free_port(21800, 21900), [replica], tokenizer=tiny_model_dir, extra={"tracing": tracing}
    )
    with run_gateway(config, env=FAST_EXPORT) as gateway_url:
        yield gateway_url


def test_vllm_parents_its_span_on_the_gateway_upstream_span(
    gateway: str, collector: tuple[Collector, str]
) -> None:
    sink, _url = collector
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello"}],
            max_tokens=4,
            extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},
        )
    assert reply.usage is not None
    wait_until(lambda: bool(sink.find("llm_request")), timeout_s=30.0)
    wait_until(lambda: bool(sink.find("POST /v1/chat/completions", "gw")), timeout_s=30.0)

    gateway_spans = sink.find("POST /v1/chat/completions", "gw")
    (server,) = [s for s in gateway_spans if s.kind == 2]  # SPAN_KIND_SERVER
    (upstream,) = [s for s in gateway_spans if s.kind == 3]  # SPAN_KIND_CLIENT
    (tokenize,) = sink.find("sal.tokenize", "gw")
    (engine,) = sink.find("llm_request")
    assert server.trace_id == TRACE_ID
    assert server.parent_span_id == CLIENT_SPAN_ID
    assert tokenize.parent_span_id == server.span_id
    assert upstream.parent_span_id == server.span_id
    # vLLM read the traceparent the gateway sent: its span is the upstream span's child.
    assert engine.trace_id == TRACE_ID
    assert engine.parent_span_id == upstream.span_id
    assert engine.service != "gw"
