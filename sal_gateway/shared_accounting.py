"""Between-poll accounting shared by the workers of one host (``listen.workers``).

Each gateway process counts what it routed to a backend since that backend's last snapshot
(`sal_gateway.state`): its requests in flight and the prefill and KV tokens no snapshot
includes yet. Workers that keep this only for themselves decide on a picture that lacks the
other workers' requests; after each poll they all see the same snapshot and send their next
requests to the same replica (herding). In the simulator, 8 gateways that each knew only
their own requests lost up to 1.45x in p50 TTFT against one gateway; 8 workers that sum
every worker's counts route like one gateway (docs/results/gateways.md).

One shared-memory block holds every worker's counts: a file in ``/dev/shm`` (the system's
temporary folder where there is none) that every worker maps. The supervisor creates it
(`SharedAccounting.create`) and removes it when the workers have stopped (a supervisor
killed with SIGKILL cannot: the next one removes such orphans); each worker
attaches (`SharedAccounting.attach`) with its index. A plain mapped file rather than
`multiprocessing.shared_memory`: before Python 3.13 every process that attaches one
registers it with a resource tracker, which removes it when that process exits or
unregisters it for all.

Layout, native 8-byte integers: a header (`MAGIC`, workers, slots), then one row per worker
of `slots` entries of (key, in flight, routed tokens, routed KV tokens, then `ADAPTER_WORDS`
pending LoRA adapters). A backend's key is a 63-bit hash of its model and URL, never 0; its
entry sits at ``key % slots`` or the next free one after it (linear probing).

**Pending LoRA adapters.** A request routed to a backend for an adapter takes one of its
``--max-loras`` slots until a snapshot includes it (`sal_core.lora_slots`). Each worker
publishes those adapters (`adapter_key` hashes, 0 for none) so that the others count the
slots as taken too, as one gateway counts its own (a real-process test sees the second
adapter go past the full slot; in the simulator, ``sal-bench lora``, TTFT ties with and
without sharing them over 8 windows). A worker with more than `ADAPTER_WORDS` distinct pending
adapters on one backend publishes `ADAPTER_WORDS` of them: enough to show every slot taken
on a replica with that many slots or fewer.

Each worker writes only its own row, so no lock is needed. An entry, once written, never
moves or changes its key, so a reader that found a backend in a row keeps that position.
An aligned 8-byte store is read whole by another process on the platforms vLLM runs on
(x86-64, arm64). Another worker's counts are read at decision time. They are exact up to
the requests it is routing at that instant: fresher than any poll.

A row that is full (more backends than `slots` over the process's life) stops sharing new
backends: `SharedAccounting.slot` returns None and that backend is accounted locally.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
import tempfile
from collections.abc import Collection
from pathlib import Path

MAGIC = 0x53414C4143435432  # "SALACCT2"
HEADER = 3
"""Header words: MAGIC, workers, slots."""
COUNTS = 4
"""Words before the adapters: key, in flight, routed prefill tokens, routed KV tokens."""
ADAPTER_WORDS = 8
"""Pending LoRA adapters a worker publishes per backend (`adapter_key`; 0: none)."""
ENTRY = COUNTS + ADAPTER_WORDS
"""Words per entry."""
DEFAULT_SLOTS = 1024
"""Backends a worker can share over its life (8 workers x 1024 entries: 768 KiB)."""


def _key63(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


def backend_key(model: str, url: str) -> int:
    """A backend's key in the block: a non-zero 63-bit hash of its model and URL."""
    return _key63(f"{model}\0{url}")


def adapter_key(adapter: str) -> int:
    """A LoRA adapter's name as the block holds it: a non-zero 63-bit hash (names are
    compared within one backend's entry, so its model need not be part of it)."""
    return _key63(f"lora\0{adapter}")


class SharedAccountingError(RuntimeError):
    """The named block does not exist or is not a shared-accounting block."""


SHM_DIR = Path("/dev/shm")
"""Where the block's file goes (memory, not disk) when the system has it."""


PREFIX = "sal-accounting-"
"""Block files are named ``sal-accounting-<creator pid>-<random>``."""


def remove_orphans(folder: Path) -> list[Path]:
    """Remove the block files in `folder` whose creator is no longer running (a supervisor
    killed with SIGKILL cannot remove its own); returns them."""
    removed = []
    for path in folder.glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _map(path: str) -> mmap.mmap:
    """`path` mapped shared, read-write."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise SharedAccountingError(f"no shared accounting block {path!r}") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8 * HEADER:
            raise SharedAccountingError(f"{path!r} is not an accounting block")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping stays


class SharedAccounting:
    """One process's handle on the block: its own row to write, every row to read."""

    def __init__(self, path: str, index: int, *, owner: bool) -> None:
        mapped = _map(path)
        words = memoryview(mapped).cast("q")
        workers, slots = int(words[1]), int(words[2])
        problem = None
        if words[0] != MAGIC or len(words) < HEADER + workers * slots * ENTRY:
            problem = f"{path!r} is not an accounting block"
        elif not 0 <= index < workers:
            problem = f"worker index {index} outside 0..{workers - 1}"
        if problem is not None:
            words.release()
            mapped.close()
            raise SharedAccountingError(problem)
        self._path = path
        self._mapped = mapped
        self._words = words
        self.workers = workers
        self.slots = slots
        self.index = index
        self._owner = owner

    @classmethod
    def create(cls, workers: int, slots: int = DEFAULT_SLOTS) -> SharedAccounting:
        """A new zeroed block for `workers` workers (the supervisor's: its `close` removes
        the file). The handle's own row is worker 0's but the supervisor writes nothing."""
        if workers < 1 or slots < 1:
            raise ValueError(f"need workers >= 1 and slots >= 1, got {workers}, {slots}")
        size = 8 * (HEADER + workers * slots * ENTRY)
        folder = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else None
        remove_orphans(Path(folder or tempfile.gettempdir()))
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=folder)
        try:
            os.ftruncate(fd, size)  # zeros
            header = memoryview(bytearray(8 * HEADER)).cast("q")
            header[0], header[1], header[2] = MAGIC, workers, slots
            os.pwrite(fd, header.tobytes(), 0)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, 0, owner=True)

    @classmethod
    def attach(cls, name: str, index: int) -> SharedAccounting:
        """Worker `index`'s handle on the supervisor's block `name` (its `name`)."""
        return cls(name, index, owner=False)

    @property
    def name(self) -> str:
        """What workers pass to `attach` (the block's file)."""
        return self._path

    def _row_base(self, row: int) -> int:
        return HEADER + row * self.slots * ENTRY

    def _find(self, row: int, key: int, claim: bool) -> int | None:
        """Word offset of `key`'s entry in `row`; with `claim` (own row only) the first free
        entry on its probe path is taken. None: not there (or the row is full)."""
        words = self._words
        base = self._row_base(row)
        start = key % self.slots
        for step in range(self.slots):
            offset = base + ((start + step) % self.slots) * ENTRY
            found = words[offset]
            if found == key:
                return offset
            if found == 0:
                if not claim:
                    return None
                for word in range(1, ENTRY):
                    words[offset + word] = 0
                words[offset] = key  # last: the counts are zero before the key is seen
                return offset
        return None

    def slot(self, model: str, url: str) -> SharedSlot | None:
        """This process's entry for a backend (claimed on first use), or None when its row
        is full (the backend is then accounted by this process alone)."""
        key = backend_key(model, url)
        own = self._find(self.index, key, claim=True)
        return None if own is None else SharedSlot(self, key, own)

    def close(self) -> None:
        """Drop this handle (the creator also removes the block's file)."""
        self._words.release()
        self._mapped.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


class SharedSlot:
    """One backend's entry: this process's counts to publish, the others' to read."""

    __slots__ = ("_acc", "_found", "_key", "_missing", "_own")

    def __init__(self, acc: SharedAccounting, key: int, own: int) -> None:
        self._acc = acc
        self._key = key
        self._own = own
        self._found: list[int] = []
        """Word offsets of this backend's entry in the other rows where it was found."""
        self._missing = [row for row in range(acc.workers) if row != acc.index]
        """Other rows that had no entry for it yet (looked up again at each read)."""

    def publish(
        self,
        in_flight: int,
        routed_tokens: int,
        routed_kv_tokens: int,
        adapters: Collection[str] = (),
    ) -> None:
        """Write this process's current counts for the backend and its pending LoRA
        `adapters` (at most `ADAPTER_WORDS` of them; the rest are not shared)."""
        words = self._acc._words
        own = self._own
        words[own + 1] = in_flight
        words[own + 2] = routed_tokens
        words[own + 3] = routed_kv_tokens
        keys = [adapter_key(name) for name in itertools.islice(adapters, ADAPTER_WORDS)]
        keys += [0] * (ADAPTER_WORDS - len(keys))
        for word, key in enumerate(keys, own + COUNTS):
            if words[word] != key:
                words[word] = key

    def _refresh(self) -> None:
        """Look again for the backend in the rows that had no entry for it yet."""
        if self._missing:
            for row in list(self._missing):
                offset = self._acc._find(row, self._key, claim=False)
                if offset is not None:
                    self._found.append(offset)
                    self._missing.remove(row)

    def other_adapters(self) -> frozenset[int]:
        """The LoRA adapters (`adapter_key`) the other workers routed here that no
        snapshot of theirs includes yet."""
        self._refresh()
        words = self._acc._words
        keys = set()
        for offset in self._found:
            for word in range(offset + COUNTS, offset + ENTRY):
                key = words[word]
                if key:
                    keys.add(key)
        return frozenset(keys)

    def others(self) -> tuple[int, int, int]:
        """The other workers' (in flight, routed tokens, routed KV tokens), summed."""
        self._refresh()
        words = self._acc._words
        in_flight = tokens = kv = 0
        for offset in self._found:
            in_flight += words[offset + 1]
            tokens += words[offset + 2]
            kv += words[offset + 3]
        return in_flight, tokens, kv
