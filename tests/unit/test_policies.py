"""Routing policies: the invariants every policy keeps, and SAL's formula."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sal_gateway.policies import (
    POLICIES,
    BackendView,
    NoEligibleBackend,
    RouteRequest,
    make_policy,
    sal_load,
)

backend_st = st.builds(
    BackendView,
    url=st.sampled_from(["http://a", "http://b", "http://c", "http://d"]),
    eligible=st.booleans(),
    in_flight=st.integers(0, 500),
    free_kv_tokens=st.integers(0, 200_000),
    queued_prefill_tokens=st.integers(0, 200_000),
    max_num_batched_tokens=st.integers(1, 16_384),
)
pool_st = st.lists(backend_st, min_size=1, max_size=16)
request_st = st.builds(
    RouteRequest, prompt_tokens=st.integers(0, 32_000), beta=st.floats(1.0, 50.0)
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(pool=pool_st, requests=st.lists(request_st, min_size=1, max_size=8))
def test_never_picks_an_ineligible_backend(
    name: str, pool: list[BackendView], requests: list[RouteRequest]
) -> None:
    policy = make_policy(name, seed=7)
    for request in requests:
        if not any(b.eligible for b in pool):
            with pytest.raises(NoEligibleBackend):
                policy.select(request, pool)
            continue
        decision = policy.select(request, pool)
        assert pool[decision.index].eligible
        assert decision.url == pool[decision.index].url


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=100, deadline=None)
@given(pool=pool_st, requests=st.lists(request_st, min_size=1, max_size=8), seed=st.integers())
def test_deterministic_for_equal_inputs_and_seed(
    name: str, pool: list[BackendView], requests: list[RouteRequest], seed: int
) -> None:
    if not any(b.eligible for b in pool):
        return
    first, second = make_policy(name, seed=seed), make_policy(name, seed=seed)
    assert [first.select(r, pool).index for r in requests] == [
        second.select(r, pool).index for r in requests
    ]


def _view(i: int, *, free: int = 10_000, queued: int = 0, in_flight: int = 0) -> BackendView:
    return BackendView(f"http://b{i}", True, in_flight, free, queued, 2048)


@settings(max_examples=200, deadline=None)
@given(
    pool=st.lists(backend_st, min_size=2, max_size=8),
    request=request_st,
    extra_free=st.integers(1, 100_000),
    fewer_queued=st.integers(1, 100_000),
)
def test_sal_prefers_more_free_kv_and_fewer_queued_tokens(
    pool: list[BackendView], request: RouteRequest, extra_free: int, fewer_queued: int
) -> None:
    """Making the chosen backend strictly better never moves the decision elsewhere."""
    pool = [BackendView(b.url + str(i), True, *_rest(b)) for i, b in enumerate(pool)]
    policy = make_policy("sal")
    chosen = policy.select(request, pool).index
    b = pool[chosen]
    better = BackendView(
        b.url,
        True,
        b.in_flight,
        b.free_kv_tokens + extra_free,
        max(0, b.queued_prefill_tokens - fewer_queued),
        b.max_num_batched_tokens,
    )
    improved = [*pool[:chosen], better, *pool[chosen + 1 :]]
    assert policy.select(request, improved).index == chosen


def _rest(b: BackendView) -> tuple[int, int, int, int]:
    return (b.in_flight, b.free_kv_tokens, b.queued_prefill_tokens, b.max_num_batched_tokens)


def test_sal_routes_to_shorter_queue_when_memory_is_plentiful() -> None:
    pool = [_view(0, queued=8_000), _view(1, queued=1_000), _view(2, queued=4_000)]
    assert make_policy("sal").select(RouteRequest(prompt_tokens=500), pool).index == 1


def test_sal_avoids_a_server_without_room_for_the_prompt() -> None:
    # b0 has the shorter queue but cannot hold the prompt: the memory term dominates.
    pool = [_view(0, free=100, queued=0), _view(1, free=50_000, queued=6_000)]
    decision = make_policy("sal").select(RouteRequest(prompt_tokens=2_000, beta=3.0), pool)
    assert decision.index == 1


def test_sal_load_matches_the_paper_formula() -> None:
    # max(beta * (mem - free), (queued + prompt) / budget)
    assert sal_load(1_000, 400, 2_000, 1_000, 2.0) == pytest.approx(1_200.0)
    assert sal_load(1_000, 9_000, 3_000, 1_000, 2.0) == pytest.approx(4.0)


def test_sal_ties_go_to_fewer_in_flight_then_the_first_backend() -> None:
    # Idle fleet: equal loads. Decode work must not pile up on the first backend.
    pool = [_view(0, in_flight=3), _view(1, in_flight=1), _view(2, in_flight=1)]
    assert make_policy("sal").select(RouteRequest(prompt_tokens=10), pool).index == 1
    pool = [_view(0), _view(1), _view(2)]
    assert make_policy("sal").select(RouteRequest(prompt_tokens=10), pool).index == 0


def test_round_robin_cycles_and_skips_ejected() -> None:
    pool = [_view(0), BackendView("http://b1", False, 0, 0, 0, 1), _view(2)]
    policy = make_policy("round_robin")
    picks = [policy.select(RouteRequest(1), pool).index for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_least_requests_and_p2c_pick_fewer_in_flight() -> None:
    pool = [_view(0, in_flight=5), _view(1, in_flight=1)]
    assert make_policy("least_requests").select(RouteRequest(1), pool).index == 1
    # With two backends p2c always compares both.
    assert all(
        make_policy("p2c", seed=s).select(RouteRequest(1), pool).index == 1 for s in range(20)
    )


def test_random_spreads_over_all_eligible() -> None:
    pool = [_view(i) for i in range(4)]
    policy = make_policy("random", seed=1)
    seen = {policy.select(RouteRequest(1), pool).index for _ in range(200)}
    assert seen == {0, 1, 2, 3}


def test_unknown_policy_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest'.*least_requests"):
        make_policy("fastest")


@settings(max_examples=200, deadline=None)
@given(pool=pool_st, request=request_st)
def test_sal_select_is_the_argmin_of_sal_load(
    pool: list[BackendView], request: RouteRequest
) -> None:
    """The inlined hot loop in `SAL.select` agrees with the documented formula."""
    eligible = [i for i, b in enumerate(pool) if b.eligible]
    if not eligible:
        return
    loads = {
        i: sal_load(
            request.prompt_tokens,
            pool[i].free_kv_tokens,
            pool[i].queued_prefill_tokens,
            pool[i].max_num_batched_tokens,
            request.beta,
        )
        for i in eligible
    }
    expected = min(eligible, key=lambda i: (loads[i], pool[i].in_flight, i))
    decision = make_policy("sal").select(request, pool)
    assert decision.index == expected
    assert decision.score == pytest.approx(loads[expected])
