"""What each replica holds in its prefix cache, as the gateway tracks it (``routing.prefix_cache``).

Pure bookkeeping on the main event loop (no I/O): one `PrefixTracker` per gateway, one
`sal_core.prefix.PrefixIndex` per model (block keys of different models never mix). Fed by

* the request path: the admitted request's block keys (`tokenizer.PromptCount.block_keys`,
  chained over the very token ids vLLM will hash) fill the views' ``cached_tokens`` /
  ``cached_held_tokens`` for every candidate (`annotate`), and the chosen replica's entry
  takes the blocks, held until the request ends (`hold`);
* the pollers: each replica's ``/stats`` gives its block size, whether prefix caching is on
  and its KV capacity, which bounds its entry (LRU; `observe`). An engine that restarted
  (its step counter went back) or turned caching off starts empty;
* in ``kv_events`` mode, vLLM's own KV-cache events (`kv_events`): stored blocks refresh or
  enter the entry, removed blocks leave it, a cleared cache empties it (`apply`).

Beside the index, per model, a `sal_core.fleet_reuse.FleetReuse`: what a cache as large as
the whole tracked fleet's KV (and 2x, 4x that) would have held of each routed prompt
(`fleet_reuse`), sized by the tracked replicas' capacities summed; in ``kv_events`` mode the
blocks the engines report stored enter it too (other gateways' requests, decoded replies).

Modes: ``off`` (no tracker; every cached field 0: SAL is Eq. 2 blind to caches), ``approximate``
(the index of what the gateway routed, evicted by capacity LRU), ``kv_events`` (the same,
corrected by the engine's evictions and filled by other gateways' traffic).

A replica is predicted to hold a block only if its ``/stats`` says prefix caching is on with
the model's block size (the first such replica's). As in vLLM, the prompt's last token is
never a hit: a prompt of n tokens reuses at most ``(n - 1) // block_size`` blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sal_core.fleet_reuse import FleetReuse
from sal_core.policies import BackendView
from sal_core.prefix import PrefixIndex, adapter_keys
from sal_core.stats import ReplicaStats

MODES = ("off", "approximate", "kv_events")
"""Values of ``routing.prefix_cache``."""


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """One request's prompt as the prefix index sees it."""

    keys: tuple[int, ...]
    """Chained keys of its full blocks (`sal_core.prefix.chain_hashes`)."""
    prompt_tokens: int
    """Its prompt tokens (one engine request's)."""

    def for_adapter(self, adapter: str) -> PromptBlocks:
        """The same prompt run with LoRA adapter `adapter` (its own blocks in vLLM's cache)."""
        return PromptBlocks(adapter_keys(self.keys, adapter), self.prompt_tokens)


@dataclass(slots=True)
class _Replica:
    caching: bool = False
    block_size: int = 0
    capacity_blocks: int = -1
    step: int = -1
    engine_queries: int = 0
    engine_hits: int = 0


@dataclass(slots=True)
class _ModelCache:
    index: PrefixIndex = field(default_factory=PrefixIndex)
    block_size: int | None = None
    """The model's block size: the first replica's that has prefix caching on."""
    replicas: dict[str, _Replica] = field(default_factory=dict)
    reuse: FleetReuse = field(default_factory=FleetReuse)

    def resize_reuse(self) -> None:
        """Size `reuse` by the KV of the replicas whose blocks the index tracks."""
        self.reuse.set_fleet_blocks(
            sum(
                r.capacity_blocks
                for r in self.replicas.values()
                if r.caching and r.block_size == self.block_size and r.capacity_blocks > 0
            )
        )


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Increase of a replica's own prefix-cache counters since its previous poll."""

    query_tokens: int
    hit_tokens: int


class PrefixTracker:
    """See the module docstring. Main loop only; every method is O(blocks of one request) or
    O(1), so a request's lookup over 64 replicas stays in the tens of microseconds."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES or mode == "off":
            raise ValueError(f"prefix cache mode must be approximate or kv_events, got {mode!r}")
        self.mode = mode
        self._models: dict[str, _ModelCache] = {}
        self.hold_listeners: list[Callable[[str, str, Sequence[int]], Callable[[], None]]] = []
        """Each is called with ``(model, url, keys)`` after every `hold` that indexed blocks;
        what it returns is called when that hold is released. The workers'
        `sal_gateway.prefix_share` tells the other workers of this host both, ``peers``
        the gateways on other hosts (`sal_gateway.peers.PeerNetwork.tell_blocks`)."""

    def _model(self, model: str) -> _ModelCache:
        cache = self._models.get(model)
        if cache is None:
            cache = self._models[model] = _ModelCache()
        return cache

    # --- what the request path asks ----------------------------------------------------

    def block_size(self, model: str) -> int | None:
        """The block size to key `model`'s prompts by (None until a replica reported one)."""
        cache = self._models.get(model)
        return None if cache is None else cache.block_size

    def tracking(self, model: str, url: str) -> bool:
        """Whether `url`'s blocks are indexed from now on: its last good poll reported prefix
        caching on, with `model`'s block size. Until then a request routed there is not
        remembered (`hold` returns None), so a model's block size alone does not mean
        every replica is tracked."""
        cache = self._models.get(model)
        replica = None if cache is None else cache.replicas.get(url)
        return (
            cache is not None
            and replica is not None
            and replica.caching
            and replica.block_size == cache.block_size
        )

    def block_sizes(self) -> dict[str, int]:
        """Every model's block size known so far (for the body workers)."""
        return {m: c.block_size for m, c in self._models.items() if c.block_size is not None}

    def annotate(self, model: str, views: Sequence[BackendView], blocks: PromptBlocks) -> None:
        """Fill each view's ``cached_tokens`` / ``cached_held_tokens`` for `blocks`, and its
        ``indexed_tokens`` (in place: the views are this request's own, fresh from the
        state table)."""
        cache = self._models.get(model)
        if cache is None or cache.block_size is None or not blocks.keys:
            return
        size = cache.block_size
        keys = blocks.keys[: max(0, (blocks.prompt_tokens - 1) // size)]
        if not keys:
            return
        match = cache.index.match_prefix_closed  # O(log blocks) per replica
        replicas = cache.replicas
        for view in views:
            replica = replicas.get(view.url)
            if replica is None or not replica.caching or replica.block_size != size:
                continue
            view.indexed_tokens = cache.index.size(view.url) * size
            found = match(view.url, keys)
            if found.cached_blocks:
                view.cached_tokens = found.cached_blocks * size
                view.cached_held_tokens = found.held_blocks * size

    def fleet_blocks(self, model: str) -> int:
        """The tracked fleet's KV in blocks: what `fleet_reuse`'s x1 cache holds (0: none
        reported yet)."""
        cache = self._models.get(model)
        return 0 if cache is None else cache.reuse.fleet_blocks

    def fleet_sample_shift(self, model: str) -> int | None:
        """`fleet_reuse` samples 1 block key in ``2**shift`` (those whose low `shift` bits
        are 0), each found one counting for ``2**shift`` blocks; None: `model` unknown."""
        cache = self._models.get(model)
        return None if cache is None else cache.reuse.sample_shift

    def fleet_reuse(self, model: str, blocks: PromptBlocks) -> tuple[int, ...] | None:
        """A request with `blocks` was routed (call once, not per retry): per scale of
        `sal_core.fleet_reuse.SCALES`, the estimated prompt tokens a pooled cache of that
        many times the tracked fleet's KV held; then the pooled caches take its blocks.
        None while no tracked replica has reported its capacity."""
        cache = self._models.get(model)
        if cache is None or cache.block_size is None or cache.reuse.fleet_blocks <= 0:
            return None
        size = cache.block_size
        found = cache.reuse.observe(blocks.keys, max(0, (blocks.prompt_tokens - 1) // size))
        return tuple(blocks_found * size for blocks_found in found)

    def hold(self, model: str, url: str, blocks: PromptBlocks) -> Callable[[], None] | None:
        """`blocks` were routed to `url`: they become its most recent blocks, held until the
        returned callable is called (the request ended). None when `url` keeps no cache."""
        cache = self._models.get(model)
        replica = None if cache is None else cache.replicas.get(url)
        if cache is None or replica is None or not replica.caching or not blocks.keys:
            return None
        if replica.block_size != cache.block_size:
            return None
        index, keys = cache.index, blocks.keys
        index.insert(url, keys, hold=True)
        if not self.hold_listeners:
            return lambda: index.release(url, keys)
        ends = [listener(model, url, keys) for listener in self.hold_listeners]

        def release() -> None:
            index.release(url, keys)
            for ended in ends:
                ended()

        return release

    # --- what the pollers and the event subscribers report -----------------------------

    def observe(self, model: str, url: str, stats: ReplicaStats) -> EngineCounters:
        """A good poll of `url`: learn its block size, caching switch and capacity; start
        its entry empty when its engine restarted. Returns the growth of its engine's own
        hit counters (a restarted engine's counters start again from 0)."""
        cache = self._model(model)
        replica = cache.replicas.get(url)
        if replica is None:
            replica = cache.replicas[url] = _Replica()
        restarted = 0 < stats.step < replica.step
        if restarted or (replica.caching and not stats.prefix_caching):
            cache.index.remove_backend(url)
            replica.capacity_blocks = -1
        # What sizes the fleet-reuse estimate (re-summed only when it changed: polls come
        # ~10x a second from every replica).
        was = (replica.caching, replica.block_size, replica.capacity_blocks, cache.block_size)
        replica.step = stats.step
        replica.caching = stats.prefix_caching
        replica.block_size = stats.block_size
        if stats.prefix_caching and cache.block_size is None and stats.block_size > 0:
            cache.block_size = stats.block_size
        capacity = stats.kv_blocks_total if replica.block_size == cache.block_size else 0
        if capacity != replica.capacity_blocks:
            cache.index.set_capacity(url, capacity)
            replica.capacity_blocks = capacity
        if was != (replica.caching, replica.block_size, replica.capacity_blocks, cache.block_size):
            cache.resize_reuse()
        queries, hits = stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens
        grown = EngineCounters(
            queries - replica.engine_queries if queries >= replica.engine_queries else queries,
            hits - replica.engine_hits if hits >= replica.engine_hits else hits,
        )
        replica.engine_queries, replica.engine_hits = queries, hits
        return grown

    def indexed_blocks(self, model: str, url: str) -> int:
        """Blocks indexed for `url` now."""
        cache = self._models.get(model)
        return 0 if cache is None else cache.index.size(url)

    def store(self, model: str, url: str, keys: Sequence[int]) -> None:
        """`url`'s engine stored (or reused) these blocks (a KV event): most recent, unheld;
        and in the fleet-reuse estimate too, so that it covers every gateway's traffic."""
        cache = self._models.get(model)
        if cache is not None and keys:
            cache.index.insert(url, keys, hold=False)
            cache.reuse.touch(keys)

    def told(self, model: str, url: str, keys: Sequence[int], held: bool) -> bool:
        """Another worker of this host (`sal_gateway.prefix_share`) or a gateway on another
        host (``peers``, `sal_gateway.peers`) routed a prompt with these blocks to `url`
        (`held`), or that request ended (not `held`). Routed: cached there, most recent,
        held until the other one says the request ended; and in the fleet-reuse estimate,
        so that it covers every worker's and gateway's traffic. Ended: unheld, as
        `hold`'s release. A routed message is ignored unless this worker tracks `url` for
        `model` (`tracking`): an unknown backend's entry would have no capacity bound. Returns
        whether the blocks are now held for that request (only then may its end release
        them: a release without a hold would end this worker's own hold on the same blocks)."""
        cache = self._models.get(model)
        if cache is None or not keys:
            return False
        if not held:
            cache.index.release(url, keys)
            return False
        if not self.tracking(model, url):
            return False
        cache.index.insert(url, keys, hold=True)
        cache.reuse.touch(keys)
        return True

    def evict(self, model: str, url: str, keys: Sequence[int]) -> None:
        """`url`'s engine evicted these blocks (a KV event)."""
        cache = self._models.get(model)
        if cache is not None and keys:
            cache.index.discard(url, keys)

    def clear(self, model: str, url: str) -> None:
        """`url`'s engine dropped its whole prefix cache (a KV event)."""
        cache = self._models.get(model)
        replica = None if cache is None else cache.replicas.get(url)
        if cache is None or replica is None:
            return
        cache.index.remove_backend(url)
        cache.index.set_capacity(url, max(0, replica.capacity_blocks))

    def forget(self, model: str, url: str) -> None:
        """`url` left `model`'s pool."""
        cache = self._models.get(model)
        if cache is not None:
            cache.index.remove_backend(url)
            cache.replicas.pop(url, None)
            cache.resize_reuse()
