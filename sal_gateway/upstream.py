"""The gateway's upstream HTTP client: the pooled session and the headers sent each way.

Client stack: one pooled ``aiohttp.ClientSession`` per app (built in the lifespan by
`make_session`). httpx's pool collapses under hundreds of concurrent streams (issue #2
measured p99 3.4 s at 200 streams with ``httpx.AsyncClient`` against 0.4 s with aiohttp); the
gateway-bench script measures it again.

`RETRYABLE` names the connection-level failures that happen before a backend answered
anything, which `proxy.Forwarder` may retry on another backend. Two of them are no fault of
the backend: `is_stale_connection`, a pooled keep-alive connection the backend closed just as
the request went out on it, and `connect_held_up_by_stall`, a connect timeout that fired only
because the gateway's own process was stalled (`ConnectionUse` records what both need).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from types import SimpleNamespace

import aiohttp

from sal_gateway.config import ProxyConfig
from sal_gateway.stall_guard import held_up_by_stall

__all__ = [
    "POOL_KEEPALIVE_S",
    "RETRYABLE",
    "ConnectionUse",
    "connect_held_up_by_stall",
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

POOL_KEEPALIVE_S = 4.0
"""How long the pool keeps an idle connection: below uvicorn's (and vLLM's) 5 s keep-alive."""

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
    """Passed as a request's ``trace_request_ctx``: the session's tracing hooks set `reused`
    when the request went out on a pooled (kept-alive) connection, and `connect_started_s`
    (loop time) when it opened a new one: when its name was resolved, if it was looked up,
    else when the connection was begun (after any wait for a pool slot)."""

    __slots__ = ("connect_started_s", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.connect_started_s: float | None = None


async def _note_reuse(
    _session: aiohttp.ClientSession,
    ctx: SimpleNamespace,
    _params: aiohttp.TraceConnectionReuseconnParams,
) -> None:
    use = ctx.trace_request_ctx
    if isinstance(use, ConnectionUse):
        use.reused = True


async def _note_connect_start(
    _session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: object
) -> None:
    use = ctx.trace_request_ctx
    if isinstance(use, ConnectionUse):
        use.connect_started_s = asyncio.get_running_loop().time()


def connect_held_up_by_stall(
    exc: BaseException,
    use: ConnectionUse,
    connect_timeout_s: float,
    now_s: float,
    ceil_threshold_s: float = aiohttp.ClientTimeout().ceil_threshold,
) -> bool:
    """Whether `exc` is a connect timeout that fired only because the gateway's process was
    stalled (`stall_guard`), noticed at loop time `now_s`: its timer ran more than
    `stall_guard.STALL_S` after it was due. The connect had completed in the kernel during
    the stall, but the loop ran the overdue timer before the task the connection woke, so a
    healthy backend looked unreachable. aiohttp arms the timer `connect_timeout_s` after the
    connect begins (rounded up to a whole loop second above `ceil_threshold_s`, as it does);
    a timeout with no recorded start never counts."""
    if not isinstance(exc, aiohttp.ConnectionTimeoutError) or use.connect_started_s is None:
        return False
    due_s = use.connect_started_s + connect_timeout_s
    if connect_timeout_s > ceil_threshold_s:
        due_s = math.ceil(due_s)
    return held_up_by_stall(due_s, now_s)


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
    trace.on_connection_create_start.append(_note_connect_start)
    trace.on_dns_resolvehost_end.append(_note_connect_start)  # the connect starts after it
    if fresh:
        connector = aiohttp.TCPConnector(
            limit=proxy.max_connections, limit_per_host=0, force_close=True, ttl_dns_cache=10
        )
    else:
        connector = aiohttp.TCPConnector(
            limit=proxy.max_connections,
            limit_per_host=0,
            keepalive_timeout=POOL_KEEPALIVE_S,
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
