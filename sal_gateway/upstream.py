"""The gateway's upstream HTTP client: the pooled session and the headers sent each way.

Client stack: one pooled ``aiohttp.ClientSession`` per app (built in the lifespan by
`make_session`). httpx's pool collapses under hundreds of concurrent streams (issue #2
measured p99 3.4 s at 200 streams with ``httpx.AsyncClient`` against 0.4 s with aiohttp); the
gateway-bench script measures it again.

`RETRYABLE` names the connection-level failures that happen before a backend answered
anything, which `proxy.Forwarder` may retry on another backend. `is_stale_connection` tells
the one that is no fault of the backend: a pooled keep-alive connection the backend closed
just as the request went out on it (`ConnectionUse`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace

import aiohttp

from sal_gateway.config import ProxyConfig

__all__ = [
    "RETRYABLE",
    "ConnectionUse",
    "is_stale_connection",
    "make_session",
    "response_headers",
    "upstream_headers",
]

RETRYABLE = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,  # connect timeout (a TimeoutError too: listed first)
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)
"""Connection-level failures before any response byte: safe to try another backend."""

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


class ConnectionUse:
    """Passed as a request's ``trace_request_ctx``: the session's tracing hook sets
    `reused` when the request went out on a pooled (kept-alive) connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _note_reuse(
    _session: aiohttp.ClientSession,
    ctx: SimpleNamespace,
    _params: aiohttp.TraceConnectionReuseconnParams,
) -> None:
    use = ctx.trace_request_ctx
    if isinstance(use, ConnectionUse):
        use.reused = True


def is_stale_connection(exc: BaseException, use: ConnectionUse) -> bool:
    """Whether `exc` (before any response byte) is the keep-alive race, not a backend fault:
    the request went out on a reused connection and the backend closed or reset it instead
    of answering. A server closes an idle keep-alive connection after its own timeout
    (vLLM's uvicorn: 5 s); the pool gives a connection up after 4 s of its own idleness, but
    when the gateway's loop runs late (a busy or stalled host) the backend's close can still
    cross a request on the way. Such a request never reached the backend's handler; a
    connect failure (refused, timeout) never counts here."""
    return (
        use.reused
        and isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
        and not isinstance(exc, aiohttp.ClientConnectorError)
    )


def make_session(proxy: ProxyConfig, *, fresh: bool = False) -> aiohttp.ClientSession:
    """The app's one pooled upstream client (call inside a running loop, in the lifespan).

    `fresh`: a client that opens a new connection for every request and closes it after
    (the retry after a stale pooled connection, `is_stale_connection`)."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_note_reuse)
    if fresh:
        connector = aiohttp.TCPConnector(
            limit=proxy.max_connections, limit_per_host=0, force_close=True, ttl_dns_cache=10
        )
    else:
        connector = aiohttp.TCPConnector(
            limit=proxy.max_connections,
            limit_per_host=0,
            keepalive_timeout=4.0,  # below uvicorn's (and vLLM's) 5 s keep-alive
            ttl_dns_cache=10,
        )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=proxy.connect_timeout_s),
        auto_decompress=False,  # bytes pass through as the backend sent them
        skip_auto_headers=("User-Agent",),
        trace_configs=[trace],
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


def response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """A backend's response headers to pass on to the client (hop-by-hop and the ones our
    own server sets dropped)."""
    return {
        k: v
        for k, v in resp.headers.items()
        if k.lower() not in _HOP_BY_HOP and k.lower() not in _SERVER_OWN
    }
