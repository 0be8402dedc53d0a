"""Routing policies: the invariants every policy keeps, and SAL's formula."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sal_core.policies import (
    DEFAULT_MIN_MATCH_TOKENS,
    LLM_D_WEIGHTS,
    POLICIES,
    SAL,
    BackendView,
    NoEligibleBackend,
    PolicySettings,
    RouteRequest,
    make_policy,
    memory_wait_steps,
    sal_load,
)


@st.composite
def backend_st(draw: st.DrawFn) -> BackendView:
    cached = draw(st.integers(0, 32_000))
    return BackendView(
        url=draw(st.sampled_from(["http://a", "http://b", "http://c", "http://d"])),
        eligible=draw(st.booleans()),
        in_flight=draw(st.integers(0, 500)),
        free_kv_tokens=draw(st.integers(0, 200_000)),
        queued_prefill_tokens=draw(st.integers(0, 200_000)),
        max_num_batched_tokens=draw(st.integers(1, 16_384)),
        cached_tokens=cached,
        cached_held_tokens=draw(st.integers(0, cached)),
        num_waiting=draw(st.integers(0, 300)),
        kv_tokens_total=draw(st.integers(0, 400_000)),
        indexed_tokens=draw(st.integers(0, 400_000)),
        num_running=draw(st.integers(0, 300)),
    )


pool_st = st.lists(backend_st(), min_size=1, max_size=16)
request_st = st.builds(
    RouteRequest,
    prompt_tokens=st.integers(0, 32_000),
    beta=st.floats(1.0, 50.0),
    affinity_key=st.none() | st.text(max_size=12),
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
    pool=st.lists(backend_st(), min_size=2, max_size=8),
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


def test_sal_memory_term_is_steps_until_the_running_requests_free_the_shortfall() -> None:
    # 600 tokens missing; 3 running requests free beta = 2 tokens each per step: 100 steps.
    assert sal_load(1_000, 400, 2_000, 1_000, 2.0, num_running=3) == pytest.approx(100.0)
    # Nothing running: as if one were (the prompt does not fit an empty server either).
    assert sal_load(1_000, 400, 0, 1_000, 2.0, num_running=0) == pytest.approx(300.0)
    assert memory_wait_steps(-50, 2.0, 5) < 0  # it fits: the queue term decides


def _saturated(queued: int, free: int, in_flight: int, waiting: int) -> BackendView:
    return BackendView(
        f"http://q{queued}", True, in_flight, free, queued, 2048,
        num_waiting=waiting, num_running=in_flight - waiting,
    )  # fmt: skip


def test_sal_sends_a_memory_short_fleet_s_request_to_the_short_queue() -> None:
    # Four replicas of a simulated 40 GB fleet past saturation (`sal-bench prefix`,
    # chat-short-40gb-sat, seed 0, t = 140 s): KV is short everywhere. The paper's term
    # (beta * shortfall, ~10^5 here) dwarfs every queue and picks the replica with the most
    # free KV at the last poll, whatever waits there: 209k queued tokens, against 55k.
    pool = [
        _saturated(queued=55_140, free=6_608, in_flight=26, waiting=7),
        _saturated(queued=208_858, free=8_032, in_flight=39, waiting=25),
        _saturated(queued=431_213, free=1_712, in_flight=45, waiting=33),
        _saturated(queued=94_504, free=6_800, in_flight=29, waiting=13),
    ]
    request = RouteRequest(prompt_tokens=13_945, beta=14.8)
    assert make_policy("sal_paper").select(request, pool).index == 1
    decision = make_policy("sal").select(request, pool)
    assert decision.index == 0
    # Its wait there is its queue: (55,140 + 13,945) / 2,048 steps.
    assert decision.score == pytest.approx((55_140 + 13_945) / 2048)


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

    def counted(b: BackendView) -> tuple[int, int]:
        if b.cached_tokens < DEFAULT_MIN_MATCH_TOKENS:
            return 0, 0
        return b.cached_tokens, b.cached_held_tokens

    cmax = max(counted(pool[i])[0] for i in eligible)
    loads = {
        i: sal_load(
            request.prompt_tokens,
            pool[i].free_kv_tokens,
            pool[i].queued_prefill_tokens,
            pool[i].max_num_batched_tokens,
            request.beta,
            cached_tokens=counted(pool[i])[0],
            cached_held_tokens=counted(pool[i])[1],
            in_flight=pool[i].in_flight,
            best_cached_tokens=cmax,
            num_running=pool[i].num_running,
        )
        for i in eligible
    }
    expected = min(eligible, key=lambda i: (loads[i], pool[i].in_flight, i))
    policy = make_policy("sal")
    decision = policy.select(request, pool)
    assert decision.index == expected
    assert decision.score == pytest.approx(loads[expected])
    assert isinstance(policy, SAL)
    assert dict(policy.loads(request, pool)) == pytest.approx(loads)


def _cache_view(url: str, **fields: int) -> BackendView:
    base = {
        "eligible": True,
        "in_flight": 0,
        "free_kv_tokens": 10_000,
        "queued_prefill_tokens": 0,
        "max_num_batched_tokens": 1_000,
    }
    return BackendView(url=url, **{**base, **fields})  # type: ignore[arg-type]


def test_sal_counts_only_uncached_prompt_tokens_as_prefill_work() -> None:
    # Both replicas have 1,000 tokens queued; b holds 3,000 of the 4,000-token prompt.
    pool = [
        _cache_view("a", queued_prefill_tokens=1_000),
        _cache_view("b", queued_prefill_tokens=1_500, cached_tokens=3_000),
    ]
    request = RouteRequest(prompt_tokens=4_000, beta=2.0)
    decision = make_policy("sal").select(request, pool)
    assert decision.url == "b"
    assert decision.score == pytest.approx((1_500 + 1_000) / 1_000)
    # The paper's Eq. 2 does not see the cache: a has less queued work.
    assert make_policy("sal_paper").select(request, pool).url == "a"


def test_sal_credits_only_held_cached_blocks_in_the_memory_term() -> None:
    # Free KV is short on both; b's cached prefix is evictable (unheld): it still consumes
    # free KV, so the memory term is the same as without the cache.
    unheld = _cache_view("b", free_kv_tokens=1_000, cached_tokens=3_000, num_running=5)
    request = RouteRequest(prompt_tokens=4_000, beta=2.0)
    # 3,000 tokens missing, freed at beta * 5 running = 10 tokens per step.
    assert make_policy("sal").select(request, [unheld]).score == pytest.approx(3_000 / 10)
    held = replace(unheld, cached_held_tokens=3_000)
    # Held blocks need no new KV: 1,000 new tokens fit in 1,000 free -> the queue term rules.
    assert make_policy("sal").select(request, [held]).score == pytest.approx(1.0)


def test_sal_ignores_matches_shorter_than_the_configured_minimum() -> None:
    # a holds only the universal opening block; b holds nothing but has fewer requests.
    pool = [
        _cache_view("a", in_flight=2, cached_tokens=512, cached_held_tokens=512),
        _cache_view("b", in_flight=1),
    ]
    request = RouteRequest(prompt_tokens=4_000)
    assert make_policy("sal").select(request, pool).url == "b"
    counts_all = make_policy("sal", settings=PolicySettings(min_match_tokens=0))
    assert counts_all.select(request, pool).url == "a"
    longer = [replace(pool[0], cached_tokens=DEFAULT_MIN_MATCH_TOKENS), pool[1]]
    assert make_policy("sal").select(request, longer).url == "a"


def test_policy_settings_reject_a_negative_minimum() -> None:
    with pytest.raises(ValueError, match="min_match_tokens"):
        PolicySettings(min_match_tokens=-1)


def test_decode_reserve_counts_the_running_requests_future_kv_as_taken() -> None:
    # a has no queue and is 100 tokens short of KV; b has a queue and KV to spare. Each
    # backend runs 10 requests that will still decode ~200 tokens each.
    pool = [
        _cache_view("a", free_kv_tokens=900, num_running=10),
        _cache_view("b", free_kv_tokens=100_000, num_running=10, queued_prefill_tokens=5_000),
    ]
    request = RouteRequest(prompt_tokens=1_000, beta=2.0, mean_output_tokens=200.0)
    # Reserve 0 (the default): a's 100 missing tokens free in 100 / (2 * 10) = 5 steps,
    # less than b's 6-step queue.
    default = make_policy("sal").select(request, pool)
    assert (default.url, default.score) == ("a", pytest.approx(5.0))
    reserving = make_policy("sal", settings=PolicySettings(decode_reserve=1.0))
    # Reserving 10 x 200 tokens of a's KV, it is 2,100 tokens short: 105 steps; b's queue wins.
    decision = reserving.select(request, pool)
    assert (decision.url, decision.score) == ("b", pytest.approx(6.0))
    assert isinstance(reserving, SAL)
    assert dict(reserving.loads(request, pool)) == pytest.approx({0: 105.0, 1: 6.0})
    half = make_policy("sal", settings=PolicySettings(decode_reserve=0.5))
    assert isinstance(half, SAL)
    assert dict(half.loads(request, pool))[0] == pytest.approx(1_100 / 20)
    # Unknown mean output (no request finished yet): nothing to reserve.
    unknown = RouteRequest(prompt_tokens=1_000, beta=2.0)
    assert reserving.select(unknown, pool).url == "a"
    # The paper's Eq. 2 stays literal whatever the settings: 2 * 100 on a.
    paper = make_policy("sal_paper", settings=PolicySettings(decode_reserve=1.0))
    assert isinstance(paper, SAL)
    assert dict(paper.loads(request, pool)) == pytest.approx({0: 200.0, 1: 6.0})


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_policy_settings_reject_a_bad_decode_reserve(bad: float) -> None:
    with pytest.raises(ValueError, match="decode_reserve"):
        PolicySettings(decode_reserve=bad)


def test_sal_charges_a_move_off_the_cache_for_the_wait_it_imposes_on_in_flight_requests() -> None:
    # a holds 6,000 of the 6,500-token conversation but has 7,000 tokens queued; b holds
    # none of it and has nothing queued, only decoders in flight. The request's own wait is
    # shorter on b (6.5 steps vs 7.5), but there it prefills 6,000 tokens a would skip, in
    # the same steps as b's 4 in-flight requests: each waits 6 steps longer.
    request = RouteRequest(prompt_tokens=6_500)
    a = _cache_view("a", queued_prefill_tokens=7_000, in_flight=6, cached_tokens=6_000)
    b = _cache_view("b", in_flight=4)
    decision = make_policy("sal").select(request, [a, b])
    assert decision.url == "a"
    assert decision.score == pytest.approx(7.5)
    policy = make_policy("sal")
    assert isinstance(policy, SAL)
    assert dict(policy.loads(request, [a, b])) == pytest.approx({0: 7.5, 1: 6.5 + 4 * 6.0})
    # An idle replica delays no one: the shorter wait wins, as in Eq. 2.
    assert make_policy("sal").select(request, [a, replace(b, in_flight=0)]).url == "b"
    # Without a cache (or a match under the minimum) the term is 0: the paper's formula.
    short = replace(a, cached_tokens=512)
    assert make_policy("sal").select(request, [short, b]).score == pytest.approx(6.5)
    assert make_policy("sal_paper").select(request, [a, b]).url == "b"


def test_sal_near_weighs_the_pool_as_sal_does() -> None:
    # The in-flight term needs the whole pool: a near-best choice must not lose it.
    request = RouteRequest(prompt_tokens=6_500)
    a = _cache_view("a", queued_prefill_tokens=7_000, in_flight=6, cached_tokens=6_000)
    b = _cache_view("b", in_flight=4)
    picks = {make_policy("sal_near", seed=s).select(request, [a, b]).url for s in range(20)}
    assert picks == {"a"}


def test_sal_spreads_a_hot_prefix_once_its_replica_queues_up() -> None:
    # Every replica but a misses the 6,000-token shared prefix. A request costs a 500 tokens
    # of prefill, the others 6,500: a takes requests until the 6,000 uncached tokens queued
    # there make it as slow as an empty replica, then the prefix spreads.
    pool = [_cache_view(u, max_num_batched_tokens=2_048) for u in "abcd"]
    pool[0] = replace(pool[0], cached_tokens=6_000)
    request = RouteRequest(prompt_tokens=6_500)
    picks = []
    policy = make_policy("sal")
    for _ in range(16):
        d = policy.select(request, pool)
        picks.append(d.url)
        b = pool[d.index]
        uncached = request.prompt_tokens - b.cached_tokens
        pool[d.index] = replace(
            b, queued_prefill_tokens=b.queued_prefill_tokens + uncached, in_flight=b.in_flight + 1
        )
    assert picks[:12] == ["a"] * 12
    assert picks[12:] == ["b", "c", "d", "a"]


def test_prefix_affinity_sticks_to_a_key_and_moves_only_a_departed_backends_keys() -> None:
    pool = [_view(i) for i in range(5)]
    policy = make_policy("prefix_affinity")
    keys = [f"session-{k}" for k in range(300)]
    home = {k: policy.select(RouteRequest(100, affinity_key=k), pool).index for k in keys}
    assert all(
        policy.select(RouteRequest(100, affinity_key=k), pool).index == home[k] for k in keys
    )
    assert min(Counter(home.values()).values()) > 30  # spread over all five
    ejected = [*pool[:2], replace(pool[2], eligible=False), *pool[3:]]
    moved = {
        k
        for k in keys
        if policy.select(RouteRequest(100, affinity_key=k), ejected).index != home[k]
    }
    assert moved == {k for k in keys if home[k] == 2}


def test_prefix_affinity_without_a_key_takes_the_least_loaded() -> None:
    pool = [_view(0, in_flight=4), _view(1, in_flight=2), _view(2, in_flight=3)]
    assert make_policy("prefix_affinity").select(RouteRequest(100), pool).index == 1


def test_llm_d_sums_its_default_weighted_scorers() -> None:
    assert LLM_D_WEIGHTS == {"queue": 2.0, "kv_cache_utilization": 2.0, "prefix_cache": 3.0}
    # a: whole prompt cached, longest queue, half its KV free -> 3*1 + 2*0 + 2*0.5 = 4.
    # b: nothing cached, empty queue, all KV free             -> 0 + 2*1 + 2*1.0 = 4.
    # c: nothing cached, empty queue, half free               -> 0 + 2 + 1 = 3.
    a = _cache_view("a", cached_tokens=1_000, num_waiting=6, kv_tokens_total=20_000)
    b = _cache_view("b", free_kv_tokens=20_000, kv_tokens_total=20_000)
    c = _cache_view("c", kv_tokens_total=20_000)
    request = RouteRequest(prompt_tokens=1_000)
    picks = {make_policy("llm_d", seed=s).select(request, [a, b, c]).url for s in range(30)}
    assert picks == {"a", "b"}  # a tie at 4, broken at random; c never
    # Half the prompt cached: 1.5 + 0 + 1 = 2.5 < b's 4.
    half = replace(a, cached_tokens=500)
    decision = make_policy("llm_d").select(request, [half, b, c])
    assert decision.url == "b"
    assert decision.score == pytest.approx(-4.0)


def test_cache_aware_follows_a_good_match_while_load_is_balanced() -> None:
    pool = [
        _cache_view("a", in_flight=3, indexed_tokens=50_000),
        _cache_view("b", in_flight=5, cached_tokens=2_000, indexed_tokens=90_000),
        _cache_view("c", in_flight=4, indexed_tokens=10_000),
    ]
    policy = make_policy("cache_aware")
    assert policy.select(RouteRequest(prompt_tokens=4_000), pool).url == "b"  # 50% > 30%
    # 2,000 of 10,000 (20%) is not enough: the smallest tree gets it.
    assert policy.select(RouteRequest(prompt_tokens=10_000), pool).url == "c"


def test_cache_aware_falls_back_to_the_least_loaded_when_imbalanced() -> None:
    pool = [
        _cache_view("a", in_flight=100, cached_tokens=4_000),
        _cache_view("b", in_flight=30),
    ]
    # 100 - 30 > 64 and 100 > 1.5 * 30: shortest queue, the match is ignored.
    assert make_policy("cache_aware").select(RouteRequest(4_000), pool).url == "b"
    # 100 vs 70: within the relative threshold, the match wins.
    pool[1] = replace(pool[1], in_flight=70)
    assert make_policy("cache_aware").select(RouteRequest(4_000), pool).url == "a"


def test_round_robin_rotates_each_pool_apart() -> None:
    # Requests for a LoRA adapter choose among the replicas that serve it; interleaved with
    # requests for the whole pool, both rotations stay even.
    policy = make_policy("round_robin")
    full = [_view(i) for i in range(4)]
    subset = full[2:]
    request = RouteRequest(prompt_tokens=10)
    chosen_full, chosen_subset = Counter[str](), Counter[str]()
    for _ in range(8):
        chosen_full[policy.select(request, full).url] += 1
        chosen_subset[policy.select(request, subset).url] += 1
    assert chosen_full == {f"http://b{i}": 2 for i in range(4)}
    assert chosen_subset == {"http://b2": 4, "http://b3": 4}
