"""The TTFT lower bound: exact for a request alone, never above what the simulator measures."""

from __future__ import annotations

import pytest

from engine_sim.cost_model import get_profile
from engine_sim.simulator import RouterConfig, simulate
from engine_sim.trace import TraceRequest
from engine_sim.ttft_bound import best_cached_tokens, isolated_prefill_s, ttft_lower_bounds
from engine_sim.workloads import ChatSpec, TokenBlocks, multi_turn_chat

PROFILE = "llama31-8b-a100"
LENGTHS = [(300, 120), (900, 200), (1_500, 60), (600, 400)]


def blocks(ids: list[int], num_tokens: int) -> TokenBlocks:
    return TokenBlocks(ids, 64, num_tokens)


def test_a_request_alone_gets_exactly_its_bound_cached_or_not() -> None:
    # Two turns far apart: the first finishes long before the second arrives, so each runs
    # alone on the replica and its TTFT is its prefill steps, nothing else. The second
    # repeats the first's prompt and answer (5,120 tokens, 80 blocks of 64) and adds 3,000;
    # the engine computed 5,119 of them (the last answer token is sampled, never computed),
    # so 319 blocks of 16 are cached.
    first = TraceRequest(0.0, 5_000, 120, blocks(list(range(80)), 5_120))
    second = TraceRequest(60.0, 8_120, 10, blocks([*range(80), *range(100, 147)], 8_120))
    reqs = [first, second]
    bounds = ttft_lower_bounds(reqs, get_profile(PROFILE))
    assert best_cached_tokens(reqs, 16) == [0, 5_104]
    result = simulate(
        reqs, replicas=1, profile=PROFILE, router=RouterConfig(policy="sal"),
        enable_prefix_caching=True,
    )  # fmt: skip
    measured = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert measured[1].cached_tokens == 5_104
    assert [o.ttft_s for o in measured] == pytest.approx(bounds, rel=1e-9)
    # Three chunks of the 2,048-token budget for 5,000 tokens: more than one 2,048 chunk.
    assert bounds[0] > 2 * isolated_prefill_s(get_profile(PROFILE), 2_048, 0, 2_048)


def test_no_router_beats_the_bound_on_a_busy_multi_turn_workload() -> None:
    spec = ChatSpec(conversations=50, rate_per_s=4.0, think_time_s=(2.0, 10.0))
    reqs = multi_turn_chat(spec, LENGTHS, 3)
    bounds = ttft_lower_bounds(reqs, get_profile(PROFILE))
    slack: list[float] = []
    for policy, source in (("sal", "approximate"), ("p2c", "none"), ("sal", "oracle")):
        router = RouterConfig(policy=policy, cache_source=source)
        result = simulate(
            reqs, replicas=2, profile=PROFILE, router=router, enable_prefix_caching=True
        )
        assert result.unfinished == 0
        for outcome in result.outcomes:
            bound = bounds[int(outcome.request_id[1:])]  # "r<index in arrival order>"
            assert outcome.ttft_s >= bound * (1 - 1e-9), (policy, outcome)
            slack.append(outcome.ttft_s - bound)
    # Busy enough that the bound is not simply every TTFT: queueing shows.
    assert max(slack) > 0.5


def test_same_instant_arrivals_do_not_lend_each_other_blocks() -> None:
    shared = blocks([1, 2, 3], 192)
    reqs = [TraceRequest(1.0, 192, 5, shared), TraceRequest(1.0, 192, 5, shared)]
    assert best_cached_tokens(reqs, 16) == [0, 0]
    later = [*reqs, TraceRequest(2.0, 192, 5, shared)]
    # At most (192 - 1) // 16 = 11 blocks: at least one token is computed.
    assert best_cached_tokens(later, 16) == [0, 0, 176]


def test_bad_arguments_are_refused() -> None:
    profile = get_profile(PROFILE)
    with pytest.raises(ValueError, match="token_budget"):
        isolated_prefill_s(profile, 100, 0, 0)
    with pytest.raises(ValueError, match="cached_tokens"):
        isolated_prefill_s(profile, 100, 100, 2_048)
    with pytest.raises(ValueError, match="block_size"):
        best_cached_tokens([], 0)
