"""The engine model's prefix cache: reuse, sharing, LRU eviction, and what it reports."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sim.engine import EngineModel, SimRequest
from engine_sim.schedulers import ENGINE_SCHEDULERS
from sal_core.prefix import chain_hashes
from tests.unit.test_engine_model import make_engine, random_requests, run

BS = 16


def cached_engine(scheduler: str = "fcfs", **overrides: object) -> EngineModel:
    return make_engine(scheduler, enable_prefix_caching=True, **overrides)


def request(
    request_id: str, tokens: list[int], output: int = 4, arrival_s: float = 0.0
) -> SimRequest:
    return SimRequest(
        request_id, arrival_s, len(tokens), output, block_keys=chain_hashes(tokens, BS)
    )


def drain(engine: EngineModel, now_s: float = 0.0) -> float:
    while engine.has_work():
        now_s += engine.step(now_s).duration_s
    return now_s


def check_cache_invariants(engine: EngineModel, live: list[SimRequest]) -> None:
    cache = engine.cache
    assert cache is not None
    assert engine.free_blocks == cache.free_uncached + cache.evictable_blocks
    private = sum(r.kv_blocks - len(r.cached_keys) for r in live if r.finish_s is None)
    assert private + cache.held_blocks + engine.free_blocks == engine.config.num_kv_blocks


def test_a_repeated_prompt_reuses_all_but_its_last_token_and_prefills_less() -> None:
    engine = cached_engine(num_kv_blocks=64)
    prompt = list(range(200))  # 12 full blocks + 8 tokens
    first = request("a", prompt)
    engine.add_request(first)
    first_step = engine.step(0.0)
    end = drain(engine, first_step.duration_s)
    second = request("b", prompt, arrival_s=end)
    engine.add_request(second)
    second_step = engine.step(end)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12 * BS
    assert first_step.prefill_tokens == 200
    assert second_step.prefill_tokens == 200 - 12 * BS
    assert second_step.duration_s < first_step.duration_s
    assert engine.prefix_hits_tokens == 12 * BS
    assert engine.prefix_queries_tokens == 400


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = cached_engine(num_kv_blocks=64)
    prompt = list(range(4 * BS))  # exactly 4 full blocks
    engine.add_request(request("a", prompt))
    end = drain(engine)
    again = request("b", prompt, arrival_s=end)
    engine.add_request(again)
    step = engine.step(end)
    # vLLM caps a hit at num_tokens - 1: the last block is recomputed.
    assert again.num_cached_tokens == 3 * BS
    assert step.prefill_tokens == BS


def test_blocks_a_running_request_holds_are_shared_not_allocated_twice() -> None:
    engine = cached_engine(num_kv_blocks=64)
    prefix = list(range(8 * BS))
    long_runner = request("a", [*prefix, 1000, 1001], output=50)
    engine.add_request(long_runner)
    now = engine.step(0.0).duration_s  # prefilled; decoding now, holding 9 blocks
    free_before = engine.free_blocks
    follower = request("b", [*prefix, 2000, 2001, 2002], arrival_s=now)
    engine.add_request(follower)
    engine.step(now)
    assert follower.num_cached_tokens == 8 * BS
    # Only the follower's own last block is new (plus nothing for the shared 8).
    assert free_before - engine.free_blocks == 1
    assert engine.cache is not None
    assert engine.cache.holders(follower.block_keys[0]) == 2
    check_cache_invariants(engine, [long_runner, follower])


def test_unheld_cached_blocks_count_as_free_and_are_evicted_least_recently_freed_first() -> None:
    engine = cached_engine(num_kv_blocks=20)
    old = list(range(8 * BS))
    new = list(range(10_000, 10_000 + 8 * BS))
    now = 0.0
    for i, prompt in enumerate((old, new)):
        engine.add_request(request(f"fill{i}", prompt, arrival_s=now))
        now = drain(engine, now)
    assert engine.free_blocks == 20  # both prompts cached, all blocks free
    assert engine.cached_prefix(chain_hashes(old, BS)) == (8, 0)
    # 12 blocks needed, 4 uncached free: 8 cached blocks must go, the older prompt's first.
    big = request("big", list(range(50_000, 50_000 + 12 * BS - 1)), arrival_s=now)
    engine.add_request(big)
    engine.step(now)
    assert engine.cached_prefix(chain_hashes(old, BS))[0] == 0
    assert engine.cached_prefix(chain_hashes(new, BS)) == (8, 0)
    assert engine.cache is not None
    assert engine.cache.evictions == 8


def test_an_evicted_prefix_loses_its_tail_before_its_head() -> None:
    engine = cached_engine(num_kv_blocks=12)
    prompt = list(range(8 * BS))
    engine.add_request(request("a", prompt))
    now = drain(engine)
    engine.add_request(request("b", list(range(9_000, 9_000 + 7 * BS - 1)), arrival_s=now))
    engine.step(now)
    # 7 blocks needed, 4 uncached free: the prompt's last 3 blocks were evicted.
    assert engine.cached_prefix(chain_hashes(prompt, BS))[0] == 5


def test_waiting_requests_report_only_uncached_prefill_tokens() -> None:
    engine = cached_engine(num_kv_blocks=64, max_num_seqs=1)
    prompt = list(range(10 * BS))
    engine.add_request(request("a", prompt, output=30))
    engine.step(0.0)  # a runs and holds its blocks; b must wait (one sequence slot)
    engine.add_request(request("b", [*prompt, 7, 7, 7]))
    assert engine.stats(0.0).queued_prefill_tokens == 10 * BS + 3 - 10 * BS


def test_larry_counts_only_uncached_blocks_as_memory() -> None:
    # A long prompt that is mostly cached must beat a shorter uncached one.
    engine = cached_engine("larry", num_kv_blocks=200, max_num_seqs=1, alpha=0.0)
    shared = list(range(20 * BS))
    engine.add_request(request("warm", shared, output=1))
    now = drain(engine)
    blocker = request("blocker", list(range(70_000, 70_100)), output=20, arrival_s=now)
    engine.add_request(blocker)
    now += engine.step(now).duration_s
    short = request("short", list(range(80_000, 80_000 + 5 * BS)), arrival_s=now)
    cached_long = request("cached_long", [*shared, 5, 5], arrival_s=now)
    engine.add_request(short)
    engine.add_request(cached_long)
    drain(engine, now)
    assert cached_long.first_token_s is not None
    assert short.first_token_s is not None
    assert cached_long.first_token_s < short.first_token_s
    # Without the cache the longer prompt goes last.
    plain = make_engine("larry", num_kv_blocks=200, max_num_seqs=1, alpha=0.0)
    requests = [
        SimRequest(r.request_id, 0.0, r.prompt_tokens, r.output_tokens)
        for r in (blocker, short, cached_long)
    ]
    for r in requests:
        plain.add_request(r)
    drain(plain)
    assert requests[2].first_token_s is not None
    assert requests[1].first_token_s is not None
    assert requests[2].first_token_s > requests[1].first_token_s


@pytest.mark.parametrize("scheduler", sorted(ENGINE_SCHEDULERS))
def test_without_reuse_the_cache_changes_nothing(scheduler: str) -> None:
    """Unique prompts, cache evictions but no preemption: every timestamp equals the run
    without prefix caching (the Azure traces have no reuse)."""

    def requests() -> list[SimRequest]:
        reqs = random_requests(seed=11, n=80, max_prompt=400, max_output=80)
        for r in reqs:
            r.block_keys = chain_hashes([hash(r.request_id), *range(r.prompt_tokens)], BS)
        return reqs

    plain, cached = requests(), requests()
    run(make_engine(scheduler, num_kv_blocks=300, max_num_batched_tokens=128), plain)
    engine = cached_engine(scheduler, num_kv_blocks=300, max_num_batched_tokens=128)
    run(engine, cached)
    assert engine.cache is not None
    assert engine.cache.evictions > 0
    assert sum(r.num_preemptions for r in plain) == 0
    assert [(r.first_token_s, r.finish_s) for r in plain] == [
        (r.first_token_s, r.finish_s) for r in cached
    ]
    assert engine.prefix_hits_tokens == 0


def test_a_preempted_request_reuses_its_own_cached_blocks() -> None:
    # vLLM's recompute preemption frees the blocks, but full ones stay cached: unless they
    # were evicted meanwhile, the re-admission recomputes only the rest.
    engine = cached_engine(num_kv_blocks=12, max_num_batched_tokens=512)
    victim = request("victim", list(range(5 * BS + 3)), output=60)
    engine.add_request(victim)
    now = engine.step(0.0).duration_s
    hog = request("hog", list(range(9_000, 9_000 + 5 * BS)), output=60, arrival_s=now)
    engine.add_request(hog)
    while victim.num_preemptions == 0 and hog.num_preemptions == 0:
        now += engine.step(now).duration_s
    preempted = victim if victim.num_preemptions else hog
    assert preempted.prefix_hit_tokens > 0
    drain(engine, now)
    assert engine.prefix_hits_tokens > 0  # only the re-admission can hit: prompts are unique


@settings(max_examples=30, deadline=None)
@given(
    scheduler=st.sampled_from(sorted(ENGINE_SCHEDULERS)),
    seed=st.integers(0, 10_000),
    num_kv_blocks=st.integers(40, 120),
    budget=st.sampled_from([16, 64, 512]),
    full=st.booleans(),
)
def test_cache_accounting_holds_under_reuse_and_pressure(
    scheduler: str, seed: int, num_kv_blocks: int, budget: int, full: bool
) -> None:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(0, 200))] for _ in range(4)]
    engine = cached_engine(
        scheduler,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        reserve_full_prompt=full,
    )
    reqs = []
    t = 0.0
    for i in range(30):
        t += rng.expovariate(30.0)
        tokens = [*rng.choice(prefixes), *(rng.randrange(1000) for _ in range(rng.randint(1, 150)))]
        reqs.append(request(f"r{i}", tokens, output=rng.randint(1, 60), arrival_s=t))
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    now, k = 0.0, 0
    while k < len(pending) or engine.has_work():
        while k < len(pending) and pending[k].arrival_s <= now:
            engine.add_request(pending[k])
            k += 1
        if not engine.has_work():
            now = pending[k].arrival_s
            continue
        now += engine.step(now).duration_s
        check_cache_invariants(engine, reqs)
        assert engine.queued_prefill_tokens >= 0
    assert all(r.output_done == r.output_tokens for r in reqs)
    assert engine.free_blocks == num_kv_blocks
    assert engine.queued_prefill_tokens == 0
