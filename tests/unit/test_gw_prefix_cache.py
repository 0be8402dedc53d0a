"""The gateway's prefix tracker (`sal_gateway.prefix_cache`): what each replica is predicted to
hold of a prompt, as the views a policy sees carry it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine_sim.fake_vllm import default_stats
from sal_core.policies import SAL, BackendView, PaperSAL, PolicySettings, RouteRequest
from sal_core.prefix import chain_hashes
from sal_core.stats import ReplicaStats
from sal_gateway.prefix_cache import PrefixTracker, PromptBlocks

BS = 16
A, B = "http://a", "http://b"


def _stats(**kw: object) -> ReplicaStats:
    return replace(default_stats(), prefix_caching=True, prefix_hash_algo="sha256", **kw)  # type: ignore[arg-type]


def _views() -> list[BackendView]:
    return [BackendView(url, True, 0, 16000, 0, 2048) for url in (A, B)]


def _blocks(tokens: list[int]) -> PromptBlocks:
    return PromptBlocks(tuple(chain_hashes(tokens, BS)), len(tokens))


def _tracker(**kw: object) -> PrefixTracker:
    tracker = PrefixTracker("approximate")
    for url in (A, B):
        tracker.observe("m", url, _stats(**kw))
    return tracker


CONV = list(range(1000, 1000 + 10 * BS + 5))
"""A conversation so far: 10 full blocks and 5 tokens."""


def test_the_replica_that_served_a_prefix_is_predicted_to_hold_it_while_held_then_unheld() -> None:
    tracker = _tracker()
    release = tracker.hold("m", A, _blocks(CONV))
    assert release is not None
    turn2 = _blocks([*CONV, *range(7, 40)])
    views = _views()
    tracker.annotate("m", views, turn2)
    a, b = views
    assert (a.cached_tokens, a.cached_held_tokens) == (10 * BS, 10 * BS)
    assert (b.cached_tokens, b.cached_held_tokens) == (0, 0)
    release()
    views = _views()
    tracker.annotate("m", views, turn2)
    assert (views[0].cached_tokens, views[0].cached_held_tokens) == (10 * BS, 0)


def test_cache_aware_sal_follows_the_prefix_and_the_paper_does_not() -> None:
    """The views' cached fields are what turns SAL cache-aware: a loaded replica that holds
    most of the prompt beats an idle one that holds nothing."""
    tracker = _tracker()
    tracker.hold("m", A, _blocks(CONV))
    views = _views()
    views[0].queued_prefill_tokens = 100
    turn2 = [*CONV, *range(7, 40)]
    tracker.annotate("m", views, _blocks(turn2))
    request = RouteRequest(len(turn2), beta=2.0)
    every_hit = PolicySettings(min_match_tokens=0)  # this conversation is short
    assert SAL(settings=every_hit).select(request, views).url == A
    assert PaperSAL(settings=every_hit).select(request, views).url == B
    # By default a match this short (160 tokens) is ignored: the paper's choice.
    assert SAL().select(request, views).url == B


def test_a_prompt_is_never_predicted_to_hit_its_last_token() -> None:
    tracker = _tracker()
    exact = list(range(5000, 5000 + 4 * BS))
    tracker.hold("m", A, _blocks(exact))
    views = _views()
    tracker.annotate("m", views, _blocks(exact))
    assert views[0].cached_tokens == 3 * BS  # vLLM recomputes the last block's last token


def test_replicas_without_prefix_caching_are_never_predicted_to_hold_anything() -> None:
    tracker = PrefixTracker("approximate")
    tracker.observe("m", A, replace(default_stats(), prefix_caching=False))
    tracker.observe("m", B, _stats())
    assert tracker.hold("m", A, _blocks(CONV)) is None
    tracker.hold("m", B, _blocks(CONV))
    views = _views()
    tracker.annotate("m", views, _blocks(CONV))
    assert views[0].cached_tokens == 0
    assert views[1].cached_tokens == 10 * BS


def test_a_replica_with_another_block_size_is_not_matched() -> None:
    tracker = PrefixTracker("approximate")
    tracker.observe("m", A, _stats())
    tracker.observe("m", B, _stats(block_size=32))
    assert tracker.block_size("m") == BS
    assert tracker.hold("m", B, _blocks(CONV)) is None


def test_capacity_from_stats_bounds_the_index_lru() -> None:
    tracker = _tracker(kv_blocks_total=12)
    first = list(range(100, 100 + 10 * BS))
    second = list(range(9000, 9000 + 10 * BS))
    tracker.hold("m", A, _blocks(first))()
    tracker.hold("m", A, _blocks(second))()
    assert tracker.indexed_blocks("m", A) == 12
    views = _views()
    tracker.annotate("m", views, _blocks([*first, 1]))
    assert views[0].cached_tokens < 10 * BS  # the older prompt lost its tail
    views = _views()
    tracker.annotate("m", views, _blocks([*second, 1]))
    assert views[0].cached_tokens == 10 * BS


def test_an_engine_that_restarted_starts_empty_and_its_counters_restart() -> None:
    tracker = PrefixTracker("approximate")
    assert (
        tracker.observe("m", A, _stats(step=50, prefix_cache_query_tokens=900)).query_tokens == 900
    )
    tracker.hold("m", A, _blocks(CONV))()
    grown = tracker.observe(
        "m", A, _stats(step=80, prefix_cache_query_tokens=1000, prefix_cache_hit_tokens=64)
    )
    assert (grown.query_tokens, grown.hit_tokens) == (100, 64)
    assert tracker.indexed_blocks("m", A) == 10
    grown = tracker.observe("m", A, _stats(step=3, prefix_cache_query_tokens=30))
    assert tracker.indexed_blocks("m", A) == 0
    assert grown.query_tokens == 30


def test_kv_event_store_evict_and_clear_drive_the_index() -> None:
    tracker = PrefixTracker("kv_events")
    tracker.observe("m", A, _stats())
    keys = chain_hashes(CONV, BS)
    tracker.store("m", A, keys)
    assert tracker.indexed_blocks("m", A) == 10
    tracker.evict("m", A, keys[6:])
    views = _views()
    tracker.annotate("m", views, _blocks(CONV))
    assert views[0].cached_tokens == 6 * BS
    tracker.clear("m", A)
    assert tracker.indexed_blocks("m", A) == 0
    tracker.store("m", A, keys)
    assert tracker.indexed_blocks("m", A) == 10  # the capacity survives a clear


def test_off_is_not_a_tracker_mode() -> None:
    with pytest.raises(ValueError, match="approximate or kv_events"):
        PrefixTracker("off")


def test_a_replica_is_tracked_only_once_its_own_poll_reported_caching_on() -> None:
    # The model's block size comes from the first replica polled; a request routed to one not
    # polled since caching went on is not remembered, which is what `tracking` tells.
    tracker = PrefixTracker("approximate")
    tracker.observe("m", A, _stats())
    assert tracker.block_size("m") == BS
    assert tracker.tracking("m", A)
    assert not tracker.tracking("m", B)
    assert tracker.hold("m", B, _blocks(CONV)) is None  # not indexed: nothing to release
    tracker.observe("m", B, _stats())
    assert tracker.tracking("m", B)
    tracker.observe("m", B, replace(_stats(), prefix_caching=False))
    assert not tracker.tracking("m", B)
    assert not tracker.tracking("other", A)


def _sampled_blocks(n_blocks: int, seed: int, shift: int) -> tuple[list[int], int]:
    """A prompt of `n_blocks` full blocks and 5 tokens whose reusable blocks include some
    the fleet-reuse estimate samples (1 key in ``2**shift``); and how many."""
    rng = random.Random(seed)
    mask = (1 << shift) - 1
    while True:
        tokens = [rng.randrange(32_000) for _ in range(n_blocks * BS + 5)]
        sampled = sum(1 for k in chain_hashes(tokens, BS) if not k & mask)
        if sampled:
            return tokens, sampled


def test_the_fleet_reuse_estimate_is_sized_by_the_replicas_that_cache() -> None:
    tracker = PrefixTracker("approximate")
    tracker.observe("m", A, _stats(kv_blocks_total=500))
    tracker.observe("m", B, _stats(kv_blocks_total=300))
    tracker.observe("m", "http://c", replace(_stats(kv_blocks_total=900), prefix_caching=False))
    assert tracker.fleet_blocks("m") == 800  # c keeps no prefix cache: not counted
    tracker.forget("m", B)
    assert tracker.fleet_blocks("m") == 500
    tracker.observe("m", A, replace(_stats(kv_blocks_total=500), prefix_caching=False))
    assert tracker.fleet_blocks("m") == 0
    assert tracker.fleet_reuse("m", _blocks(CONV)) is None  # nothing to size it by


def test_the_fleet_reuse_estimate_counts_a_repeated_prompt_in_tokens_at_every_scale() -> None:
    for blocks, shift in ((1_000, 0), (20_000, 4)):  # 2 replicas: exact, then 1 in 16
        tracker = _tracker(kv_blocks_total=blocks)
        assert tracker.fleet_sample_shift("m") == shift
        tokens, sampled = _sampled_blocks(40, seed=5, shift=shift)
        assert tracker.fleet_reuse("m", _blocks(tokens)) == (0, 0, 0)
        # Every sampled block of the reusable 40 stands for 2**shift blocks of 16 tokens.
        again = tracker.fleet_reuse("m", _blocks(tokens))
        assert again == ((sampled << shift) * BS,) * 3
    assert tracker.fleet_reuse("m", _blocks(list(range(7, 7 + 40 * BS)))) == (0, 0, 0)


def test_with_kv_events_the_fleet_reuse_estimate_sees_other_gateways_traffic() -> None:
    # Blocks a replica reports stored (here: a prompt another gateway routed) count as held
    # by the pooled cache, so this gateway's first request of that prompt finds them.
    for mode, found in (("kv_events", True), ("approximate", False)):
        tracker = PrefixTracker(mode)
        for url in (A, B):
            tracker.observe("m", url, _stats(kv_blocks_total=500))
        assert tracker.fleet_sample_shift("m") == 0  # a small fleet: every key
        elsewhere = _blocks(CONV)
        if mode == "kv_events":  # only the event subscribers call store
            tracker.store("m", B, elsewhere.keys)
        expected = (10 * BS,) * 3 if found else (0, 0, 0)
        assert tracker.fleet_reuse("m", elsewhere) == expected


def test_every_routed_hold_is_told_to_each_listener_and_so_is_its_end() -> None:
    """The workers' exchange and ``peers`` both listen: each hears the routed blocks once
    and, when the request ends, its own end."""
    tracker = _tracker()
    events: list[tuple[str, str, str]] = []

    def listener(name: str) -> object:
        def told(model: str, url: str, keys: object) -> object:
            assert tuple(keys) == tuple(chain_hashes(CONV, BS))  # type: ignore[call-overload]
            events.append((name, url, "routed"))
            return lambda: events.append((name, url, "ended"))

        return told

    tracker.hold_listeners += [listener("workers"), listener("peers")]  # type: ignore[list-item]
    release = tracker.hold("m", A, _blocks(CONV))
    assert release is not None
    assert events == [("workers", A, "routed"), ("peers", A, "routed")]
    release()
    assert events[2:] == [("workers", A, "ended"), ("peers", A, "ended")]
    assert tracker.hold("m", "http://unknown:1", _blocks(CONV)) is None  # not indexed
    assert len(events) == 4
