"""Forwarding one request to the best backend, with bounded retries, and relaying the answer.

The app calls `Forwarder.forward()` once per validated request. Client stack: one pooled
``aiohttp.ClientSession`` per app (built in the lifespan). httpx's pool collapses under
hundreds of concurrent streams (issue #2 measured p99 3.4 s at 200 streams with
``httpx.AsyncClient`` against 0.4 s with aiohttp); the gateway-bench script measures it again.

Timeouts follow how vLLM answers (see docs/gateway.md):

* A non-streamed answer's headers come only when generation ends, so a non-streaming request
  is bounded by ``proxy.total_timeout_s`` alone (then 504, not retried: the backend worked).
* A stream's headers come as soon as vLLM accepts the request, so they are due within
  ``proxy.stream_header_timeout_s``. On expiry the upstream connection is closed (vLLM aborts
  the request: nothing runs twice), the backend is marked suspect and the request is retried
  like a connect failure; when every attempt timed out, 504.
* Once a stream's headers arrived, `relay.RelayResponse` bounds each silence by
  ``proxy.stream_idle_timeout_s`` and never retries.

Other failures:

* Connect failure before any response byte (refused, reset, connect timeout, closed before the
  headers): the backend is marked suspect and the request goes to the next best backend, at
  most ``routing.max_retries`` times; then 502.
* A backend's HTTP error (4xx *and* 5xx) is passed through with its status and body, never
  retried: generation may have happened.
* The request body is forwarded byte for byte, except that a stream whose client did not ask
  for usage is asked for it (`usage.with_usage_requested`) and the usage-only event removed
  again (`relay`). A client disconnect cancels the upstream request (its connection is
  closed). The state-table ticket is released on every exit path. Every connection the
  gateway closes on an unfinished exchange is counted in ``sal_upstream_cancels_total``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp
from starlette.responses import Response

from sal_gateway.beta import BetaEstimator
from sal_gateway.config import ProxyConfig, RoutingConfig
from sal_gateway.errors import GatewayError, NoBackendAvailable, UpstreamError, UpstreamTimeout
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.policies import NoEligibleBackend, Policy, RouteRequest
from sal_gateway.relay import Exchange, RelayResponse, sse_error_event, stream_error
from sal_gateway.request_body import InboundRequest
from sal_gateway.state import StateTable
from sal_gateway.usage import usage_from_json, with_usage_requested

__all__ = ["Forwarder", "make_session", "sse_error_event", "upstream_headers"]

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


class _HeaderTimeout(Exception):
    """A stream's headers did not come within ``proxy.stream_header_timeout_s``."""


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
        # sock_read is aiohttp's own idle bound: rearmed by every byte the backend sends (and
        # paused while a slow client holds reading back), so it measures the backend alone.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=proxy.total_timeout_s,
            sock_connect=proxy.connect_timeout_s,
            sock_read=proxy.stream_idle_timeout_s,
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
        """Send `inbound` to the best backend and return the response to relay.

        Retries (at most ``routing.max_retries``, each on a backend not tried yet) only what
        cannot have generated anything: connect failures and streams whose headers timed out
        (their connection is closed first, so vLLM aborts them)."""
        model = inbound.model
        path = inbound.endpoint.value
        tried: set[str] = set()
        timed_out = 0
        last_error: Exception | None = None
        failed_url = ""
        # Ask streams for usage (beta and token counters need it) without the client seeing it.
        injected = with_usage_requested(inbound.body, raw_body) if inbound.stream else None
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
            ex = Exchange(
                model, url, ticket, time.perf_counter(), prompt_tokens, injected is not None
            )
            try:
                resp = await self._open(url + path, body, headers, inbound.stream)
            except (*_RETRYABLE, _HeaderTimeout) as exc:
                StateTable.release(ticket)
                self._table.mark_suspect(model, url)
                tried.add(url)
                last_error, failed_url = exc, url
                if isinstance(exc, _HeaderTimeout):
                    timed_out += 1
                    self._count_timeout(ex, "header")
                    logger.warning("%s: %s", url, exc)
                else:
                    logger.warning("connect to %s failed: %s: %s", url, type(exc).__name__, exc)
                continue
            except GatewayError as exc:
                StateTable.release(ticket)
                exc.backend = url
                if isinstance(exc, UpstreamTimeout):
                    self.upstream_cancelled(ex, "total_timeout")
                raise
            except BaseException:  # cancelled: the client went away while we waited
                StateTable.release(ticket)
                self.upstream_cancelled(ex, "client_disconnect")
                self._metrics.requests.labels(model=model, backend=url, status="499").inc()
                raise
            return await self._relay(ex, inbound, resp)
        message = (
            f"could not reach a backend for model {model!r} after {len(tried)} attempt(s): "
            f"{last_error}"
        )
        raise UpstreamTimeout(message) if timed_out == len(tried) else UpstreamError(message)

    async def _open(
        self, url: str, body: bytes, headers: Mapping[str, str], stream: bool
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers; raises what `forward` sorts out."""
        try:
            if not stream:
                return await self._session.post(
                    url, data=body, headers=headers, timeout=self._total_timeout
                )
            # Leaving this block by timeout cancels the request: aiohttp closes its connection.
            async with asyncio.timeout(self._proxy.stream_header_timeout_s):
                return await self._session.post(
                    url, data=body, headers=headers, timeout=self._stream_timeout
                )
        except _RETRYABLE:
            raise
        except TimeoutError:
            if stream:  # the header bound, or the idle bound if that one is shorter
                bound = min(self._proxy.stream_header_timeout_s, self._proxy.stream_idle_timeout_s)
                raise _HeaderTimeout(f"stream headers not received within {bound} s") from None
            raise UpstreamTimeout(
                f"backend did not answer within {self._proxy.total_timeout_s} s "
                f"(proxy.total_timeout_s)"
            ) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"backend request failed: {type(exc).__name__}: {exc}") from None

    # --- reports from the relay (`relay.Settler`) ---------------------------------------

    def first_byte(self, ex: Exchange) -> None:
        """The backend started answering: prefill is done, time to first token known."""
        StateTable.first_byte(ex.ticket)
        self._metrics.series(ex.model, ex.backend, self._policy.name).ttft.observe(
            time.perf_counter() - ex.start_s
        )

    def upstream_cancelled(self, ex: Exchange, reason: str) -> None:
        """The gateway closed the connection of an unfinished upstream exchange."""
        self._metrics.upstream_cancels.labels(ex.model, ex.backend, reason).inc()

    def stream_failed(self, ex: Exchange, exc: BaseException) -> GatewayError:
        """Count a stream broken after its headers; the error event the client gets."""
        self._metrics.stream_errors.labels(model=ex.model, backend=ex.backend).inc()
        if isinstance(exc, aiohttp.SocketTimeoutError):  # sock_read: the idle bound
            self._count_timeout(ex, "idle")
        elif isinstance(exc, TimeoutError):  # aiohttp's total bound
            self.upstream_cancelled(ex, "total_timeout")
        return stream_error(ex, exc, self._proxy.stream_idle_timeout_s)

    def _count_timeout(self, ex: Exchange, kind: str) -> None:
        self._metrics.stream_timeouts.labels(ex.model, ex.backend, kind).inc()
        self.upstream_cancelled(ex, f"{kind}_timeout")

    def finish(self, ex: Exchange, status: int, usage: tuple[int, int] | None) -> None:
        """The exchange is over: release its ticket, record its metrics (once per exchange)."""
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
        self, ex: Exchange, inbound: InboundRequest, resp: aiohttp.ClientResponse
    ) -> Response:
        content_type = resp.headers.get("Content-Type", "application/json")
        if inbound.stream and resp.status == 200 and content_type.startswith("text/event-stream"):
            return RelayResponse(self, ex, resp, _response_headers(resp), content_type)
        try:
            body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            resp.close()
            err: UpstreamError
            if isinstance(exc, TimeoutError):  # the total bound (or a stream's idle bound)
                self.upstream_cancelled(ex, "total_timeout")
                err = UpstreamTimeout(f"backend answer not complete in time: {exc}")
            else:
                err = UpstreamError(f"backend failed while answering: {type(exc).__name__}: {exc}")
            self.finish(ex, err.status, None)
            err.backend = ex.backend
            err.counted = True
            raise err from None
        except BaseException:
            resp.close()
            self.upstream_cancelled(ex, "client_disconnect")
            self.finish(ex, 499, None)
            raise
        self.first_byte(ex)
        usage = None
        if resp.status == 200 and "Content-Encoding" not in resp.headers:
            usage = usage_from_json(body)
        resp.release()
        self.finish(ex, resp.status, usage)
        return Response(
            body, status_code=resp.status, headers=_response_headers(resp), media_type=content_type
        )
