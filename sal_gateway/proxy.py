"""Forwarding one request to the best backend, with bounded retries, and relaying the answer.

The app calls `Forwarder.forward()` once per validated request. Client stack: one pooled
``aiohttp.ClientSession`` per app (built in the lifespan). httpx's pool collapses under
hundreds of concurrent streams (issue #2 measured p99 3.4 s at 200 streams with
``httpx.AsyncClient`` against 0.4 s with aiohttp); the gateway-bench script measures it again.

Failure semantics (see docs/gateway.md):

* Connect failure before any response byte (refused, reset, connect timeout, closed before the
  headers): the backend is marked suspect and the request goes to the next best backend, at
  most ``routing.max_retries`` times; then 502.
* No response headers within ``first_byte_timeout_s``: 504, not retried (the backend may be
  generating).
* A backend's HTTP error (4xx *and* 5xx) is passed through with its status and body, never
  retried: generation may have happened.
* Failure after the first byte of a stream: the stream ends with
  ``data: {"error": {...}}`` and ``data: [DONE]``, never retried (no duplicate generation).
* The request body is forwarded byte for byte, except that a stream whose client did not ask
  for usage is asked for it (`usage.with_usage_requested`) and the usage-only event removed
  again. SSE bytes are relayed as they arrive, never re-encoded (when removing that event,
  the bytes of a not yet terminated event wait for its end). A client disconnect cancels the
  upstream request (its connection is closed). The state-table ticket is released on every
  exit path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from sal_gateway.beta import BetaEstimator
from sal_gateway.config import ProxyConfig, RoutingConfig
from sal_gateway.errors import GatewayError, NoBackendAvailable, UpstreamError, UpstreamTimeout
from sal_gateway.errors import error_body as _error_body
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.policies import NoEligibleBackend, Policy, RouteRequest
from sal_gateway.request_body import InboundRequest
from sal_gateway.state import StateTable, Ticket
from sal_gateway.usage import (
    USAGE_TAIL_BYTES,
    UsageStripper,
    usage_from_json,
    usage_from_sse_tail,
    with_usage_requested,
)

logger = logging.getLogger("sal_gateway.proxy")

# Connection-level failures before any response byte: safe to try another backend.
_RETRYABLE = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,  # connect timeout (a TimeoutError too: listed first)
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Set by our own server (uvicorn) or by the Response object; forwarding them would duplicate.
_SERVER_OWN = frozenset({"content-type", "date", "server"})
_SSE_DONE = b"data: [DONE]\n\n"


def make_session(proxy: ProxyConfig) -> aiohttp.ClientSession:
    """The app's one pooled upstream client (call inside a running loop, in the lifespan)."""
    connector = aiohttp.TCPConnector(
        limit=proxy.max_connections,
        limit_per_host=0,
        keepalive_timeout=4.0,  # below uvicorn's (and vLLM's) 5 s keep-alive: no reuse race
        ttl_dns_cache=10,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=proxy.connect_timeout_s),
        auto_decompress=False,  # bytes pass through as the backend sent them
        skip_auto_headers=("User-Agent",),
    )


def upstream_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Client request headers worth forwarding (hop-by-hop ones dropped)."""
    forwarded = {
        k: v
        for k, v in headers.items()
        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-type"
    }
    # The body was validated as JSON; vLLM's FastAPI only parses it when it is labelled so.
    forwarded["Content-Type"] = "application/json"
    return forwarded


def _response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {
        k: v
        for k, v in resp.headers.items()
        if k.lower() not in _HOP_BY_HOP and k.lower() not in _SERVER_OWN
    }


def sse_error_event(exc: GatewayError) -> bytes:
    """The SSE event that ends a stream broken after its first byte, then ``[DONE]``."""
    return b"data: " + json.dumps(_error_body(exc)).encode() + b"\n\n" + _SSE_DONE


@dataclass(slots=True)
class _Exchange:
    """One upstream exchange in progress (for metrics and accounting)."""

    model: str
    backend: str
    ticket: Ticket
    start_s: float
    prompt_tokens: int
    strip_usage: bool = False
    """The gateway asked for usage on the client's behalf: remove the usage event."""
    client_gone: bool = False


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


class _RelayResponse(Response):
    """Streams an upstream SSE response to the client chunk by chunk, without buffering.

    Cheaper than Starlette's `StreamingResponse` (no anyio task group per stream): one asyncio
    task watches for the client's disconnect and then closes the upstream connection, which
    ends the relay loop at once and makes the backend abort the generation.
    """

    def __init__(
        self,
        forwarder: Forwarder,
        ex: _Exchange,
        resp: aiohttp.ClientResponse,
        headers: Mapping[str, str],
        media_type: str,
    ) -> None:
        # Not Response.__init__: it would render an empty body and add Content-Length: 0.
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._forwarder = forwarder
        self._ex = ex
        self._resp = resp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, resp = self._ex, self._resp

        def client_gone() -> None:
            ex.client_gone = True
            resp.close()

        watcher = asyncio.ensure_future(_watch_disconnect(receive, client_gone))
        try:
            await self._forwarder.relay_stream(ex, resp, self.raw_headers, send)
        finally:
            watcher.cancel()


class Forwarder:
    """Routes and forwards requests; one per app, built in the lifespan."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        table: StateTable,
        policy: Policy,
        metrics: GatewayMetrics,
        betas: Mapping[str, BetaEstimator],
        routing: RoutingConfig,
        proxy: ProxyConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._table = table
        self._policy = policy
        self._metrics = metrics
        self._betas = betas
        self._routing = routing
        self._proxy = proxy
        self._clock = clock
        self._decision_seconds = metrics.routing_decision_seconds.labels(policy=policy.name)
        self._total_timeout = aiohttp.ClientTimeout(
            total=proxy.total_timeout_s, sock_connect=proxy.connect_timeout_s
        )

    def select(self, model: str, prompt_tokens: int, exclude: set[str]) -> str:
        """The policy's choice for `model` among backends not in `exclude` (records metrics)."""
        views = self._table.views(model, self._clock())
        if exclude:
            views = [
                dataclasses.replace(v, eligible=False) if v.url in exclude else v for v in views
            ]
        beta = self._betas[model].beta if model in self._betas else self._routing.beta_seed
        started = time.perf_counter()
        try:
            decision = self._policy.select(RouteRequest(prompt_tokens, beta), views)
        except NoEligibleBackend:
            raise NoBackendAvailable(f"no eligible backend for model {model!r}") from None
        finally:
            self._decision_seconds.observe(time.perf_counter() - started)
        self._metrics.series(model, decision.url, self._policy.name).routing_decisions.inc()
        if logger.isEnabledFor(logging.DEBUG):
            view = views[decision.index]
            logger.debug(
                "route model=%s prompt_tokens=%d -> %s score=%.4g (free_kv=%d queued=%d "
                "in_flight=%d beta=%.3g)",
                model,
                prompt_tokens,
                decision.url,
                decision.score,
                view.free_kv_tokens,
                view.queued_prefill_tokens,
                view.in_flight,
                beta,
            )
        return decision.url

    async def forward(
        self,
        inbound: InboundRequest,
        raw_body: bytes,
        headers: Mapping[str, str],
        prompt_tokens: int,
    ) -> Response:
        """Send `inbound` to the best backend and return the response to relay."""
        model = inbound.model
        path = inbound.endpoint.value
        tried: set[str] = set()
        last_error: Exception | None = None
        failed_url = ""
        # Ask streams for usage (beta and token counters need it) without the client seeing it.
        injected = with_usage_requested(inbound.body) if inbound.stream else None
        body = raw_body if injected is None else injected
        for _attempt in range(self._routing.max_retries + 1):
            try:
                url = self.select(model, prompt_tokens, tried)
            except NoBackendAvailable:
                if last_error is None:
                    raise
                break
            if last_error is not None:  # this is a retry of what failed on `failed_url`
                self._metrics.retries.labels(model=model, backend=failed_url).inc()
            ticket = self._table.route(model, url, prompt_tokens)
            ex = _Exchange(
                model, url, ticket, time.perf_counter(), prompt_tokens, injected is not None
            )
            try:
                resp = await self._open(url + path, body, headers)
            except _RETRYABLE as exc:
                StateTable.release(ticket)
                self._table.mark_suspect(model, url)
                tried.add(url)
                last_error, failed_url = exc, url
                logger.warning("connect to %s failed: %s: %s", url, type(exc).__name__, exc)
                continue
            except GatewayError as exc:
                StateTable.release(ticket)
                exc.backend = url
                raise
            except BaseException:  # cancelled: the client went away while we waited
                StateTable.release(ticket)
                self._metrics.requests.labels(model=model, backend=url, status="499").inc()
                raise
            return await self._relay(ex, inbound, resp)
        raise UpstreamError(
            f"could not reach a backend for model {model!r} after {len(tried)} attempt(s): "
            f"{last_error}"
        )

    async def _open(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        try:
            async with asyncio.timeout(self._proxy.first_byte_timeout_s):
                return await self._session.post(
                    url, data=body, headers=headers, timeout=self._total_timeout
                )
        except _RETRYABLE:
            raise
        except TimeoutError:
            raise UpstreamTimeout(
                f"backend sent no response within {self._proxy.first_byte_timeout_s} s"
            ) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"backend request failed: {type(exc).__name__}: {exc}") from None

    def _finish(self, ex: _Exchange, status: int, usage: tuple[int, int] | None) -> None:
        StateTable.release(ex.ticket)
        elapsed_s = time.perf_counter() - ex.start_s
        series = self._metrics.series(ex.model, ex.backend, self._policy.name)
        if status == 200:
            series.ok_requests.inc()
        else:
            self._metrics.requests.labels(ex.model, ex.backend, str(status)).inc()
        if status < 400:
            series.generation.observe(elapsed_s)
        if usage is not None:
            prompt, completion = usage
            self._metrics.output_tokens.labels(model=ex.model).inc(completion)
            beta = self._betas.get(ex.model)
            if beta is not None:
                beta.observe(prompt, completion)

    async def _relay(
        self, ex: _Exchange, inbound: InboundRequest, resp: aiohttp.ClientResponse
    ) -> Response:
        content_type = resp.headers.get("Content-Type", "application/json")
        if inbound.stream and resp.status == 200 and content_type.startswith("text/event-stream"):
            return _RelayResponse(self, ex, resp, _response_headers(resp), content_type)
        try:
            body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            resp.release()
            self._finish(ex, 502, None)
            err = UpstreamError(f"backend failed while answering: {type(exc).__name__}: {exc}")
            err.backend = ex.backend
            err.counted = True
            raise err from None
        except BaseException:
            resp.close()
            self._finish(ex, 499, None)
            raise
        StateTable.first_byte(ex.ticket)
        self._metrics.series(ex.model, ex.backend, self._policy.name).ttft.observe(
            time.perf_counter() - ex.start_s
        )
        usage = None
        if resp.status == 200 and "Content-Encoding" not in resp.headers:
            usage = usage_from_json(body)
        resp.release()
        self._finish(ex, resp.status, usage)
        return Response(
            body, status_code=resp.status, headers=_response_headers(resp), media_type=content_type
        )

    async def relay_stream(
        self,
        ex: _Exchange,
        resp: aiohttp.ClientResponse,
        raw_headers: list[tuple[bytes, bytes]],
        send: Send,
    ) -> None:
        """Relay `resp`'s body to the client as it arrives; settle metrics and accounting."""
        tail = b""  # the last bytes relayed: where the client's own usage event is
        stripper = UsageStripper() if ex.strip_usage else None
        first = True
        status = 200
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            try:
                async for chunk in resp.content.iter_any():
                    if ex.client_gone:
                        break
                    if first:
                        first = False
                        StateTable.first_byte(ex.ticket)
                        self._metrics.series(ex.model, ex.backend, self._policy.name).ttft.observe(
                            time.perf_counter() - ex.start_s
                        )
                    if stripper is not None:
                        chunk = stripper.feed(chunk)
                        if not chunk:
                            continue
                    tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not ex.client_gone:
                    held = stripper.flush() if stripper is not None else b""
                    await send(self._stream_error(ex, exc, tail + held, held))
            if ex.client_gone:
                status = 499  # nginx's "client closed request"
            else:
                held = stripper.flush() if stripper is not None else b""
                await send({"type": "http.response.body", "body": held, "more_body": False})
        except BaseException:  # cancelled (shutdown) or the send failed
            status = 499
            raise
        finally:
            if status == 200:
                resp.release()
            else:
                resp.close()  # closing the upstream connection makes vLLM abort the request
            usage = None
            if status == 200:
                usage = stripper.usage if stripper is not None else usage_from_sse_tail(tail)
            self._finish(ex, status, usage)

    def _stream_error(
        self, ex: _Exchange, exc: BaseException, tail: bytes, held: bytes = b""
    ) -> Message:
        """The body message that ends a stream broken after its first byte: `held` (bytes
        the usage stripper still held), then the error event and ``[DONE]``."""
        self._metrics.stream_errors.labels(model=ex.model, backend=ex.backend).inc()
        logger.warning("stream from %s broke: %s: %s", ex.backend, type(exc).__name__, exc)
        err = UpstreamError(
            f"the backend failed mid-stream ({type(exc).__name__}); the response is "
            f"incomplete and was not retried"
        )
        # Close a partially relayed event first so the error event parses on its own.
        prefix = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
        return {
            "type": "http.response.body",
            "body": held + prefix + sse_error_event(err),
            "more_body": True,
        }
