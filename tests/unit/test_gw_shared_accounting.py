"""The workers' shared between-poll accounting (`sal_gateway.shared_accounting`) and what the
state table makes of it: a worker sees what the other workers routed since the snapshot."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_sim.fake_vllm import default_stats
from sal_core.policies import RouteRequest, make_policy
from sal_gateway.shared_accounting import (
    ADAPTER_WORDS,
    PREFIX,
    SharedAccounting,
    SharedAccountingError,
    SharedSlot,
    adapter_key,
    remove_orphans,
)
from sal_gateway.state import StateTable

A, B = "http://a:1", "http://b:1"


@pytest.fixture
def block() -> Iterator[SharedAccounting]:
    owner = SharedAccounting.create(workers=2)
    yield owner
    owner.close()


def _slot(acc: SharedAccounting, model: str, url: str) -> SharedSlot:
    slot = acc.slot(model, url)
    assert slot is not None
    return slot


def test_a_worker_reads_what_the_other_published(block: SharedAccounting) -> None:
    w0, w1 = SharedAccounting.attach(block.name, 0), SharedAccounting.attach(block.name, 1)
    try:
        a0, a1 = _slot(w0, "m", A), _slot(w1, "m", A)
        assert a1.others() == (0, 0, 0)  # worker 0 has published nothing yet
        a0.publish(3, 1200, 900)
        assert a1.others() == (3, 1200, 900)
        assert a0.others() == (0, 0, 0)  # its own counts are not "others"
        a1.publish(1, 10, 10)
        assert a0.others() == (1, 10, 10)
        a0.publish(0, 0, 0)
        assert a1.others() == (0, 0, 0)
        # Another backend, or the same address in another model, is another entry.
        assert _slot(w1, "m", B).others() == (0, 0, 0)
        assert _slot(w1, "other", A).others() == (0, 0, 0)
    finally:
        w0.close()
        w1.close()


def test_colliding_backends_stay_apart_and_a_full_row_stops_sharing() -> None:
    owner = SharedAccounting.create(workers=2, slots=3)
    try:
        w0, w1 = SharedAccounting.attach(owner.name, 0), SharedAccounting.attach(owner.name, 1)
        urls = [f"http://r{i}:1" for i in range(3)]
        for i, url in enumerate(urls):  # 3 entries in 3 slots: some probe past a taken one
            _slot(w0, "m", url).publish(i + 1, 0, 0)
        assert [_slot(w1, "m", url).others()[0] for url in urls] == [1, 2, 3]
        assert w0.slot("m", "http://r3:1") is None  # row full: accounted locally
        w0.close()
        w1.close()
    finally:
        owner.close()


def test_attach_refuses_what_is_not_an_accounting_block(
    block: SharedAccounting, tmp_path: Path
) -> None:
    with pytest.raises(SharedAccountingError, match="no shared accounting block"):
        SharedAccounting.attach(str(tmp_path / "no-such-block"), 0)
    with pytest.raises(SharedAccountingError, match=r"outside 0\.\.1"):
        SharedAccounting.attach(block.name, 2)
    for size in (8, 4096):  # too short for a header; a header of zeros
        other = tmp_path / f"other-{size}"
        other.write_bytes(bytes(size))
        with pytest.raises(SharedAccountingError, match="not an accounting block"):
            SharedAccounting.attach(str(other), 0)


def _publish_and_exit(name: str) -> None:
    worker = SharedAccounting.attach(name, 1)
    _slot(worker, "m", A).publish(5, 500, 400)
    worker.close()


def test_a_worker_process_that_exits_leaves_the_block_and_its_counts(
    block: SharedAccounting,
) -> None:
    # A worker that exits (or dies) must not take the block with it: the others use it.
    proc = multiprocessing.get_context("spawn").Process(
        target=_publish_and_exit, args=(block.name,)
    )
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    reader = SharedAccounting.attach(block.name, 0)
    try:
        assert _slot(reader, "m", A).others() == (5, 500, 400)
    finally:
        reader.close()


def _tables(block: SharedAccounting) -> tuple[StateTable, StateTable, list[SharedAccounting]]:
    handles = [SharedAccounting.attach(block.name, i) for i in range(2)]
    tables = []
    for handle in handles:
        table = StateTable(stale_after_s=1.0, eject_after_failures=3, peers=handle.slot)
        table.add_backend("m", A)
        table.add_backend("m", B)
        tables.append(table)
    return tables[0], tables[1], handles


def test_two_workers_tables_see_each_others_routing_until_a_snapshot_covers_it(
    block: SharedAccounting,
) -> None:
    first, second, handles = _tables(block)
    try:
        stats = dataclasses.replace(default_stats(), free_kv_tokens=1000, queued_prefill_tokens=50)
        for table in (first, second):
            for url in (A, B):
                table.record_poll_success("m", url, stats, "stats", now_s=0.0)
        tickets = [first.route("m", A, 300, sent_s=0.05), first.route("m", A, 400, sent_s=0.05)]
        view = second.views("m", 0.1)[0]
        assert (view.in_flight, view.queued_prefill_tokens, view.free_kv_tokens) == (
            2,
            50 + 700,
            300,
        )
        # SAL in the second worker: equal snapshots, so the first worker's requests decide.
        policy = make_policy("sal", 0)
        decision = policy.select(RouteRequest(100), second.views("m", 0.1))
        assert decision.url == B
        # The first worker's next poll covers its requests: their tokens leave both views;
        # they are still in flight.
        first.record_poll_success("m", A, stats, "stats", now_s=0.3)
        view = second.views("m", 0.3)[0]
        assert (view.in_flight, view.queued_prefill_tokens, view.free_kv_tokens) == (
            2,
            50,
            1000,
        )
        for ticket in tickets:
            StateTable.release(ticket)
        assert second.views("m", 0.3)[0].in_flight == 0
    finally:
        for handle in handles:
            handle.close()


def test_a_worker_reads_the_pending_adapters_the_other_published(block: SharedAccounting) -> None:
    w0, w1 = SharedAccounting.attach(block.name, 0), SharedAccounting.attach(block.name, 1)
    try:
        a0, a1 = _slot(w0, "m", A), _slot(w1, "m", A)
        assert a1.other_adapters() == frozenset()
        a0.publish(2, 100, 100, ["lora-a", "lora-b"])
        assert a1.other_adapters() == {adapter_key("lora-a"), adapter_key("lora-b")}
        assert a1.others() == (2, 100, 100)
        assert a0.other_adapters() == frozenset()  # its own are not "others"
        a0.publish(1, 50, 50, ["lora-b"])  # lora-a's request acknowledged: its word clears
        assert a1.other_adapters() == {adapter_key("lora-b")}
        many = [f"lora-{i}" for i in range(ADAPTER_WORDS + 3)]
        a0.publish(len(many), 0, 0, many)  # more than the entry holds: ADAPTER_WORDS shared
        assert len(a1.other_adapters()) == ADAPTER_WORDS
        assert a1.other_adapters() <= {adapter_key(name) for name in many}
        a0.publish(0, 0, 0)
        assert a1.other_adapters() == frozenset()
        assert _slot(w1, "m", B).other_adapters() == frozenset()  # another backend's entry
    finally:
        w0.close()
        w1.close()


def test_a_lora_slot_another_worker_filled_since_the_poll_blocks_this_ones_adapter(
    block: SharedAccounting,
) -> None:
    # Each replica has one LoRA slot, free at the poll. Worker 0 sends lora-a to A; worker 1
    # must then see A's slot taken: lora-b waits there (blocked), lora-a would join it.
    first, second, handles = _tables(block)
    try:
        stats = dataclasses.replace(default_stats(), max_loras=1, lora_running=())
        for table in (first, second):
            for url in (A, B):
                table.record_poll_success("m", url, stats, "stats", now_s=0.0)
        assert second.lora_slots("m", "lora-b") == (set(), set())
        ticket = first.route("m", A, 300, sent_s=0.05, adapter="lora-a")
        assert second.lora_slots("m", "lora-b") == ({A}, set())
        assert second.lora_slots("m", "lora-a") == (set(), {A})
        # Both kinds of knowledge count together: worker 1's own lora-c on B fills B.
        own = second.route("m", B, 300, sent_s=0.06, adapter="lora-c")
        assert second.lora_slots("m", "lora-b") == ({A, B}, set())
        StateTable.release(ticket)  # lora-a's request is over: A's slot is free again
        assert second.lora_slots("m", "lora-b") == ({B}, set())
        StateTable.release(own)
        assert first.lora_slots("m", "lora-b") == (set(), set())
    finally:
        for handle in handles:
            handle.close()


def test_without_sharing_a_worker_decides_on_its_own_counts_only() -> None:
    alone = StateTable(stale_after_s=1.0, eject_after_failures=3)
    other = StateTable(stale_after_s=1.0, eject_after_failures=3)
    for table in (alone, other):
        table.add_backend("m", A)
        table.add_backend("m", B)
        for url in (A, B):
            table.record_poll_success("m", url, default_stats(), "stats", now_s=0.0)
    other.route("m", A, 300, sent_s=0.05)
    assert alone.views("m", 0.1)[0].in_flight == 0
    assert make_policy("sal", 0).select(RouteRequest(100), alone.views("m", 0.1)).url == A


def test_the_creator_removes_the_block_when_it_closes() -> None:
    owner = SharedAccounting.create(workers=2)
    path = Path(owner.name)
    assert path.is_file()
    worker = SharedAccounting.attach(owner.name, 1)
    worker.close()
    assert path.is_file()  # a worker's close leaves it
    owner.close()
    assert not path.exists()


def test_blocks_of_a_supervisor_that_died_are_removed_by_the_next(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{PREFIX}{os.getpid()}-def"
    other = tmp_path / "sal-accounting-notes.txt"
    for path in (orphan, live, other):
        path.write_bytes(b"x")
    assert remove_orphans(tmp_path) == [orphan]
    assert live.exists()
    assert other.exists()
