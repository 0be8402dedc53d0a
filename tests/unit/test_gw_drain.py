"""The drain state and what the server does with a stop signal (`sal_gateway.drain`,
`sal_gateway.server`); the whole sequence against real processes is
`tests/integration/test_gw_drain.py`."""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn

from sal_gateway.drain import Drain, GatewayShutdown
from sal_gateway.errors import error_body
from sal_gateway.server import DrainingServer


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not served")


def _server(delay_s: float) -> tuple[DrainingServer, Drain]:
    drain = Drain()
    return DrainingServer(uvicorn.Config(_app, timeout_graceful_shutdown=1), drain, delay_s), drain


def test_only_a_cancellation_while_draining_is_the_shutdown() -> None:
    drain = Drain()
    assert not drain.is_shutdown(asyncio.CancelledError())
    drain.begin()
    first = drain.began_s
    drain.begin()
    assert drain.began_s == first  # the first signal counts
    assert drain.is_shutdown(asyncio.CancelledError())
    assert not drain.is_shutdown(TimeoutError())
    error = drain.error()
    assert isinstance(error, GatewayShutdown)
    assert error.status == 503
    assert error_body(error)["error"]["code"] == "gateway_shutdown"


def test_the_signal_drains_first_and_stops_the_server_after_the_delay() -> None:
    server, drain = _server(0.3)
    server.handle_exit(signal.SIGTERM, None)
    assert drain.draining  # /ready says so at once
    assert not server.should_exit  # still serving
    deadline = time.monotonic() + 5.0
    while not server.should_exit:
        assert time.monotonic() < deadline, "the delay never ended"
        time.sleep(0.02)


def test_a_second_signal_during_the_delay_stops_at_once() -> None:
    server, drain = _server(30.0)
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    assert drain.draining


def test_without_a_delay_the_signal_stops_at_once() -> None:
    server, drain = _server(0.0)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    assert drain.draining
