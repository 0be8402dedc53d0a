"""Optional OpenTelemetry tracing: set-up, settings and the per-request middleware.

Off by default (``tracing.enabled``). When off, `build_tracing` returns None, `create_app`
installs no middleware, the OpenTelemetry packages are never imported (the ``otel`` extra is
optional) and the hooks on the request path are the no-op ones of `trace_hooks`. When on,
`TracingMiddleware` wraps each HTTP request (probe paths excepted) in a SERVER span, and the
hooks add a ``sal.tokenize`` child, the routing decision, and one CLIENT span per upstream
attempt whose context goes to the replica as ``traceparent`` / ``tracestate`` (so vLLM with
``--otlp-traces-endpoint`` parents its ``llm_request`` span on it). Spans, attributes and
statuses: `trace_hooks` and docs/gateway.md, "Tracing".

Precedence of settings (`resolve_settings`, pure): ``OTEL_*`` environment variables over
``config.yaml``'s ``tracing`` section over the SDK defaults; only ``tracing.enabled`` turns
tracing on, ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sal_gateway import __version__
from sal_gateway.config import TracingConfig
from sal_gateway.trace_hooks import (
    NO_SPAN,
    NO_TRACE,
    PROPAGATED,
    STATE_KEY,
    RequestTrace,
    UpstreamSpan,
    start_live_trace,
    trace_of,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "NO_SPAN",
    "NO_TRACE",
    "STATE_KEY",
    "UNTRACED_PATHS",
    "ExportSettings",
    "RequestTrace",
    "Tracing",
    "TracingError",
    "TracingMiddleware",
    "UpstreamSpan",
    "build_tracing",
    "resolve_settings",
    "trace_of",
]

UNTRACED_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Probe and scrape paths: polled every few seconds, a span each would drown the traces."""


class TracingError(RuntimeError):
    """Tracing is enabled but cannot be set up (SDK missing, unsupported ``OTEL_*`` value)."""


# --- settings (pure) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportSettings:
    """What `build_tracing` sets up; None fields are left to the SDK (it reads ``OTEL_*``)."""

    exporter: str
    """``otlp_http``, ``otlp_grpc`` or ``console``."""
    endpoint: str | None
    service_name: str | None
    sample_ratio: float | None


def _env_true(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() == "true"


def _exporter(config: TracingConfig, environ: Mapping[str, str]) -> str | None:
    chosen = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if chosen == "none":
        return None
    if chosen not in ("", "otlp", "console"):
        raise TracingError(f"OTEL_TRACES_EXPORTER={chosen!r}: supported are otlp, console, none")
    if chosen == "console" or (chosen == "" and config.exporter == "console"):
        return "console"
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    ).strip()
    if protocol == "grpc":
        return "otlp_grpc"
    if protocol == "http/protobuf":
        return "otlp_http"
    if protocol:
        raise TracingError(f"OTLP protocol {protocol!r}: supported are grpc, http/protobuf")
    return "otlp_grpc" if config.exporter == "otlp_grpc" else "otlp_http"


def resolve_settings(config: TracingConfig, environ: Mapping[str, str]) -> ExportSettings | None:
    """The effective settings, or None when tracing is off. ``OTEL_*`` variables win over
    the config where both name the same thing (raises `TracingError` on values the SDK
    cannot honour)."""
    if not config.enabled or _env_true(environ, "OTEL_SDK_DISABLED"):
        return None
    exporter = _exporter(config, environ)
    if exporter is None:
        return None
    endpoint = config.endpoint
    env_endpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in environ or (
        "OTEL_EXPORTER_OTLP_ENDPOINT" in environ
    )
    if exporter == "console" or env_endpoint:
        endpoint = None
    elif endpoint is not None and exporter == "otlp_http" and urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"  # as the SDK does for the base variable
    named_in_env = "OTEL_SERVICE_NAME" in environ or "service.name=" in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    return ExportSettings(
        exporter=exporter,
        endpoint=endpoint,
        service_name=None if named_in_env else config.service_name,
        sample_ratio=None if "OTEL_TRACES_SAMPLER" in environ else config.sample_ratio,
    )


# --- set-up (imports the SDK) ------------------------------------------------------------


def _span_exporter(settings: ExportSettings) -> SpanExporter:
    if settings.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if settings.exporter == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=settings.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.endpoint)


def build_tracing(
    config: TracingConfig,
    environ: Mapping[str, str],
    *,
    exporter: SpanExporter | None = None,
    batch: bool = False,
) -> Tracing | None:
    """The app's `Tracing` (None when off); called once by `create_app`, before serving.

    Spans are batched and exported off the loop by the SDK's ``BatchSpanProcessor`` (its
    ``OTEL_BSP_*`` variables apply). `exporter` replaces the configured one and, unless
    `batch`, gets each span as it ends (tests pass the SDK's ``InMemorySpanExporter``). Raises
    `TracingError` when the SDK or the chosen exporter package is not installed."""
    settings = resolve_settings(config, environ)
    if settings is None:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        attributes = (
            {} if settings.service_name is None else {"service.name": settings.service_name}
        )
        sampler = None
        if settings.sample_ratio is not None:
            sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
        if exporter is not None and not batch:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            chosen = _span_exporter(settings) if exporter is None else exporter
            provider.add_span_processor(BatchSpanProcessor(chosen))
    except ImportError as exc:
        raise TracingError(
            f"tracing.enabled is true but OpenTelemetry is not installed ({exc}); install the "
            "gateway's `otel` extra: pip install 'sal-gateway[otel]'"
        ) from None
    return Tracing(provider)


class Tracing:
    """The app's tracer (one per app): starts request traces, flushes on shutdown."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("sal_gateway", __version__)
        # A private W3C propagator, not the global one: no process-wide state is touched.
        self.propagator = TraceContextTextMapPropagator()
        self.in_context = trace.set_span_in_context
        self.server_kind = trace.SpanKind.SERVER
        self.client_kind = trace.SpanKind.CLIENT
        self.error = trace.StatusCode.ERROR
        self.status = trace.Status

    def start_request(self, scope: Scope) -> RequestTrace:
        """A SERVER span for the HTTP request in `scope`, child of its ``traceparent``."""
        carrier = {}
        for key, value in scope["headers"]:
            name = key.decode("latin-1").lower()
            if name in PROPAGATED:
                carrier[name] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        method, path = scope["method"], scope["path"]
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "url.scheme": scope.get("scheme", "http"),
            "http.route": path,
        }
        client = scope.get("client")
        if client:
            attributes["client.address"] = client[0]
        span = self.tracer.start_span(
            f"{method} {path}", context=parent, kind=self.server_kind, attributes=attributes
        )
        return start_live_trace(self, span, method)

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking: call off the event loop)."""
        self.provider.shutdown()


# --- the middleware ----------------------------------------------------------------------


class TracingMiddleware:
    """Pure-ASGI middleware (installed outermost by `create_app` only when tracing is on):
    one SERVER span per HTTP request except `UNTRACED_PATHS`, ended after the last response
    byte (so a stream's span covers the whole stream) or when the app raises."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        trace = self.tracing.start_request(scope)
        state = scope.setdefault("state", {})
        state[STATE_KEY] = trace
        status = 0

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            trace.end(status or 500, exc, state.get("request_id"))
            raise
        trace.end(status, None, state.get("request_id"))
