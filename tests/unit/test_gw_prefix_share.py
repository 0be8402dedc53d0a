"""The workers' prefix-index exchange (`sal_gateway.prefix_share`): the wire format refuses
what is not a message, and one worker's routed blocks reach the other worker's tracker, so a
conversation's next turn, arriving at the other worker, is predicted where its prefix is."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from engine_sim.fake_vllm import default_stats
from sal_core.policies import BackendView
from sal_core.prefix import chain_hashes
from sal_gateway.prefix_cache import PrefixTracker, PromptBlocks
from sal_gateway.prefix_share import (
    MAX_KEYS,
    MAX_MESSAGE_BYTES,
    PrefixShare,
    ShareError,
    ShareSpec,
    decode,
    encode,
)

BS = 16
A, B = "http://a:8000", "http://b:8000"


@pytest.mark.parametrize("held", [True, False])
def test_a_message_round_trips_keys_of_any_sign_and_only_the_leading_blocks_travel(
    held: bool,
) -> None:
    keys = [-(2**63), -1, 0, 1, 2**63 - 1, *range(MAX_KEYS + 100)]
    model, url, got, was_held, seq = decode(encode("llama-é", A, keys, held, 2**64 - 1))
    assert (model, url, was_held, seq) == ("llama-é", A, held, 2**64 - 1)
    assert got == keys[:MAX_KEYS]


SEQ = (7).to_bytes(8, "big")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"XX1H" + SEQ + b"\x00\x01m\x00\x01u",  # bad magic
        b"SP1X" + SEQ + b"\x00\x01m\x00\x01u",  # bad kind
        b"SP1",  # no kind
        b"SP1H\x00\x00\x01",  # sequence number cut short
        b"SP1H" + SEQ + b"\x00\x05m",  # model length past the end
        b"SP1E" + SEQ + b"\x00\x01m\x00\x09u",  # URL length past the end
        b"SP1H" + SEQ + b"\x00\x01\xff\x00\x01u",  # not UTF-8
        b"SP1H" + SEQ + b"\x00\x01m\x00\x01u\x01\x02\x03",  # keys not a multiple of 8
        b"SP1H" + SEQ + b"\x00\x01m\x00\x01u" + b"\x00" * 8 * (MAX_KEYS + 1),  # too many
    ],
)
def test_what_is_not_a_message_is_refused(data: bytes) -> None:
    with pytest.raises(ShareError):
        decode(data)


def _tracker() -> PrefixTracker:
    tracker = PrefixTracker("approximate")
    stats = replace(default_stats(), prefix_caching=True, prefix_hash_algo="sha256")
    for url in (A, B):
        tracker.observe("m", url, stats)
    return tracker


def _cached_on(tracker: PrefixTracker, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
    views = [BackendView(url, True, 0, 16000, 0, 2048) for url in (A, B)]
    tracker.annotate("m", views, PromptBlocks(tuple(chain_hashes(tokens, BS)), len(tokens)))
    return {v.url: (v.cached_tokens, v.cached_held_tokens) for v in views}


CONV = list(range(1000, 1000 + 10 * BS + 5))
TURN2 = [*CONV, *range(7, 40)]


def test_told_blocks_are_held_until_told_ended_and_only_on_a_tracked_backend() -> None:
    tracker = _tracker()
    keys = chain_hashes(CONV, BS)
    assert tracker.told("m", B, keys, True) is True
    # Never polled: no entry without a bound, and nothing held that an end could release.
    assert tracker.told("m", "http://unknown:1", keys, True) is False
    assert tracker.told("other-model", A, keys, True) is False
    assert _cached_on(tracker, TURN2) == {A: (0, 0), B: (10 * BS, 10 * BS)}
    assert tracker.indexed_blocks("m", "http://unknown:1") == 0
    tracker.told("m", B, keys, False)
    assert _cached_on(tracker, TURN2) == {A: (0, 0), B: (10 * BS, 0)}
    tracker.told("m", B, keys, False)  # an "ended" too many releases nothing below 0
    tracker.told("m", B, keys, True)
    assert _cached_on(tracker, TURN2)[B] == (10 * BS, 10 * BS)


def _count(counts: Counter[str]) -> Callable[[str], None]:
    def count(outcome: str) -> None:
        counts[outcome] += 1

    return count


async def _wait(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


Seen = dict[str, tuple[int, int]]


async def _exchange(tmp_path: Path) -> tuple[Seen, Seen, Counter[str], Counter[str]]:
    """Worker 0 starts before worker 1 (it connects once 1 is up), routes a conversation's
    turn to B, then the request ends; worker 1 is told both. Returns what worker 1 predicts
    for the next turn after each, and both workers' outcome counts."""
    spec0, spec1 = (ShareSpec(str(tmp_path), i, 2) for i in range(2))
    out0: Counter[str] = Counter()
    out1: Counter[str] = Counter()
    t0, t1 = _tracker(), _tracker()
    w0 = PrefixShare(spec0, t0.told, _count(out0))
    w1 = PrefixShare(spec1, t1.told, _count(out1))
    await w0.start()
    await asyncio.sleep(0.3)
    await w1.start()
    t0.hold_listeners.append(w0.tell)
    try:
        await _wait(lambda: w0.connected == 1)
        release = t0.hold("m", B, PromptBlocks(tuple(chain_hashes(CONV, BS)), len(CONV)))
        assert release is not None
        await _wait(lambda: out1["received"] == 1)
        running = _cached_on(t1, TURN2)
        release()
        await _wait(lambda: out1["received"] == 2)
        ended = _cached_on(t1, TURN2)
        # Not a message, and a frame longer than any message, each on a connection of its
        # own: counted, and the connection closed.
        for frame in (b"\x00\x00\x00\x05hello", (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big")):
            reader, writer = await asyncio.open_unix_connection(spec1.path(1))
            writer.write(frame)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        await _wait(lambda: out1["garbled"] == 2)
    finally:
        await w0.aclose()
        await w1.aclose()
    return running, ended, out0, out1


def test_a_worker_is_told_the_blocks_another_routed_and_predicts_the_next_turn_there(
    tmp_path: Path,
) -> None:
    running, ended, out0, out1 = asyncio.run(_exchange(tmp_path))
    assert out0 == {"sent": 2}
    assert out1 == {"received": 2, "garbled": 2}
    # Worker 1 never routed the conversation, yet predicts its next turn on B: held by a
    # running request while worker 0's runs (reusing them needs no free KV), then not.
    assert running == {A: (0, 0), B: (10 * BS, 10 * BS)}
    assert ended == {A: (0, 0), B: (10 * BS, 0)}
    assert not list(tmp_path.iterdir()), "each worker removes its socket on close"


def test_a_burst_while_the_other_worker_is_busy_waits_for_it_and_arrives_whole(
    tmp_path: Path,
) -> None:
    """500 requests routed, and every other one ended, without the receiving worker's loop
    getting a turn (its loop is this one): every message waits in the connection and
    arrives, in order, each "ended" releasing its own request's blocks. With Unix datagrams
    Linux had kept only 10 of them per socket. When the sender's connection ends, what it
    still held is released."""
    told: list[tuple[str, bool]] = []
    out: Counter[str] = Counter()

    async def burst() -> None:
        w0 = PrefixShare(ShareSpec(str(tmp_path), 0, 2), lambda *_: None, _count(out))
        w1 = PrefixShare(
            ShareSpec(str(tmp_path), 1, 2),
            lambda m, u, k, h: told.append((u, h)) or True,
            _count(out),
        )
        await w0.start()
        await w1.start()
        try:
            await _wait(lambda: w0.connected == 1)
            keys = chain_hashes(list(range(8192)), BS)  # an 8k-token prompt: 512 blocks
            for i in range(500):
                ended = w0.tell("m", f"http://r{i}", keys)
                if i % 2:
                    ended()
            await _wait(lambda: len(told) == 750)
            await w0.aclose()
            await _wait(lambda: len(told) == 1000)
        finally:
            await w0.aclose()
            await w1.aclose()

    asyncio.run(burst())
    in_order = []
    for i in range(500):
        in_order.append((f"http://r{i}", True))
        if i % 2:
            in_order.append((f"http://r{i}", False))
    assert told[:750] == in_order
    assert sorted(told[750:]) == sorted((f"http://r{i}", False) for i in range(0, 500, 2))
    assert out == {"sent": 750, "received": 750}


def test_a_worker_that_is_not_up_costs_a_dropped_message_not_an_error(tmp_path: Path) -> None:
    out: Counter[str] = Counter()

    async def tell() -> None:
        share = PrefixShare(ShareSpec(str(tmp_path), 0, 3), lambda *_: None, _count(out))
        await share.start()
        try:
            ended = share.tell("m", A, [1, 2, 3])  # workers 1 and 2 never start
            ended()  # not told it was routed: not told it ended
            share.tell("m", A, [])()  # nothing indexed: nothing sent
        finally:
            await share.aclose()

    asyncio.run(tell())
    assert out == {"dropped": 2}


def test_an_ended_message_releases_only_what_its_own_routed_message_held(tmp_path: Path) -> None:
    """Another request's "ended" (an unknown sequence number: its "routed" was missed, or a
    forged one) must not release a running request's hold on the same blocks."""
    told: list[tuple[str, bool]] = []

    async def exchange() -> None:
        w1 = PrefixShare(
            ShareSpec(str(tmp_path), 1, 2),
            lambda m, u, k, h: told.append((u, h)) or True,
            lambda _: None,
        )
        await w1.start()
        try:
            _, writer = await asyncio.open_unix_connection(ShareSpec(str(tmp_path), 1, 2).path(1))
            for message in (
                encode("m", A, [1, 2, 3], True, 5),
                encode("m", A, (), False, 6),  # not routed on this connection: ignored
                encode("m", A, [1, 2, 3], True, 5),  # a repeat of 5: held once
            ):
                writer.write(len(message).to_bytes(4, "big") + message)
            await writer.drain()
            await _wait(lambda: len(told) == 1)
            await asyncio.sleep(0.1)  # the ignored end and the repeat read too
            assert w1.held_requests == 1
            message = encode("m", A, (), False, 5)
            writer.write(len(message).to_bytes(4, "big") + message)
            await writer.drain()
            await _wait(lambda: len(told) == 2)
            assert w1.held_requests == 0
            # A worker that goes away while its request runs: released, and no longer counted.
            message = encode("m", A, [4], True, 7)
            writer.write(len(message).to_bytes(4, "big") + message)
            await writer.drain()
            await _wait(lambda: w1.held_requests == 1)
            writer.close()
            await _wait(lambda: len(told) == 4)
            assert w1.held_requests == 0
        finally:
            await w1.aclose()

    asyncio.run(exchange())
    assert told == [(A, True), (A, False), (A, True), (A, False)]
