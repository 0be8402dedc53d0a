"""``peers``: gateways on separate hosts tell each other their between-poll accounting.

The wire format (`sal_gateway.peer_wire`) refuses anything not sent with the shared secret,
and what does not parse; two `PeerNetwork`s on real UDP sockets (loopback) see each other's
counts within a loop turn, forget a peer that went silent, and ignore a stranger, a replay
and their own datagrams. What a user would notice if it broke: gateways that herd (they do
not hear each other), or routing that anyone on the network can steer.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import pytest

from sal_gateway.config import ConfigError, PeersConfig, build_config
from sal_gateway.peer_wire import (
    MAX_DATAGRAM,
    MAX_ROWS,
    PeerRow,
    PeerWireError,
    decode,
    encode,
)
from sal_gateway.peers import PeerNetwork, PeersError, bind_socket, load_secret, open_peer_link
from sal_gateway.shared_accounting import backend_key

SECRET = b"0123456789abcdef-shared"


def test_a_datagram_round_trips_and_stays_under_one_ethernet_frame() -> None:
    rows = [PeerRow(k + 1, k, 1000 * k, 2000 * k) for k in range(MAX_ROWS)]
    data = encode(SECRET, 42, 7, rows)
    assert len(data) == MAX_DATAGRAM <= 1500 - 20 - 8  # IPv4 and UDP headers
    message = decode(SECRET, data)
    assert (message.sender, message.seq, list(message.rows)) == (42, 7, rows)
    with pytest.raises(ValueError, match="rows"):
        encode(SECRET, 42, 8, [*rows, PeerRow(99, 1, 1, 1)])


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
    assert not build_config(_config()).peers.enabled
    bad = [
        (_config(listen="0.0.0.0:7946"), "list the other gateways"),
        (_config(addresses=["a:1"]), "set peers.listen"),
        (_config(listen="7946", addresses=["a:1"]), "host:port"),
        (_config(listen="0.0.0.0:7946", addresses=["a:0"]), "port 0"),
        (_config(listen="0.0.0.0:7946", addresses=["a:70000"]), "host:port"),
        (_config(listen="0.0.0.0:1", addresses=["a:1"], expire_s=0.05), "exceed heartbeat"),
        (_config(listen="0.0.0.0:1", addresses=["a:1"], gossip=True), "unknown key"),
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

    def __init__(self, clock: list[float]) -> None:
        socks = [
            bind_socket(PeersConfig(listen="127.0.0.1:0", addresses=("127.0.0.1:9",)))
            for _ in range(2)
        ]
        addresses = tuple(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
        config = PeersConfig(
            listen="127.0.0.1:0", addresses=addresses, heartbeat_s=0.05, expire_s=0.5
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
