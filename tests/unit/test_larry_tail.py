"""The tail guard (`sal_core.larry_tail`), its drain-rate estimate and TGI's admission rule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sal_core.drain_rate import DrainRateEstimator
from sal_core.larry import larry_order
from sal_core.larry_tail import (
    TailGuard,
    TailParams,
    admits_with_headroom,
    headroom_blocks,
)
from sal_core.tgi import TgiAdmission, TgiParams, count_fitting

BLOCK = 16


@dataclass
class Req:
    request_id: str
    arrival_s: float
    tokens: int


def order(guard: TailGuard, reqs: list[Req], now_s: float, queued: int | None = None) -> list[str]:
    total = sum(r.tokens for r in reqs) if queued is None else queued
    out = guard.order(
        reqs,
        now_s=now_s,
        queued_tokens=total,
        arrival_s=lambda r: r.arrival_s,
        uncomputed_tokens=lambda r: r.tokens,
        request_id=lambda r: r.request_id,
    )
    return [r.request_id for r in out]


def warmed(params: TailParams, rate_tokens_s: float, kv_blocks: int = 1000) -> TailGuard:
    """A guard that has measured `rate_tokens_s` over 10 backlogged seconds."""
    guard = TailGuard(params, block_size=BLOCK, kv_blocks_total=kv_blocks)
    for _ in range(100):
        guard.observe_step(0.1, int(rate_tokens_s * 0.1), backlogged=True)
    return guard


# Drain rate -----------------------------------------------------------------------------


def test_drain_rate_is_prefill_tokens_per_backlogged_second() -> None:
    est = DrainRateEstimator(window_s=30.0)
    assert est.rate_tokens_s is None  # nothing measured yet
    for _ in range(20):
        est.observe(0.05, 100, backlogged=True)
        # Idle steps (nothing waiting) say nothing about how fast a backlog drains.
        est.observe(0.05, 0, backlogged=False)
    assert est.rate_tokens_s == pytest.approx(2000.0)


def test_drain_rate_follows_a_slowdown_within_about_a_window() -> None:
    est = DrainRateEstimator(window_s=5.0)
    for _ in range(200):
        est.observe(0.1, 400, backlogged=True)  # 4,000 tokens/s
    for _ in range(150):
        est.observe(0.1, 50, backlogged=True)  # KV-bound: 500 tokens/s for 15 s
    rate = est.rate_tokens_s
    assert rate is not None
    assert 500 <= rate < 700


def test_drain_rate_ignores_broken_intervals() -> None:
    est = DrainRateEstimator(min_observed_s=0.0)
    est.observe(-1.0, 100, backlogged=True)
    est.observe(math.nan, 100, backlogged=True)
    assert est.rate_tokens_s is None
    with pytest.raises(ValueError, match="window_s"):
        DrainRateEstimator(window_s=0.0)


# Pinning --------------------------------------------------------------------------------


def test_without_a_rate_estimate_the_order_is_paper_larry() -> None:
    guard = TailGuard(TailParams(), block_size=BLOCK, kv_blocks_total=1000)
    reqs = [Req("big", 0.0, 3000), Req("small", 1.0, 50), Req("mid", 2.0, 400)]
    expected = larry_order(
        reqs,
        now_s=100.0,
        alpha=1.0,
        block_size=BLOCK,
        arrival_s=lambda r: r.arrival_s,
        uncomputed_tokens=lambda r: r.tokens,
        request_id=lambda r: r.request_id,
    )
    assert order(guard, reqs, 100.0) == [r.request_id for r in expected]


def test_a_request_is_pinned_once_its_fcfs_wait_is_due() -> None:
    # 1,000 tokens/s; "big" arrived first (nothing ahead: due at 0 + margin 1 s), "small"
    # behind 5,000 tokens (due at 0.1 + 1 + 5 s).
    guard = warmed(TailParams(pin="fcfs_due", margin_s=1.0, slack=1.0), rate_tokens_s=1000.0)
    big = Req("big", 0.0, 5000)
    assert order(guard, [big], 0.0) == ["big"]
    small = Req("small", 0.1, 40)
    # Before big is due LARRY's order holds: the small prompt first.
    assert order(guard, [big, small], 0.5) == ["small", "big"]
    assert guard.next_due_s == pytest.approx(1.0)
    # Past its due time the big one is pinned ahead of anything LARRY would prefer.
    assert order(guard, [big, small], 1.01) == ["big", "small"]
    assert guard.next_due_s == pytest.approx(0.1 + 1.0 + 5.0)


def test_pinned_requests_go_earliest_due_first() -> None:
    guard = warmed(TailParams(pin="fcfs_due", margin_s=0.0, slack=1.0), rate_tokens_s=100.0)
    a = Req("a", 0.0, 100)
    assert order(guard, [a], 0.0) == ["a"]  # due at 0
    b = Req("b", 0.5, 900)
    assert order(guard, [a, b], 0.5) == ["a", "b"]  # b: 100 tokens ahead, due at 1.5
    c = Req("c", 0.6, 10)
    # At 20 s all three are due: by due time (a 0, b 1.5, c 0.6 + 10), not by size.
    assert order(guard, [c, b, a], 20.0) == ["a", "b", "c"]


def test_adaptive_aging_pins_everything_older_than_one_threshold() -> None:
    params = TailParams(pin="adaptive_aging", margin_s=1.0, slack=0.5, memory_s=60.0)
    guard = warmed(params, rate_tokens_s=1000.0)
    # A 10,000-token backlog seen now: FCFS would need 10 s, the threshold is 1 + 5 s.
    reqs = [Req("old-big", 0.0, 9000), Req("new-small", 5.0, 1000)]
    assert order(guard, reqs, 5.5) == ["new-small", "old-big"]
    assert order(guard, reqs, 6.5) == ["old-big", "new-small"]


def test_forgotten_requests_do_not_keep_the_guard_growing() -> None:
    guard = warmed(TailParams(), rate_tokens_s=1000.0)
    for i in range(50):
        order(guard, [Req(f"r{i}", float(i), 100)], float(i))
    assert len(guard._ahead_tokens) == 1


@given(
    st.lists(
        st.tuples(st.floats(0, 100), st.integers(1, 8000)),
        min_size=1,
        max_size=30,
    ),
    st.floats(0, 200),
)
def test_order_is_a_permutation_and_deterministic(
    specs: list[tuple[float, int]], now_s: float
) -> None:
    reqs = [Req(f"r{i}", a, n) for i, (a, n) in enumerate(specs)]
    first = order(warmed(TailParams(), 500.0), reqs, now_s)
    again = order(warmed(TailParams(), 500.0), list(reversed(reqs)), now_s)
    assert sorted(first) == sorted(r.request_id for r in reqs)
    assert first == again


@pytest.mark.parametrize(
    ("field", "value"),
    [("slack", -1.0), ("margin_s", math.inf), ("headroom", 1.0), ("pin", "edf"), ("alpha", -2)],
)
def test_bad_params_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TailParams(**{field: value})  # type: ignore[arg-type]


# Headroom -------------------------------------------------------------------------------


def test_headroom_is_vllms_watermark_rounding() -> None:
    # vLLM: int(watermark * num_blocks), the null block counted.
    assert headroom_blocks(0.02, 1001) == 20
    assert headroom_blocks(0.0, 1001) == 0


def test_headroom_holds_blocks_free_only_while_others_run() -> None:
    assert admits_with_headroom(10, 30, num_running=3, reserve_blocks=20)
    assert not admits_with_headroom(11, 30, num_running=3, reserve_blocks=20)
    # Nothing running: whatever fits starts (else a large prompt could never run).
    assert admits_with_headroom(30, 30, num_running=0, reserve_blocks=20)
    assert not admits_with_headroom(31, 30, num_running=0, reserve_blocks=20)


# TGI ------------------------------------------------------------------------------------


def test_tgi_waits_for_enough_waiting_work_while_a_batch_decodes() -> None:
    tgi = TgiAdmission(TgiParams(waiting_served_ratio=1.2, max_waiting_tokens=20))
    # Nothing running: admit at once.
    assert tgi.admission_open(num_running=0, fitting=1)
    # 10 running: at least floor(12) must be able to join.
    assert not tgi.admission_open(num_running=10, fitting=11)
    assert tgi.admission_open(num_running=10, fitting=12)
    # ... unless the batch has decoded max_waiting_tokens steps since the last admission.
    for _ in range(20):
        tgi.stepped()
    assert tgi.admission_open(num_running=10, fitting=1)
    tgi.admitted()
    assert not tgi.admission_open(num_running=10, fitting=1)


def test_tgi_counts_requests_that_fit_together() -> None:
    fits = count_fitting(
        [4, 4, 4, 1], [64, 64, 64, 16], free_blocks=10, free_slots=8, prefill_budget_tokens=512
    )
    assert fits == 2  # the third needs 4 blocks, 2 are left: FCFS stops there
    assert (
        count_fitting([1] * 5, [300] * 5, free_blocks=99, free_slots=8, prefill_budget_tokens=512)
        == 1
    )
    assert (
        count_fitting([1] * 5, [10] * 5, free_blocks=99, free_slots=3, prefill_budget_tokens=512)
        == 3
    )
    with pytest.raises(ValueError, match="max_waiting_tokens"):
        TgiParams(max_waiting_tokens=0)
