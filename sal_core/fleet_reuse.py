"""How much prefix reuse a fleet's KV cache could keep, and how much more KV would keep (pure).

Tells a deployment which regime it is in. The gateway's routing and vLLM's counters say what
is reused now (`sal_prefix_predicted_hit_tokens`, `sal_prefix_engine_hit_tokens`); they do
not say whether better routing or more KV memory would reuse more. `FleetReuse` answers
both from the prompts alone: it replays every routed prompt's full blocks through one LRU
cache as large as the whole fleet's KV (every replica's blocks pooled, no replica boundary),
and through two more with 2x and 4x that. Its hit rate at x1 is what a router that always
finds a cached prefix could keep with this fleet's memory; x2 and x4 are what FP8 KV, larger
GPUs or more replicas would add. Reading it:

* achieved (vLLM's counters) well below x1: routing scatters the reuse (a cache-aware
  policy would keep more);
* x1 near achieved, x2 and x4 well above it: KV-bound (the cache evicts prefixes before they
  return; more KV per replica, not routing, pays);
* all three near 0: the traffic has little reuse.

Checked against the simulator (`sal-bench prefix --only reuse-profile`,
docs/results/prefix.md): at x1 its median per scenario was within 2.5 points of the best
cache-aware router's measured hit rate on all 8 scenarios, and on the Mooncake synthetic
trace within 0.6 points at x1, x2 and x4 KV. Not a bound: a replica's own cache holds only
what was routed to it, and the pooled cache keeps no running request's blocks apart. Fed
by the routed prompts (`observe`) it misses the replies a multi-turn prompt repeats and
other gateways' traffic; blocks the engines report stored (`touch`) add both.

Memory and time stay bounded whatever the fleet: blocks are sampled by key (SHARDS,
Waldspurger et al., FAST 2015: the LRU of a spatially hashed sample, its capacity scaled by
the same rate, has about the same hit rate): a key is kept when its low ``shift`` bits are
all 0 (a chained key is a Python tuple hash, whose last multiply-and-rotate round mixes
them well), so a key kept at one rate is kept at every lower one. ``shift`` is `min_shift`
(1 block in 16 by default, so an 8k-token prompt costs tens of microseconds, not a
millisecond), smaller on a fleet so small that the x1 cache would keep fewer than
`min_x1_samples` keys (under 2,048 blocks every key is kept: exact), and larger where the x4
cache would keep more than `max_sampled_blocks`; each sampled hit counts for ``2**shift``
blocks. Since a request's blocks enter child
first, parent last, a cached block's prefix is cached too, so counting the prompt's cached
blocks one by one counts its leading cached run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

SCALES = (1, 2, 4)
"""KV of the pooled caches, in multiples of the fleet's."""


class FleetReuse:
    """Pooled LRU caches of a fleet's KV x `SCALES` over the prompts routed (see module doc).

    One per model (block keys of different models never mix). `set_fleet_blocks` whenever
    the fleet's KV changes; `observe` once per routed request, in routing order."""

    def __init__(
        self, max_sampled_blocks: int = 1 << 15, min_shift: int = 4, min_x1_samples: int = 1024
    ) -> None:
        if max_sampled_blocks < 1:
            raise ValueError(f"max_sampled_blocks must be >= 1, got {max_sampled_blocks}")
        if not 0 <= min_shift <= 20:
            raise ValueError(f"min_shift must be in 0..20, got {min_shift}")
        if min_x1_samples < 1:
            raise ValueError(f"min_x1_samples must be >= 1, got {min_x1_samples}")
        self._budget = max_sampled_blocks
        self._min_shift = min_shift
        self._min_samples = min_x1_samples
        self._fleet_blocks = 0
        self._shift = min_shift
        self._caches: tuple[OrderedDict[int, None], ...] = tuple(OrderedDict() for _ in SCALES)
        self._capacities = tuple(0 for _ in SCALES)

    @property
    def fleet_blocks(self) -> int:
        """The fleet's KV, in blocks, that the x1 cache holds (0: nothing is observed)."""
        return self._fleet_blocks

    @property
    def sample_shift(self) -> int:
        """Blocks are sampled at rate 1 / 2**sample_shift."""
        return self._shift

    def set_fleet_blocks(self, blocks: int) -> None:
        """The fleet's KV is now `blocks` blocks in all: resize the caches (the least
        recently used blocks beyond the new capacity leave; when the sampling rate drops,
        so do the keys no longer sampled). A rate that rises starts sampling the new keys
        from now on, so the caches hold too few for a while: hit rates then read low."""
        blocks = max(0, blocks)
        if blocks == self._fleet_blocks:
            return
        self._fleet_blocks = blocks
        # Sample 1 in 2**min_shift, less coarsely where the x1 cache would keep fewer than
        # min_x1_samples keys (a small fleet: its prompts have few blocks too), and more
        # coarsely where the x4 cache would pass the budget.
        shift = 0
        while shift < self._min_shift and blocks >> (shift + 1) >= self._min_samples:
            shift += 1
        while (SCALES[-1] * blocks) >> shift > self._budget:
            shift += 1
        if shift > self._shift:
            mask = (1 << shift) - 1
            for cache in self._caches:
                for key in [k for k in cache if k & mask]:
                    del cache[key]
        self._shift = shift
        self._capacities = tuple((scale * blocks) >> shift for scale in SCALES)
        for cache, capacity in zip(self._caches, self._capacities, strict=True):
            while len(cache) > capacity:
                cache.popitem(last=False)

    def observe(self, keys: Sequence[int], reusable: int) -> tuple[int, ...]:
        """A request with chained block `keys` (`sal_core.prefix.chain_hashes`) was routed:
        per scale of `SCALES`, the estimated blocks of its first `reusable` keys that cache
        held (vLLM never reuses a prompt's last token: ``(prompt_tokens - 1) // block_size``);
        then all its keys become the most recently used. All 0 while the fleet's KV is
        unknown. Unbiased over many requests; one request's estimate is a multiple of
        the sampling stride (``2**sample_shift``) and may exceed `reusable`."""
        if self._fleet_blocks <= 0 or not keys:
            return tuple(0 for _ in SCALES)
        shift = self._shift
        if shift:  # (every key sampled at shift 0)
            mask = (1 << shift) - 1
            lookup = [k for k in keys[:reusable] if not k & mask]
            sampled = lookup + [k for k in keys[reusable:] if not k & mask]
        else:
            lookup, sampled = list(keys[:reusable]), list(keys)
        hits = []
        for cache in self._caches:
            found = 0
            for key in lookup:
                if key in cache:
                    found += 1
            hits.append(found << shift)
        self._insert(sampled)
        return tuple(hits)

    def touch(self, keys: Sequence[int]) -> None:
        """Blocks with chained `keys` were stored in some replica's cache without this
        gateway routing them (vLLM's KV events: another gateway's request, or the reply a
        request decoded): they become the most recently used, nothing is looked up. Keys
        from different requests may interleave; a request's own keys come parent first."""
        if self._fleet_blocks <= 0 or not keys:
            return
        shift = self._shift
        if shift:
            mask = (1 << shift) - 1
            self._insert([k for k in keys if not k & mask])
        else:
            self._insert(list(keys))

    def _insert(self, sampled: list[int]) -> None:
        for cache, capacity in zip(self._caches, self._capacities, strict=True):
            for key in reversed(sampled):  # child first: a parent stays more recent
                cache[key] = None
                cache.move_to_end(key)
            while len(cache) > capacity:
                cache.popitem(last=False)
