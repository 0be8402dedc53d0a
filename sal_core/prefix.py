"""What each backend holds in its prefix cache, as the router can know it (pure, no I/O).

vLLM's automatic prefix caching keys every *full* KV block of a prompt by a hash chained over
all earlier blocks, so a block is reused only when the whole prefix up to it matches, and a
replica that holds the first k blocks of a prompt prefills k blocks fewer. The router cannot
see a replica's cache; it keeps an index of the full blocks it sent there (`PrefixIndex`),
bounded by the replica's KV capacity with LRU eviction, or fills the same index from vLLM's
own KV-cache events. Used by the gateway's state table and by the simulator's router.

* `chain_hashes` turns token ids into one key per full block (chained: block i's key covers
  blocks 0..i). Python's hash of a tuple of ints is not salted, so keys agree across
  processes and runs. `adapter_keys` turns them into the keys of the same prompt under a
  LoRA adapter (vLLM keys an adapter's blocks apart).
* `PrefixIndex` keeps, per backend, an LRU set of block keys with a reference count of the
  in-flight requests that use each block (*held*: a running request's blocks cannot be
  evicted, and reusing them needs no new KV memory; unheld cached blocks are evictable, and
  vLLM reports them as free).

Blocks are inserted child first, parent last, so a parent is always more recently used than
its children and eviction takes a prefix's tail before its head (as vLLM's free-block queue
does); a lookup stops at the first missing block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT_HASH = 0
"""Parent key of a prompt's first block."""


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """One key per *full* block of `token_ids` (a trailing partial block has none), each
    chained on the one before (`parent` for the first). Equal keys mean equal prefixes up to
    and including that block (up to hash collisions)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        keys.append(parent)
    return keys


def adapter_keys(keys: Sequence[int], adapter: str) -> tuple[int, ...]:
    """`keys` (a prompt's `chain_hashes`) as the blocks of the same prompt run with LoRA
    adapter `adapter`: vLLM puts the adapter in every block's hash, so they share no block
    with the base model's or another adapter's. Key i still covers blocks 0..i. The name is
    digested (not Python's per-process salted `hash` of a string), so keys agree across
    processes."""
    salt = int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "big")
    return tuple(hash((salt, key)) for key in keys)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a request's prompt one backend holds, in blocks of the index."""

    cached_blocks: int
    """Leading blocks present in the index (a run from the first block; stops at a miss)."""
    held_blocks: int
    """Of those, blocks an in-flight request on that backend holds (not evictable)."""


_NO_MATCH = PrefixMatch(0, 0)


@dataclass(slots=True)
class _BackendBlocks:
    capacity_blocks: int | None = None
    """Most blocks kept (None: unbounded until the backend's capacity is known)."""
    lru: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """Block key -> in-flight requests holding it; least recently used first."""


class PrefixIndex:
    """Per-backend LRU index of the full prompt blocks routed there (see module doc).

    Called by the request path once per routing decision (`match` for every candidate,
    `insert` on the chosen one) and once per finished request (`release`), and by the
    state table when a backend's capacity is learnt (`set_capacity`) or it leaves."""

    def __init__(self) -> None:
        self._backends: dict[str, _BackendBlocks] = {}

    def set_capacity(self, backend: str, capacity_blocks: int) -> None:
        """Bound `backend`'s entry to `capacity_blocks` blocks (its KV cache, in index
        blocks), evicting the least recently used unheld blocks beyond it."""
        entry = self._backends.setdefault(backend, _BackendBlocks())
        entry.capacity_blocks = max(0, capacity_blocks)
        self._evict(entry)

    def match(self, backend: str, keys: Sequence[int]) -> PrefixMatch:
        """How many leading `keys` `backend` holds; no side effect on the LRU order."""
        entry = self._backends.get(backend)
        if entry is None:
            return PrefixMatch(0, 0)
        lru = entry.lru
        cached = held = 0
        for key in keys:
            refs = lru.get(key)
            if refs is None:
                break
            cached += 1
            if refs > 0:
                held += 1
        return PrefixMatch(cached, held)

    def match_prefix_closed(self, backend: str, keys: Sequence[int]) -> PrefixMatch:
        """`match`, in O(log len(keys)) lookups instead of one per matched block, for an
        index whose contents are prefix-closed (every held or cached block's parent is too).

        This index keeps them so by itself: insertion is child first, eviction takes the
        least recently used (a prefix's tail before its head), and a request holds whole
        prefixes. `discard` of a block in the middle of a prefix (vLLM evicting it before
        its tail) breaks it for that prefix: the result may then count blocks past the gap.
        Galloping search: 1, 2, 4, ... blocks until a miss, then bisection; the same for
        held blocks inside the cached run. No side effect on the LRU order."""
        entry = self._backends.get(backend)
        if entry is None or not keys or keys[0] not in entry.lru:
            return _NO_MATCH
        lru = entry.lru
        # Inlined galloping searches (this runs for every replica of every request).
        n, good, step = len(keys), 0, 1
        while True:
            probe = good + step
            if probe >= n or keys[probe] not in lru:
                bad = min(probe, n)
                break
            good, step = probe, step * 2
        while bad - good > 1:
            mid = (good + bad) // 2
            if keys[mid] in lru:
                good = mid
            else:
                bad = mid
        cached = good + 1
        if not lru[keys[0]]:
            return PrefixMatch(cached, 0)
        good, step = 0, 1
        while True:
            probe = good + step
            if probe >= cached or not lru[keys[probe]]:
                bad = min(probe, cached)
                break
            good, step = probe, step * 2
        while bad - good > 1:
            mid = (good + bad) // 2
            if lru[keys[mid]]:
                good = mid
            else:
                bad = mid
        return PrefixMatch(cached, good + 1)

    def insert(self, backend: str, keys: Sequence[int], *, hold: bool = True) -> None:
        """A request with these block `keys` was routed to `backend`: its blocks become the
        most recently used there and, with `hold`, are held until `release`."""
        entry = self._backends.setdefault(backend, _BackendBlocks())
        lru = entry.lru
        add = 1 if hold else 0
        for key in reversed(keys):  # child first: a parent stays more recent than its tail
            lru[key] = lru.get(key, 0) + add
            lru.move_to_end(key)
        self._evict(entry)

    def release(self, backend: str, keys: Sequence[int]) -> None:
        """A request inserted with ``hold=True`` ended: its blocks stay cached, unheld."""
        entry = self._backends.get(backend)
        if entry is None:
            return
        lru = entry.lru
        for key in keys:
            refs = lru.get(key)
            if refs:
                lru[key] = refs - 1
        self._evict(entry)

    def discard(self, backend: str, keys: Sequence[int]) -> None:
        """`backend` evicted these blocks (vLLM's KV-cache events say so): forget them,
        held or not (the engine's word beats the index's guess)."""
        entry = self._backends.get(backend)
        if entry is None:
            return
        lru = entry.lru
        for key in keys:
            lru.pop(key, None)

    def remove_backend(self, backend: str) -> None:
        """Forget everything about `backend` (it left the pool, or restarted empty)."""
        self._backends.pop(backend, None)

    def size(self, backend: str) -> int:
        """Blocks indexed for `backend` now."""
        entry = self._backends.get(backend)
        return 0 if entry is None else len(entry.lru)

    @staticmethod
    def _evict(entry: _BackendBlocks) -> None:
        capacity = entry.capacity_blocks
        if capacity is None:
            return
        lru = entry.lru
        # Held blocks cannot be evicted: skip past them (at most one pass over the entry).
        skipped = 0
        while len(lru) > capacity and skipped < len(lru):
            key, refs = next(iter(lru.items()))
            if refs > 0:
                lru.move_to_end(key)
                skipped += 1
                continue
            del lru[key]
