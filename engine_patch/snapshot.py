"""The scheduler-state snapshot in shared memory: fixed binary layout, seqlock writer and reader.

The scheduler (in vLLM's EngineCore process) writes one record after every scheduling step;
the API server(s) read it on every ``GET /stats`` without a round-trip to the engine. One file
per data-parallel engine: ``{prefix}.dp{rank}`` (`snapshot_path`).

Layout (little-endian, fixed size `FILE_SIZE_BYTES`)::

    offset 0   8s  magic  b"SALSNAP1"
    offset 8   Q   seq    even: record stable; odd: a write is in progress
    offset 16  ... record (`_RECORD`), then its extensions (`_RECORD_EXT`, `_RECORD_LORA`)

Each extension follows the ones before it, so the layout stays compatible both ways: a
reader of an older layout ignores the bytes after the part it knows, and this reader decodes
the zero-filled tail of an older file (`SnapshotWriter` creates the file zero-filled) as
the extension's "off":

* ``_RECORD_EXT`` (``sal-stats/1.1``): prefix caching on, its hash algorithm, cached prefill
  tokens, hit counters. Zero-filled: prefix caching off.
* ``_RECORD_LORA`` (``sal-stats/1.2``): ``max_loras`` (u32), then the names of the LoRA
  adapters of the running requests, UTF-8, joined by newlines, as a u16 byte length and a
  fixed field of `LORA_NAMES_BYTES` bytes. Zero-filled: ``max_loras`` 0 and no names.

Names that cannot be carried are left out whole, never cut (`_pack_names`): the names are
written in order, and one that would overflow the field is skipped (a later, shorter one may
still fit), as is a name that `sal_core.stats.parse_stats` would reject (empty, longer than
``MAX_LORA_NAME_CHARS``, beyond ``MAX_LORA_NAMES``) or that contains the separator
(a newline). A reader then sees fewer adapters than run, never a wrong one. vLLM's
``--max-loras`` is a handful, so with names of ordinary length nothing is left out.

Seqlock protocol: the writer bumps ``seq`` to odd, writes the record, bumps it to even. A
reader reads ``seq``, the record, and ``seq`` again, and retries unless both reads are equal
and even, so it never returns a torn record. Readers run on vLLM's API-server event loop, so
they never sleep and retry a bounded number of times (`READ_ATTEMPTS`, about a millisecond
at worst): a writer descheduled mid-write makes the read fail (`SnapshotError`, reason
``"torn"``; ``/stats`` answers 503 and the gateway polls again), never stalls the server.
There is one writer per file (the engine's
scheduler thread, plus its idle heartbeat, serialised by a lock in `SnapshotWriter`).
A file appears atomically (written under a temporary name, then renamed), so a reader never
sees a half-initialised header.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sal_core.stats import MAX_LORA_NAME_CHARS, MAX_LORA_NAMES, ReplicaStats

MAGIC = b"SALSNAP1"
_HEADER = struct.Struct("<8sQ")
_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = 8
_MODEL_NAME_BYTES = 256
_RECORD = struct.Struct(f"<dqdB7x10qH{_MODEL_NAME_BYTES}s")
_HASH_ALGO_BYTES = 16
_RECORD_EXT = struct.Struct(f"<B{_HASH_ALGO_BYTES}sqqq")
"""prefix_caching (0/1), prefix_hash_algo (NUL-padded ASCII, empty: None),
cached_prefill_tokens, prefix_cache_query_tokens, prefix_cache_hit_tokens."""
LORA_NAMES_BYTES = 2048
"""Bytes of the running adapters' names (UTF-8, newline-separated) a record carries."""
_RECORD_LORA = struct.Struct(f"<IH{LORA_NAMES_BYTES}s")
"""max_loras (0: LoRA off), byte length of the names, the names (zero-padded)."""
_MAX_LORAS = 2**32 - 1
_LORA_OFFSET = _RECORD.size + _RECORD_EXT.size
_RECORD_BYTES = _LORA_OFFSET + _RECORD_LORA.size
FILE_SIZE_BYTES = 4096
READ_ATTEMPTS = 1000
"""Consistent-read attempts before a reader gives up (a write takes ~1 µs, an attempt about
as long, so this outlasts any writer that is running; one descheduled mid-write is not
waited for: ~1 ms of the API server's loop at most)."""

_SCHEDULER_CODES = {"fcfs": 0, "larry": 1, "larry_tail": 2}
_SCHEDULER_NAMES = {code: name for name, code in _SCHEDULER_CODES.items()}

assert _HEADER.size + _RECORD_BYTES <= FILE_SIZE_BYTES


class SnapshotError(RuntimeError):
    """A snapshot file is missing, foreign, or kept changing while being read.

    `reason` names the case for the ``/stats`` 503 body: ``"missing"`` (no file or nothing
    published), ``"foreign"`` (not a SAL snapshot), ``"torn"`` (no consistent read within
    `READ_ATTEMPTS`), ``"partial"`` (not every data-parallel engine has published)."""

    def __init__(self, message: str, reason: str = "missing") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    """One engine's published state: the `/stats` body plus data-parallel bookkeeping."""

    stats: ReplicaStats
    dp_rank: int
    """Data-parallel rank of the engine that wrote it (0 without data parallelism)."""
    dp_local_count: int
    """How many data-parallel engines run on this host (files a reader should expect)."""


def snapshot_path(prefix: str, dp_rank: int) -> Path:
    """The snapshot file of data-parallel rank `dp_rank` under `prefix`."""
    return Path(f"{prefix}.dp{dp_rank}")


def _pack_names(names: tuple[str, ...]) -> bytes:
    """`names` UTF-8 encoded and newline-joined in at most `LORA_NAMES_BYTES` bytes: a name
    that does not fit, or could not be read back as itself, is left out whole."""
    out = bytearray()
    kept = 0
    for name in names:
        if kept == MAX_LORA_NAMES:
            break
        if not name or len(name) > MAX_LORA_NAME_CHARS or "\n" in name:
            continue
        encoded = name.encode("utf-8", "replace")
        needed = len(encoded) + (1 if out else 0)
        if len(out) + needed > LORA_NAMES_BYTES:
            continue
        if out:
            out += b"\n"
        out += encoded
        kept += 1
    return bytes(out)


def _unpack_names(length: int, field: bytes) -> tuple[str, ...]:
    if length == 0:
        return ()
    text = field[: min(length, LORA_NAMES_BYTES)].decode("utf-8", errors="replace")
    return tuple(name for name in text.split("\n") if name)


def encode_record(record: SnapshotRecord) -> bytes:
    """Pack a record into its fixed binary layout (pure)."""
    s = record.stats
    model = s.model.encode("utf-8")[:_MODEL_NAME_BYTES]
    algo = (s.prefix_hash_algo or "").encode("ascii", "replace")[:_HASH_ALGO_BYTES]
    ext = _RECORD_EXT.pack(
        int(s.prefix_caching),
        algo,
        s.cached_prefill_tokens,
        s.prefix_cache_query_tokens,
        s.prefix_cache_hit_tokens,
    )
    original = _RECORD.pack(
        s.time,
        s.step,
        math.nan if s.alpha is None else s.alpha,
        _SCHEDULER_CODES[s.scheduler],
        s.block_size,
        s.kv_blocks_total,
        s.kv_blocks_free,
        s.queued_prefill_tokens,
        s.num_waiting,
        s.num_running,
        s.max_num_batched_tokens,
        s.max_num_seqs,
        record.dp_rank,
        record.dp_local_count,
        len(model),
        model,
    )
    names = _pack_names(s.lora_running)
    lora = _RECORD_LORA.pack(min(s.max_loras, _MAX_LORAS), len(names), names)
    return original + ext + lora


def decode_record(data: bytes) -> SnapshotRecord:
    """Unpack a record packed by `encode_record` (pure)."""
    (
        time_s,
        step,
        alpha,
        scheduler_code,
        block_size,
        kv_total,
        kv_free,
        queued,
        num_waiting,
        num_running,
        max_batched,
        max_seqs,
        dp_rank,
        dp_local_count,
        model_len,
        model,
    ) = _RECORD.unpack(data[: _RECORD.size])
    caching, algo, cached, queries, hits = _RECORD_EXT.unpack(data[_RECORD.size : _LORA_OFFSET])
    max_loras, names_len, names = _RECORD_LORA.unpack(data[_LORA_OFFSET:_RECORD_BYTES])
    algo_name = algo.rstrip(b"\0").decode("ascii", errors="replace")
    stats = ReplicaStats(
        time=time_s,
        step=step,
        model=model[:model_len].decode("utf-8", errors="replace"),
        scheduler=_SCHEDULER_NAMES.get(scheduler_code, "unknown"),
        alpha=None if math.isnan(alpha) else alpha,
        block_size=block_size,
        kv_blocks_total=kv_total,
        kv_blocks_free=kv_free,
        free_kv_tokens=kv_free * block_size,
        queued_prefill_tokens=queued,
        num_waiting=num_waiting,
        num_running=num_running,
        max_num_batched_tokens=max_batched,
        max_num_seqs=max_seqs,
        prefix_caching=bool(caching),
        prefix_hash_algo=algo_name or None,
        cached_prefill_tokens=cached,
        prefix_cache_query_tokens=queries,
        prefix_cache_hit_tokens=hits,
        max_loras=max_loras,
        lora_running=_unpack_names(names_len, names),
    )
    return SnapshotRecord(stats, dp_rank, dp_local_count)


class SnapshotWriter:
    """Owns one snapshot file; `publish()` is called by the scheduler once per step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, 0).ljust(FILE_SIZE_BYTES, b"\0"))
        os.replace(tmp, path)
        self._fd = os.open(path, os.O_RDWR)
        self._mm = mmap.mmap(self._fd, FILE_SIZE_BYTES)
        self._seq = 0
        self._last: SnapshotRecord | None = None
        # The scheduler thread and the idle heartbeat thread both write.
        self._lock = threading.Lock()

    @property
    def last(self) -> SnapshotRecord | None:
        """The record most recently published (None before the first)."""
        return self._last

    def publish(self, record: SnapshotRecord) -> None:
        """Write `record` under the seqlock (a few microseconds)."""
        with self._lock:
            self._write_locked(record)

    def restamp_if_idle(self, now_s: float) -> bool:
        """Republish the last record with time `now_s` if it showed an idle engine.

        An idle engine runs no steps, so nothing would refresh ``time`` and readers would
        take a healthy idle replica for a stale one. Its state cannot change until a request
        arrives, and that triggers a step which publishes fresh state; the lock makes sure a
        restamp never overwrites that newer record. Returns whether it wrote.
        """
        with self._lock:
            last = self._last
            if last is None or last.stats.num_waiting or last.stats.num_running:
                return False
            self._write_locked(replace(last, stats=replace(last.stats, time=now_s)))
            return True

    def _write_locked(self, record: SnapshotRecord) -> None:
        data = encode_record(record)
        self._seq += 1
        _SEQ.pack_into(self._mm, _SEQ_OFFSET, self._seq)
        self._mm[_HEADER.size : _HEADER.size + len(data)] = data
        self._seq += 1
        _SEQ.pack_into(self._mm, _SEQ_OFFSET, self._seq)
        self._last = record

    def close(self, *, unlink: bool = True) -> None:
        """Unmap the file and (by default) remove it, so readers stop serving it."""
        with self._lock:
            if self._mm.closed:
                return
            self._mm.close()
            os.close(self._fd)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class SnapshotReader:
    """Reads one snapshot file; reopens it when the file was replaced (engine restart)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inode: int | None = None
        self._mm: mmap.mmap | None = None

    def _mapping(self) -> mmap.mmap:
        try:
            st = os.stat(self.path)
        except FileNotFoundError as exc:
            self.close()
            raise SnapshotError(f"no snapshot at {self.path}") from exc
        if self._mm is None or st.st_ino != self._inode:
            self.close()
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), FILE_SIZE_BYTES, access=mmap.ACCESS_READ)
            self._inode = st.st_ino
            if self._mm[: len(MAGIC)] != MAGIC:
                self.close()
                raise SnapshotError(f"{self.path} is not a SAL snapshot file", "foreign")
        return self._mm

    def read(self) -> SnapshotRecord | None:
        """The latest complete record, or None if the engine has not published one yet.

        Never sleeps: `SnapshotError` (reason ``"torn"``) after `READ_ATTEMPTS` inconsistent
        reads."""
        mm = self._mapping()
        for _ in range(READ_ATTEMPTS):
            (seq_before,) = _SEQ.unpack_from(mm, _SEQ_OFFSET)
            if not seq_before % 2:
                data = mm[_HEADER.size : _HEADER.size + _RECORD_BYTES]
                (seq_after,) = _SEQ.unpack_from(mm, _SEQ_OFFSET)
                if seq_before == seq_after:
                    return None if seq_before == 0 else decode_record(data)
        raise SnapshotError(
            f"{self.path}: no consistent read in {READ_ATTEMPTS} attempts (the engine was "
            "descheduled mid-write)",
            "torn",
        )

    def close(self) -> None:
        """Unmap the file (reopened on the next `read`)."""
        if self._mm is not None:
            self._mm.close()
        self._mm = None
        self._inode = None


ORPHAN_AGE_S = 300.0
"""A snapshot whose engine is gone and whose last record is older than this is an orphan."""


def remove_orphans(
    folder: Path,
    basename: str,
    *,
    now_s: float,
    alive: Callable[[int], bool],
) -> list[Path]:
    """Remove the snapshot files ``<basename>-<pid>-<token>.dp<N>`` in `folder` left by
    launches that were SIGKILLed (their own clean-up never ran); returns them.

    A file is removed only when its launcher's `pid` is not `alive` *and* its last record is
    more than `ORPHAN_AGE_S` old (by its wall-clock ``time``): a live engine restamps its
    record at least every 0.2 s, so a file shared with another PID namespace (where the pid
    means nothing here) is kept while its engine runs. Files that are not SAL snapshots, or
    cannot be read, are left alone."""
    removed = []
    for path in folder.glob(f"{basename}-*-*.dp*"):
        pid_text = path.name[len(basename) + 1 :].split("-", 1)[0]
        if not pid_text.isdigit() or alive(int(pid_text)):
            continue
        reader = SnapshotReader(path)
        try:
            record = reader.read()
        except (SnapshotError, OSError, ValueError):
            continue
        finally:
            reader.close()
        if record is not None and now_s - record.stats.time <= ORPHAN_AGE_S:
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed
