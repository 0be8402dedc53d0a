"""Relaying one upstream SSE stream to the client, byte for byte, with an idle bound.

`RelayResponse` is what `Forwarder` returns for a streamed answer. Its contract:

* The client gets the backend's bytes as they arrive, never re-encoded; only the usage-only
  event the gateway asked for on the client's behalf is removed (`UsageStripper`).
* No byte from the backend for ``proxy.stream_idle_timeout_s`` (aiohttp's ``sock_read``
  timeout, rearmed by every byte received, SSE keep-alive comments included): the stream ends
  with an OpenAI-shaped error event and ``data: [DONE]``, and the upstream connection is
  closed, which makes vLLM abort the request. Never retried: bytes may have been relayed.
* Any other failure after the headers (reset, total timeout) ends the same way.
* A client disconnect closes the upstream connection at once (vLLM aborts the generation).
* The `Settler` (the forwarder) is told exactly once how the exchange ended (`finish`), on
  every exit path, so the state-table ticket is always released.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from sal_gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from sal_gateway.errors import error_body as _error_body
from sal_gateway.state import Ticket
from sal_gateway.usage import USAGE_TAIL_BYTES, UsageStripper, usage_from_sse_tail

logger = logging.getLogger("sal_gateway.proxy")

SSE_DONE = b"data: [DONE]\n\n"


def sse_error_event(exc: GatewayError) -> bytes:
    """The SSE event that ends a stream broken after its headers, then ``[DONE]``."""
    return b"data: " + json.dumps(_error_body(exc)).encode() + b"\n\n" + SSE_DONE


@dataclass(slots=True)
class Exchange:
    """One upstream exchange in progress (for metrics and accounting)."""

    model: str
    backend: str
    ticket: Ticket
    start_s: float
    prompt_tokens: int
    strip_usage: bool = False
    """The gateway asked for usage on the client's behalf: remove the usage event."""
    client_gone: bool = False


class Settler(Protocol):
    """What the relay reports to (the forwarder: metrics, accounting, beta)."""

    def first_byte(self, ex: Exchange) -> None:
        """The first body byte arrived from the backend."""

    def upstream_cancelled(self, ex: Exchange, reason: str) -> None:
        """The gateway closed the upstream connection of an unfinished exchange."""

    def stream_failed(self, ex: Exchange, exc: BaseException) -> GatewayError:
        """The stream broke after its headers: count it; the error the client is shown."""

    def finish(self, ex: Exchange, status: int, usage: tuple[int, int] | None) -> None:
        """The exchange is over (once, on every path): release the ticket, record metrics."""


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


class RelayResponse(Response):
    """Streams an upstream SSE response to the client chunk by chunk, without buffering.

    Cheaper than Starlette's `StreamingResponse` (no anyio task group per stream): one asyncio
    task watches for the client's disconnect and then closes the upstream connection, which
    ends the relay loop at once and makes the backend abort the generation.
    """

    def __init__(
        self,
        settler: Settler,
        ex: Exchange,
        resp: aiohttp.ClientResponse,
        headers: Mapping[str, str],
        media_type: str,
    ) -> None:
        # Not Response.__init__: it would render an empty body and add Content-Length: 0.
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._settler = settler
        self._ex = ex
        self._resp = resp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, resp = self._ex, self._resp

        def client_gone() -> None:
            ex.client_gone = True
            resp.close()

        watcher = asyncio.ensure_future(_watch_disconnect(receive, client_gone))
        try:
            await relay_stream(self._settler, ex, resp, self.raw_headers, send)
        finally:
            watcher.cancel()


async def relay_stream(
    settler: Settler,
    ex: Exchange,
    resp: aiohttp.ClientResponse,
    raw_headers: list[tuple[bytes, bytes]],
    send: Send,
) -> None:
    """Relay `resp`'s body to the client as it arrives; settle metrics and accounting."""
    tail = b""  # the last bytes relayed: where the client's own usage event is
    stripper = UsageStripper() if ex.strip_usage else None
    first = True
    status = 200
    broken = False  # the upstream exchange did not end cleanly: close, never reuse
    try:
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        try:
            async for chunk in resp.content.iter_any():
                if ex.client_gone:
                    break
                if first:
                    first = False
                    settler.first_byte(ex)
                if stripper is not None:
                    chunk = stripper.feed(chunk)
                    if not chunk:
                        continue
                tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            broken = True
            if not ex.client_gone:
                resp.close()  # before anything else: vLLM aborts the request now
                err = settler.stream_failed(ex, exc)
                held = stripper.flush() if stripper is not None else b""
                await send(_error_message(err, tail + held, held))
        if ex.client_gone:
            status = 499  # nginx's "client closed request"
            settler.upstream_cancelled(ex, "client_disconnect")
        else:
            held = stripper.flush() if stripper is not None else b""
            await send({"type": "http.response.body", "body": held, "more_body": False})
    except BaseException:  # cancelled (shutdown) or the send to the client failed
        if status == 200 and not broken:
            settler.upstream_cancelled(ex, "aborted")
        status = 499
        raise
    finally:
        if status == 200 and not broken:
            resp.release()
        else:
            resp.close()  # closing the upstream connection makes vLLM abort the request
        usage = None
        if status == 200:
            usage = stripper.usage if stripper is not None else usage_from_sse_tail(tail)
        settler.finish(ex, status, usage)


def stream_error(ex: Exchange, exc: BaseException, idle_timeout_s: float) -> GatewayError:
    """The error shown for a stream broken after its headers by `exc` (logged here)."""
    if isinstance(exc, aiohttp.SocketTimeoutError):
        logger.warning("stream from %s idle for %s s: closed", ex.backend, idle_timeout_s)
        return UpstreamTimeout(
            f"the backend sent nothing for {idle_timeout_s} s (proxy.stream_idle_timeout_s); "
            f"the response is incomplete and was not retried"
        )
    logger.warning("stream from %s broke: %s: %s", ex.backend, type(exc).__name__, exc)
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(
            "the response exceeded proxy.total_timeout_s; it is incomplete and was not retried"
        )
    return UpstreamError(
        f"the backend failed mid-stream ({type(exc).__name__}); the response is "
        f"incomplete and was not retried"
    )


def _error_message(err: GatewayError, tail: bytes, held: bytes) -> Message:
    """The body message that ends a broken stream: `held` (bytes the usage stripper still
    held), then the error event and ``[DONE]``."""
    # Close a partially relayed event first so the error event parses on its own.
    prefix = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
    return {
        "type": "http.response.body",
        "body": held + prefix + sse_error_event(err),
        "more_body": True,
    }
