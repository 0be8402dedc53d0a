"""Bare streaming proxies, one per HTTP client stack, to compare the stacks by measurement.

Each proxy forwards ``POST /v1/completions`` and ``/v1/chat/completions`` to one upstream and
relays the response bytes chunk by chunk (SSE included) without parsing anything; it is the
floor of what a gateway built on that client can achieve. `bench.gateway_bench` runs every
stack in its own uvicorn process (uvloop + httptools) in front of the same fake backend::

    python -m bench.proxy_stacks --stack aiohttp --upstream http://127.0.0.1:19001 --port 19010

Stacks: ``httpx`` (one pooled ``httpx.AsyncClient``, default transport), ``httpx-aiohttp``
(httpx's API over the ``httpx_aiohttp.AiohttpTransport``), ``aiohttp`` (``aiohttp.ClientSession``
directly).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

STACKS = ("httpx", "httpx-aiohttp", "aiohttp")
"""Client stacks the proxy can be built on."""

_MAX_CONNECTIONS = 1000

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def _httpx_client(stack: str) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=_MAX_CONNECTIONS, max_keepalive_connections=_MAX_CONNECTIONS
    )
    timeout = httpx.Timeout(60.0, connect=2.0)
    if stack == "httpx":
        return httpx.AsyncClient(limits=limits, timeout=timeout)
    from httpx_aiohttp import AiohttpTransport

    return httpx.AsyncClient(transport=AiohttpTransport(limits=limits), timeout=timeout)


def build_app(stack: str, upstream: str) -> Starlette:
    """A Starlette app relaying completions to ``upstream`` through client stack ``stack``."""
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r} (known: {', '.join(STACKS)})")
    clients: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if stack == "aiohttp":
            connector = aiohttp.TCPConnector(limit=_MAX_CONNECTIONS)
            session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=60.0)
            )
            clients["client"] = session
            yield
            await session.close()
        else:
            async with _httpx_client(stack) as client:
                clients["client"] = client
                yield

    async def relay_httpx(request: Request) -> Response:
        client: httpx.AsyncClient = clients["client"]
        body = await request.body()
        upstream_req = client.build_request(
            "POST",
            upstream + request.url.path,
            content=body,
            headers={"content-type": "application/json"},
        )
        resp = await client.send(upstream_req, stream=True)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        media = resp.headers.get("content-type", "application/json")
        return StreamingResponse(chunks(), status_code=resp.status_code, media_type=media)

    async def relay_aiohttp(request: Request) -> Response:
        session: aiohttp.ClientSession = clients["client"]
        body = await request.body()
        resp = await session.post(
            upstream + request.url.path, data=body, headers={"content-type": "application/json"}
        )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.release()

        media = resp.headers.get("content-type", "application/json")
        return StreamingResponse(chunks(), status_code=resp.status, media_type=media)

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    relay: Handler = relay_aiohttp if stack == "aiohttp" else relay_httpx
    routes = [
        Route("/v1/completions", relay, methods=["POST"]),
        Route("/v1/chat/completions", relay, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bare streaming proxy for client-stack benchmarks")
    parser.add_argument("--stack", choices=STACKS, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    app = build_app(args.stack, args.upstream.rstrip("/"))
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
