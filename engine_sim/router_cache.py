"""What the simulated router knows of each replica's prefix cache (pure, no I/O).

The simulator's router fills `BackendView.cached_tokens` / ``cached_held_tokens`` /
``indexed_tokens`` for every candidate from one of two sources, as the gateway would:

* ``approximate`` — a `sal_core.prefix.PrefixIndex` of the full prompt blocks the router
  sent to each replica (inserted and held when routed, released when the request finishes),
  bounded by the replica's KV capacity from its latest `/stats` snapshot, with LRU eviction:
  the gateway's own index. It knows nothing of the engine's evictions under memory pressure
  or of output blocks a later prompt repeats.
* ``oracle`` — the engine model's true cache contents at decision time
  (`EngineModel.cached_prefix`), standing in for vLLM's KV-cache events (``precise``) with
  no delay: the best a router can know.
* ``none`` — every cached field 0 (prefix-blind routing; the paper's setting).

Who calls it: `engine_sim.simulator.Simulation`, once per routing decision (`lookup` for
every replica, `on_route` for the chosen one), once per finished request (`on_finish`) and
once per snapshot that reaches the router (`on_snapshot`); with several gateways that share
their indexes, once per decision of every other gateway (`on_told`) and once per request
another gateway saw finish (`on_finish`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sal_core.prefix import PrefixIndex

CACHE_SOURCES = ("none", "approximate", "oracle")
"""Values of `engine_sim.simulator.RouterConfig.cache_source`."""


class CacheOracle(Protocol):
    """The part of `engine_sim.engine.EngineModel` the oracle source reads."""

    def cached_prefix(self, keys: Sequence[int]) -> tuple[int, int]: ...

    @property
    def cached_blocks(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CacheView:
    """One replica's predicted hold on one prompt, in tokens."""

    cached_tokens: int = 0
    held_tokens: int = 0
    indexed_tokens: int = 0


_NOTHING = CacheView()


class RouterCache:
    """The router's cache knowledge for a fleet of replicas (see module doc)."""

    def __init__(
        self,
        source: str,
        urls: Sequence[str],
        block_size: int,
        oracles: Sequence[CacheOracle] | None = None,
    ) -> None:
        if source not in CACHE_SOURCES:
            raise ValueError(f"cache source must be one of {', '.join(CACHE_SOURCES)}")
        if source == "oracle" and (oracles is None or len(oracles) != len(urls)):
            raise ValueError("the oracle cache source needs one engine per replica")
        self.source = source
        self.block_size = block_size
        self._urls = list(urls)
        self._oracles = list(oracles or ())
        self._index = PrefixIndex()

    @property
    def enabled(self) -> bool:
        return self.source != "none"

    def lookup(self, keys: Sequence[int]) -> list[CacheView]:
        """Every replica's predicted hold on a prompt with block `keys` (no side effects)."""
        if self.source == "none" or not keys:
            return [_NOTHING] * len(self._urls)
        bs = self.block_size
        if self.source == "oracle":
            out = []
            for oracle in self._oracles:
                cached, held = oracle.cached_prefix(keys)
                out.append(CacheView(cached * bs, held * bs, oracle.cached_blocks * bs))
            return out
        index = self._index
        views = []
        for url in self._urls:
            match = index.match(url, keys)
            views.append(
                CacheView(match.cached_blocks * bs, match.held_blocks * bs, index.size(url) * bs)
            )
        return views

    def on_route(self, replica: int, keys: Sequence[int]) -> None:
        if self.source == "approximate" and keys:
            self._index.insert(self._urls[replica], keys, hold=True)

    def on_told(self, replica: int, keys: Sequence[int]) -> None:
        """Another gateway routed a prompt with block `keys` to `replica` (it told this one,
        ``listen.share_prefix_index``): cached there, most recent, held until `on_finish`
        (the other gateway tells that too)."""
        self.on_route(replica, keys)

    def on_heard(self, replica: int, keys: Sequence[int]) -> None:
        """A gateway on another host routed a prompt with block `keys` to `replica` (it told
        this one over the network, ``peers.share_prefix_blocks``): cached there, most
        recent, not held (nobody tells when that request ends)."""
        if self.source == "approximate" and keys:
            self._index.insert(self._urls[replica], keys, hold=False)

    def on_finish(self, replica: int, keys: Sequence[int]) -> None:
        if self.source == "approximate" and keys:
            self._index.release(self._urls[replica], keys)

    def on_snapshot(self, replica: int, kv_blocks_total: int, block_size: int) -> None:
        """Bound the replica's index by its KV capacity, in the index's blocks."""
        if self.source == "approximate":
            capacity = kv_blocks_total * block_size // self.block_size
            self._index.set_capacity(self._urls[replica], capacity)
