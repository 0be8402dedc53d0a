"""The fleet-reuse estimate: a pooled LRU cache of the fleet's KV (x1, x2, x4) over the routed
prompts, exact without sampling and close with it, bounded in memory whatever the fleet."""

from __future__ import annotations

import random

import pytest

from sal_core.fleet_reuse import SCALES, FleetReuse
from sal_core.prefix import chain_hashes

BS = 16


def _prompts(n: int, blocks: int, seed: int = 0) -> list[list[int]]:
    """`n` unrelated prompts of `blocks` full blocks each, as chained keys."""
    rng = random.Random(seed)
    return [chain_hashes([rng.randrange(32_000) for _ in range(blocks * BS)], BS) for _ in range(n)]


def _cycle(profile: FleetReuse, prompts: list[list[int]], rounds: int) -> list[int]:
    """Replay `prompts` round after round; the blocks found per scale in the last round."""
    last = [0] * len(SCALES)
    for r in range(rounds):
        for keys in prompts:
            found = profile.observe(keys, len(keys))
            if r == rounds - 1:
                last = [a + b for a, b in zip(last, found, strict=True)]
    return last


def test_a_working_set_that_fits_only_twice_the_kv_hits_only_from_x2() -> None:
    # 10 prompts of 30 blocks cycled (300 blocks) through a fleet of 200 blocks: LRU misses
    # every block at x1 (each is evicted just before it returns), hits every one at x2, x4.
    prompts = _prompts(10, 30)
    exact = FleetReuse(min_shift=0)
    exact.set_fleet_blocks(200)
    assert _cycle(exact, prompts, rounds=3) == [0, 300, 300]


def test_sampled_estimate_agrees_with_the_exact_one_over_many_prompts() -> None:
    # The default samples 1 block in 16: over 400 prompts of 64 blocks the estimate of the
    # last round lands near the exact count (a broken sample or scaling would be far off).
    prompts = _prompts(400, 64, seed=1)
    exact, sampled = FleetReuse(max_sampled_blocks=1 << 20, min_shift=0), FleetReuse()
    for profile in (exact, sampled):
        profile.set_fleet_blocks(20_000)  # 25,600 blocks cycled: x1 misses, x2 and x4 hit
    truth = _cycle(exact, prompts, rounds=2)
    estimate = _cycle(sampled, prompts, rounds=2)
    assert (exact.sample_shift, sampled.sample_shift) == (0, 4)
    assert truth == [0, 25_600, 25_600]
    assert estimate[0] == 0
    for scale in (1, 2):
        assert estimate[scale] == pytest.approx(truth[scale], rel=0.1)


def test_a_follow_up_counts_only_its_leading_shared_blocks_and_never_its_last_token() -> None:
    profile = FleetReuse(min_shift=0)
    profile.set_fleet_blocks(1_000)
    rng = random.Random(2)
    turn1 = [rng.randrange(32_000) for _ in range(5 * BS)]
    turn2 = [*turn1, *[rng.randrange(32_000) for _ in range(3 * BS)]]
    other = [rng.randrange(32_000) for _ in range(2 * BS)] + turn1[2 * BS :]
    assert profile.observe(chain_hashes(turn1, BS), (len(turn1) - 1) // BS) == (0, 0, 0)
    # 8 full blocks, the first 5 shared; all 5 reusable.
    assert profile.observe(chain_hashes(turn2, BS), (len(turn2) - 1) // BS) == (5, 5, 5)
    # Same tokens after a different start: chained keys share nothing.
    assert profile.observe(chain_hashes(other, BS), (len(other) - 1) // BS) == (0, 0, 0)
    # The same 5-block prompt again: its last block holds its last token, 4 are reusable.
    assert profile.observe(chain_hashes(turn1, BS), (len(turn1) - 1) // BS) == (4, 4, 4)


def test_nothing_is_estimated_until_the_fleet_reports_its_kv() -> None:
    profile = FleetReuse(min_shift=0)
    keys = _prompts(1, 8)[0]
    assert profile.observe(keys, 8) == (0, 0, 0)
    assert profile.observe(keys, 8) == (0, 0, 0)  # and nothing was remembered either
    profile.set_fleet_blocks(100)
    assert profile.observe(keys, 8) == (0, 0, 0)
    assert profile.observe(keys, 8) == (8, 8, 8)


def test_a_fleet_that_shrinks_forgets_its_least_recent_blocks() -> None:
    profile = FleetReuse(min_shift=0)
    profile.set_fleet_blocks(100)
    old, new = _prompts(2, 40, seed=3)
    profile.observe(old, 40)
    profile.observe(new, 40)
    # x1 keeps 30 blocks (of the newer prompt); x2 60: the newer prompt and the older one's
    # first 20 blocks (a prefix's tail leaves before its head); x4 120: both whole.
    profile.set_fleet_blocks(30)
    assert profile.observe(old, 40) == (0, 20, 40)
    assert profile.fleet_blocks == 30


def test_memory_stays_bounded_by_the_sample_budget_whatever_the_fleet() -> None:
    profile = FleetReuse(max_sampled_blocks=1_000)
    profile.set_fleet_blocks(1_000_000)  # a large fleet: 4M blocks at x4
    assert (SCALES[-1] * 1_000_000) >> profile.sample_shift <= 1_000
    for keys in _prompts(300, 64, seed=4):
        profile.observe(keys, 64)
    caches = profile._caches  # the bound is the point of the test
    assert max(len(c) for c in caches) <= 1_000
    # Growing the fleet raises the shift: keys no longer sampled leave every cache.
    before = profile.sample_shift
    profile.set_fleet_blocks(8_000_000)
    mask = (1 << profile.sample_shift) - 1
    assert profile.sample_shift > before
    assert all(not key & mask for cache in profile._caches for key in cache)


def test_a_small_fleet_is_sampled_finely_enough_to_keep_a_thousand_keys_at_x1() -> None:
    shifts = {}
    for blocks in (80, 2_047, 2_048, 8_000, 16_384, 1_000_000):
        profile = FleetReuse()
        profile.set_fleet_blocks(blocks)
        shifts[blocks] = profile.sample_shift
    # Exact under 2,048 blocks; 1 in 16 from 16,384 on; coarser once x4 passes 32,768 keys.
    assert shifts == {80: 0, 2_047: 0, 2_048: 1, 8_000: 2, 16_384: 4, 1_000_000: 7}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_sampled_blocks"):
        FleetReuse(max_sampled_blocks=0)
    with pytest.raises(ValueError, match="min_shift"):
        FleetReuse(min_shift=-1)
    with pytest.raises(ValueError, match="min_x1_samples"):
        FleetReuse(min_x1_samples=0)


def test_touched_blocks_are_found_by_later_requests_and_age_like_routed_ones() -> None:
    profile = FleetReuse(min_shift=0)
    profile.set_fleet_blocks(50)
    stored, routed = _prompts(2, 40, seed=6)
    profile.touch(stored)  # stored by a replica for a request this gateway did not route
    assert profile.observe(stored, 40) == (40, 40, 40)
    profile.observe(routed, 40)  # 40 newer blocks: x1 (50) keeps only 10 of the older ones
    assert profile.observe(stored, 40) == (10, 40, 40)
