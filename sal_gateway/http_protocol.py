"""uvicorn's httptools protocol with the deadlines uvicorn lacks (slow-client protection).

uvicorn bounds idle keep-alive connections but not a client that opens a connection and
trickles its headers, or sends headers then trickles a body its route never reads: each such
connection stays open forever, and hundreds of them exhaust descriptors and memory. The
protocol class made by `deadline_protocol()` (passed to uvicorn as ``http=``) adds:

* a **header deadline**: from a connection's opening (or a later request's first byte) to its
  headers being complete, at most ``header_timeout_s``; else a 408 and close;
* a **body deadline**: from headers to the end of the body, ``body_timeout_s``, whether or
  not a handler reads the body; else a 408 (or just a close once a response started). The
  generation handlers have their own deadline a grace second later, for other servers;
* a **header size** cap (``MAX_HEADER_BYTES``; httptools itself has none): 431 and close;
* protocol-level 400s (unparsable HTTP) in the OpenAI error shape, counted
  (``invalid_http``), and uvicorn's warning for each of them rate-limited
  (`ClientFaultLogLimit`): one client sending garbage must not flood the log.

Such an answer is followed by a *lingering close*: our side of the connection is shut for
writing, what the client still sends is read and dropped for up to ``LINGER_S``, then the
connection is closed. Closing at once with unread input would make the kernel send a reset,
and the client would lose the 408 it was being sent.

Keep-alive is unchanged: between requests uvicorn's ``timeout_keep_alive`` governs.
`on_timeout(reason)` is called once per cut or refused connection (``header_timeout``,
``body_timeout`` or ``invalid_http``), for ``sal_rejected_requests_total``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 * 1024
LINGER_S = 2.0
_REASONS = {
    408: "Request Timeout",
    400: "Bad Request",
    431: "Request Header Fields Too Large",
}


def _raw_error(status: int, message: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": status,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _HeadersTooLarge(Exception):
    pass


CLIENT_FAULT_LOG_EVERY_S = 10.0
CLIENT_FAULT_MESSAGES = frozenset(
    {"Invalid HTTP request received.", "Unsupported upgrade request."}
)
"""uvicorn's warnings (logger ``uvicorn.error``) that any client can cause at will."""


class ClientFaultLogLimit(logging.Filter):
    """Passes each of `CLIENT_FAULT_MESSAGES` at most once per `every_s`, the next one that
    passes saying how many were dropped; every other record passes untouched. Installed on
    uvicorn's logger by `deadline_protocol()` (the counts are in the metrics anyway)."""

    def __init__(
        self, every_s: float = CLIENT_FAULT_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.msg
        if not isinstance(key, str) or key not in CLIENT_FAULT_MESSAGES:
            return True
        now = self.clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._seen[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            record.msg = f"{key} ({last[1]} similar since last logged)"
        self._seen[key] = (now, 0)
        return True


def limit_client_fault_logs(logger: logging.Logger) -> None:
    """Install one `ClientFaultLogLimit` on `logger` (idempotent)."""
    if not any(isinstance(f, ClientFaultLogLimit) for f in logger.filters):
        logger.addFilter(ClientFaultLogLimit())


class DeadlineProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` plus header/body deadlines; configure via `deadline_protocol()`."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    on_timeout: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting_headers = False
        self._header_bytes = 0
        self._lingering = False
        self._parsed_header_bytes = 0
        self._headers_too_large = False

    def _answer_and_close(self, status: int, message: str) -> None:
        """Send a final error and close lingering (see the module docstring); once only."""
        if self._lingering:
            return
        self._disarm()
        self._lingering = True
        self.transport.write(_raw_error(status, message))
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _arm(self, delay_s: float, reason: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._expire, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, reason: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.on_timeout is not None:
            self.on_timeout(reason)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the handler sees a disconnect and stops
            cycle.message_event.set()
        if reason == "header_timeout":
            answer = self._header_bytes > 0  # a request began (not just an idle connection)
        else:  # unless this request was answered already (a route that ignores bodies)
            answer = cycle is None or not cycle.response_started
        if answer:
            what = "headers" if reason == "header_timeout" else "body"
            limit = self.header_timeout_s if reason == "header_timeout" else self.body_timeout_s
            self._answer_and_close(408, f"request {what} not received within {limit:g} s")
        else:
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._awaiting_headers = True
        self._header_bytes = 0
        self._arm(self.header_timeout_s, "header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered already: drain and drop
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if (
            self._awaiting_headers
            and self._header_bytes > MAX_HEADER_BYTES
            and not self._lingering
            and not self.transport.is_closing()
        ):
            self._answer_and_close(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")

    def _count_header_bytes(self, n: int) -> None:
        # Headers that arrive in one read are parsed before `data_received` can count them.
        self._parsed_header_bytes += n
        if self._parsed_header_bytes > MAX_HEADER_BYTES:
            self._headers_too_large = True
            raise _HeadersTooLarge  # httptools turns it into a parser error: 431 below

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_message_begin(self) -> None:
        self._parsed_header_bytes = 0
        super().on_message_begin()
        if not self._awaiting_headers:  # a later request on a kept-alive connection
            self._awaiting_headers = True
            self._header_bytes = 0
            self._arm(self.header_timeout_s, "header_timeout")

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._arm(self.body_timeout_s, "body_timeout")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self.on_timeout is not None and not self._lingering:
            self.on_timeout("invalid_http")
        if self._headers_too_large:
            self._answer_and_close(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
        else:
            self._answer_and_close(400, msg)


def deadline_protocol(
    header_timeout_s: float,
    body_timeout_s: float,
    on_timeout: Callable[[str], None] | None = None,
) -> type[DeadlineProtocol]:
    """A `DeadlineProtocol` subclass with these settings (uvicorn instantiates it per
    connection, so the settings are class attributes). Also rate-limits uvicorn's
    client-fault warnings (`limit_client_fault_logs`)."""
    limit_client_fault_logs(logging.getLogger("uvicorn.error"))
    return type(
        "ConfiguredDeadlineProtocol",
        (DeadlineProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "on_timeout": staticmethod(on_timeout) if on_timeout else None,
        },
    )
