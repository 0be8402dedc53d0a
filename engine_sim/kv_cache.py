"""The engine model's prefix cache: vLLM's automatic prefix caching, block by block (pure).

vLLM V1 (`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`) keys every *full* KV block by a
hash chained over the whole prefix up to it. A computed full block stays cached when its
request ends: its reference count drops to 0 and it joins the free-block queue, still holding
its content. Free blocks are handed out from the queue's head (least recently freed first);
handing out a cached one evicts it. An arriving request looks up its leading blocks and
*touches* the hits: a hit no running request holds leaves the free queue (it consumes free KV
again), a hit a running request holds is shared (no new KV). vLLM reports every block with
reference count 0 as free, cached or not, and so does this model.

`PrefixCache` keeps the keyed part of that state; the engine (`engine_sim.engine`) keeps the
total free count and calls this module at admission (`lookup`, `acquire`), on allocation
(`take_free`), when blocks fill up (`promote`) and when a request lets go of its blocks
(`release`). Invariant (checked by the tests): the engine's free blocks ==
`free_uncached + evictable_blocks`.

One simplification against vLLM, stated where it matters: free blocks that hold no reusable
content (a request's partial last block, blocks of outputs whose tokens no later prompt is
known to repeat) are handed out before any cached block is evicted, where vLLM interleaves
them in one LRU queue. Cached content therefore survives a little longer here (by at most
those uncached blocks: ~1 per request, plus output blocks for traces without output keys).

Who calls it: `EngineModel`, a few times per admission and per step; each call is O(blocks
touched). Deterministic: insertion-ordered dicts, no hashing of unordered sets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Cached full blocks of one replica, keyed by chained block key (see module doc)."""

    def __init__(self, num_blocks: int) -> None:
        self._held: dict[int, int] = {}
        """Cached blocks some live request holds: key -> number of holders (>= 1)."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody holds (free, still reusable): least recently freed first."""
        self.free_uncached = num_blocks
        """Free blocks without reusable content (handed out before any eviction)."""
        self.evictions = 0
        """Cached blocks evicted since start."""

    # --- queries (no side effects) -----------------------------------------------------

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def held_blocks(self) -> int:
        """Distinct cached blocks some live request holds."""
        return len(self._held)

    @property
    def cached_blocks(self) -> int:
        """Distinct cached blocks, held or not."""
        return len(self._held) + len(self._evictable)

    def lookup(self, keys: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """``(hit_blocks, held_blocks)``: how many leading `keys` (at most `max_blocks`) are
        cached, and how many of those a live request holds. No effect on the LRU order."""
        held = self._held
        evictable = self._evictable
        hit = shared = 0
        for key in keys[: max(0, max_blocks)]:
            if key in held:
                shared += 1
            elif key not in evictable:
                break
            hit += 1
        return hit, shared

    def contains(self, key: int) -> bool:
        return key in self._held or key in self._evictable

    def holders(self, key: int) -> int:
        """Live requests holding `key` (0: evictable or absent)."""
        return self._held.get(key, 0)

    # --- commands ----------------------------------------------------------------------

    def acquire(self, keys: Sequence[int]) -> int:
        """A request reuses the cached blocks `keys` (all must be cached): hold each one.
        Returns how many were evictable (free) before, i.e. the free blocks this consumed."""
        held = self._held
        evictable = self._evictable
        consumed = 0
        for key in keys:
            refs = held.get(key)
            if refs is None:
                del evictable[key]  # KeyError: not cached, a caller bug
                held[key] = 1
                consumed += 1
            else:
                held[key] = refs + 1
        return consumed

    def take_free(self, n: int) -> None:
        """`n` free blocks are allocated: uncached ones first, then the least recently
        freed cached ones, which are evicted. The caller checked that `n` blocks are free."""
        from_uncached = min(n, self.free_uncached)
        self.free_uncached -= from_uncached
        evictable = self._evictable
        for _ in range(n - from_uncached):
            evictable.popitem(last=False)
            self.evictions += 1

    def promote(self, key: int) -> bool:
        """A request's private, now full and computed block gets its key: it becomes a
        cached block that request holds. False (stays private) if `key` is already cached
        (another request computed the same block first)."""
        if key in self._held or key in self._evictable:
            return False
        self._held[key] = 1
        return True

    def release(self, keys: Sequence[int], private_blocks: int) -> int:
        """A request lets go of its cached blocks `keys` (in block order) and of
        `private_blocks` uncached ones. Returns the blocks that became free.

        Released in reverse block order, as vLLM frees them, so that a prefix's tail is
        evicted before its head."""
        self.free_uncached += private_blocks
        freed = private_blocks
        held = self._held
        evictable = self._evictable
        for key in reversed(keys):
            refs = held[key] - 1
            if refs:
                held[key] = refs
            else:
                del held[key]
                evictable[key] = None
                freed += 1
        return freed
