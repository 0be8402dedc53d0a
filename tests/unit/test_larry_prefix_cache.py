"""LARRY's memory term and `/stats` with vLLM's prefix cache, in vLLM's real V1 `Scheduler`.

The lookup (`cached_prefix_tokens`) must find what vLLM's own admission then reuses, and must
leave the cache as it found it: LRU order of the free-block queue, hit counters, KV events.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from engine_patch.scheduler import FcfsScheduler, LarryScheduler, cached_prefix_tokens
    from sal_core.larry import memory_blocks
    from tests.vllm_scheduler_support import BLOCK_SIZE, Clock, make_request, make_scheduler
    from tests.vllm_scheduler_support import run_step as step


@pytest.fixture(autouse=True)
def stats_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    prefix = tmp_path / "stats"
    monkeypatch.setenv("SAL_STATS_PREFIX", str(prefix))
    return prefix


SHARED = list(range(30, 30 + 6 * BLOCK_SIZE))
"""A 6-block conversation prefix."""


def _finish_all(sched: Any, steps: int = 20) -> None:
    for _ in range(steps):
        if not sched.requests:
            return
        step(sched)
    assert not sched.requests


def _warm(sched: Any) -> None:
    """Serve one request over `SHARED`, so its 6 full blocks stay cached (unheld)."""
    sched.add_request(make_request("turn-1", 0, arrival_s=999.0, prompt=[*SHARED, 1, 2, 3]))
    _finish_all(sched)


def _free_queue_ids(sched: Any) -> list[int]:
    return [
        b.block_id for b in sched.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
    ]


def test_lookup_finds_what_admission_reuses_and_has_no_side_effects(tiny_model_dir: Path) -> None:
    sched = make_scheduler(LarryScheduler, tiny_model_dir, enable_prefix_caching=True)
    pool = sched.kv_cache_manager.block_pool
    pool.enable_kv_cache_events = True  # as with --kv-events-config: lookups must emit nothing
    _warm(sched)
    pool.take_events()
    turn2 = make_request("turn-2", 0, arrival_s=1000.0, prompt=[*SHARED, 1, 2, 3, 4, 5, 6, 7])
    sched.add_request(turn2)
    lru_before = _free_queue_ids(sched)
    stats_before = sched.kv_cache_manager.prefix_cache_stats.queries

    found = [cached_prefix_tokens(sched.kv_cache_manager, turn2) for _ in range(3)]

    assert found == [6 * BLOCK_SIZE] * 3
    assert _free_queue_ids(sched) == lru_before, "the lookup reordered vLLM's LRU queue"
    assert sched.kv_cache_manager.prefix_cache_stats.queries == stats_before
    assert pool.take_events() == []
    # vLLM's own admission then skips exactly those tokens.
    output = step(sched)
    assert output.num_scheduled_tokens["turn-2"] == len(turn2.prompt_token_ids) - found[0]
    # ... and /stats carries vLLM's own hit counters (cumulative: both turns were queried).
    stats = sched.sal_stats()
    assert stats.prefix_cache_hit_tokens == found[0]
    assert stats.prefix_cache_query_tokens == len(SHARED) + 3 + len(turn2.prompt_token_ids)


def test_a_fully_cached_prompt_still_prefills_its_last_block(tiny_model_dir: Path) -> None:
    sched = make_scheduler(FcfsScheduler, tiny_model_dir, enable_prefix_caching=True)
    _warm(sched)
    again = make_request("again", 0, arrival_s=1000.0, prompt=SHARED)
    # 6 full blocks cached, but vLLM recomputes the last token, so its block is not a hit.
    assert cached_prefix_tokens(sched.kv_cache_manager, again) == 5 * BLOCK_SIZE


def test_stats_queued_prefill_is_net_of_the_cached_prefix(tiny_model_dir: Path) -> None:
    # One running request fills the token budget so the next two wait.
    sched = make_scheduler(
        FcfsScheduler, tiny_model_dir, enable_prefix_caching=True, max_num_seqs=1
    )
    _warm(sched)
    sched.add_request(make_request("busy", 40, arrival_s=1000.0, max_tokens=50))
    step(sched)
    turn2 = make_request("turn-2", 0, arrival_s=1000.1, prompt=[*SHARED, *range(5, 25)])
    cold = make_request("cold", 50, arrival_s=1000.2)
    sched.add_request(turn2)
    sched.add_request(cold)
    stats = sched.sal_stats()
    assert stats.prefix_caching is True
    assert stats.prefix_hash_algo == "sha256"
    assert stats.num_waiting == 2
    assert stats.cached_prefill_tokens == 6 * BLOCK_SIZE
    assert stats.queued_prefill_tokens == (len(SHARED) + 20 - 6 * BLOCK_SIZE) + 50


def test_stats_without_prefix_caching_count_every_prompt_token(tiny_model_dir: Path) -> None:
    sched = make_scheduler(FcfsScheduler, tiny_model_dir, enable_prefix_caching=False)
    _warm(sched)
    sched.add_request(make_request("turn-2", 0, arrival_s=1000.0, prompt=[*SHARED, 9]))
    stats = sched.sal_stats()
    assert (stats.prefix_caching, stats.prefix_hash_algo) == (False, None)
    assert stats.cached_prefill_tokens == 0
    assert stats.queued_prefill_tokens == len(SHARED) + 1


def test_larry_memory_term_counts_only_uncached_blocks(tiny_model_dir: Path) -> None:
    """A long follow-up turn whose prefix is cached needs fewer new blocks than a short cold
    prompt: LARRY admits it first, where a cache-blind memory term would put it last."""
    clock = Clock(1000.0)
    sched = make_scheduler(
        LarryScheduler, tiny_model_dir, enable_prefix_caching=True, clock=clock, max_num_seqs=1
    )
    _warm(sched)
    sched.add_request(make_request("busy", 20, arrival_s=1000.0, max_tokens=3))
    step(sched)  # "busy" runs; the next two wait behind the one-sequence limit
    follow_up = [*SHARED, *range(5, 10)]  # 101 tokens, 96 of them cached: 1 new block
    sched.add_request(make_request("cold", 40, arrival_s=1000.0))  # 3 new blocks, older
    sched.add_request(make_request("turn-2", 0, arrival_s=1000.0, prompt=follow_up))
    assert memory_blocks(len(follow_up), BLOCK_SIZE) > memory_blocks(40, BLOCK_SIZE)
    admitted: list[str] = []
    for _ in range(12):
        admitted += [r.req_id for r in step(sched).scheduled_new_reqs]
    assert admitted.index("turn-2") < admitted.index("cold")
