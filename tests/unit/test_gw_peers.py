"""``peers``: gateways on separate hosts tell each other their between-poll accounting.

The wire format (`sal_gateway.peer_wire`) refuses anything not sent with the shared secret,
and what does not parse; two `PeerNetwork`s on real UDP sockets (loopback) see each other's
counts within a loop turn, forget a peer that went silent, and ignore a stranger, a replay
and their own datagrams. What a user would notice if it broke: gateways that herd (they do
not hear each other), or routing that anyone on the network can steer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import struct
from collections import Counter

import pytest

from sal_gateway.config import ConfigError, PeersConfig, build_config
from sal_gateway.peer_wire import (
    BLOCK_KEYS_PER_DATAGRAM,
    ENDED,
    MAX_ADAPTERS,
    MAX_DATAGRAM,
    MAX_ROWS,
    ROUTED,
    WATERMARK,
    PeerBlocks,
    PeerRow,
    PeerWireError,
    decode,
    decode_blocks,
    encode,
    encode_blocks,
    fits,
)
from sal_gateway.peers import (
    MAX_BLOCK_DATAGRAMS,
    PeerNetwork,
    PeersError,
    bind_socket,
    load_secret,
    open_peer_link,
)
from sal_gateway.shared_accounting import adapter_key, backend_key

SECRET = b"0123456789abcdef-shared"


def test_a_datagram_round_trips_and_stays_under_one_ethernet_frame() -> None:
    rows = [PeerRow(k + 1, k, 1000 * k, 2000 * k) for k in range(MAX_ROWS)]
    data = encode(SECRET, 42, 7, rows)
    # Without adapters: version 1, at most 1,394 bytes, as the release before adapters sent
    # and accepted it (gateways of both releases hear each other during an upgrade).
    assert (data[4], len(data)) == (1, 1394)
    assert MAX_DATAGRAM <= 1500 - 40 - 8  # IPv6 and UDP headers
    message = decode(SECRET, data)
    assert (message.sender, message.seq, list(message.rows)) == (42, 7, rows)
    with pytest.raises(ValueError, match="rows"):
        encode(SECRET, 42, 8, [*rows, PeerRow(99, 1, 1, 1)])


def test_pending_adapters_round_trip_and_a_row_carries_at_most_max_adapters() -> None:
    rows = [
        PeerRow(1, 2, 300, 300, (11, 12)),
        PeerRow(2, 0, 0, 0),
        PeerRow(3, 9, 900, 900, tuple(range(100, 100 + MAX_ADAPTERS + 4))),
    ]
    data = encode(SECRET, 42, 7, rows)
    assert data[4] == 2  # version 2: rows carry adapters
    decoded = decode(SECRET, data).rows
    assert decoded[:2] == tuple(rows[:2])
    assert decoded[2].adapters == tuple(range(100, 100 + MAX_ADAPTERS))
    full = [PeerRow(k + 1, 1, 1, 1, tuple(range(MAX_ADAPTERS))) for k in range(15)]
    assert fits(full[:14])  # 14 rows of 8 adapters: 1,352 bytes
    assert not fits(full)  # 15: 1,445
    assert len(encode(SECRET, 1, 1, full[:14])) <= MAX_DATAGRAM


def test_a_gateway_not_yet_upgraded_is_still_heard() -> None:
    # Version 1 rows (no adapter count), as a gateway of the previous release sends them.
    header = struct.pack("<4sB3xQQQH", b"SALP", 1, 42, 42, 7, 2)
    body = header + struct.pack("<QIQQ", 5, 3, 300, 200) + struct.pack("<QIQQ", 6, 1, 10, 10)
    tag = hmac.new(SECRET, body, hashlib.sha256).digest()[:16]
    message = decode(SECRET, body + tag)
    assert message.rows == (PeerRow(5, 3, 300, 200), PeerRow(6, 1, 10, 10))


@pytest.mark.parametrize(
    ("count", "adapters", "extra"),
    [(1, 9, 9), (1, 3, 2), (1, 1, 2), (2, 0, 0)],
    ids=["over max adapters", "adapters past the end", "bytes left over", "rows missing"],
)
def test_rows_that_do_not_add_up_are_refused(count: int, adapters: int, extra: int) -> None:
    """Authentic (a peer with the secret, or a bug) but inconsistent: refused, no traceback."""
    body = struct.pack("<4sB3xQQQH", b"SALP", 2, 42, 42, 7, count)
    body += struct.pack("<QIQQB", 5, 3, 300, 200, adapters) + struct.pack("<Q", 77) * extra
    tag = hmac.new(SECRET, body, hashlib.sha256).digest()[:16]
    with pytest.raises(PeerWireError) as caught:
        decode(SECRET, body + tag)
    assert caught.value.reason == "malformed"


def test_negative_counts_are_sent_as_zero() -> None:
    (row,) = decode(SECRET, encode(SECRET, 1, 1, [PeerRow(5, -1, -10, -20)])).rows
    assert row == PeerRow(5, 0, 0, 0)


@pytest.mark.parametrize("position", [0, 4, 10, 30, 40, -1])
def test_any_changed_byte_is_refused(position: int) -> None:
    data = bytearray(encode(SECRET, 42, 7, [PeerRow(1, 2, 3, 4)]))
    data[position] ^= 0x01
    with pytest.raises(PeerWireError) as caught:
        decode(SECRET, bytes(data))
    assert caught.value.reason == "bad_tag"


def test_another_secret_is_refused() -> None:
    data = encode(b"another secret of enough bytes", 42, 7, [PeerRow(1, 2, 3, 4)])
    with pytest.raises(PeerWireError) as caught:
        decode(SECRET, data)
    assert caught.value.reason == "bad_tag"


@pytest.mark.parametrize(
    "data",
    [b"", b"SALP", b"x" * 43, b"\x00" * (MAX_DATAGRAM + 1), b"GET / HTTP/1.1\r\n\r\n" * 3],
    ids=["empty", "magic only", "short garbage", "oversized", "http"],
)
def test_garbage_is_refused_without_a_traceback(data: bytes) -> None:
    with pytest.raises(PeerWireError) as caught:
        decode(SECRET, data)
    assert caught.value.reason in ("malformed", "bad_tag")


def test_the_secret_must_be_set_and_long_enough() -> None:
    config = PeersConfig(listen="127.0.0.1:0", addresses=("127.0.0.1:9",))
    with pytest.raises(PeersError, match="not set"):
        load_secret(config, {})
    with pytest.raises(PeersError, match="5 bytes"):
        load_secret(config, {config.secret_env: "short"})
    assert load_secret(config, {config.secret_env: SECRET.decode()}) == SECRET
    assert open_peer_link(PeersConfig(), {}) is None  # off: nothing asked for


def test_a_taken_port_is_an_error_at_start() -> None:
    first = bind_socket(PeersConfig(listen="127.0.0.1:0", addresses=("127.0.0.1:9",)))
    try:
        port = first.getsockname()[1]
        with pytest.raises(PeersError, match="cannot bind"):
            bind_socket(PeersConfig(listen=f"127.0.0.1:{port}", addresses=("127.0.0.1:9",)))
    finally:
        first.close()


def _config(**peers: object) -> dict[str, object]:
    return {"models": [{"name": "m", "backends": ["http://127.0.0.1:8000"]}], "peers": peers}


def test_peers_config_is_checked() -> None:
    ok = build_config(_config(listen="0.0.0.0:7946", addresses=["gw.ns.svc:7946"])).peers
    assert ok.enabled
    assert ok.addresses == ("gw.ns.svc:7946",)
    assert not ok.share_adapters
    assert ok.share_prefix_blocks  # on by default
    off = _config(listen="0.0.0.0:7946", addresses=["a:1"], share_prefix_blocks=False)
    assert not build_config(off).peers.share_prefix_blocks
    on = _config(listen="0.0.0.0:7946", addresses=["a:1"], share_adapters=True)
    assert build_config(on).peers.share_adapters
    assert not build_config(_config()).peers.enabled
    bad = [
        (_config(listen="0.0.0.0:7946"), "list the other gateways"),
        (_config(addresses=["a:1"]), "set peers.listen"),
        (_config(listen="7946", addresses=["a:1"]), "host:port"),
        (_config(listen="0.0.0.0:7946", addresses=["a:0"]), "port 0"),
        (_config(listen="0.0.0.0:7946", addresses=["a:70000"]), "host:port"),
        (_config(listen="0.0.0.0:1", addresses=["a:1"], expire_s=0.05), "exceed heartbeat"),
        (_config(listen="0.0.0.0:1", addresses=["a:1"], gossip=True), "unknown key"),
        (_config(listen="0.0.0.0:1", addresses=["a:1"], share_adapters="yes"), "share_adapters"),
        (
            _config(listen="0.0.0.0:1", addresses=["a:1"], share_prefix_blocks=1),
            "share_prefix_blocks",
        ),
    ]
    for data, message in bad:
        with pytest.raises(ConfigError, match=message):
            build_config(data)
    any_port = _config(listen="0.0.0.0:0", addresses=["a:1"])
    any_port["listen"] = {"workers": 2}
    with pytest.raises(ConfigError, match="give a port"):
        build_config(any_port)
    too_high = _config(listen="0.0.0.0:7946", addresses=["a:65535"])
    too_high["listen"] = {"workers": 2}
    with pytest.raises(ConfigError, match="65535"):
        build_config(too_high)


def test_each_worker_listens_on_its_own_port_and_sends_to_every_workers_port() -> None:
    data = _config(listen="0.0.0.0:7946", addresses=["gw-peers:7946", "[fd00::2]:7000"])
    data["listen"] = {"workers": 3}
    peers = build_config(data).peers
    assert peers.for_worker(0, 3).listen == "0.0.0.0:7946"
    worker2 = peers.for_worker(2, 3)
    assert worker2.listen == "0.0.0.0:7948"
    assert worker2.addresses == (
        "gw-peers:7946", "gw-peers:7947", "gw-peers:7948",
        "[fd00::2]:7000", "[fd00::2]:7001", "[fd00::2]:7002",
    )  # fmt: skip
    assert peers.for_worker(0, 1) == peers  # one worker: as configured


class _Pair:
    """Two networks on loopback, each listing the other (and itself, as a headless service
    name would)."""

    def __init__(self, clock: list[float], *, share_adapters: bool = False) -> None:
        socks = [
            bind_socket(PeersConfig(listen="127.0.0.1:0", addresses=("127.0.0.1:9",)))
            for _ in range(2)
        ]
        addresses = tuple(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
        config = PeersConfig(
            listen="127.0.0.1:0",
            addresses=addresses,
            heartbeat_s=0.05,
            expire_s=0.5,
            share_adapters=share_adapters,
        )
        self.results: list[Counter[str]] = [Counter(), Counter()]
        self.nets = [
            PeerNetwork(
                config,
                SECRET,
                sock,
                clock=lambda: clock[0],
                on_datagram=lambda result, seen=seen: seen.update([result]),
            )
            for sock, seen in zip(socks, self.results, strict=True)
        ]

    async def __aenter__(self) -> list[PeerNetwork]:
        for net in self.nets:
            await net.start()
        return self.nets

    async def __aexit__(self, *exc: object) -> None:
        for net in self.nets:
            await net.close()


async def _until(check: object, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.005)


async def test_a_change_reaches_the_other_gateway_at_once_and_a_silent_one_is_forgotten() -> None:
    clock = [100.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        a_slot = a.slot("m", "http://r1:8000")
        b_slot = b.slot("m", "http://r1:8000")
        other = b.slot("m", "http://r2:8000")
        a_slot.publish(3, 1500, 1600)
        await _until(lambda: b_slot.others() == (3, 1500, 1600), 0.5)
        assert other.others() == (0, 0, 0)  # another backend's counts stay apart
        assert a_slot.others() == (0, 0, 0)  # a gateway never counts its own requests
        a_slot.publish(2, 0, 0)  # a snapshot acknowledged the tokens; one request ended
        await _until(lambda: b_slot.others() == (2, 0, 0), 0.5)
        assert b.heard() == 1
        assert pair.results[1]["bad_tag"] == 0
        assert pair.results[0]["own"] >= 1  # its own datagrams came back and were dropped
        # a goes silent (its heartbeats stop reaching b's clock): after expire_s its
        # requests no longer count at b.
        await a.close()
        clock[0] += 0.6
        assert b_slot.others() == (0, 0, 0)
        assert b.heard() == 0


async def test_a_gateway_hears_the_lora_adapters_the_other_routed_since_its_poll() -> None:
    clock = [0.0]
    pair = _Pair(clock, share_adapters=True)
    async with pair as (a, b):
        a_slot, b_slot = a.slot("m", "http://r1:8000"), b.slot("m", "http://r1:8000")
        a_slot.publish(2, 600, 600, {"lora-a", "lora-b"})
        both = {adapter_key("lora-a"), adapter_key("lora-b")}
        await _until(lambda: b_slot.other_adapters() == both, 0.5)
        assert a_slot.other_adapters() == frozenset()  # never its own
        assert b.slot("m", "http://r2:8000").other_adapters() == frozenset()
        a_slot.publish(1, 300, 300, {"lora-b"})  # lora-a's request acknowledged
        await _until(lambda: b_slot.other_adapters() == {adapter_key("lora-b")}, 0.5)
        await a.close()
        clock[0] += 0.6  # a went silent: past expire_s its adapters no longer count
        assert b_slot.other_adapters() == frozenset()


async def test_without_share_adapters_only_the_counts_go_out() -> None:
    clock = [0.0]
    pair = _Pair(clock)  # peers.share_adapters off, the default
    async with pair as (a, b):
        a_slot, b_slot = a.slot("m", "http://r1:8000"), b.slot("m", "http://r1:8000")
        a_slot.publish(2, 600, 600, {"lora-a"})
        await _until(lambda: b_slot.others() == (2, 600, 600), 0.5)
        assert b_slot.other_adapters() == frozenset()
        assert b.other_adapters(backend_key("m", "http://r1:8000")) == frozenset()  # not sent


async def test_many_backends_without_adapters_go_out_in_version_1_datagrams() -> None:
    clock = [0.0]
    pair = _Pair(clock, share_adapters=True)  # on, but no adapter pending: version 1
    async with pair as (a, b):
        sent: list[tuple[int, int]] = []
        a._on_sent = lambda n, errors: sent.append((n, errors))
        for i in range(100):
            a.slot("m", f"http://r{i}:8000").publish(i + 1, 0, 0)
        keys = [backend_key("m", f"http://r{i}:8000") for i in range(100)]
        await _until(lambda: all(b.others(k)[0] == i + 1 for i, k in enumerate(keys)), 1.0)
        assert sent[0] == (3 * 2, 0)  # 48 + 48 + 4 rows, to each of the 2 addresses
        assert pair.results[1]["malformed"] == 0


async def test_many_backends_with_adapters_go_out_in_datagrams_that_fit() -> None:
    clock = [0.0]
    pair = _Pair(clock, share_adapters=True)
    async with pair as (a, b):
        names = {f"lora-{i}" for i in range(MAX_ADAPTERS)}
        slots = [a.slot("m", f"http://r{i}:8000") for i in range(40)]  # 40 x 93 bytes
        for i, slot in enumerate(slots):
            slot.publish(i + 1, 0, 0, names)
        keys = [backend_key("m", f"http://r{i}:8000") for i in range(40)]
        await _until(lambda: all(len(b.other_adapters(k)) == MAX_ADAPTERS for k in keys), 1.0)
        assert pair.results[1]["malformed"] == 0


async def test_changes_of_one_loop_turn_go_out_in_one_datagram_per_peer() -> None:
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        sent: list[tuple[int, int]] = []
        a._on_sent = lambda n, errors: sent.append((n, errors))
        slots = [a.slot("m", f"http://r{i}:8000") for i in range(5)]
        for i, slot in enumerate(slots):
            slot.publish(i + 1, 0, 0)
        await asyncio.sleep(0)  # the flush runs at the end of this turn
        await asyncio.sleep(0)
        assert sent[0] == (2, 0)  # one datagram to each listed address (b and a itself)
        await _until(
            lambda: all(
                b.others(backend_key("m", f"http://r{i}:8000"))[0] == i + 1 for i in range(5)
            ),
            0.5,
        )


async def test_the_workers_of_one_host_drop_each_others_datagrams() -> None:
    """Workers sharing their accounting through memory count each other already: their
    datagrams (one group) are dropped as their own, while another host's are counted."""
    clock = [0.0]
    pair = _Pair(clock)
    key = backend_key("m", "http://r1:8000")
    a, b = pair.nets
    b.group = a.group  # same host
    async with pair:
        a.slot("m", "http://r1:8000").publish(3, 30, 30)
        await _until(lambda: pair.results[1]["own"] >= 1, 0.5)
        assert b.others(key) == (0, 0, 0)
        b.group = b.sender  # another host
        a.slot("m", "http://r1:8000").publish(4, 40, 40)
        await _until(lambda: b.others(key) == (4, 40, 40), 0.5)


async def test_strangers_and_replays_do_not_count() -> None:
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (_, b):
        key = backend_key("m", "http://r1:8000")
        port = b._sock.getsockname()[1]
        out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            stranger = encode(b"not the shared secret at all", 9, 1, [PeerRow(key, 50, 9, 9)])
            newer = encode(SECRET, 9, 5, [PeerRow(key, 2, 0, 0)])
            older = encode(SECRET, 9, 4, [PeerRow(key, 40, 0, 0)])
            for data in (stranger, b"garbage", newer, older, newer):
                out.sendto(data, ("127.0.0.1", port))
            await _until(lambda: sum(pair.results[1].values()) >= 5, 1.0)
        finally:
            out.close()
        assert b.others(key) == (2, 0, 0)  # the authentic newest, nothing else
        results = pair.results[1]
        assert (results["bad_tag"], results["malformed"], results["old"]) == (1, 1, 2)


async def test_a_gateway_restarted_on_the_same_address_replaces_its_old_counts_at_once() -> None:
    clock = [0.0]
    pair = _Pair(clock)
    key = backend_key("m", "http://r1:8000")
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as first,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as second,
    ):
        async with pair as (_, b):
            to_b = ("127.0.0.1", b._sock.getsockname()[1])
            first.sendto(encode(SECRET, 7, 1, [PeerRow(key, 5, 500, 500)]), to_b)
            second.sendto(encode(SECRET, 8, 1, [PeerRow(key, 1, 100, 100)]), to_b)
            await _until(lambda: b.others(key) == (6, 600, 600), 1.0)
            # Sender 7 restarts as sender 9 on the same socket address: its old 5 requests
            # are gone at once (not after expire_s), the other gateway's stay.
            first.sendto(encode(SECRET, 9, 1, [PeerRow(key, 2, 0, 0)]), to_b)
            await _until(lambda: b.others(key) == (3, 100, 100), 1.0)
            assert b.heard() == 2


# --- prompt blocks (peers.share_prefix_blocks) -------------------------------------------


def _routed(seq: int, request: int, keys: list[int], *, oldest: int = 1, sender: int = 9,
            key: int = 99) -> PeerBlocks:  # fmt: skip
    return PeerBlocks(ROUTED, sender, sender, seq, request, oldest, key, tuple(keys))


def test_a_blocks_datagram_round_trips_signed_keys_and_fits_one_frame() -> None:
    keys = [-(2**63), 2**63 - 1, *range(-5, BLOCK_KEYS_PER_DATAGRAM - 7)]
    assert len(keys) == BLOCK_KEYS_PER_DATAGRAM
    message = PeerBlocks(ROUTED, 42, 5, 7, 3, 2, 99, tuple(keys))
    data = encode_blocks(SECRET, message)
    assert len(data) <= MAX_DATAGRAM
    assert decode_blocks(SECRET, data) == message
    ended = PeerBlocks(ENDED, 42, 5, 8, 3, 4)
    assert decode_blocks(SECRET, encode_blocks(SECRET, ended)) == ended
    for wrong in ((), (*keys, 1)):
        with pytest.raises(ValueError, match="block keys"):
            encode_blocks(SECRET, PeerBlocks(ROUTED, 42, 5, 9, 3, 2, 99, wrong))
    with pytest.raises(ValueError, match="block keys"):
        encode_blocks(SECRET, PeerBlocks(ENDED, 42, 5, 9, 3, 2, 99, (1,)))


def test_a_release_without_blocks_drops_them_as_malformed_not_as_counts() -> None:
    """During a rolling upgrade an older gateway reads a blocks datagram with `decode`: it
    is refused (counted), never read as counts."""
    data = encode_blocks(SECRET, _routed(7, 1, [1, 2, 3]))
    with pytest.raises(PeerWireError) as caught:
        decode(SECRET, data)
    assert caught.value.reason == "malformed"


@pytest.mark.parametrize(
    ("kind", "count", "keys"),
    [(1, 0, 0), (1, 3, 2), (1, 2, 3), (2, 1, 1), (7, 0, 0)],
    ids=["routed, none", "missing", "left over", "keys in an end", "unknown kind"],
)
def test_blocks_that_do_not_add_up_are_refused(kind: int, count: int, keys: int) -> None:
    body = struct.pack("<4sBB2xQQQQQQH", b"SALB", 1, kind, 42, 42, 7, 3, 1, 99, count)
    body += struct.pack("<q", 5) * keys
    tag = hmac.new(SECRET, body, hashlib.sha256).digest()[:16]
    with pytest.raises(PeerWireError) as caught:
        decode_blocks(SECRET, body + tag)
    assert caught.value.reason == "malformed"


@pytest.mark.parametrize("position", [0, 4, 5, 12, 60, -1])
def test_a_changed_blocks_byte_or_another_secret_is_refused(position: int) -> None:
    data = bytearray(encode_blocks(SECRET, _routed(7, 1, [1, 2, 3])))
    data[position] ^= 0x01
    with pytest.raises(PeerWireError) as caught:
        decode_blocks(SECRET, bytes(data))
    assert caught.value.reason == "bad_tag"
    with pytest.raises(PeerWireError) as caught:
        decode_blocks(SECRET, encode_blocks(b"not the shared secret at all", _routed(7, 1, [1])))
    assert caught.value.reason == "bad_tag"


class _Index:
    """A stand-in for the tracker's `told` (`PeerNetwork.on_blocks`): what is held now, per
    backend URL, and every call; it tracks backend r1 (and r3) only."""

    TRACKED = ("http://r1:8000", "http://r3:8000")

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], bool]] = []
        self.held: Counter[tuple[str, tuple[int, ...]]] = Counter()

    def __call__(self, model: str, url: str, keys: object, held: bool) -> bool:
        run = tuple(keys)  # type: ignore[call-overload]
        self.calls.append((url, run, held))
        if not held:
            self.held[(url, run)] -= 1
            return False
        if url not in self.TRACKED:
            return False
        self.held[(url, run)] += 1
        return True

    def holding(self) -> dict[tuple[str, tuple[int, ...]], int]:
        return {k: n for k, n in self.held.items() if n}

    @classmethod
    def on(cls, network: PeerNetwork, *urls: str) -> _Index:
        """Listen to `network`'s blocks, for backends r1 and `urls` of model m."""
        index = network.on_blocks = cls()
        for url in ("http://r1:8000", *urls):
            network.slot("m", url)
        return index


R1 = "http://r1:8000"


async def test_routed_blocks_are_held_at_the_other_gateway_until_the_request_ends() -> None:
    """A prompt of 400 blocks goes out as 170 + 170 + 60 consecutive keys to every listed
    address; the other gateway holds each run for the backend it names, and releases all
    three when told the request ended."""
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        index = _Index.on(b)
        sent: list[tuple[int, int]] = []
        a._on_sent = lambda n, errors: sent.append((n, errors))
        keys = list(range(1000, 1400))
        ended = a.tell_blocks("m", R1, keys)
        assert sent == [(3 * 2, 0)]  # 3 datagrams, to b and to a itself
        runs = [tuple(keys[:170]), tuple(keys[170:340]), tuple(keys[340:])]
        await _until(lambda: len(index.holding()) == 3, 1.0)
        assert index.holding() == {(R1, run): 1 for run in runs}
        assert (a.held_requests(), b.held_requests()) == (0, 1)  # one request, three runs
        assert pair.results[1]["blocks"] == 3
        await _until(lambda: pair.results[0]["own"] >= 3, 1.0)  # its own came back, dropped
        assert a.heard() == 0  # its own blocks do not make a peer
        assert b.heard() == 1  # blocks prove a peer alive
        ended()
        ended()  # twice: nothing more goes out
        await _until(lambda: not index.holding(), 1.0)
        assert b.held_requests() == 0
        assert sent[1:] == [(2, 0)]
        assert [c for c in index.calls if not c[2]] == [(R1, run, False) for run in runs]


async def test_a_long_prompt_sends_at_most_max_block_datagrams() -> None:
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        index = _Index.on(b)
        a.tell_blocks("m", R1, list(range(100_000)))
        await _until(lambda: len(index.holding()) == MAX_BLOCK_DATAGRAMS, 1.0)
        told = sorted(k for (_, run) in index.holding() for k in run)
        assert told == list(range(MAX_BLOCK_DATAGRAMS * BLOCK_KEYS_PER_DATAGRAM))  # the first


async def test_blocks_for_an_unknown_or_untracked_backend_or_without_a_listener_are_ignored() -> (
    None
):
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        a.tell_blocks("m", R1, [1, 2])  # b has no listener yet
        await _until(lambda: pair.results[1]["blocks_ignored"] == 1, 1.0)
        index = _Index.on(b, "http://r2:8000")
        a.tell_blocks("m", "http://elsewhere:8000", [3])  # not a backend of b's
        a.tell_blocks("m", "http://r2:8000", [4])  # b's, but its index does not track it
        a.tell_blocks("m", R1, [5])
        await _until(lambda: pair.results[1]["blocks"] == 1, 1.0)
        assert pair.results[1]["blocks_ignored"] == 3
        assert index.holding() == {(R1, (5,)): 1}
        assert [c[0] for c in index.calls] == ["http://r2:8000", R1]  # never the unknown one


async def test_a_missed_end_is_made_good_by_the_watermark() -> None:
    """The end of request 1 is lost; request 2's datagram says every request below 2 ended,
    so the other gateway releases request 1's blocks then; a heartbeat's watermark does
    the same for the last request. Reordered or replayed runs of an ended request are not
    held again."""
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (_, b):
        index = _Index.on(b, "http://r3:8000")
        key1, key3 = backend_key("m", R1), backend_key("m", "http://r3:8000")
        to_b = ("127.0.0.1", b._sock.getsockname()[1])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:

            def send(message: PeerBlocks) -> None:
                out.sendto(encode_blocks(SECRET, message), to_b)

            async def wait(datagrams: int) -> None:
                await _until(lambda: sum(pair.results[1].values()) >= datagrams, 1.0)

            send(_routed(1, 1, [11], key=key1))
            await wait(1)
            assert index.holding() == {(R1, (11,)): 1}
            send(_routed(2, 2, [22], oldest=2, key=key3))  # request 1 ended, its end was lost
            await wait(2)
            assert index.holding() == {("http://r3:8000", (22,)): 1}
            send(_routed(3, 1, [11], key=key1))  # request 1's run again: reordered or replayed
            send(_routed(4, 2, [22], oldest=2, key=key3))  # a run held already
            await wait(4)
            assert index.holding() == {("http://r3:8000", (22,)): 1}
            assert pair.results[1]["old"] == 2
            send(PeerBlocks(WATERMARK, 9, 9, 5, 0, 3))  # nothing in flight below 3 now
            await wait(5)
            assert index.holding() == {}


async def test_a_lost_end_is_sent_again_on_the_next_heartbeat() -> None:
    """Request 2 ends while request 1 still runs, and its end datagram is lost: the
    watermark cannot pass request 2 until request 1 ends, but the next heartbeat sends the
    end again, so the other gateway releases request 2's blocks within a heartbeat (and
    request 1's stay held). The copy of an end that did arrive changes nothing."""
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        index = _Index.on(b)
        real_send = a._send_all
        lost: list[int] = []

        def lose_the_first_end(
            transport: asyncio.DatagramTransport, datagrams: list[bytes]
        ) -> None:
            if (
                not lost
                and len(datagrams) == 1
                and decode_blocks(SECRET, datagrams[0]).kind == ENDED
            ):
                lost.append(decode_blocks(SECRET, datagrams[0]).request)
                return
            real_send(transport, datagrams)

        a._send_all = lose_the_first_end  # type: ignore[method-assign]
        a.tell_blocks("m", R1, [1])  # request 1: runs on
        end_2 = a.tell_blocks("m", R1, [2])
        await _until(lambda: len(index.holding()) == 2, 1.0)
        end_2()
        assert lost == [2]
        await _until(lambda: index.holding() == {(R1, (1,)): 1}, 1.0)  # the heartbeat's copy
        end_3 = a.tell_blocks("m", R1, [3])
        await _until(lambda: len(index.holding()) == 2, 1.0)
        end_3()  # arrives; its copy a heartbeat later is ignored
        await _until(lambda: index.holding() == {(R1, (1,)): 1}, 1.0)
        released = sum(1 for c in index.calls if not c[2])
        await asyncio.sleep(0.2)  # several heartbeats
        assert sum(1 for c in index.calls if not c[2]) == released
        assert b.held_requests() == 1


async def test_a_silent_or_restarted_gateways_holds_are_released() -> None:
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (_, b):
        index = _Index.on(b)
        key1 = backend_key("m", R1)
        to_b = ("127.0.0.1", b._sock.getsockname()[1])
        with (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as first,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as second,
        ):
            first.sendto(encode_blocks(SECRET, _routed(1, 1, [11], sender=7, key=key1)), to_b)
            second.sendto(encode_blocks(SECRET, _routed(1, 1, [22], sender=8, key=key1)), to_b)
            await _until(lambda: len(index.holding()) == 2, 1.0)
            assert b.held_requests() == 2
            # Sender 7 restarts as sender 17 on the same socket address: what it held goes.
            first.sendto(encode_blocks(SECRET, PeerBlocks(WATERMARK, 17, 17, 1, 0, 1)), to_b)
            await _until(lambda: index.holding() == {(R1, (22,)): 1}, 1.0)
            # Sender 8 goes silent: past expire_s (0.5 s here) the heartbeat forgets it.
            clock[0] += 0.6
            await _until(lambda: not index.holding(), 1.0)
            assert b.held_requests() == 0


async def test_blocks_from_a_stranger_or_the_same_host_do_not_count() -> None:
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (a, b):
        index = _Index.on(b)
        key = backend_key("m", R1)
        port = b._sock.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
            stranger = encode_blocks(b"not the shared secret at all", _routed(1, 1, [66], key=key))
            out.sendto(stranger, ("127.0.0.1", port))
            out.sendto(encode_blocks(SECRET, _routed(2, 1, [55], key=key)), ("127.0.0.1", port))
            await _until(lambda: sum(pair.results[1].values()) >= 2, 1.0)
        assert index.holding() == {(R1, (55,)): 1}
        assert (pair.results[1]["bad_tag"], pair.results[1]["blocks"]) == (1, 1)
        b.group = a.group  # the workers of one host share their index through memory
        a.tell_blocks("m", R1, [77])
        await _until(lambda: pair.results[1]["own"] >= 1, 1.0)
        assert index.holding() == {(R1, (55,)): 1}


async def test_a_peer_that_never_ends_its_requests_pins_a_bounded_number_of_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer with the secret that routes and never says a request ended (a bug, or a lie)
    cannot make this gateway hold more than `MAX_HELD_RUNS` runs for it."""
    monkeypatch.setattr("sal_gateway.peers.MAX_HELD_RUNS", 3)
    clock = [0.0]
    pair = _Pair(clock)
    async with pair as (_, b):
        index = _Index.on(b)
        key = backend_key("m", R1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
            for request in range(1, 6):
                datagram = encode_blocks(SECRET, _routed(request, request, [request], key=key))
                out.sendto(datagram, ("127.0.0.1", b._sock.getsockname()[1]))
            await _until(lambda: sum(pair.results[1].values()) >= 5, 1.0)
        assert len(index.holding()) == 3
        assert (pair.results[1]["blocks"], pair.results[1]["blocks_ignored"]) == (3, 2)
