"""The herding scenario shared by the tests of gateways that tell each other what they routed
(`listen.workers` sharing memory: test_gw_workers.py; `peers` over UDP: test_gw_peers.py).

Two fake backends a and b. Gateway X holds `LONG_STREAMS` long streams; while they are
routed b reports a deep queue, so they all land on a. Then b reports the same idle queue as
a, and `SHORT_REQUESTS` short requests go through gateway Y: SAL's loads tie, so the
requests in flight decide. A Y that knows X's streams sends every one to b; a Y that does
not sends every one to a (the first on a tie): it herds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx

from tests.fault_support import FakeProc
from tests.gateway_support import metric, scrape_metrics

LONG_STREAMS = 4
SHORT_REQUESTS = 8


def short_body(i: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": [1] * (10 + i), "max_tokens": 4, "ignore_eos": True}


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _hold_stream(url: str, gone: threading.Event, backends: list[str]) -> None:
    """A stream that runs until `gone` is set (the client then leaves) or its gateway dies."""
    body = {"model": "tiny", "prompt": "long", "max_tokens": 1000, "stream": True}
    with (
        contextlib.suppress(httpx.RemoteProtocolError),  # the gateway was SIGKILLed
        httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60.0) as resp,
    ):
        backends.append(resp.headers.get("x-fake-backend", "?"))
        for _ in resp.iter_lines():
            if gone.is_set():
                return


def slow_backends(a: FakeProc, b: FakeProc) -> None:
    """Both stream slowly; b reports a deep queue (so the held streams go to a)."""
    a.fault(chunk_delay_s=0.2)
    b.fault(chunk_delay_s=0.2, stats={"queued_prefill_tokens": 100_000, "num_waiting": 50})


@contextlib.contextmanager
def streams_held_on_a(hold_via: str, b: FakeProc, observer: str) -> Iterator[None]:
    """`LONG_STREAMS` streams through `hold_via`, all on a (asserted), then b reports an
    idle queue and `observer` (the gateway about to route) has seen it; the streams end
    when the block does."""
    gone = threading.Event()
    held: list[str] = []
    threads = [
        threading.Thread(target=_hold_stream, args=(hold_via, gone, held), daemon=True)
        for _ in range(LONG_STREAMS)
    ]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len(held) == LONG_STREAMS, 30, f"streams held: {held}")
        assert held == ["a"] * LONG_STREAMS  # b looked busy
        b.fault(stats={"queued_prefill_tokens": 0, "num_waiting": 0})
        wait_until(
            lambda: (
                not metric(
                    scrape_metrics(observer), "sal_backend_queued_prefill_tokens", backend=b.url
                )
            ),
            30,
            "the routing gateway never saw b idle",
        )
        time.sleep(0.3)  # a few more polls: every snapshot settled
        yield
    finally:
        gone.set()
        for thread in threads:
            thread.join(timeout=30)


def route_short_requests(url: str) -> list[str | None]:
    """`SHORT_REQUESTS` short requests through `url`, one after another: the backend each
    went to."""
    chosen = []
    with httpx.Client(timeout=30.0) as client:
        for i in range(SHORT_REQUESTS):
            resp = client.post(f"{url}/v1/completions", json=short_body(i))
            assert resp.status_code == 200, resp.text
            chosen.append(resp.headers.get("x-fake-backend"))
    return chosen
