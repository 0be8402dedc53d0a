"""Relaying one upstream answer to the client: a stream byte for byte, or a whole body.

`relay_answer` turns the backend's response (headers received) into the client's response:
a `RelayResponse` for a 200 event stream, otherwise the body passed on with the backend's
status: read whole when it is at most `BUFFERED_BODY_BYTES` (almost every answer), else
relayed as it arrives (`PassThroughResponse`), so a huge answer (long logprobs, a large
embeddings batch, a broken replica) cannot exhaust the gateway's memory. `RelayResponse`'s
contract:

* The client gets the headers with the first body bytes the forwarder already read
  (`Head`; see `proxy` for why it holds them), then the backend's bytes as they arrive,
  never re-encoded; only the usage-only event the gateway asked for on the client's behalf
  is removed (`UsageStripper`).
* No content from the backend for ``proxy.stream_idle_timeout_s`` (`idle_watch.IdleWatch`:
  SSE comments do not count, a slow client's time does not count, and with
  ``proxy.stream_idle_spares_live_engines`` a replica whose engine is demonstrably
  progressing is left to serve its queue): the stream ends with an OpenAI-shaped error event
  and ``data: [DONE]``, and the upstream connection is closed, which makes vLLM abort the
  request. Never retried: bytes may have been relayed.
* Any other failure after the headers (reset, total timeout) ends the same way.
* A client disconnect closes the upstream connection at once (vLLM aborts the generation).
* The gateway's shutdown (its grace over, `sal_gateway.drain`) ends the stream with an error
  event (503 ``gateway_shutdown``) and ``[DONE]``, and closes the upstream connection.
* The `Settler` (`accounting.Accounting`) is told exactly once how the exchange ended (`finish`), on
  every exit path, so the state-table ticket is always released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import aiohttp
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from sal_gateway.drain import Drain, uncancel_current_task
from sal_gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from sal_gateway.errors import error_body as _error_body
from sal_gateway.idle_watch import IdleWatch
from sal_gateway.state import Ticket
from sal_gateway.trace_hooks import NO_SPAN, UpstreamSpan
from sal_gateway.upstream import ConnectionUse, response_headers
from sal_gateway.usage import (
    USAGE_TAIL_BYTES,
    UsageStripper,
    usage_from_body,
    usage_from_json_tail,
    usage_from_sse_tail,
)

logger = logging.getLogger("sal_gateway.proxy")

SSE_DONE = b"data: [DONE]\n\n"
HeadT = TypeVar("HeadT")
BUFFERED_BODY_BYTES = 4 << 20
"""A non-streamed answer up to this size is read whole before the client gets its headers
(a failure while reading it is a clean 502/504; usage: `usage_from_body`);
a larger one (long logprobs, a big embeddings batch) is passed through as it arrives
(`PassThroughResponse`), so no answer costs the gateway more memory than this."""


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
    span: UpstreamSpan = NO_SPAN
    """This attempt's tracing span (`sal_gateway.tracing`; a no-op when tracing is off)."""
    idle_s: float = 60.0
    """A stream's idle bound (``proxy.stream_idle_timeout_s``)."""
    live: Callable[[], bool] | None = field(default=None)
    """Whether the backend's engine is demonstrably alive now (`StateTable.is_live`); None:
    every silence of `idle_s` ends the stream."""
    headers_at_s: float = 0.0
    """Event-loop time at which the response headers arrived (a stream's silence starts)."""
    connection: ConnectionUse = field(default_factory=ConnectionUse)
    """Whether the request went out on a reused pooled connection (set by the session)."""
    fresh_connection: bool = False
    """Send on a new connection of its own (the retry after a stale pooled one)."""
    adapter_label: str | None = None
    """The LoRA adapter the request named, for its own metric series (None: the base model,
    or a name no replica lists yet, which clients could otherwise mint series with)."""
    drain: Drain | None = None
    """The process's shutdown state: a cancellation while it drains is the shutdown's
    (`Drain.is_shutdown`), and a stream then ends with an error event, not a cut."""


@dataclass(frozen=True, slots=True)
class Head:
    """What the forwarder read of a stream's body before the client's headers went out."""

    chunk: bytes = b""
    """The first body bytes (relayed first): SSE comments, then the first content, or only
    comments when no content came within the hold; empty when nothing came."""
    error: BaseException | None = None
    """The read failure that ended the hold (an idle or total timeout): the relay sends the
    headers, then the error event."""


class Settler(Protocol):
    """What the relay reports to (`accounting.Accounting`: metrics, the ticket, beta)."""

    def first_byte(self, ex: Exchange) -> None:
        """The first body content arrived from the backend (for a stream: the first chunk
        that is not only SSE comments, `comments_only`: vLLM's keep-alive comments come
        while a request waits, before its first token)."""

    def content(self, ex: Exchange) -> None:
        """Content of a 200 answer (not an SSE comment) arrived from the backend."""

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


class _Relayed(Response, Generic[HeadT]):
    """A response whose body the backend is still sending: relayed as it arrives by
    `_relay`, while one asyncio task watches for the client's disconnect and then closes the
    upstream connection, which ends the relay at once and makes the backend abort.

    Cheaper than Starlette's `StreamingResponse` (no anyio task group per response)."""

    def __init__(
        self,
        settler: Settler,
        ex: Exchange,
        resp: aiohttp.ClientResponse,
        headers: Mapping[str, str],
        media_type: str,
        head: HeadT,
    ) -> None:
        # Not Response.__init__: it would render an empty body and add Content-Length: 0.
        self.status_code = resp.status
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._settler = settler
        self._ex = ex
        self._resp = resp
        self._head = head
        """What was read of the body before the client's headers went out."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, resp = self._ex, self._resp

        def client_gone() -> None:
            ex.client_gone = True
            resp.close()

        watcher = asyncio.ensure_future(_watch_disconnect(receive, client_gone))
        try:
            await self._relay(send)
        finally:
            watcher.cancel()

    async def _relay(self, send: Send) -> None:
        raise NotImplementedError


class RelayResponse(_Relayed[Head]):
    """Streams an upstream SSE response to the client chunk by chunk (`relay_stream`)."""

    async def _relay(self, send: Send) -> None:
        await relay_stream(self._settler, self._ex, self._resp, self.raw_headers, send, self._head)


async def relay_stream(
    settler: Settler,
    ex: Exchange,
    resp: aiohttp.ClientResponse,
    raw_headers: list[tuple[bytes, bytes]],
    send: Send,
    head: Head,
) -> None:
    """Relay `head`, then the rest of `resp`'s body to the client as it arrives; settle
    metrics and accounting."""
    tail = b""  # the last bytes relayed: where the client's own usage event is
    stripper = UsageStripper() if ex.strip_usage else None
    first = True
    status = 200
    broken = False  # the upstream exchange did not end cleanly: close, never reuse
    loop = asyncio.get_running_loop()
    watch = IdleWatch(
        loop,
        ex.idle_s,
        ex.live,
        resp.close,  # ends the read below; vLLM aborts the request
        loop.time() if head.chunk and not comments_only(head.chunk) else ex.headers_at_s or None,
    )
    started = False  # the client has its headers
    delivered = False  # the client has the whole stream, ``data: [DONE]`` included
    try:
        watch.sending = True
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        started = True
        watch.sending = False
        watch.start()
        try:
            async for chunk in _body(resp, head):
                if ex.client_gone:
                    break
                if first and not comments_only(chunk):
                    first = False
                    settler.first_byte(ex)
                if not chunk.startswith(b":"):
                    settler.content(ex)
                raw = chunk
                if stripper is not None:
                    chunk = stripper.feed(chunk)
                    if not chunk:
                        watch.touch(raw)
                        continue
                tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
                watch.sending = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                watch.sending = False
                watch.touch(raw)
                delivered = tail.endswith(SSE_DONE)
            if watch.fired and not ex.client_gone:
                raise aiohttp.SocketTimeoutError("stream idle")
        except (aiohttp.ClientError, TimeoutError) as exc:
            # The watch closed the connection: whatever the read raised, it was the idle bound.
            failure = aiohttp.SocketTimeoutError("stream idle") if watch.fired else exc
            if delivered:
                # The backend's body broke or went silent after ``[DONE]`` (its chunked
                # terminator never came): the client has its whole answer; end it cleanly.
                broken = True  # never reuse that connection
            elif not ex.client_gone:
                broken = True
                resp.close()  # before anything else: vLLM aborts the request now
                err = settler.stream_failed(ex, failure)
                held = stripper.flush() if stripper is not None else b""
                await send(_error_message(err, tail + held, held))
        # A client gone after ``[DONE]`` reached it hung up before the backend's body had
        # quite ended (vLLM sends the chunked terminator in a write of its own): a served
        # request, and closing the upstream connection cancelled nothing.
        if ex.client_gone and not delivered:
            status = 499  # nginx's "client closed request"
            settler.upstream_cancelled(ex, "client_disconnect")
        elif not ex.client_gone:
            held = stripper.flush() if stripper is not None else b""
            await send({"type": "http.response.body", "body": held, "more_body": False})
    except BaseException as exc:  # cancelled (shutdown) or the send to the client failed
        if delivered:  # whatever ended it now, the client has the whole stream: served
            if ex.drain is not None and ex.drain.is_shutdown(exc):
                uncancel_current_task()
                return
            raise
        if ex.drain is not None and ex.drain.is_shutdown(exc) and started and not broken:
            # The shutdown grace ran out: close upstream (vLLM aborts), tell the client.
            broken = True
            resp.close()
            settler.upstream_cancelled(ex, "shutdown")
            uncancel_current_task()
            held = stripper.flush() if stripper is not None else b""
            with contextlib.suppress(Exception):
                await send(_error_message(ex.drain.error(), tail + held, held))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if status == 200 and not broken:
            settler.upstream_cancelled(ex, "aborted")
        status = 499
        raise
    finally:
        watch.stop()
        if status == 200 and not broken:
            resp.release()
        else:
            resp.close()  # closing the upstream connection makes vLLM abort the request
        usage = None
        if status == 200:
            usage = stripper.usage if stripper is not None else usage_from_sse_tail(tail)
        settler.finish(ex, status, usage)


async def _read_up_to(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """`resp`'s body if it ends within `limit` bytes (True), else its first bytes, a little
    over `limit` (False: the rest is still to read)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await resp.content.readany():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks), False
    return b"".join(chunks), True


class PassThroughResponse(_Relayed[bytes]):
    """A non-streamed answer too large to hold (over `BUFFERED_BODY_BYTES`): the backend's
    status and headers, the bytes already read, then the rest as it arrives, never more than
    one chunk in the gateway's memory. Usage is read from the body's last bytes
    (`usage_from_json_tail`). A client disconnect closes the upstream connection (vLLM
    aborts). A failure of the backend after the headers went out cannot become an error
    status any more: the client's connection is closed without completing the body (a
    truncated chunked or ``Content-Length`` body, which every HTTP client reports as an
    error), counted in ``sal_stream_errors_total`` and logged."""

    async def _relay(self, send: Send) -> None:
        ex, resp, settler = self._ex, self._resp, self._settler
        tail = self._head[-USAGE_TAIL_BYTES:]
        status = resp.status
        complete = False
        try:
            await send(
                {"type": "http.response.start", "status": status, "headers": self.raw_headers}
            )
            await send({"type": "http.response.body", "body": self._head, "more_body": True})
            try:
                async for chunk in resp.content.iter_any():
                    if ex.client_gone:
                        break
                    tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not ex.client_gone:
                    resp.close()
                    settler.stream_failed(ex, exc)
                    return  # the client's body stays incomplete: the server closes it
            if ex.client_gone:
                status = 499
                settler.upstream_cancelled(ex, "client_disconnect")
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            complete = True
        except BaseException as exc:  # cancelled (shutdown) or the send to the client failed
            if ex.drain is not None and ex.drain.is_shutdown(exc):
                # The shutdown grace ran out mid-body: it stays incomplete (the server closes
                # the connection); no error status can follow a 200's headers.
                settler.upstream_cancelled(ex, "shutdown")
                uncancel_current_task()
                return
            if status != 499:
                settler.upstream_cancelled(ex, "aborted")
            status = 499
            raise
        finally:
            if complete:
                resp.release()
            else:
                resp.close()
            usage = None
            if complete and status == 200 and "Content-Encoding" not in resp.headers:
                usage = usage_from_json_tail(tail)
            settler.finish(ex, status, usage)


def comments_only(chunk: bytes) -> bool:
    """Whether every SSE line in `chunk` is a comment (``:``...) or blank: vLLM's
    ``: keep-alive`` (``--sse-keep-alive-interval``), sent while a request waits for its
    first token as well as between tokens."""
    return all(not line.strip() or line.startswith(b":") for line in chunk.split(b"\n"))


async def _body(resp: aiohttp.ClientResponse, head: Head) -> AsyncIterator[bytes]:
    if head.error is not None:
        raise head.error
    if head.chunk:
        yield head.chunk
    async for chunk in resp.content.iter_any():
        yield chunk


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


def is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    """Whether `resp` is a stream to relay as one: 200 and ``text/event-stream``."""
    content_type = resp.headers.get("Content-Type", "")
    return resp.status == 200 and content_type.startswith("text/event-stream")


async def relay_answer(
    settler: Settler,
    ex: Exchange,
    resp: aiohttp.ClientResponse,
    stream: bool,
    head: Head | None = None,
    read: bytes = b"",
) -> Response:
    """The client's response for `resp` (its headers received): a `RelayResponse` for a
    requested stream the backend answers with 200 ``text/event-stream``, otherwise the body
    with the backend's status: read whole (bounded by the request's aiohttp timeout) when it
    is at most `BUFFERED_BODY_BYTES`, else a `PassThroughResponse` relaying it as it comes.
    `head`: what the forwarder already read of the stream's body; `read`: of another body.

    A body that breaks while being read: `UpstreamError` (`UpstreamTimeout` past the total
    bound), already counted. Every path but the returned `RelayResponse` settles `ex`."""
    ex.span.response(resp.status)
    content_type = resp.headers.get("Content-Type", "application/json")
    if stream and is_event_stream(resp):
        headers = response_headers(resp)
        return RelayResponse(settler, ex, resp, headers, content_type, head or Head())
    try:
        body, whole = await _read_up_to(resp, BUFFERED_BODY_BYTES - len(read))
        body = read + body
    except (aiohttp.ClientError, TimeoutError) as exc:
        resp.close()
        ex.span.outcome(type(exc).__name__)
        err: UpstreamError
        if isinstance(exc, TimeoutError):  # the total bound (or a stream's idle bound)
            settler.upstream_cancelled(ex, "total_timeout")
            err = UpstreamTimeout(f"backend answer not complete in time: {exc}")
        else:
            err = UpstreamError(f"backend failed while answering: {type(exc).__name__}: {exc}")
        settler.finish(ex, err.status, None)
        err.backend = ex.backend
        err.counted = True
        raise err from None
    except BaseException:
        resp.close()
        settler.upstream_cancelled(ex, "client_disconnect")
        settler.finish(ex, 499, None)
        raise
    settler.first_byte(ex)
    if resp.status == 200:
        settler.content(ex)
    if not whole:
        headers = response_headers(resp)
        return PassThroughResponse(settler, ex, resp, headers, content_type, body)
    usage = None
    if resp.status == 200 and "Content-Encoding" not in resp.headers:
        usage = usage_from_body(body)
    resp.release()
    settler.finish(ex, resp.status, usage)
    return Response(
        body, status_code=resp.status, headers=response_headers(resp), media_type=content_type
    )
