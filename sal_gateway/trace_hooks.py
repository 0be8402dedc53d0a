"""Per-request tracing hooks: the span handles the request path calls.

`RequestTrace` and `UpstreamSpan` are no-op base classes: with tracing off every hook is one
empty method call (`NO_TRACE`, `NO_SPAN`). With tracing on, `sal_gateway.tracing` makes a
live subclass per request (`start_live_trace`); the hooks then fill one SERVER span, its
``sal.tokenize`` child and one CLIENT span per upstream attempt (span tree, attributes and
statuses: docs/gateway.md, "Tracing"). Who calls what, once per request unless noted:

* `TracingMiddleware` starts the trace, stores it in ``scope["state"]`` (`trace_of` finds it)
  and calls `RequestTrace.end` after the last response byte;
* `admission.admit`: `RequestTrace.tokenize` around counting, then `RequestTrace.admitted`;
* `Forwarder.select`: `RequestTrace.routed` (per attempt); `Forwarder.forward`:
  `RequestTrace.upstream` and `UpstreamSpan.inject` per attempt; the forwarder's relay
  reports: `UpstreamSpan.response`, `outcome` and `end` (exactly once per attempt).

Nothing here imports OpenTelemetry: the live classes only use what `Tracing` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from sal_gateway.request_body import InboundRequest
    from sal_gateway.tokenizer import PromptCount
    from sal_gateway.tracing import Tracing

__all__ = [
    "NO_SPAN",
    "NO_TRACE",
    "PROPAGATED",
    "STATE_KEY",
    "RequestTrace",
    "UpstreamSpan",
    "start_live_trace",
    "trace_of",
]

STATE_KEY = "sal_trace"
"""Where `TracingMiddleware` puts the request's `RequestTrace` in ``scope["state"]``."""
PROPAGATED = frozenset({"traceparent", "tracestate"})
"""The W3C Trace Context headers (a client's are replaced upstream when tracing is on)."""
_OPERATIONS = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
}
"""``gen_ai.operation.name`` per endpoint path (semantic-convention values)."""


class UpstreamSpan:
    """One upstream attempt's CLIENT span. This base class is the no-op used when tracing is
    off; `Forwarder` calls these hooks once per attempt (`end` exactly once)."""

    __slots__ = ()

    def inject(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """The upstream request headers, carrying this span's W3C context."""
        return headers

    def response(self, status: int) -> None:
        """The replica's response headers arrived with `status`."""

    def outcome(self, error_type: str) -> None:
        """The exchange did not end cleanly: ``client_disconnect``, ``header_timeout``, ..."""

    def end(
        self,
        status: int | None,
        exc: BaseException | None = None,
        usage: tuple[int, int] | None = None,
    ) -> None:
        """The exchange is over; `status` as `Forwarder.finish` settled it (None: no
        response), `exc` what ended it without a response, `usage` the token usage."""


class RequestTrace:
    """One request's spans. This base class is the no-op used when tracing is off (a method
    call each, nothing else); the app, admission and forwarder call its hooks."""

    __slots__ = ()

    def tokenize(self) -> _Tokenizing:
        """A context manager around prompt counting (template rendering included)."""
        return _NO_TOKENIZING

    def admitted(self, inbound: InboundRequest, count: PromptCount) -> None:
        """The request was read, validated and counted."""

    def routed(self, policy: str, backend: str, score: float) -> None:
        """The policy chose `backend` with `score` (once per attempt)."""

    def upstream(self, backend: str, path: str) -> UpstreamSpan:
        """A CLIENT span for the next attempt at `backend` + `path`."""
        return NO_SPAN

    def end(self, status: int, exc: BaseException | None, request_id: object) -> None:
        """The response is sent (or the request failed with `exc`): end the server span."""


class _Tokenizing:
    __slots__ = ()

    def __enter__(self) -> _Tokenizing:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def counted(self, count: PromptCount) -> None:
        """The count, recorded on the span."""


NO_SPAN = UpstreamSpan()
NO_TRACE = RequestTrace()
_NO_TOKENIZING = _Tokenizing()


def trace_of(request: Any) -> RequestTrace:
    """The `RequestTrace` `TracingMiddleware` gave this Starlette request (`NO_TRACE` when
    tracing is off): once per request, a dict look-up."""
    state = request.scope.get("state")
    trace = state.get(STATE_KEY) if state else None
    return trace if trace is not None else NO_TRACE


def _fail(tracing: Tracing, span: Span, attrs: dict[str, Any], error_type: str, why: str) -> None:
    attrs["error.type"] = error_type
    span.set_status(tracing.status(tracing.error, why))


# The live classes collect attributes in a dict and hand them to the SDK once, when the span
# ends: each `set_attribute` call takes a lock and validates, at ~1 us apiece.


class _LiveTokenizing(_Tokenizing):
    __slots__ = ("_attrs", "_span", "_tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self._span = span
        self._attrs: dict[str, Any] = {}

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._span.record_exception(exc)
            _fail(self._tracing, self._span, self._attrs, type(exc).__name__, str(exc)[:200])
        self._span.set_attributes(self._attrs)
        self._span.end()

    def counted(self, count: PromptCount) -> None:
        self._attrs["gen_ai.usage.input_tokens"] = count.total
        self._attrs["sal.prompt_tokens.estimated"] = count.estimated
        self._attrs["sal.prompts"] = len(count.per_prompt)


class _LiveUpstreamSpan(UpstreamSpan):
    __slots__ = ("_attrs", "_error_type", "_request", "_span", "_status")

    def __init__(self, request: _LiveRequestTrace, span: Span) -> None:
        self._request = request
        self._span = span
        self._attrs: dict[str, Any] = {}
        self._status: int | None = None
        self._error_type: str | None = None

    def inject(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        carrier = {k: v for k, v in headers.items() if k.lower() not in PROPAGATED}
        tracing = self._request.tracing
        tracing.propagator.inject(carrier, context=tracing.in_context(self._span))
        return carrier

    def response(self, status: int) -> None:
        self._status = status
        self._attrs["http.response.status_code"] = status

    def outcome(self, error_type: str) -> None:
        self._error_type = error_type

    def end(
        self,
        status: int | None,
        exc: BaseException | None = None,
        usage: tuple[int, int] | None = None,
    ) -> None:
        span, request, attrs = self._span, self._request, self._attrs
        error_type = self._error_type
        if error_type is None and exc is not None:
            error_type = type(exc).__name__
        request.failed = None  # the last attempt's outcome is the request's
        if error_type == "client_disconnect" or status == 499:
            attrs["sal.client_disconnected"] = True
            request.client_gone = True
        elif error_type is not None:
            if exc is not None and span.is_recording():
                span.record_exception(exc)
            _fail(request.tracing, span, attrs, error_type, str(exc or error_type)[:200])
            request.failed = error_type
        elif self._status is not None and self._status >= 400:
            _fail(request.tracing, span, attrs, str(self._status), f"HTTP {self._status}")
        if usage is not None:
            request.attrs["gen_ai.usage.output_tokens"] = usage[1]
        span.set_attributes(attrs)
        span.end()


class _UnsampledUpstream(UpstreamSpan):
    """A sampled-out request's attempt: the replica still gets the (unsampled) context, the
    server span's, so it does not record either; no span is made."""

    __slots__ = ("_request",)

    def __init__(self, request: _LiveRequestTrace) -> None:
        self._request = request

    def inject(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        carrier = {k: v for k, v in headers.items() if k.lower() not in PROPAGATED}
        self._request.tracing.propagator.inject(carrier, context=self._request.context)
        return carrier


class _LiveRequestTrace(RequestTrace):
    __slots__ = (
        "_attempts",
        "_method",
        "_recording",
        "_score",
        "_span",
        "attrs",
        "client_gone",
        "context",
        "failed",
        "tracing",
    )

    def __init__(self, tracing: Tracing, span: Span, method: str) -> None:
        self.tracing = tracing
        self._span = span
        self._method = method
        self.context: Context = tracing.in_context(span)
        self._recording = span.is_recording()
        self._attempts = 0
        self._score: float | None = None
        self.attrs: dict[str, Any] = {}
        """Set on the server span when it ends."""
        self.client_gone = False
        self.failed: str | None = None
        """error.type of the last upstream attempt, None when it ended cleanly."""

    def tokenize(self) -> _Tokenizing:
        if not self._recording:  # sampled out: no child spans either
            return _NO_TOKENIZING
        span = self.tracing.tracer.start_span("sal.tokenize", context=self.context)
        return _LiveTokenizing(self.tracing, span)

    def admitted(self, inbound: InboundRequest, count: PromptCount) -> None:
        attrs = self.attrs
        attrs["gen_ai.request.model"] = inbound.model
        operation = _OPERATIONS.get(inbound.upstream_path)
        if operation is not None:
            attrs["gen_ai.operation.name"] = operation
        attrs["sal.request.stream"] = inbound.stream
        attrs["gen_ai.usage.input_tokens"] = count.total
        attrs["sal.prompt_tokens.estimated"] = count.estimated
        if inbound.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = inbound.max_tokens
        if inbound.fan_out > 1:
            attrs["gen_ai.request.choice.count"] = inbound.fan_out

    def routed(self, policy: str, backend: str, score: float) -> None:
        self._score = score
        self.attrs["sal.routing.policy"] = policy
        self.attrs["sal.routing.backend"] = backend
        self.attrs["sal.routing.score"] = score

    def upstream(self, backend: str, path: str) -> UpstreamSpan:
        self._attempts += 1
        if not self._recording:
            return _UnsampledUpstream(self)
        parts = urlsplit(backend)
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.full": backend + path,
            "server.address": parts.hostname or "",
            "server.port": parts.port or (443 if parts.scheme == "https" else 80),
            "sal.attempt": self._attempts,
        }
        if self._score is not None:
            attributes["sal.routing.score"] = self._score
        span = self.tracing.tracer.start_span(
            f"POST {path}",
            context=self.context,
            kind=self.tracing.client_kind,
            attributes=attributes,
        )
        return _LiveUpstreamSpan(self, span)

    def end(self, status: int, exc: BaseException | None, request_id: object) -> None:
        span, attrs = self._span, self.attrs
        if not self._recording:
            span.end()
            return
        attrs["http.response.status_code"] = status
        if status == 404:  # an unknown path: keep span names low-cardinality
            span.update_name(self._method)
        if isinstance(request_id, str):
            attrs["sal.request_id"] = request_id
        if self._attempts:
            attrs["sal.routing.attempts"] = self._attempts
            attrs["sal.routing.retries"] = self._attempts - 1
        if status == 499 or self.client_gone:
            attrs["sal.client_disconnected"] = True
        if exc is not None and not self.client_gone:
            if span.is_recording():
                span.record_exception(exc)
            _fail(self.tracing, span, attrs, type(exc).__name__, str(exc)[:200])
        elif status >= 500:
            _fail(self.tracing, span, attrs, str(status), f"HTTP {status}")
        elif self.failed is not None and status < 400 and not self.client_gone:
            # The stream broke after its 200 went out: the client got an error event.
            _fail(self.tracing, span, attrs, self.failed, f"upstream stream failed: {self.failed}")
        span.set_attributes(attrs)
        span.end()


def start_live_trace(tracing: Tracing, span: Span, method: str) -> RequestTrace:
    """The live trace of a request whose SERVER span `span` was just started."""
    return _LiveRequestTrace(tracing, span, method)
