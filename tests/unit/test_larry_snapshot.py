"""The `/stats` snapshot: binary layout, seqlock, data-parallel aggregation, ASGI route."""

from __future__ import annotations

import json
import multiprocessing
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_patch.aggregate import combine_ranks, stats_body
from engine_patch.snapshot import (
    SnapshotError,
    SnapshotReader,
    SnapshotRecord,
    SnapshotWriter,
    decode_record,
    encode_record,
    remove_orphans,
    snapshot_path,
)
from engine_patch.stats_route import StatsMiddleware
from sal_core.stats import ReplicaStats, parse_stats


def make_stats(**overrides: Any) -> ReplicaStats:
    base: dict[str, Any] = {
        "time": 1700000000.25,
        "step": 42,
        "model": "tiny",
        "scheduler": "larry",
        "alpha": 1.0,
        "block_size": 16,
        "kv_blocks_total": 511,
        "kv_blocks_free": 300,
        "queued_prefill_tokens": 1234,
        "num_waiting": 3,
        "num_running": 7,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 32,
    }
    base.update(overrides)
    base.setdefault("free_kv_tokens", base["kv_blocks_free"] * base["block_size"])
    return ReplicaStats(**base)


def test_record_round_trips_through_the_binary_layout() -> None:
    cached = make_stats(
        prefix_caching=True, prefix_hash_algo="xxhash_cbor", cached_prefill_tokens=9
    )
    for stats in (make_stats(), make_stats(scheduler="fcfs", alpha=None, model="m/ü-名"), cached):
        record = SnapshotRecord(stats, dp_rank=2, dp_local_count=4)
        assert decode_record(encode_record(record)) == record


def test_layout_stays_compatible_with_the_original_record() -> None:
    """The prefix-cache extension follows the original record: an old reader's bytes are a
    prefix of the new record, and an old record (zero-filled after it) reads as caching off."""
    from engine_patch import snapshot

    record = SnapshotRecord(
        make_stats(prefix_caching=True, prefix_hash_algo="sha256", cached_prefill_tokens=5), 0, 1
    )
    data = encode_record(record)
    original = snapshot._RECORD.unpack(data[: snapshot._RECORD.size])
    assert original[0] == record.stats.time
    assert original[-1].rstrip(b"\0") == b"tiny"
    old_file = data[: snapshot._RECORD.size].ljust(len(data), b"\0")
    old = decode_record(old_file).stats
    assert (old.prefix_caching, old.prefix_hash_algo, old.cached_prefill_tokens) == (False, None, 0)
    assert old.queued_prefill_tokens == record.stats.queued_prefill_tokens


def test_lora_slots_round_trip_through_the_binary_layout(tmp_path: Path) -> None:
    """max_loras and the running adapters' names (UTF-8 included) reach a reader intact."""
    stats = make_stats(max_loras=4, lora_running=("chat-v2", "sql", "übersetzer-名"))
    record = SnapshotRecord(stats, dp_rank=1, dp_local_count=2)
    assert decode_record(encode_record(record)) == record
    path = snapshot_path(str(tmp_path / "s"), 1)
    writer = SnapshotWriter(path)
    writer.publish(record)
    writer.publish(SnapshotRecord(make_stats(max_loras=4, lora_running=("sql",)), 1, 2))
    read = SnapshotReader(path).read()
    assert read is not None
    # A shorter list written over a longer one leaves nothing of the old names behind.
    assert (read.stats.max_loras, read.stats.lora_running) == (4, ("sql",))
    writer.close()


def test_lora_names_that_do_not_fit_are_left_out_whole() -> None:
    """The names field holds LORA_NAMES_BYTES bytes: a name that would overflow it is dropped
    whole (a later, shorter one still fits), never cut into a name that does not run; names
    the gateway would reject (or that contain the separator) are dropped too, so the body
    still parses."""
    from engine_patch.snapshot import LORA_NAMES_BYTES

    big = "a" * 1000
    huge = "h" * (LORA_NAMES_BYTES // 2)
    names = (big, "b" * 1000, huge, "c", "bad\nname", "", "x" * 1025, "d")
    stats = make_stats(max_loras=8, lora_running=names)
    decoded = decode_record(encode_record(SnapshotRecord(stats, 0, 1))).stats
    assert decoded.lora_running == (big, "b" * 1000, "c", "d")
    assert sum(len(n) + 1 for n in decoded.lora_running) - 1 <= LORA_NAMES_BYTES
    assert decoded.max_loras == 8
    assert parse_stats(json.loads(json.dumps(decoded.to_dict()))) == decoded
    many = tuple(f"n{i:03d}" for i in range(300))
    capped = decode_record(
        encode_record(SnapshotRecord(make_stats(max_loras=300, lora_running=many), 0, 1))
    ).stats
    assert capped.lora_running == many[:256]
    assert parse_stats(json.loads(json.dumps(capped.to_dict()))) == capped


def test_an_older_layout_reads_as_lora_slots_unknown() -> None:
    """A file written before sal-stats/1.2 has zeros after the prefix-cache extension: it
    reads as max_loras 0 and no adapters, with every older field intact."""
    from engine_patch import snapshot

    stats = make_stats(
        prefix_caching=True,
        prefix_hash_algo="sha256",
        cached_prefill_tokens=5,
        max_loras=2,
        lora_running=("sql",),
    )
    data = encode_record(SnapshotRecord(stats, 0, 1))
    assert len(data) == snapshot._RECORD_BYTES
    old_size = snapshot._RECORD.size + snapshot._RECORD_EXT.size
    old = decode_record(data[:old_size].ljust(len(data), b"\0")).stats
    assert (old.max_loras, old.lora_running) == (0, ())
    assert old == replace(stats, max_loras=0, lora_running=())
    assert snapshot._HEADER.size + snapshot._RECORD_BYTES <= snapshot.FILE_SIZE_BYTES


def test_writer_and_reader_share_the_latest_record(tmp_path: Path) -> None:
    path = snapshot_path(str(tmp_path / "s"), 0)
    writer = SnapshotWriter(path)
    reader = SnapshotReader(path)
    assert reader.read() is None  # created, nothing published yet
    for step in range(3):
        record = SnapshotRecord(make_stats(step=step), 0, 1)
        writer.publish(record)
        assert reader.read() == record
    writer.close()
    assert not path.exists()
    with pytest.raises(SnapshotError):
        reader.read()


def test_reader_follows_a_restarted_engine(tmp_path: Path) -> None:
    path = snapshot_path(str(tmp_path / "s"), 0)
    first = SnapshotWriter(path)
    first.publish(SnapshotRecord(make_stats(step=100), 0, 1))
    reader = SnapshotReader(path)
    assert reader.read() is not None
    first.close(unlink=False)
    second = SnapshotWriter(path)  # a new engine replaces the file
    second.publish(SnapshotRecord(make_stats(step=1), 0, 1))
    record = reader.read()
    assert record is not None
    assert record.stats.step == 1
    second.close()


def test_idle_restamp_refreshes_time_but_never_a_busy_record(tmp_path: Path) -> None:
    path = snapshot_path(str(tmp_path / "s"), 0)
    writer = SnapshotWriter(path)
    reader = SnapshotReader(path)
    writer.publish(SnapshotRecord(make_stats(num_waiting=0, num_running=0, time=10.0), 0, 1))
    assert writer.restamp_if_idle(11.0)
    record = reader.read()
    assert record is not None
    assert record.stats.time == 11.0
    writer.publish(SnapshotRecord(make_stats(num_running=1, time=12.0), 0, 1))
    assert not writer.restamp_if_idle(13.0)
    record = reader.read()
    assert record is not None
    assert record.stats.time == 12.0
    writer.close()


def _hammer(path: str, n: int) -> None:
    writer = SnapshotWriter(Path(path))
    for i in range(n):
        # Every field carries i: a torn record would mix two values.
        writer.publish(
            SnapshotRecord(
                make_stats(
                    step=i,
                    kv_blocks_free=i,
                    free_kv_tokens=i * 16,
                    queued_prefill_tokens=i,
                    num_waiting=i,
                    num_running=i,
                    time=float(i),
                ),
                0,
                1,
            )
        )
    writer.close(unlink=False)


def test_reader_never_sees_a_torn_record_while_another_process_writes(tmp_path: Path) -> None:
    path = snapshot_path(str(tmp_path / "s"), 0)
    SnapshotWriter(path).close(unlink=False)
    # A separate process, as in vLLM (EngineCore writes, API server reads).
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_hammer, args=(str(path), 30000))
    reader = SnapshotReader(path)
    proc.start()
    seen = 0
    gave_up: set[str] = set()
    try:
        while proc.is_alive() or seen == 0:
            try:
                record = reader.read()
            except SnapshotError as exc:
                # Allowed: giving up (a 503 for that poll) rather than waiting on the API
                # server's loop. Returning a torn record is not.
                gave_up.add(exc.reason)
                continue
            if record is None:
                continue
            s = record.stats
            assert s.step == s.kv_blocks_free == s.queued_prefill_tokens == s.num_waiting
            assert s.num_running == s.step
            assert s.time == float(s.step)
            seen += 1
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert seen > 0
    assert gave_up <= {"torn"}


# Data parallelism ---------------------------------------------------------------------------


def test_snapshots_of_sigkilled_launches_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """A launch killed with SIGKILL never runs its clean-up; the next launch removes its file
    (`remove_orphans`), but never one whose launcher lives, one still being written (a live
    engine in another PID namespace), or a file that is not a snapshot."""
    now = 1_700_000_000.0
    old = make_stats(time=now - 301.0)

    def write(name: str, stats: ReplicaStats | None) -> Path:
        writer = SnapshotWriter(tmp_path / name)
        if stats is not None:
            writer.publish(SnapshotRecord(stats, 0, 1))
        writer.close(unlink=False)
        return tmp_path / name

    dead = write("sal-stats-111-aaaa0000.dp0", old)
    dead_rank = write("sal-stats-111-aaaa0000.dp1", old)
    never_published = write("sal-stats-112-bbbb0000.dp0", None)
    alive = write("sal-stats-222-cccc0000.dp0", old)
    fresh = write("sal-stats-333-dddd0000.dp0", make_stats(time=now - 1.0))
    foreign = tmp_path / "sal-stats-444-eeee0000.dp0"
    foreign.write_bytes(b"not a snapshot" * 400)
    other_name = write("other-555-ffff0000.dp0", old)
    removed = remove_orphans(tmp_path, "sal-stats", now_s=now, alive=lambda pid: pid == 222)
    assert sorted(removed) == sorted([dead, dead_rank, never_published])
    assert not dead.exists()
    for kept in (alive, fresh, foreign, other_name):
        assert kept.exists(), kept


def test_data_parallel_ranks_are_summed_with_the_oldest_time() -> None:
    r0 = SnapshotRecord(make_stats(time=5.0, step=10, num_waiting=1, kv_blocks_free=10), 0, 2)
    r1 = SnapshotRecord(make_stats(time=4.0, step=7, num_waiting=2, kv_blocks_free=20), 1, 2)
    combined = combine_ranks([r1, r0])
    assert combined.time == 4.0
    assert combined.step == 17
    assert combined.num_waiting == 3
    assert combined.kv_blocks_free == 30
    assert combined.free_kv_tokens == 30 * 16
    assert combined.kv_blocks_total == 2 * 511
    assert combined.max_num_batched_tokens == 2 * 2048
    body = stats_body([r1, r0])
    assert [r["dp_rank"] for r in body["dp_ranks"]] == [0, 1]
    assert parse_stats(body) == combined  # readers ignore the extra field


def test_data_parallel_lora_slots_are_summed_and_names_merged() -> None:
    """Each engine runs its own batch: the replica's slots are the sum, its running adapters
    the union (sorted, each name once)."""
    r0 = SnapshotRecord(make_stats(max_loras=2, lora_running=("sql", "chat")), 0, 3)
    r1 = SnapshotRecord(make_stats(max_loras=2, lora_running=("chat", "code")), 1, 3)
    r2 = SnapshotRecord(make_stats(max_loras=2), 2, 3)
    combined = combine_ranks([r2, r0, r1])
    assert combined.max_loras == 6
    assert combined.lora_running == ("chat", "code", "sql")
    body = json.loads(json.dumps(stats_body([r2, r0, r1])))  # as served
    assert parse_stats(body) == combined
    assert [r["lora_running"] for r in body["dp_ranks"]] == [
        ["sql", "chat"],
        ["chat", "code"],
        [],
    ]
    no_lora = combine_ranks(
        [SnapshotRecord(make_stats(), 0, 2), SnapshotRecord(make_stats(), 1, 2)]
    )
    assert (no_lora.max_loras, no_lora.lora_running) == (0, ())


def test_single_engine_body_is_exactly_the_contract() -> None:
    record = SnapshotRecord(make_stats(), 0, 1)
    body = stats_body([record])
    assert next(iter(body)) == "schema"
    assert body == make_stats().to_dict()


# The ASGI route ------------------------------------------------------------------------------


async def _fallthrough(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"vllm"})


async def test_stats_route_serves_the_snapshot_and_passes_other_paths(tmp_path: Path) -> None:
    prefix = str(tmp_path / "replica")
    app = StatsMiddleware(_fallthrough, prefix=prefix)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        missing = await client.get("/stats")
        assert missing.status_code == 503
        assert missing.json()["error"]["type"] == "stats_unavailable"

        w0 = SnapshotWriter(snapshot_path(prefix, 0))
        w0.publish(SnapshotRecord(make_stats(num_running=2), 0, 2))
        partial = await client.get("/stats")
        assert partial.status_code == 503  # rank 1 of 2 has not published yet

        w1 = SnapshotWriter(snapshot_path(prefix, 1))
        w1.publish(SnapshotRecord(make_stats(num_running=5), 1, 2))
        ok = await client.get("/stats")
        assert ok.status_code == 200
        assert ok.headers["content-type"] == "application/json"
        assert parse_stats(ok.json()).num_running == 7

        assert (await client.post("/stats")).status_code == 405
        other = await client.get("/v1/models")
        assert other.text == "vllm"
        w0.close()
        w1.close()


def test_threads_publishing_and_restamping_keep_the_latest_busy_state(tmp_path: Path) -> None:
    path = snapshot_path(str(tmp_path / "s"), 0)
    writer = SnapshotWriter(path)
    idle = SnapshotRecord(make_stats(num_waiting=0, num_running=0, time=1.0), 0, 1)
    busy = SnapshotRecord(make_stats(num_running=3, time=2.0), 0, 1)
    writer.publish(idle)
    stop = threading.Event()

    def heartbeat() -> None:
        t = 100.0
        while not stop.is_set():
            writer.restamp_if_idle(t)
            t += 1

    thread = threading.Thread(target=heartbeat)
    thread.start()
    writer.publish(busy)
    stop.set()
    thread.join()
    record = SnapshotReader(path).read()
    assert record is not None
    assert record.stats == busy.stats
    writer.close()


# Readers never wait on the API server's event loop ------------------------------------------


def _freeze_mid_write(path: Path) -> None:
    """Leave the seqlock odd, as a writer descheduled (or SIGSTOPped) mid-write does."""
    import mmap
    import struct

    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        (seq,) = struct.unpack_from("<Q", mm, 8)
        struct.pack_into("<Q", mm, 8, seq + 1)


def test_reader_gives_up_on_a_write_in_progress_without_sleeping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = snapshot_path(str(tmp_path / "s"), 0)
    writer = SnapshotWriter(path)
    writer.publish(SnapshotRecord(make_stats(), 0, 1))
    _freeze_mid_write(path)

    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"the reader slept {seconds} s on the API server's loop")

    monkeypatch.setattr("time.sleep", no_sleep)
    with pytest.raises(SnapshotError) as caught:
        SnapshotReader(path).read()
    assert caught.value.reason == "torn"
    writer.close()


async def test_stats_route_answers_503_with_the_reason_when_no_consistent_read(
    tmp_path: Path,
) -> None:
    prefix = str(tmp_path / "replica")
    writer = SnapshotWriter(snapshot_path(prefix, 0))
    writer.publish(SnapshotRecord(make_stats(), 0, 1))
    app = StatsMiddleware(_fallthrough, prefix=prefix)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        assert (await client.get("/stats")).status_code == 200
        _freeze_mid_write(snapshot_path(prefix, 0))
        torn = await client.get("/stats")
        assert torn.status_code == 503
        error = torn.json()["error"]
        assert (error["type"], error["code"]) == ("stats_unavailable", "torn")
        assert "consistent read" in error["message"]
        writer.publish(SnapshotRecord(make_stats(step=43), 0, 1))  # the writer resumes
        assert (await client.get("/stats")).json()["step"] == 43
    writer.close()
