"""vLLM's KV-cache events in the gateway: the wire format (encoded by vLLM's own classes), the
mapping of vLLM's block hashes onto the gateway's chained keys, hostile messages, the
subscriber thread against vLLM's own ZMQ publisher, and replay (a gateway that joins late
catches up; lost messages are asked for again; a replayer that never ends is abandoned)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import zmq

from engine_sim.fake_vllm import default_stats
from sal_core.policies import BackendView
from sal_core.prefix import chain_hashes
from sal_gateway import kv_subscriber
from sal_gateway.kv_events import BlockKeyMap, seq_of
from sal_gateway.kv_subscriber import Endpoints, KvEventSubscribers, endpoint_for, endpoints_for
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.prefix_cache import PrefixTracker, PromptBlocks
from tests.gw_fake_support import metric

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

BS = 16
TOKENS = list(range(200, 200 + 6 * BS))


def _stored(
    hashes: list[bytes], tokens: list[int], parent: bytes | None, **kw: object
) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    fields.update(kw)
    return BlockStored(**fields)  # type: ignore[arg-type]


def _payload(*events: object) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))  # type: ignore[arg-type]


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")  # vLLM's sha256 block hashes are 32 bytes


def test_stored_blocks_chain_to_the_keys_the_gateway_computes_from_tokens() -> None:
    keymap = BlockKeyMap()
    # The prompt's first 4 blocks, then 2 more (a later step, chained on block 3).
    first = keymap.decode(_payload(_stored([_h(i) for i in range(4)], TOKENS[: 4 * BS], None)), BS)
    later = keymap.decode(_payload(_stored([_h(4), _h(5)], TOKENS[4 * BS :], _h(3))), BS)
    expected = chain_hashes(TOKENS, BS)
    assert first.stored == [expected[:4]]
    assert later.stored == [expected[4:]]
    removed = keymap.decode(_payload(BlockRemoved(block_hashes=[_h(5), _h(4)], medium="GPU")), BS)
    assert removed.removed == [expected[5], expected[4]]
    assert len(keymap) == 4


def test_int_block_hashes_work_like_bytes() -> None:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 publishes 64-bit ints instead of bytes."""
    keymap = BlockKeyMap()
    ops = keymap.decode(_payload(_stored([11, 12], TOKENS[: 2 * BS], None)), BS)  # type: ignore[list-item]
    assert ops.stored == [chain_hashes(TOKENS[: 2 * BS], BS)]


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        pytest.param(_stored([_h(1)], TOKENS[:BS], _h(99)), "unknown_parent", id="unknown-parent"),
        pytest.param(_stored([_h(1)], TOKENS[:BS], None, lora_id=3), "foreign", id="lora"),
        pytest.param(_stored([_h(1)], TOKENS[:BS], None, medium="CPU"), "foreign", id="cpu-tier"),
        pytest.param(_stored([_h(1)], TOKENS[:BS], None, group_idx=1), "foreign", id="group"),
        pytest.param(
            _stored([_h(1)], TOKENS[:BS], None, extra_keys=[("salt",)]), "foreign", id="salt"
        ),
        pytest.param(
            _stored([_h(1)], TOKENS[: 2 * BS], None, block_size=2 * BS), "foreign", id="block-size"
        ),
        pytest.param(_stored([_h(1), _h(2)], TOKENS[:BS], None), "garbled", id="short-tokens"),
    ],
)
def test_blocks_the_gateway_cannot_key_are_dropped_and_counted(event: object, reason: str) -> None:
    ops = BlockKeyMap().decode(_payload(event), BS)
    assert ops.stored == []
    assert ops.dropped == {reason: 1}


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1\xff\x00garbage", id="not-msgpack"),
        pytest.param(msgspec.msgpack.encode({"ts": 1}), id="wrong-shape"),
        pytest.param(msgspec.msgpack.encode([1.0, "events", None]), id="events-not-a-list"),
        pytest.param(b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", id="huge-array-header"),
    ],
)
def test_garbled_messages_are_counted_never_raised(payload: bytes) -> None:
    ops = BlockKeyMap().decode(payload, BS)
    assert ops.empty
    assert ops.dropped == {"garbled": 1}


def test_an_unknown_event_is_dropped_alone_and_clear_empties_the_map() -> None:
    keymap = BlockKeyMap()
    future = msgspec.msgpack.encode({"type": "BlockPinned", "block_hashes": [b"x"]})
    good = msgspec.msgpack.encode(_stored([_h(1)], TOKENS[:BS], None))
    payload = msgspec.msgpack.encode([1.0, [msgspec.Raw(future), msgspec.Raw(good)], 0])
    ops = keymap.decode(payload, BS)
    assert ops.dropped == {"garbled": 1}
    assert ops.stored == [chain_hashes(TOKENS[:BS], BS)]
    ops = keymap.decode(_payload(AllBlocksCleared()), BS)
    assert ops.cleared
    assert len(keymap) == 0


def test_sequence_frames_and_endpoints() -> None:
    assert seq_of((7).to_bytes(8, "big")) == 7
    assert seq_of(b"\x01") is None
    assert endpoint_for("http://10.0.0.5:8000", 5557, {}) == "tcp://10.0.0.5:5557"
    assert endpoint_for("http://[::1]:8000", 5557, {}) == "tcp://[::1]:5557"
    explicit = {"http://a:1": "ipc:///run/a.sock"}
    assert endpoint_for("http://a:1", 5557, explicit) == "ipc:///run/a.sock"
    # Replay: only where a port or an endpoint names it.
    assert endpoints_for("http://a:1", 5557, {}, None, {}) == Endpoints("tcp://a:5557")
    assert endpoints_for("http://a:1", 5557, {}, 5558, {}) == Endpoints(
        "tcp://a:5557", "tcp://a:5558"
    )
    replay = {"http://a:1": "ipc:///run/a-replay.sock"}
    assert endpoints_for("http://a:1", 5557, explicit, None, replay) == Endpoints(
        "ipc:///run/a.sock", "ipc:///run/a-replay.sock"
    )
    assert endpoints_for("http://b:1", 5557, {}, None, replay).replay is None


# --- the subscriber thread, against vLLM's own publisher -------------------------------------


async def _until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _tracker() -> PrefixTracker:
    tracker = PrefixTracker("kv_events")
    tracker.observe("m", "http://a", replace(default_stats(), prefix_caching=True))
    return tracker


async def test_subscriber_applies_vllm_publisher_events_off_the_loop(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    tracker = _tracker()
    metrics = GatewayMetrics("test")
    subscribers = KvEventSubscribers(tracker, metrics)
    try:
        subscribers.add("m", "http://a", Endpoints(endpoint))
        stored = _stored([_h(i) for i in range(6)], TOKENS, None)

        def published_and_applied() -> bool:
            # ZMQ's slow joiner: what is published before the subscription lands is lost.
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
            return tracker.indexed_blocks("m", "http://a") == 6

        await _until(published_and_applied)
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([_h(5)], "GPU")]))
        await _until(lambda: tracker.indexed_blocks("m", "http://a") == 5)
        views = [BackendView("http://a", True, 0, 16000, 0, 2048)]
        tracker.annotate("m", views, PromptBlocks(tuple(chain_hashes(TOKENS, BS)), len(TOKENS) + 1))
        assert views[0].cached_tokens == 5 * BS
        text = metrics.exposition().decode()
        assert metric(text, "sal_kv_events_total", kind="removed_blocks") == 1.0
    finally:
        await subscribers.stop()
        publisher.shutdown()


async def test_hostile_publisher_messages_are_counted_and_the_subscriber_keeps_going(
    tmp_path: Path,
) -> None:
    endpoint = f"ipc://{tmp_path}/hostile.sock"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    tracker = _tracker()
    metrics = GatewayMetrics("test")
    subscribers = KvEventSubscribers(tracker, metrics)
    good = _payload(_stored([_h(1)], TOKENS[:BS], None))
    try:
        subscribers.add("m", "http://a", Endpoints(endpoint))

        def dropped(reason: str) -> float:
            text = metrics.exposition().decode()
            return metric(text, "sal_kv_events_dropped_total", reason=reason) or 0.0

        def send_garbage() -> bool:
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1garbage"])
            pub.send_multipart([b"only-one-frame"])
            return dropped("garbled") >= 2

        await _until(send_garbage)
        pub.send_multipart([b"", (5).to_bytes(8, "big"), good])  # seq 0 -> 5: a gap
        await _until(lambda: tracker.indexed_blocks("m", "http://a") == 1)
        assert dropped("gap") >= 1
    finally:
        await subscribers.stop()
        pub.close(linger=0)
        ctx.term()


# --- replay ---------------------------------------------------------------------------------


def _counted(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metric(metrics.exposition().decode(), name, **labels) or 0.0


async def test_a_gateway_that_joins_late_learns_what_the_replica_cached_before(
    tmp_path: Path,
) -> None:
    # vLLM's own publisher, with its replay socket: six blocks stored and one removed before
    # the gateway subscribes. Live events alone never show them (ZMQ delivers only what is
    # published after the subscription); the catch-up replay does, once the gateway keys
    # the backend's blocks.
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay)
    tracker = _tracker()
    metrics = GatewayMetrics("test")
    subscribers = KvEventSubscribers(tracker, metrics)
    try:
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[_stored([_h(i) for i in range(6)], TOKENS, None)])
        )
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([_h(5)], "GPU")]))
        await _until(lambda: len(publisher._buffer) == 2)
        subscribers.add("m", "http://a", Endpoints(endpoint, replay))
        await asyncio.sleep(0.3)
        assert tracker.indexed_blocks("m", "http://a") == 0  # nothing live to learn from
        subscribers.tracked("m", "http://a")
        await _until(lambda: tracker.indexed_blocks("m", "http://a") == 5)
        views = [BackendView("http://a", True, 0, 16000, 0, 2048)]
        tracker.annotate("m", views, PromptBlocks(tuple(chain_hashes(TOKENS, BS)), len(TOKENS) + 1))
        assert views[0].cached_tokens == 5 * BS
        assert _counted(metrics, "sal_kv_events_total", kind="replayed_messages") == 2
        # Asked once per subscription; live events go on after it.
        subscribers.tracked("m", "http://a")
        more = _stored([_h(9)], list(range(900, 900 + BS)), _h(4))
        publisher.publish(KVEventBatch(ts=time.time(), events=[more]))
        await _until(lambda: tracker.indexed_blocks("m", "http://a") == 6)
        assert _counted(metrics, "sal_kv_events_total", kind="replayed_messages") == 2
        assert _counted(metrics, "sal_kv_events_dropped_total", reason="gap") == 0
    finally:
        await subscribers.stop()
        publisher.shutdown()


class _FakePublisher:
    """A publisher the test drives message by message: PUB for live messages, ROUTER for
    replay requests, answered as vLLM's `ZmqEventPublisher._service_replay` does (or not)."""

    def __init__(self, tmp_path: Path, name: str = "fake") -> None:
        self.endpoints = Endpoints(
            f"ipc://{tmp_path}/{name}-pub.sock", f"ipc://{tmp_path}/{name}-rep.sock"
        )
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoints.events)
        self.router = self.ctx.socket(zmq.ROUTER)
        assert self.endpoints.replay is not None
        self.router.bind(self.endpoints.replay)
        self.sent: dict[int, bytes] = {}
        self.pending: tuple[bytes, int] | None = None

    def take_request(self) -> bool:
        """Whether a replay request came (kept in `pending`)."""
        self.pending = self.replay_request()
        return self.pending is not None

    def live(self, seq: int, payload: bytes, *, lose: bool = False) -> None:
        self.sent[seq] = payload
        if not lose:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def replay_request(self) -> tuple[bytes, int] | None:
        if not self.router.poll(0):
            return None
        client, empty, start = self.router.recv_multipart()
        assert empty == b""
        return client, int.from_bytes(start, "big")

    def answer(self, client: bytes, start: int, *extra: list[bytes], end: bool = True) -> None:
        for seq in sorted(s for s in self.sent if s >= start):
            self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), self.sent[seq]])
        for frames in extra:
            self.router.send_multipart([client, *frames])
        if end:
            self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def _chain(n: int, first_token: int = 200) -> list[bytes]:
    """`n` payloads, each storing one block chained to the one before (block i: hash i+1,
    tokens from `first_token` on)."""
    tokens = list(range(first_token, first_token + n * BS))
    return [
        _payload(_stored([_h(i + 1)], tokens[i * BS : (i + 1) * BS], None if i == 0 else _h(i)))
        for i in range(n)
    ]


@contextlib.asynccontextmanager
async def _subscribed_to(
    fake: _FakePublisher, first: bytes
) -> AsyncIterator[tuple[PrefixTracker, GatewayMetrics, KvEventSubscribers]]:
    """A subscriber to `fake` that has applied its message 0 (`first`, one block)."""
    tracker = _tracker()
    metrics = GatewayMetrics("test")
    subscribers = KvEventSubscribers(tracker, metrics)
    try:
        subscribers.add("m", "http://a", fake.endpoints)

        def first_arrived() -> bool:  # ZMQ's slow joiner: resend until subscribed
            fake.live(0, first)
            return tracker.indexed_blocks("m", "http://a") == 1

        await _until(first_arrived)
        await asyncio.sleep(0.2)  # every resent copy of 0 applied
        yield tracker, metrics, subscribers
    finally:
        await subscribers.stop()
        fake.close()


async def test_lost_messages_are_asked_for_again_and_applied_in_order(tmp_path: Path) -> None:
    # Messages 1 and 2 are lost on the way (a slow subscriber past its high-water mark, a
    # reconnect). Without replay, block 2 and every block chained after it could never be
    # keyed (their parents unknown); with it the gateway asks for 1.. and indexes all four.
    fake = _FakePublisher(tmp_path)
    payloads = _chain(4)
    async with _subscribed_to(fake, payloads[0]) as (tracker, metrics, _):
        stored_before = _counted(metrics, "sal_kv_events_total", kind="stored_blocks")
        fake.live(1, payloads[1], lose=True)
        fake.live(2, payloads[2], lose=True)
        fake.live(3, payloads[3])
        request = None
        deadline = time.monotonic() + 10
        while (request := fake.replay_request()) is None:
            assert time.monotonic() < deadline, "no replay was asked for"
            await asyncio.sleep(0.02)
        client, start = request
        assert start == 1
        # The replay carries a garbled message too: counted, the rest applied.
        fake.answer(client, start, [b"", b"only three frames", b""])
        await _until(lambda: tracker.indexed_blocks("m", "http://a") == 4)
        views = [BackendView("http://a", True, 0, 16000, 0, 2048)]
        tracker.annotate(
            "m", views, PromptBlocks(tuple(chain_hashes(TOKENS[: 4 * BS], BS)), 4 * BS + 1)
        )
        assert views[0].cached_tokens == 4 * BS
        assert _counted(metrics, "sal_kv_events_dropped_total", reason="gap") == 0
        assert _counted(metrics, "sal_kv_events_dropped_total", reason="unknown_parent") == 0
        assert _counted(metrics, "sal_kv_events_dropped_total", reason="garbled") == 1
        # Seqs 1-3 came by replay; the live 3 that waited for it is not applied twice.
        assert _counted(metrics, "sal_kv_events_total", kind="replayed_messages") == 3
        stored = _counted(metrics, "sal_kv_events_total", kind="stored_blocks")
        assert stored == stored_before + 3


async def test_a_replay_that_never_ends_is_abandoned_and_the_live_messages_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replica's replay socket takes the request and never answers (a replayer stuck, or
    # lying): after REPLAY_TIMEOUT_S the gateway gives up, applies the live messages that
    # waited (the loss counted as a gap) and asks for no replay during the cooldown.
    monkeypatch.setattr(kv_subscriber, "REPLAY_TIMEOUT_S", 0.5)
    fake = _FakePublisher(tmp_path)
    payloads = _chain(4)
    async with _subscribed_to(fake, payloads[0]) as (tracker, metrics, _):
        fake.live(1, payloads[1], lose=True)
        fake.live(2, payloads[2])  # a gap: waits for a replay that never ends
        await _until(lambda: fake.replay_request() is not None)
        fake.live(3, payloads[3])
        await _until(
            lambda: _counted(metrics, "sal_kv_events_dropped_total", reason="replay_timeout") == 1
        )
        await _until(
            lambda: _counted(metrics, "sal_kv_events_dropped_total", reason="unknown_parent") == 2
        )
        assert _counted(metrics, "sal_kv_events_dropped_total", reason="gap") == 1
        assert tracker.indexed_blocks("m", "http://a") == 1  # blocks 2 and 3 had lost parents
        # Another gap within the cooldown is counted, not asked for.
        fake.live(5, _chain(1)[0])
        await _until(lambda: _counted(metrics, "sal_kv_events_dropped_total", reason="gap") == 2)
        await asyncio.sleep(0.2)
        assert fake.replay_request() is None
        assert tracker.indexed_blocks("m", "http://a") == 1


async def test_a_replay_larger_than_the_backlog_waits_for_the_loop_instead_of_dropping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A catch-up of 300 buffered messages against a main-loop backlog of 8: the thread reads
    # the replay only as fast as the loop applies it, so nothing is dropped as backlog and
    # every block is indexed.
    monkeypatch.setattr(kv_subscriber, "MAX_BACKLOG", 8)
    fake = _FakePublisher(tmp_path)
    for seq, payload in enumerate(_chain(300, first_token=5000)):
        fake.sent[seq] = payload
    tracker = _tracker()
    metrics = GatewayMetrics("test")
    subscribers = KvEventSubscribers(tracker, metrics)
    try:
        subscribers.add("m", "http://a", fake.endpoints)
        subscribers.tracked("m", "http://a")
        await _until(fake.take_request)
        assert fake.pending is not None
        fake.answer(*fake.pending)
        await _until(lambda: tracker.indexed_blocks("m", "http://a") == 300)
        assert _counted(metrics, "sal_kv_events_dropped_total", reason="backlog") == 0
        assert _counted(metrics, "sal_kv_events_total", kind="replayed_messages") == 300
    finally:
        await subscribers.stop()
        fake.close()


async def test_catch_ups_run_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three replicas' buffers, one catch-up at a time: the next replica is asked only once
    # the one before it has sent its end, and each is caught up in turn.
    monkeypatch.setattr(kv_subscriber, "MAX_CATCH_UPS", 1)
    fakes = [_FakePublisher(tmp_path, f"r{i}") for i in range(3)]
    tracker = PrefixTracker("kv_events")
    urls = [f"http://r{i}" for i in range(3)]
    for url in urls:
        tracker.observe("m", url, replace(default_stats(), prefix_caching=True))
    metrics = GatewayMetrics("test")
    subscribers = KvEventSubscribers(tracker, metrics)
    try:
        for i, (fake, url) in enumerate(zip(fakes, urls, strict=True)):
            fake.sent[0] = _chain(1, first_token=7000 + 100 * i)[0]
            subscribers.add("m", url, fake.endpoints)
            subscribers.tracked("m", url)
        answered: list[int] = []
        deadline = time.monotonic() + 15
        while len(answered) < 3:
            assert time.monotonic() < deadline, f"catch-ups stalled after {answered}"
            asked = [(i, r) for i, f in enumerate(fakes) if (r := f.replay_request()) is not None]
            assert len(asked) <= 1, asked  # never two at once
            if asked:
                i, (client, start) = asked[0]
                await asyncio.sleep(0.3)  # nobody else asks while this one runs
                assert all(f.replay_request() is None for f in fakes)
                fakes[i].answer(client, start)
                answered.append(i)
            await asyncio.sleep(0.02)
        assert sorted(answered) == [0, 1, 2]
        await _until(lambda: all(tracker.indexed_blocks("m", u) == 1 for u in urls))
    finally:
        await subscribers.stop()
        for fake in fakes:
            fake.close()
