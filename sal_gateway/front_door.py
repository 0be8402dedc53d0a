"""The gateway's front door: request ids, API keys and the concurrency limit (pure ASGI).

`FrontDoor` wraps the app (installed by `app.create_app`) and, for every HTTP request:

1. picks the request id: the client's ``X-Request-Id`` when it is short printable ASCII,
   else a fresh one; stores it in ``scope["state"]["request_id"]`` (the handlers log it and
   forward it upstream) and adds ``X-Request-Id`` to the response, whatever produced it;
2. unless the path is in ``auth.open_paths``, requires an accepted API key (401 with
   ``WWW-Authenticate: Bearer`` otherwise);
3. counts relayed requests (every endpoint of `endpoints.ENDPOINTS`) in progress and refuses
   those beyond ``limits.max_concurrent_requests`` with a 429 and ``Retry-After``. A request
   counts from its first byte to the end of its response, the whole stream included: this is a
   plain ASGI wrapper around the call, not a ``BaseHTTPMiddleware`` (which ends at the headers).

Pure ASGI so the streaming path stays as cheap as before (no per-chunk wrapping beyond the
response-start message).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sal_gateway.auth import KeyChecker
from sal_gateway.endpoints import RELAYED_PATHS
from sal_gateway.errors import GatewayError, TooManyRequests, Unauthorized, error_body

GENERATION_PATHS = RELAYED_PATHS
"""Every relayed endpoint counts against the limit (`endpoints.ENDPOINTS`)."""
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = b"x-request-id"


def sanitize_request_id(raw: bytes | None) -> str | None:
    """The client's request id if it is 1..128 printable ASCII characters without spaces
    (safe in logs and upstream headers), else None."""
    if raw is None or not 0 < len(raw) <= MAX_REQUEST_ID_CHARS:
        return None
    if any(not 0x21 <= b <= 0x7E for b in raw):
        return None
    return raw.decode("ascii")


def new_request_id() -> str:
    return uuid.uuid4().hex


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def send_error(send: Send, exc: GatewayError, request_id: str) -> None:
    """Answer `exc` as an OpenAI-shaped JSON error on a raw ASGI `send`."""
    body = json.dumps(error_body(exc)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (_REQUEST_ID, request_id.encode()),
    ]
    headers.extend((k.lower().encode(), v.encode()) for k, v in exc.headers.items())
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class FrontDoor:
    """ASGI middleware; see the module docstring. `on_reject(reason)` counts refusals."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        checker: KeyChecker,
        open_paths: frozenset[str],
        max_concurrent: int,
        retry_after_s: int,
        on_reject: Callable[[str], None],
    ) -> None:
        self.app = app
        self.checker = checker
        self.open_paths = open_paths
        self.max_concurrent = max_concurrent
        self.retry_after_s = retry_after_s
        self.on_reject = on_reject
        self.in_progress = 0
        """Generation requests in progress now."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = sanitize_request_id(_header(scope, _REQUEST_ID)) or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (_REQUEST_ID, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != _REQUEST_ID]
                headers.append(id_header)
                message = {**message, "headers": headers}
            await send(message)

        path = scope["path"]
        if path not in self.open_paths and not self.checker.accepts(
            _header(scope, b"authorization")
        ):
            self.on_reject("unauthorized")
            await send_error(send, Unauthorized("Incorrect or missing API key."), request_id)
            return
        if path not in GENERATION_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send_with_id)
            return
        if self.max_concurrent and self.in_progress >= self.max_concurrent:
            self.on_reject("over_limit")
            exc = TooManyRequests(
                f"the gateway is serving its limit of {self.max_concurrent} concurrent "
                "requests; retry later",
                self.retry_after_s,
            )
            await send_error(send, exc, request_id)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.in_progress -= 1
