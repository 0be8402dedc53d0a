"""The state table: local accounting between polls, staleness, ejection and re-admission."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from sal_gateway.state import StateTable
from sal_gateway.testing import default_stats

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
    stats = dataclasses.replace(default_stats(), free_kv_tokens=1000, queued_prefill_tokens=50)
    table.record_poll_success("m", A, stats, "stats", now_s=0.0)
    clock.now_s = 0.05
    t1 = table.route("m", A, 300)
    t2 = table.route("m", A, 900)
    view = table.views("m", 0.1)[0]
    assert view.in_flight == 2
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
            st.sampled_from(["route", "first_byte", "release", "poll"]),
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
        if op == "route":
            tickets.append(table.route("m", A, tokens))
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
        view = table.views("m", 0.0)[0]
        assert 0 <= view.free_kv_tokens <= 3000
        assert view.queued_prefill_tokens == backend.prefill_pending_tokens
