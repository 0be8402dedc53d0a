"""`sal_near`: SAL with a random choice among near-best backends, for several gateways."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.gateways import unseen_share
from engine_sim.simulator import RouterConfig, simulate
from engine_sim.trace import TraceRequest, gamma_arrivals
from sal_core.policies import SAL, BackendView, RouteRequest, SALNearBest, make_policy


def _view(i: int, *, free: int = 100_000, queued: int = 0, in_flight: int = 0) -> BackendView:
    return BackendView(f"http://b{i}", True, in_flight, free, queued, 2048)


backend_st = st.builds(
    BackendView,
    url=st.text(min_size=1, max_size=4),
    eligible=st.booleans(),
    in_flight=st.integers(0, 50),
    free_kv_tokens=st.integers(0, 200_000),
    queued_prefill_tokens=st.integers(0, 200_000),
    max_num_batched_tokens=st.integers(1, 16_384),
)


@settings(max_examples=200, deadline=None)
@given(
    pool=st.lists(backend_st, min_size=1, max_size=12).filter(lambda p: any(b.eligible for b in p)),
    prompt=st.integers(0, 32_000),
    beta=st.floats(1.0, 50.0),
    seed=st.integers(0, 1000),
)
def test_the_choice_is_never_worse_than_the_best_by_more_than_the_tolerance(
    pool: list[BackendView], prompt: int, beta: float, seed: int
) -> None:
    request = RouteRequest(prompt_tokens=prompt, beta=beta)
    best = SAL().select(request, pool).score
    decision = make_policy("sal_near", seed).select(request, pool)
    assert pool[decision.index].eligible
    assert decision.score <= best + SALNearBest.tolerance
    assert decision.score == SAL().select(request, [pool[decision.index]]).score


def test_a_clear_best_is_always_chosen() -> None:
    pool = [_view(0, queued=20_000), _view(1, queued=0), _view(2, queued=40_000)]
    policy = make_policy("sal_near", seed=1)
    request = RouteRequest(prompt_tokens=500)
    assert {policy.select(request, pool).index for _ in range(50)} == {1}


def test_near_equal_backends_share_the_traffic_where_sal_always_picks_one() -> None:
    pool = [_view(0, queued=100), _view(1, queued=0), _view(2, queued=200), _view(3, queued=9000)]
    request = RouteRequest(prompt_tokens=500)
    policy = make_policy("sal_near", seed=3)
    near = Counter(policy.select(request, pool).index for _ in range(300))
    assert set(near) == {0, 1, 2}
    assert min(near.values()) > 60
    assert {make_policy("sal").select(request, pool).index for _ in range(10)} == {1}


def test_eight_gateways_herd_less_with_sal_near() -> None:
    times = gamma_arrivals(600, 40.0, cv=3.0, seed=4)
    reqs = [TraceRequest(t, 300 + (i * 7919) % 2500, 20) for i, t in enumerate(times)]

    def unseen(policy: str) -> float:
        router = RouterConfig(policy, gateways=8, seed=1)
        return unseen_share(simulate(reqs, replicas=8, router=router).decisions)

    assert unseen("sal_near") < 0.85 * unseen("sal")
