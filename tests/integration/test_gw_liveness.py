"""Pollers and liveness over real sockets: a frozen engine behind a live API server, slow and
malformed ``/stats``, flapping, a blocked main loop, and no poll thread left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from engine_sim.fake_vllm import FakeBackend, default_stats
from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

LIVENESS: dict[str, Any] = {
    "policy": "round_robin",
    "poll_interval_s": 0.05,
    "poll_timeout_s": 0.5,
    "stale_after_s": 1.0,
    "eject_after_failures": 1000,  # staleness, not ejection, is under test here
    "poll_backoff_max_s": 0.2,
}


def _complete(url: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=30.0,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
    )


def _healthy(rig: Rig, index: int) -> float | None:
    return metric(rig.metrics(), "sal_backend_healthy", backend=rig.served[index].url)


def _errors_reach(rig: Rig, reason: str, count: int) -> Callable[[], bool]:
    """Whether backend 0's poll errors for `reason` reached `count` (for `wait_until`)."""
    return lambda: _poll_errors(rig, 0, reason) >= count


def _poll_errors(rig: Rig, index: int, reason: str) -> float:
    value = metric(
        rig.metrics(), "sal_poll_errors_total", backend=rig.served[index].url, reason=reason
    )
    return value or 0.0


def test_frozen_engine_becomes_ineligible_within_stale_after_and_returns() -> None:
    with gateway_rig(2, routing=LIVENESS) as rig:
        a: FakeBackend = rig.fakes[0]
        a.behaviour.engine_frozen = True  # /stats keeps answering, with the last snapshot
        frozen_at = time.monotonic()
        wait_until(lambda: _healthy(rig, 0) == 0.0)
        # Generous bound (a busy CI box): stale_after_s is 1 s.
        assert time.monotonic() - frozen_at < 1.0 + 2.0
        polls = a.stats_polls
        before = a.generation_requests
        assert {_complete(rig.url).json()["backend"] for _ in range(6)} == {"b"}
        assert a.generation_requests == before  # no black hole
        wait_until(lambda: a.stats_polls > polls)  # its API server is still polled, answers
        text = rig.metrics()
        age = metric(text, "sal_backend_progress_age_seconds", backend=rig.served[0].url)
        assert age is not None
        assert age > 1.0
        assert _poll_errors(rig, 0, "no_progress") > 0
        a.behaviour.engine_frozen = False
        wait_until(lambda: _healthy(rig, 0) == 1.0)
        assert "a" in {_complete(rig.url).json()["backend"] for _ in range(4)}


def test_busy_engine_is_eligible_while_it_steps_and_not_when_frozen() -> None:
    with gateway_rig(2, routing=LIVENESS) as rig:
        a = rig.fakes[0]
        a.stats = dataclasses.replace(a.stats, num_running=3)  # busy: step advances per read
        wait_until(lambda: _healthy(rig, 0) == 1.0)  # busy, stepping: eligible
        a.behaviour.engine_frozen = True
        wait_until(lambda: _healthy(rig, 0) == 0.0)


def test_slow_stats_within_the_timeout_is_fine_beyond_it_is_stale() -> None:
    with gateway_rig(2, routing=LIVENESS) as rig:
        a = rig.fakes[0]
        a.behaviour.stats_delay_s = 0.2
        time.sleep(1.5)
        assert _healthy(rig, 0) == 1.0
        assert _poll_errors(rig, 0, "timeout") == 0.0
        a.behaviour.stats_delay_s = 2.0  # past poll_timeout_s
        wait_until(lambda: _healthy(rig, 0) == 0.0)
        wait_until(lambda: _poll_errors(rig, 0, "timeout") > 0)
        a.behaviour.stats_delay_s = 0.0
        wait_until(lambda: _healthy(rig, 0) == 1.0)


def _nan_body() -> bytes:
    body = default_stats().to_dict()
    body["time"] = "__NAN__"
    return json.dumps(body).replace('"__NAN__"', "NaN").encode()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(b"[" * 200_000 + b"]" * 200_000, "bad_body", id="deeply-nested"),
        pytest.param(_nan_body(), "bad_body", id="nan"),
        pytest.param(b'{"schema": "sal-stats/2", "time": 1}', "schema", id="wrong-schema"),
        pytest.param(b'{"schema": "sal-stats/1", "time": 1.0}', "schema", id="missing-fields"),
        pytest.param(b"[1, 2, 3]", "schema", id="not-an-object"),
        pytest.param(b"\xff\xfe garbage", "bad_body", id="not-json"),
        pytest.param(b" " * (5 * 1024 * 1024), "bad_body", id="5-MiB"),
    ],
)
def test_malformed_stats_is_counted_and_the_poller_survives(body: bytes, reason: str) -> None:
    with gateway_rig(2, routing=LIVENESS) as rig:
        a = rig.fakes[0]
        a.behaviour.stats_raw_body = body
        wait_until(lambda: _poll_errors(rig, 0, reason) >= 3)  # it keeps polling
        wait_until(lambda: _healthy(rig, 0) == 0.0)
        assert {_complete(rig.url).json()["backend"] for _ in range(4)} == {"b"}
        a.behaviour.stats_raw_body = None
        wait_until(lambda: _healthy(rig, 0) == 1.0)  # the same poll task is still alive
        assert httpx.get(f"{rig.url}/health").status_code == 200


def test_nan_in_stock_vllm_metrics_is_counted_and_the_poller_survives() -> None:
    with gateway_rig(2, routing=LIVENESS) as rig:
        a = rig.fakes[0]
        a.behaviour.stats_status = 404  # stock vLLM: /metrics fallback
        wait_until(
            lambda: (
                metric(rig.metrics(), "sal_backend_stats_source", backend=rig.served[0].url,
                       source="metrics") == 1.0
            )
        )  # fmt: skip
        a.metrics_kv_usage = float("nan")
        wait_until(lambda: _poll_errors(rig, 0, "schema") >= 3)
        wait_until(lambda: _healthy(rig, 0) == 0.0)
        a.metrics_kv_usage = 0.5
        wait_until(lambda: _healthy(rig, 0) == 1.0)


def test_unexpected_exception_is_counted_as_internal_and_polling_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sal_gateway.poll_fetch as poller_module

    real = poller_module.parse_stats
    failing = threading.Event()

    def parse(obj: object) -> Any:
        if failing.is_set():
            raise ZeroDivisionError("a bug in the parser")
        return real(obj)

    monkeypatch.setattr(poller_module, "parse_stats", parse)
    with gateway_rig(2, routing=LIVENESS) as rig:
        failing.set()
        wait_until(lambda: _poll_errors(rig, 0, "internal") >= 3)
        failing.clear()
        wait_until(lambda: _healthy(rig, 0) == 1.0 and _healthy(rig, 1) == 1.0)


def test_flapping_stats_never_kills_the_poller() -> None:
    with gateway_rig(2, routing=LIVENESS) as rig:
        a = rig.fakes[0]
        # Each flap lasts until the poller has seen it (a busy machine may poll late; a
        # fixed sleep could miss a whole 500 phase).
        for flap in range(1, 7):
            a.behaviour.stats_status = 500
            wait_until(_errors_reach(rig, "http_status", flap))
            a.behaviour.stats_status = 200
            wait_until(lambda: _healthy(rig, 0) == 1.0)
        assert _poll_errors(rig, 0, "http_status") >= 6
        assert all(_complete(rig.url).status_code == 200 for _ in range(4))


def test_blocked_main_loop_does_not_stop_polls_nor_age_state() -> None:
    # A request path saturating the event loop, at its extreme: the loop does nothing for
    # 1.5 s (> stale_after_s). Polls go on on their own thread, and results are stamped when
    # received there, so the state is fresh the moment the loop runs again.
    with gateway_rig(2, routing=LIVENESS) as rig:
        loop = rig.runtime.poller._main_loop
        assert loop is not None
        a = rig.fakes[0]
        polls = a.stats_polls

        async def block() -> None:
            time.sleep(1.5)  # noqa: ASYNC251 - blocking the loop is the point

        asyncio.run_coroutine_threadsafe(block(), loop)
        time.sleep(1.5)
        assert a.stats_polls - polls >= 5  # polled at ~20 Hz while the loop was stuck
        ready = httpx.get(f"{rig.url}/ready", timeout=10.0)
        assert ready.status_code == 200, ready.text
        assert all(_complete(rig.url).status_code == 200 for _ in range(4))


def test_poll_thread_and_tasks_end_with_the_gateway() -> None:
    def pollers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "sal-poller"]

    before = len(pollers())
    with gateway_rig(2, routing=LIVENESS) as rig:
        assert len(pollers()) == before + 1
        assert rig.runtime.poller.polled() == {(MODEL, s.url) for s in rig.served}
    wait_until(lambda: len(pollers()) == before, timeout_s=10.0)


SLOW_POLLS: dict[str, Any] = {
    **LIVENESS,
    "policy": "sal",
    "poll_interval_s": 0.05,
    "poll_timeout_s": 6.0,
    "stale_after_s": 1.0,
}
"""With `STATS_DELAY_S`: polls that succeed but arrive 3 s after they were sent (both
backends' `/stats` delayed, as on a host so busy that every poll comes late)."""

STATS_DELAY_S = 3.0
"""Each backend is stale 2 s of every 3 s, so both are at once for at least 0.5 s of each
cycle whatever their pollers' phases (with 1.5 s, a third of the time each: a drift of the
phases past 0.5 s, on a loaded machine, left no moment with both stale)."""


def _routed_while_both_stale(rig: Rig, attempts: int, ready: list[int] | None = None) -> list[int]:
    """Statuses of `attempts` requests, each sent once the gateway shows both backends stale
    (and of `/ready` asked just before each, into `ready`)."""
    statuses = []
    for _ in range(attempts):
        wait_until(lambda: _healthy(rig, 0) == 0.0 and _healthy(rig, 1) == 0.0, 30.0)
        if ready is not None:
            ready.append(httpx.get(f"{rig.url}/ready", timeout=10.0).status_code)
        statuses.append(_complete(rig.url).status_code)
    return statuses


def _degraded(rig: Rig) -> float:
    text = rig.metrics()
    return sum(metric(text, "sal_degraded_routes_total", backend=s.url) or 0.0 for s in rig.served)


def test_every_backend_a_little_stale_at_once_still_routes_degraded() -> None:
    with gateway_rig(2, routing=SLOW_POLLS) as rig:
        for fake in rig.fakes:
            fake.behaviour.stats_delay_s = STATS_DELAY_S
        ready: list[int] = []
        assert set(_routed_while_both_stale(rig, 5, ready)) == {200}
        assert _degraded(rig) >= 1  # at least one of them found no eligible backend
        assert set(ready) == {200}  # still ready: it routes
    # The same fleet without degraded routing: 503s, and not ready meanwhile.
    with gateway_rig(2, routing={**SLOW_POLLS, "degraded_max_progress_age_s": 0}) as rig:
        for fake in rig.fakes:
            fake.behaviour.stats_delay_s = STATS_DELAY_S
        ready = []
        assert 503 in _routed_while_both_stale(rig, 5, ready)
        assert 503 in ready


def test_degraded_routing_leaves_out_an_engine_frozen_longer_than_its_peer() -> None:
    with gateway_rig(2, routing=SLOW_POLLS) as rig:
        a, b = rig.fakes
        for fake in rig.fakes:
            fake.behaviour.stats_delay_s = STATS_DELAY_S
        a.behaviour.engine_frozen = True
        # a's last progress falls more than stale_after_s behind b's within a few polls.
        time.sleep(5.0)
        before = a.generation_requests, b.generation_requests
        degraded_before = _degraded(rig)
        assert set(_routed_while_both_stale(rig, 4)) == {200}
        assert a.generation_requests == before[0]  # never the frozen engine
        assert b.generation_requests == before[1] + 4
        assert _degraded(rig) > degraded_before
    # Nothing progressed within the bound: a 503, not a request into a black hole.
    with gateway_rig(2, routing={**SLOW_POLLS, "degraded_max_progress_age_s": 3.0}) as rig:
        for fake in rig.fakes:
            fake.behaviour.engine_frozen = True
        wait_until(lambda: _healthy(rig, 0) == 0.0 and _healthy(rig, 1) == 0.0, 30.0)
        time.sleep(3.5)
        response = _complete(rig.url)
        assert response.status_code == 503
        assert response.json()["error"]["type"]
