"""The poller's pure pieces: backoff after failures, rate-limited logging, and when the
pollers themselves are behind (the gateway was not scheduled)."""

from __future__ import annotations

import logging
import random

import pytest

from sal_gateway.config import RoutingConfig
from sal_gateway.poller import (
    LOG_EVERY_S,
    _RateLimitedLog,
    backoff_s,
    longest_wait_s,
    pollers_behind,
)
from sal_gateway.state import BackendState


def test_backoff_grows_from_the_interval_and_is_capped() -> None:
    rng = random.Random(1)
    healthy = [backoff_s(0.1, 0, 2.0, rng) for _ in range(200)]
    assert all(0.09 <= w <= 0.11 for w in healthy)  # +-10% jitter while polls succeed
    for failures in range(1, 40):
        waits = [backoff_s(0.1, failures, 2.0, rng) for _ in range(50)]
        expected = min(2.0, 0.1 * 2 ** (failures - 1))
        assert all(expected * 0.5 <= w <= expected for w in waits)
        assert len(set(waits)) > 1  # jittered: pollers of many backends do not synchronise


def test_backoff_never_polls_less_often_than_the_interval_allows() -> None:
    # A cap below the interval cannot make a failing backend polled faster than a good one.
    assert backoff_s(5.0, 3, 1.0, random.Random(0)) >= 2.5


def test_first_retry_comes_no_later_than_a_normal_poll() -> None:
    rng = random.Random(2)
    assert all(backoff_s(0.1, 1, 2.0, rng) <= 0.1 for _ in range(100))


def test_repeated_failures_are_logged_once_per_period(caplog: pytest.LogCaptureFixture) -> None:
    log = _RateLimitedLog()
    with caplog.at_level(logging.WARNING, logger="sal_gateway.poller"):
        for i in range(100):
            log.warning(("http://a:1", "timeout"), i * 0.1, "poll of a timed out")
        log.warning(("http://a:1", "schema"), 0.0, "other reason, logged at once")
        log.warning(("http://a:1", "timeout"), 100 * 0.1 + LOG_EVERY_S, "timed out again")
    assert [r.getMessage() for r in caplog.records] == [
        "poll of a timed out",
        "other reason, logged at once",
        "timed out again (99 similar since last logged)",
    ]


@pytest.mark.parametrize("failures", [0, 1, 2, 5, 40])
@pytest.mark.parametrize(("interval_s", "max_s"), [(0.1, 2.0), (5.0, 1.0), (0.05, 0.05)])
def test_longest_wait_bounds_every_backoff_and_is_reached(
    failures: int, interval_s: float, max_s: float
) -> None:
    # The forwarder judges "the pollers are not running" by it: a wait the poller really
    # takes must never look overdue, and the bound must not be loose enough to hide a stall.
    rng = random.Random(failures)
    waits = [backoff_s(interval_s, failures, max_s, rng) for _ in range(2000)]
    bound = longest_wait_s(interval_s, failures, max_s)
    assert max(waits) <= bound
    assert max(waits) > 0.95 * bound


ROUTING = RoutingConfig(poll_interval_s=0.1, poll_timeout_s=0.5, poll_backoff_max_s=2.0)
"""A healthy backend's next outcome is due within 0.11 + 0.5 + 0.1 s of its last; a failing
one's within its backoff (at most 2 s) + 0.6 s."""


def _backend(url: str, last_outcome_s: float | None, failures: int = 0) -> BackendState:
    return BackendState(url, last_outcome_s=last_outcome_s, consecutive_failures=failures)


def test_pollers_are_not_behind_while_outcomes_come_on_time() -> None:
    healthy = [_backend("http://a:1", 10.0), _backend("http://b:1", 10.05)]
    assert not pollers_behind(healthy, 10.6, ROUTING)
    # A fleet that is down: failing polls come less often, each on its backoff. Its requests
    # get their 503 at once instead of waiting for a poll round.
    down = [_backend("http://a:1", 10.0, failures=9), _backend("http://b:1", 9.0, failures=9)]
    assert not pollers_behind(down, 11.5, ROUTING)
    assert not pollers_behind([_backend("http://a:1", None)], 100.0, ROUTING)  # never polled


def test_one_overdue_poller_is_behind_even_beside_a_fresh_failure() -> None:
    # The gateway was not scheduled for 3 s: the frozen replica's poll, in flight meanwhile,
    # timed out and was booked the moment it ran again, but the healthy replica's next poll
    # has not come back yet. Its state only looks stale (a CI run answered 503 so).
    frozen = _backend("http://a:1", 13.0, failures=5)
    healthy = _backend("http://b:1", 10.0)
    assert pollers_behind([frozen, healthy], 13.0, ROUTING)
    assert not pollers_behind([frozen], 13.0, ROUTING)
    assert pollers_behind([_backend("http://a:1", 10.0, failures=5)], 12.7, ROUTING)
