"""The state table: local accounting between polls, staleness, ejection and re-admission."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sim.fake_vllm import default_stats
from sal_core.policies import BackendView
from sal_gateway.state import StateTable, Ticket, cap_budgets, shows_progress

A, B = "http://a:1", "http://b:1"


class FakeClock:
    """The gateway's monotonic clock, set by hand."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def _table(clock: FakeClock | None = None) -> StateTable:
    table = StateTable(
        stale_after_s=1.0,
        eject_after_failures=3,
        accounting_grace_s=0.05,
        clock=clock or FakeClock(),
    )
    table.add_backend("m", A)
    table.add_backend("m", B)
    return table


def test_unpolled_backends_are_unknown_not_idle() -> None:
    table = _table()
    assert [v.eligible for v in table.views("m", 0.0)] == [False, False]
    assert not table.is_ready(0.0)


def test_good_poll_makes_eligible_until_stale() -> None:
    table = _table()
    table.record_poll_success("m", A, default_stats(), "stats", now_s=10.0)
    assert [v.eligible for v in table.views("m", 10.5)] == [True, False]
    assert table.is_ready(10.5)
    # State older than stale_after_s is unknown again.
    assert [v.eligible for v in table.views("m", 11.01)] == [False, False]
    assert not table.is_ready(11.01)


def test_routing_accounts_tokens_until_a_snapshot_written_after_them_arrives() -> None:
    clock = FakeClock(0.0)
    table = _table(clock)
    stats = dataclasses.replace(
        default_stats(), free_kv_tokens=1000, queued_prefill_tokens=50, num_running=7
    )
    table.record_poll_success("m", A, stats, "stats", now_s=0.0)
    clock.now_s = 0.05
    t1 = table.route("m", A, 300)
    t2 = table.route("m", A, 900)
    view = table.views("m", 0.1)[0]
    assert view.in_flight == 2
    assert view.num_running == 7  # as polled: SAL's memory term divides by it
    assert view.queued_prefill_tokens == 50 + 300 + 900
    assert view.free_kv_tokens == 0  # floored, never negative
    # A poll read live after both requests (and their transit) replaces both numbers: the
    # engine counts those requests itself now.
    table.record_poll_success("m", A, stats, "stats", now_s=0.2)
    view = table.views("m", 0.2)[0]
    assert (view.queued_prefill_tokens, view.free_kv_tokens, view.in_flight) == (50, 1000, 2)
    StateTable.release(t1)
    StateTable.release(t1)  # idempotent
    StateTable.release(t2)
    assert table.views("m", 0.2)[0].in_flight == 0


def test_ejection_after_n_failures_and_readmission_on_good_poll() -> None:
    table = _table()
    table.record_poll_success("m", A, default_stats(), "stats", now_s=0.0)
    assert not table.record_poll_failure("m", A)
    assert not table.record_poll_failure("m", A)
    assert table.views("m", 0.1)[0].eligible  # two failures: still fresh and admitted
    assert table.record_poll_failure("m", A)  # third: ejected (reported once)
    assert not table.record_poll_failure("m", A)
    assert not table.views("m", 0.1)[0].eligible
    assert table.record_poll_success("m", A, default_stats(), "stats", now_s=0.2)
    assert table.views("m", 0.2)[0].eligible


def test_suspect_backend_is_avoided_until_next_good_poll() -> None:
    table = _table()
    table.record_poll_success("m", A, default_stats(), "stats", now_s=0.0)
    table.mark_suspect("m", A)
    assert not table.views("m", 0.1)[0].eligible
    table.record_poll_success("m", A, default_stats(), "stats", now_s=0.2)
    assert table.views("m", 0.2)[0].eligible


def test_metrics_fallback_uses_own_in_flight_prefill_tokens_as_queue() -> None:
    table = _table()
    stats = dataclasses.replace(default_stats(), queued_prefill_tokens=0, max_num_batched_tokens=0)
    table.record_poll_success("m", A, stats, "metrics", now_s=0.0)
    ticket = table.route("m", A, 400)
    table.record_poll_success("m", A, stats, "metrics", now_s=0.1)
    view = table.views("m", 0.1)[0]
    assert view.queued_prefill_tokens == 400  # still waiting for its first byte
    assert view.max_num_batched_tokens == 2048  # configured fallback budget
    StateTable.first_byte(ticket)
    assert table.views("m", 0.1)[0].queued_prefill_tokens == 0
    StateTable.release(ticket)
    assert table.views("m", 0.1)[0].queued_prefill_tokens == 0


def test_a_stats_backend_cannot_report_less_queue_than_its_unstarted_streams() -> None:
    # A replica whose /stats says "idle" while two of our streams wait there for their
    # first token: it must not look idle to SAL (it would draw every request).
    table = _table()
    lying = dataclasses.replace(default_stats(), queued_prefill_tokens=0)
    table.record_poll_success("m", A, lying, "stats", now_s=0.0)
    streams = [table.route("m", A, 500, sent_s=0.0, streamed=True) for _ in range(2)]
    whole = table.route("m", A, 300, sent_s=0.0)  # not streamed: its first byte comes last
    table.record_poll_success("m", A, lying, "stats", now_s=0.2)  # acknowledges all three
    assert table.views("m", 0.2)[0].queued_prefill_tokens == 1000
    StateTable.first_byte(streams[0])
    assert table.views("m", 0.2)[0].queued_prefill_tokens == 500
    StateTable.release(streams[1])
    assert table.views("m", 0.2)[0].queued_prefill_tokens == 0
    # An honest report above the floor is what counts.
    busy = dataclasses.replace(default_stats(), queued_prefill_tokens=4000, num_waiting=2)
    table.record_poll_success("m", A, busy, "stats", now_s=0.3)
    table.route("m", A, 500, sent_s=0.3, streamed=True)
    assert table.views("m", 0.3)[0].queued_prefill_tokens == 4500
    StateTable.release(whole)


def test_removed_backend_leaves_pool_but_its_tickets_still_release() -> None:
    table = _table()
    table.record_poll_success("m", A, default_stats(), "stats", now_s=0.0)
    ticket = table.route("m", A, 10)
    removed = table.remove_backend("m", A)
    assert removed is not None
    assert [v.url for v in table.views("m", 0.0)] == [B]
    StateTable.release(ticket)
    assert removed.in_flight == 0
    assert table.record_poll_failure("m", A) is False  # late poll result is ignored
    assert table.add_backend("m", B) is False


@settings(deadline=None)  # a busy shared CI box must not turn slowness into failure
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "stream", "first_byte", "release", "poll"]),
            st.integers(0, 5),
            st.integers(0, 5000),
        ),
        max_size=60,
    )
)
def test_accounting_invariants_hold_for_any_sequence(ops: list[tuple[str, int, int]]) -> None:
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    table.add_backend("m", A)
    stats = dataclasses.replace(default_stats(), free_kv_tokens=3000, queued_prefill_tokens=7)
    table.record_poll_success("m", A, stats, "metrics", now_s=0.0)
    tickets = []
    for op, index, tokens in ops:
        if op in ("route", "stream"):
            tickets.append(table.route("m", A, tokens, streamed=op == "stream"))
        elif op == "poll":
            table.record_poll_success("m", A, stats, "metrics", now_s=0.0)
        elif tickets:
            ticket = tickets[index % len(tickets)]
            (StateTable.first_byte if op == "first_byte" else StateTable.release)(ticket)
        backend = table.backends("m")[0]
        live = [t for t in tickets if not t.released]
        assert backend.in_flight == len(live)
        assert backend.prefill_pending_tokens == sum(
            t.prompt_tokens for t in live if not t.first_byte_seen
        )
        assert backend.stream_pending_tokens == sum(
            t.prompt_tokens for t in live if t.streamed and not t.first_byte_seen
        )
        view = table.views("m", 0.0)[0]
        assert 0 <= view.free_kv_tokens <= 3000
        assert view.queued_prefill_tokens == backend.prefill_pending_tokens


# Liveness: judged by the engine's own progress ----------------------------------------------


def _snap(time_s: float, step: int = 0, running: int = 0) -> Any:
    return dataclasses.replace(default_stats(), time=time_s, step=step, num_running=running)


@pytest.mark.parametrize("skew_s", [0.0, 3600.0, -3600.0])
def test_engine_frozen_behind_a_live_api_server_goes_ineligible(skew_s: float) -> None:
    # The engine's clock is off by `skew_s`: only its advance between polls matters.
    table = _table()
    table.record_poll_success("m", A, _snap(1000.0 + skew_s), "stats", now_s=0.0, wall_s=1000.0)
    table.record_poll_success("m", A, _snap(1000.1 + skew_s), "stats", now_s=0.1, wall_s=1000.1)
    # From now on the API server serves the same snapshot: polls succeed, nothing advances.
    for i in range(2, 12):
        t = i / 10
        table.record_poll_success("m", A, _snap(1000.1 + skew_s), "stats", now_s=t, wall_s=1000 + t)
    backend = table.backends("m")[0]
    assert backend.age_s(1.1) == 0.0  # polls are fresh...
    assert backend.progress_age_s(1.1) == pytest.approx(1.0)
    assert table.views("m", 1.1)[0].eligible  # ...and 1.0 s without progress is still ok
    table.record_poll_success("m", A, _snap(1000.1 + skew_s), "stats", now_s=1.2, wall_s=1001.2)
    assert not table.views("m", 1.2)[0].eligible  # 1.1 s > stale_after_s
    assert not table.is_ready(1.2)
    # The engine resumes: the next snapshot that advances re-admits it at once.
    table.record_poll_success("m", A, _snap(1001.3 + skew_s), "stats", now_s=1.3, wall_s=1001.3)
    assert table.views("m", 1.3)[0].eligible


def test_busy_engine_must_advance_its_step_not_only_its_heartbeat() -> None:
    table = _table()
    table.record_poll_success("m", A, _snap(0.0, step=5, running=2), "stats", now_s=0.0)
    for i in range(1, 13):  # the heartbeat moves, the step does not, requests are running
        table.record_poll_success("m", A, _snap(i / 10, step=5, running=2), "stats", now_s=i / 10)
    assert not table.views("m", 1.2)[0].eligible
    table.record_poll_success("m", A, _snap(1.3, step=6, running=2), "stats", now_s=1.3)
    assert table.views("m", 1.3)[0].eligible


def test_idle_engine_only_needs_its_heartbeat() -> None:
    table = _table()
    for i in range(30):  # an idle LARRY engine restamps every 0.2 s, polled every 0.1 s
        t = i / 10
        table.record_poll_success("m", A, _snap(0.2 * (i // 2)), "stats", now_s=t, wall_s=t)
        assert table.views("m", t)[0].eligible


def test_shows_progress_rule() -> None:
    assert shows_progress(None, _snap(5.0))
    assert not shows_progress(_snap(5.0), _snap(5.0))
    assert shows_progress(_snap(5.0), _snap(5.2))
    assert shows_progress(_snap(5.0), _snap(4.0))  # a restarted engine: a new series
    assert not shows_progress(_snap(5.0, 7, running=1), _snap(5.2, 7, running=1))
    assert shows_progress(_snap(5.0, 7, running=1), _snap(5.2, 8, running=1))


def test_metrics_fallback_counts_every_good_poll_as_progress() -> None:
    table = _table()
    stats = default_stats()
    for i in range(20):  # /metrics has no heartbeat: the same numbers every time
        table.record_poll_success("m", A, stats, "metrics", now_s=i / 10)
    assert table.views("m", 1.9)[0].eligible


# Accounting that does not forget ------------------------------------------------------------


def test_snapshot_written_before_a_request_does_not_clear_it() -> None:
    # The engine's clock is 1 h ahead of ours. Snapshots reach us 5-100 ms after they are
    # written; the freshest one seen anchors the skew estimate (an engine publishes after
    # every step, or every 0.2 s when idle, so some poll always finds a fresh one).
    clock = FakeClock()
    table = _table(clock)
    skew = 3600.0

    def poll(written_wall_s: float, received_s: float) -> None:
        stats = _snap(written_wall_s + skew)
        table.record_poll_success("m", A, stats, "stats", now_s=received_s, wall_s=received_s)

    poll(0.095, 0.1)  # (monotonic and wall clocks coincide here, for readability)
    clock.now_s = 0.15
    ticket = table.route("m", A, 700)
    poll(0.1, 0.2)  # written before the request was sent: must not clear it
    assert table.views("m", 0.2)[0].queued_prefill_tokens == 700
    poll(0.18, 0.28)  # written 30 ms after it: within the 50 ms grace, keeps counting
    assert table.views("m", 0.28)[0].queued_prefill_tokens == 700
    poll(0.3, 0.4)  # written 150 ms after it: the engine's own numbers include it now
    assert table.views("m", 0.4)[0].queued_prefill_tokens == 0
    StateTable.release(ticket)
    assert table.backends("m")[0].routed_tokens_since_poll == 0


def test_request_that_ended_before_any_snapshot_stops_counting() -> None:
    clock = FakeClock(1.0)
    table = _table(clock)
    table.record_poll_success("m", A, _snap(0.0), "stats", now_s=0.0, wall_s=0.0)
    ticket = table.route("m", A, 500)
    assert table.views("m", 1.0)[0].queued_prefill_tokens == 500
    StateTable.release(ticket)
    assert table.views("m", 1.0)[0].queued_prefill_tokens == 0
    table.record_poll_success("m", A, _snap(2.0), "stats", now_s=2.0, wall_s=2.0)
    assert table.backends("m")[0].routed_tokens_since_poll == 0  # not subtracted twice


def test_metrics_fallback_clears_only_requests_sent_before_the_poll() -> None:
    clock = FakeClock(0.0)
    table = _table(clock)
    table.record_poll_success("m", A, default_stats(), "metrics", now_s=0.0)
    clock.now_s = 0.5
    early = table.route("m", A, 100)
    clock.now_s = 0.62
    late = table.route("m", A, 40)  # sent after the poll below was sent
    table.record_poll_success("m", A, default_stats(), "metrics", now_s=0.65, sent_s=0.6)
    assert table.views("m", 0.65)[0].free_kv_tokens == 16000 - 40
    for t in (early, late):
        StateTable.release(t)


@settings(deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "release", "poll", "tick"]),
            st.integers(0, 20),
            st.integers(0, 3000),
        ),
        max_size=80,
    ),
    st.floats(-5000.0, 5000.0),
    st.lists(st.floats(0.0, 0.3), min_size=1, max_size=8),
)
def test_tickets_count_until_a_snapshot_can_include_them(
    ops: list[tuple[str, int, int]], skew_s: float, ages_s: list[float]
) -> None:
    """Never forgets, and bounded: with any engine clock skew and snapshot ages (the
    freshest of every few polls close to 0, as with an engine publishing every step), a live
    ticket counts exactly until a snapshot written `grace` after it was sent arrives."""
    clock = FakeClock(0.0)
    table = _table(clock)
    cutoffs: list[float] = []
    ages = [0.0, *ages_s]

    def poll() -> None:
        age = ages[len(cutoffs) % len(ages)]
        written = clock.now_s - age
        cutoffs.append(written - 0.05)
        stats = _snap(written + skew_s)
        table.record_poll_success("m", A, stats, "stats", now_s=clock.now_s, wall_s=clock.now_s)

    poll()
    tickets: list[Ticket] = []
    for op, index, amount in ops:
        if op == "route":
            tickets.append(table.route("m", A, amount))
        elif op == "release" and tickets:
            StateTable.release(tickets[index % len(tickets)])
        elif op == "poll":
            poll()
        else:
            clock.now_s += index / 100
        backend = table.backends("m")[0]
        live = [t for t in tickets if not t.released]
        counted = sum(t.prompt_tokens for t in live if not t.acked)
        assert backend.routed_tokens_since_poll == counted >= 0
        for t in live:
            covered = any(t.sent_s < c - 1e-6 for c in cutoffs)
            if not any(t.sent_s < c + 1e-6 for c in cutoffs):
                assert not t.acked  # no snapshot can include it: still counted
            elif covered:
                assert t.acked  # a snapshot includes it: not counted twice


def _progress(table: StateTable, url: str, now_s: float, heartbeat: float) -> None:
    """A poll at `now_s` whose snapshot shows the (idle) engine alive at `heartbeat`."""
    stats = dataclasses.replace(default_stats(), time=heartbeat, num_waiting=0, num_running=0)
    table.record_poll_success("m", url, stats, "stats", now_s=now_s)


def test_degraded_views_keep_the_freshest_backends_when_none_is_eligible() -> None:
    """A busy host makes both backends a little stale at once: both stay candidates for
    degraded routing. One engine frozen for longer than its peer: only the peer."""
    table = _table()
    _progress(table, A, 10.0, 100.0)
    _progress(table, B, 10.4, 100.4)
    now = 11.6  # both stale (> 1 s), neither eligible
    assert [v.eligible for v in table.views("m", now)] == [False, False]
    assert [v.eligible for v in table.degraded_views("m", now, 10.0)] == [True, True]
    # A's engine stops; B keeps progressing (its polls are late, but they come).
    _progress(table, B, 12.0, 102.0)
    now = 13.05
    assert [v.eligible for v in table.views("m", now)] == [False, False]
    assert [v.eligible for v in table.degraded_views("m", now, 10.0)] == [False, True]


def test_degraded_views_exclude_dead_suspect_and_long_frozen_backends() -> None:
    table = _table()
    _progress(table, A, 10.0, 100.0)
    _progress(table, B, 10.0, 100.0)
    table.mark_suspect("m", B)
    assert [v.eligible for v in table.degraded_views("m", 12.0, 10.0)] == [True, False]
    for _ in range(3):
        table.record_poll_failure("m", A)
    assert [v.eligible for v in table.degraded_views("m", 12.0, 10.0)] == [False, False]
    # Nothing progressed within the bound: the fleet is down, no candidate at all.
    table = _table()
    _progress(table, A, 10.0, 100.0)
    assert [v.eligible for v in table.degraded_views("m", 20.5, 10.0)] == [False, False]


def test_a_backend_that_relays_content_stays_a_degraded_candidate_whatever_its_polls() -> None:
    """A frozen (A, ejected) and a busy replica whose /stats polls time out (B, ejected) while
    its streams deliver tokens: B serves, so degraded routing keeps it (a CI run's 503s). Its
    content must be recent (``stale_after_s``, 1 s here); A, silent, stays out."""
    table = _table()
    _progress(table, A, 10.0, 100.0)
    _progress(table, B, 10.0, 100.0)
    ticket = table.route("m", B, 10)
    for _ in range(3):
        table.record_poll_failure("m", A, 11.0)
        table.record_poll_failure("m", B, 11.0)
    assert [v.eligible for v in table.degraded_views("m", 12.0, 10.0)] == [False, False]
    StateTable.relayed(ticket, 12.0)
    assert [v.eligible for v in table.views("m", 12.5)] == [False, False]  # SAL: unknown state
    assert [v.eligible for v in table.degraded_views("m", 12.5, 10.0)] == [False, True]
    table.mark_suspect("m", B)  # a connect failure does not outweigh tokens just relayed
    assert [v.eligible for v in table.degraded_views("m", 12.5, 10.0)] == [False, True]
    assert [v.eligible for v in table.degraded_views("m", 13.1, 10.0)] == [False, False]
    # A backend relaying content is no reason to drop a peer that still progresses.
    _progress(table, A, 12.6, 102.6)
    StateTable.relayed(ticket, 13.0)
    assert [v.eligible for v in table.degraded_views("m", 13.7, 10.0)] == [True, True]


def test_a_cached_prompt_books_its_uncached_prefill_and_its_new_kv_apart() -> None:
    # Routed by a cache-aware policy: 1,000-token prompt, 600 predicted cached on A, 200 of
    # them held by a running request. A's queue grows by the 400 tokens it must prefill and
    # its free KV shrinks by the 800 it must store, until the engine's numbers include it.
    clock = FakeClock(1.0)
    table = _table(clock)
    snap = _snap(0.0)
    table.record_poll_success("m", A, snap, "stats", now_s=0.0, wall_s=0.0)
    ticket = table.route("m", A, 400, kv_tokens=800)
    view = table.views("m", 1.0)[0]
    assert view.queued_prefill_tokens == snap.queued_prefill_tokens + 400
    assert view.free_kv_tokens == snap.free_kv_tokens - 800
    table.record_poll_success("m", A, _snap(2.0), "stats", now_s=2.0, wall_s=2.0)
    view = table.views("m", 2.0)[0]
    assert (view.queued_prefill_tokens, view.free_kv_tokens) == (
        snap.queued_prefill_tokens,
        snap.free_kv_tokens,
    )
    StateTable.release(ticket)  # acknowledged already: nothing is given back twice
    backend = table.backends("m")[0]
    assert (backend.routed_tokens_since_poll, backend.routed_kv_tokens_since_poll) == (0, 0)


def test_last_outcome_counts_failed_polls_too() -> None:
    # What tells "the pollers have not run" (the gateway was stalled) from "the backends are
    # down": failed polls are outcomes as fresh as good ones.
    table = _table()
    assert table.last_outcome_s("m") is None
    table.record_poll_success("m", A, default_stats(), "stats", 10.0)
    assert table.last_outcome_s("m") == 10.0
    table.record_poll_failure("m", B, 12.5)
    assert table.last_outcome_s("m") == 12.5
    table.record_poll_failure("m", A)  # no time given: not an outcome it can place
    assert table.last_outcome_s("m") == 12.5
    assert table.last_outcome_s("other") is None


def test_a_backend_that_serves_another_model_gets_nothing_until_it_serves_this_one() -> None:
    table = _table()
    for url in (A, B):
        table.record_poll_success("m", url, default_stats(), "stats", now_s=10.0)
    assert table.set_served("m", B, ("other",))  # a wrong address: vLLM would answer 404
    assert [v.eligible for v in table.views("m", 10.0)] == [True, False]
    assert [b.url for b in table.serving_elsewhere("m")] == [B]
    # Not even a degraded candidate: every request sent there would fail.
    assert [v.eligible for v in table.degraded_views("m", 12.0, 10.0)] == [True, False]
    assert not table.set_served("m", B, ("other", "x"))  # no change
    assert table.set_served("m", A, ("other",))
    assert not table.is_ready(10.0)
    assert table.set_served("m", A, ("m", "other"))  # serves it among others: routable
    assert table.set_served("m", B, ("m",))
    assert [v.eligible for v in table.views("m", 10.0)] == [True, True]
    assert table.serving_elsewhere("m") == []
    assert not table.set_served("m", "http://unknown:1", ("other",))


def _budget_views(*budgets: int, eligible: tuple[bool, ...] | None = None) -> list[BackendView]:
    flags = eligible or (True,) * len(budgets)
    return [
        BackendView(f"http://r{i}", ok, 0, 10_000, 1_000, budget)
        for i, (budget, ok) in enumerate(zip(budgets, flags, strict=True))
    ]


def test_a_claimed_step_budget_counts_at_most_spread_times_the_pools_smallest() -> None:
    capped = cap_budgets(_budget_views(2048, 4096, 10**12), 4.0)
    assert [v.max_num_batched_tokens for v in capped] == [2048, 4096, 8192]
    # Within the spread (a fleet that mixes GPUs), nothing changes.
    mixed = _budget_views(2048, 8192)
    assert cap_budgets(mixed, 4.0) is mixed
    # Off, or a pool of one: as reported.
    assert cap_budgets(_budget_views(2048, 10**12), 0.0)[1].max_num_batched_tokens == 10**12
    assert cap_budgets(_budget_views(10**12), 4.0)[0].max_num_batched_tokens == 10**12
    # Only eligible replicas set the floor: a stale one's small budget does not squeeze.
    views = _budget_views(16, 8192, 8192, eligible=(False, True, True))
    assert [v.max_num_batched_tokens for v in cap_budgets(views, 4.0)] == [16, 8192, 8192]


def test_the_table_caps_budgets_in_its_views() -> None:
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    for url, budget in (("http://a", 10**12), ("http://b", 2048)):
        table.add_backend("m", url)
        stats = dataclasses.replace(default_stats("m"), max_num_batched_tokens=budget)
        table.record_poll_success("m", url, stats, "stats", now_s=0.0)
    assert [v.max_num_batched_tokens for v in table.views("m", 0.1)] == [8192, 2048]
