"""A connect timeout that only a stall of the gateway's own process caused is not the backend's.

When the gateway's process is not scheduled (a CPU-throttled container, a full run queue), a
connect it had begun completes in the kernel meanwhile, and its timer comes due too. When the
loop runs again it runs the overdue timer before the task the connection woke: aiohttp
reports a connect timeout to a healthy backend. Before this was told apart the backend was
marked suspect and the request retried elsewhere: with one replica, a 502, and 503s until the
next poll.

The stall is injected where a real one hurts: the loop is blocked (``time.sleep``, as if the
process were stopped) right after the gateway begins a connect to the backend, through the
upstream session's own connect-start hook. The backend is the fake vLLM server in its own
thread, whose socket the kernel keeps accepting on: the fault is in the gateway's loop, which
no backend can tell apart. A SIGSTOP of a gateway process cannot be aimed at a loopback
connect (it completes in microseconds); `tests/integration/test_faults_real.py` stops a real
gateway process for the header and idle bounds, which the same stall rule guards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest

from engine_sim.fake_vllm import FakeBackend, ServedApp, ServedBackend
from sal_gateway import upstream
from sal_gateway.app import create_app
from sal_gateway.stall_guard import STALL_S
from tests.gw_fake_support import MODEL, gateway_config, metric, wait_until

CONNECT_TIMEOUT_S = 1.0
STALL_FOR_S = CONNECT_TIMEOUT_S + STALL_S + 1.0
"""Long enough that the connect bound's timer runs well past due."""


class ConnectStalls:
    """Stalls the gateway's loop for `STALL_FOR_S` right after each of the next `armed`
    connects to a backend begins (queued behind the connect, as a stall that strikes then)."""

    def __init__(self) -> None:
        self.armed = 0
        self.stalled = 0
        self._original = upstream._note_connect_start

    async def hook(self, session: object, ctx: SimpleNamespace, params: object) -> None:
        await self._original(session, ctx, params)  # type: ignore[arg-type]
        if self.armed > 0:
            self.armed -= 1
            self.stalled += 1
            asyncio.get_running_loop().call_soon(time.sleep, STALL_FOR_S)


@contextmanager
def _stall_rig(
    monkeypatch: pytest.MonkeyPatch, poll_interval_s: float = 2.0
) -> Iterator[tuple[str, FakeBackend, str, ConnectStalls]]:
    stalls = ConnectStalls()
    # Before the app exists: its lifespan builds the upstream session with this hook.
    monkeypatch.setattr(upstream, "_note_connect_start", stalls.hook)
    backend = FakeBackend(name="a", model=MODEL)
    with ServedBackend(backend) as backend_url:
        # One backend, polled rarely: had the timeout marked it suspect, the request would
        # have had nowhere else to go (502), and the next ones none until a poll (503).
        config = gateway_config(
            [backend_url],
            routing={"poll_interval_s": poll_interval_s, "stale_after_s": 120.0},
            proxy={"connect_timeout_s": CONNECT_TIMEOUT_S},
            extra={"models": [{"models_refresh_s": 3600.0}]},
        )
        with ServedApp(create_app(config), lifespan=True) as url:
            wait_until(lambda: httpx.get(f"{url}/ready", timeout=5.0).status_code == 200, 60)
            # The model list was read at startup on the pooled session: wait until the pool
            # drops that connection, so the request under test opens a new one.
            time.sleep(upstream.POOL_KEEPALIVE_S + 0.5)
            yield url, backend, backend_url, stalls


@pytest.mark.parametrize("stream", [False, True])
def test_a_connect_cut_by_a_stall_of_the_gateway_is_retried_on_the_same_backend(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    with _stall_rig(monkeypatch) as (url, backend, backend_url, stalls):
        stalls.armed = 1
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
        assert answer.status_code == 200, answer.text
        if stream:
            assert b"[DONE]" in answer.content
        assert stalls.stalled == 1  # the stall really struck the connect
        assert backend.generation_requests == 1  # it reached the backend exactly once
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
        assert metric(text, "sal_retries_total", backend=backend_url) == 1.0
        assert metric(text, "sal_backend_healthy", backend=backend_url) == 1.0
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
        assert again.status_code == 200, again.text  # and it stayed a candidate


def test_a_stall_on_the_retry_too_counts_against_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Forgiven once per request: a loop that stalls at every connect cannot keep a backend
    # that never answers a candidate for ever; the second timeout is the backend's.
    # A good poll lifts the suspect mark (the backend answers again), and after a 2.5 s stall
    # the poll timer is overdue: polled every 2 s, a poll could land between the 502 and the
    # scrape (it did on a loaded CI machine). Polled once a minute, none lands in this test.
    with _stall_rig(monkeypatch, poll_interval_s=60.0) as (url, backend, backend_url, stalls):
        stalls.armed = 2
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
        assert failed.status_code == 502, failed.text
        assert "after 1 attempt" in failed.text
        assert stalls.stalled == 2
        assert backend.generation_requests == 0
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
        assert metric(text, "sal_backend_healthy", backend=backend_url) == 0.0  # suspect
