"""Between-poll accounting told to gateways on other hosts (``peers``).

Several gateways in front of the same replicas each decide on their own polls plus what they
routed themselves since; they do not see what the others routed, so between polls they send
their next requests to the same replica (herding, `docs/results/gateways.md`). The workers
of one host share their counts through memory (`sal_gateway.shared_accounting`); gateways on
separate hosts tell each other over UDP, here. In the simulator, counts that reach the
other gateways within 0.2 ms of every change route as well as shared memory does, 1 ms keeps
half to most of it, and counts sent every 25 ms only as well as `sal_near`: herding happens
within bursts of near-simultaneous arrivals. So a gateway sends as soon as its counts
change (all the changes of one event-loop turn in one datagram per peer), not on a timer,
plus its full state every `PeersConfig.heartbeat_s` (lost datagrams, new peers, and the proof
it is alive).

What a gateway sends for each backend: its requests in flight there and the prefill and KV
tokens it routed there that no snapshot it polled includes yet (`sal_gateway.state`), as
absolute values (`sal_gateway.peer_wire`); with `PeersConfig.share_adapters`, also the LoRA
adapters of those requests, which hold the backend's ``--max-loras`` slots. What it adds to
its own: every peer's latest values, for peers heard within `PeersConfig.expire_s`; a peer
that died or lost its network stops counting then. A gateway restarted on the same address
(a new sender id from the socket address an old one used) replaces the old one's counts at
its first datagram.

Prompt blocks (``peers.share_prefix_blocks``, with ``routing.prefix_cache: approximate``):
each gateway's prefix index holds the blocks it routed itself, so a conversation whose turns
reach different gateways (a Service spreads a chat application's connections) would lose its
prefix. So a gateway also sends, when it routes a request, the block keys of its prompt
(`tell_blocks`; up to `MAX_BLOCK_DATAGRAMS` datagrams of `peer_wire.BLOCK_KEYS_PER_DATAGRAM`
keys, numbered as one request), and the others index them as cached on that backend, most
recent, *held* (`sal_gateway.prefix_cache.PrefixTracker.told`) until the sender says the
request ended: a block a running request holds is not evictable, so the memory term must
not charge its reuse. The end is sent when the request ends and once more on the next
heartbeat (at most `MAX_RESENT_ENDS` a heartbeat), so one lost datagram costs at most a
heartbeat. Every datagram also carries the sender's oldest request not ended (its
*watermark*; the heartbeat sends it too): a peer releases every hold below it, so an end
lost twice is made good once the sender's earlier requests end, and a silent or restarted
sender's holds are released. `MAX_HELD_RUNS` bounds what one peer can pin. The workers of
one host tell each other through `sal_gateway.prefix_share` instead.

Trust: every datagram carries an HMAC tag under a secret all the gateways share (from the
environment, `load_secret`); one without it is dropped and counted
(``sal_peer_datagrams_total{result="bad_tag"}``), so nobody on the network can steer routing
without the secret. A peer that has it can lie, as a gateway can anyway.

Everything runs on the event loop: `datagram_received` decodes and stores (a few
microseconds), `BackendState.publish` marks a backend changed and schedules one flush per
loop turn. Addresses (host names, e.g. a Kubernetes headless service) are resolved again
every `PeersConfig.resolve_s`; a gateway that reaches itself through them drops its own
datagrams (`result="own"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from sal_gateway.config import PeersConfig, split_host_port
from sal_gateway.peer_wire import (
    BLOCK_KEYS_PER_DATAGRAM,
    ENDED,
    MAX_ADAPTERS,
    MIN_SECRET_BYTES,
    ROOM,
    ROUTED,
    V1_ROWS,
    WATERMARK,
    PeerBlocks,
    PeerMessage,
    PeerRow,
    PeerWireError,
    decode,
    decode_blocks,
    encode,
    encode_blocks,
    is_blocks,
)
from sal_gateway.shared_accounting import adapter_key, backend_key
from sal_gateway.state import PeerCounts

log = logging.getLogger("sal_gateway.peers")

MAX_PEERS = 1024
"""Senders remembered at once (each needs the secret; a bound all the same)."""
MAX_BLOCK_DATAGRAMS = 8
"""Datagrams of prompt blocks per routed request and peer (`PeerNetwork.tell_blocks`): the
first 8 x 170 = 1,360 blocks, 21,760 tokens with vLLM's default 16-token blocks. A longer
prompt's later blocks stay unknown to the peers, which still find its first 21k tokens."""
MAX_RESENT_ENDS = 1024
"""Ends sent a second time on the next heartbeat, at most (beyond: the watermark repairs a
lost one)."""
MAX_HELD_RUNS = 65_536
"""Runs of blocks (one routed datagram each) held for one peer at once: a bound on what a
peer that never says its requests ended can pin (a bug, or a peer with the secret that
lies)."""


def _nothing() -> None:
    """The end of a request nobody was told of."""


class PeersError(ValueError):
    """``peers`` cannot run: no secret, or its UDP address cannot be bound."""


def load_secret(config: PeersConfig, environ: Mapping[str, str]) -> bytes:
    """The shared secret from ``$<config.secret_env>`` (at least `MIN_SECRET_BYTES`)."""
    value = environ.get(config.secret_env, "")
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise PeersError(
            f"peers: ${config.secret_env} must hold a shared secret of at least "
            f"{MIN_SECRET_BYTES} bytes (the same on every gateway), "
            + ("it is not set" if not value else f"got {len(value.encode())} bytes")
        )
    return value.encode()


def bind_socket(config: PeersConfig) -> socket.socket:
    """The UDP socket `config.listen` names, bound and non-blocking (`PeersError` if not)."""
    assert config.listen is not None
    host, port = split_host_port(config.listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise PeersError(f"peers.listen {config.listen!r}: {exc}") from None
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PeersError(f"peers.listen {config.listen!r}: cannot bind: {exc}") from None
    sock.setblocking(False)
    return sock


def group_of(accounting_name: str) -> int:
    """The `PeerNetwork.group` of the workers that share the accounting block
    `accounting_name` (`sal_gateway.shared_accounting`): the same in each of them."""
    digest = hashlib.blake2b(accounting_name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


@dataclass(frozen=True, slots=True)
class PeerLink:
    """What ``peers`` needs before serving: the shared secret and the bound UDP socket."""

    secret: bytes
    sock: socket.socket


def open_peer_link(config: PeersConfig, environ: Mapping[str, str]) -> PeerLink | None:
    """The secret and socket (`PeersError` when either is missing); None when ``peers`` is
    off. Called before serving, so that a bad setup fails at start with one line."""
    if not config.enabled:
        return None
    secret = load_secret(config, environ)
    return PeerLink(secret, bind_socket(config))


@dataclass(slots=True)
class _Peer:
    """What one other gateway told us."""

    heard_s: float
    addr: tuple[object, ...] = ()
    """Where its datagrams come from (its socket's address)."""
    rows: dict[int, tuple[int, int, int, int, tuple[int, ...]]] = field(default_factory=dict)
    """Backend key -> (seq of the datagram that set it, in flight, tokens, KV tokens,
    pending LoRA adapters)."""
    holds: dict[int, dict[int, tuple[str, str, tuple[int, ...]]]] = field(default_factory=dict)
    """Its requests whose prompt blocks this gateway's index holds for it: request number ->
    first key of each run -> (model, url, keys) (`PeerNetwork._apply_blocks`)."""
    held_runs: int = 0
    """Runs in `holds`, all requests together (at most `MAX_HELD_RUNS`)."""
    watermark: int = 0
    """Its newest `PeerBlocks.oldest`: every request numbered below has ended."""


Metrics = Callable[[str], None]
"""Counts one datagram received, by result (``sal_peer_datagrams_total``)."""


class PeerNetwork(asyncio.DatagramProtocol):
    """This gateway's side of the peer exchange: `slot` hands `sal_gateway.state` one
    backend's `PeerCounts`; `start` / `close` run it."""

    def __init__(
        self,
        config: PeersConfig,
        secret: bytes,
        sock: socket.socket,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_datagram: Metrics | None = None,
        on_sent: Callable[[int, int], None] | None = None,
        group: int | None = None,
    ) -> None:
        self.config = config
        self.sender = secrets.randbits(63) or 1
        self.group = self.sender if group is None else group
        """Datagrams of this group are dropped (`result="own"`): this gateway's own, and
        those of the workers of its host that share its accounting through memory."""
        self._secret = secret
        self._sock = sock
        self._clock = clock
        self._on_datagram = on_datagram or (lambda result: None)
        self._on_sent = on_sent or (lambda datagrams, errors: None)
        self._seq = 0
        self._own: dict[int, tuple[int, int, int, tuple[int, ...]]] = {}
        self._changed: set[int] = set()
        self._peers: dict[int, _Peer] = {}
        self._targets: tuple[tuple[object, ...], ...] = ()
        self._by_name: dict[str, tuple[tuple[object, ...], ...]] = {}
        self._transport: asyncio.DatagramTransport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_pending = False
        self._tasks: list[asyncio.Task[None]] = []
        self._backends: dict[int, tuple[str, str]] = {}
        self._request = 0
        self._told: dict[int, None] = {}
        """This gateway's told requests that have not ended, oldest first."""
        self._ended: list[int] = []
        """Requests ended since the last heartbeat, whose end it sends again."""
        self.on_blocks: Callable[[str, str, Sequence[int], bool], bool] | None = None
        """Called with ``(model, url, keys, True)`` for the prompt blocks a peer routed to a
        backend this gateway knows, and with ``False`` when that request ended
        (``peers.share_prefix_blocks``; the tracker's
        `sal_gateway.prefix_cache.PrefixTracker.told`). Returns, for ``True``, whether the
        blocks are now held for that request (only then are they released later). None:
        blocks datagrams are counted ``blocks_ignored`` and dropped."""

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on the bound socket, resolve the addresses once, start the heartbeat."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        transport, _ = await loop.create_datagram_endpoint(lambda: self, sock=self._sock)
        self._transport = transport
        await self._resolve()
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name="peers heartbeat"),
            asyncio.create_task(self._keep_resolving(), name="peers resolve"),
        ]

    async def close(self) -> None:
        """Stop sending and listening."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._transport is not None:
            self._transport.close()

    @property
    def targets(self) -> tuple[tuple[object, ...], ...]:
        """The socket addresses the peers' names resolved to last."""
        return self._targets

    def heard(self) -> int:
        """Peers heard within `PeersConfig.expire_s`."""
        cutoff = self._clock() - self.config.expire_s
        return sum(1 for p in self._peers.values() if p.heard_s >= cutoff)

    def held_requests(self) -> int:
        """Other gateways' requests whose prompt blocks this gateway's index holds now (not
        ended, as far as they told)."""
        return sum(len(p.holds) for p in self._peers.values())

    # --- the PeerCounts side (sal_gateway.state) -----------------------------------------

    def slot(self, model: str, url: str) -> PeerSlot:
        key = backend_key(model, url)
        self._backends[key] = (model, url)
        return PeerSlot(self, key)

    # --- prompt blocks (peers.share_prefix_blocks) -------------------------------------

    def tell_blocks(self, model: str, url: str, keys: Sequence[int]) -> Callable[[], None]:
        """This gateway routed a prompt with block `keys` to `url`: send its first
        `MAX_BLOCK_DATAGRAMS` runs of keys to every peer now, numbered as one request.
        Returns what to call when that request ends: it tells the peers, which then release
        the blocks they hold for it. Every datagram also carries the oldest request not
        ended, so a peer that missed an end releases those blocks once every request up to
        it has ended (or when it stops hearing this gateway, `PeersConfig.expire_s`)."""
        transport = self._transport
        if transport is None or not self._targets or not keys:
            return _nothing
        key = backend_key(model, url)
        self._backends.setdefault(key, (model, url))
        self._request += 1
        request = self._request
        self._told[request] = None
        oldest = next(iter(self._told))
        step = BLOCK_KEYS_PER_DATAGRAM
        datagrams = []
        for start in range(0, min(len(keys), step * MAX_BLOCK_DATAGRAMS), step):
            run = tuple(keys[start : start + step])
            datagrams.append(self._blocks_datagram(ROUTED, request, oldest, key, run))
        self._send_all(transport, datagrams)

        def ended() -> None:
            if request not in self._told:
                return  # called twice
            del self._told[request]
            if self._transport is not None and not self._transport.is_closing():
                self._send_all(self._transport, [self._blocks_datagram(ENDED, request)])
                if len(self._ended) < MAX_RESENT_ENDS:
                    self._ended.append(request)

        return ended

    def _blocks_datagram(
        self,
        kind: int,
        request: int,
        oldest: int | None = None,
        key: int = 0,
        keys: tuple[int, ...] = (),
    ) -> bytes:
        """A signed prompt-blocks datagram with the next sequence number (`oldest` None:
        this gateway's oldest told request not ended now)."""
        if oldest is None:
            oldest = next(iter(self._told), self._request + 1)
        self._seq += 1
        message = PeerBlocks(kind, self.sender, self.group, self._seq, request, oldest, key, keys)
        return encode_blocks(self._secret, message)

    def publish(
        self, key: int, counts: tuple[int, int, int], adapters: tuple[int, ...] = ()
    ) -> None:
        """This gateway's counts (and pending LoRA `adapters`, `adapter_key` hashes) for
        `key` changed: send them at the end of this loop turn."""
        own = (*counts, adapters)
        if self._own.get(key) == own:
            return
        self._own[key] = own
        self._changed.add(key)
        if not self._flush_pending and self._loop is not None:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def others(self, key: int) -> tuple[int, int, int]:
        """Every live peer's latest counts for `key`, summed."""
        cutoff = self._clock() - self.config.expire_s
        in_flight = tokens = kv = 0
        for peer in self._peers.values():
            if peer.heard_s < cutoff:
                continue
            row = peer.rows.get(key)
            if row is not None:
                in_flight += row[1]
                tokens += row[2]
                kv += row[3]
        return in_flight, tokens, kv

    def other_adapters(self, key: int) -> frozenset[int]:
        """Every live peer's latest pending LoRA adapters for `key`."""
        cutoff = self._clock() - self.config.expire_s
        found: set[int] = set()
        for peer in self._peers.values():
            if peer.heard_s >= cutoff and (row := peer.rows.get(key)) is not None:
                found.update(row[4])
        return frozenset(found)

    # --- receiving ---------------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple[object, ...]) -> None:
        try:
            message = (
                decode_blocks(self._secret, data) if is_blocks(data) else decode(self._secret, data)
            )
        except PeerWireError as exc:
            self._on_datagram(exc.reason)
            return
        if message.sender == self.sender or message.group == self.group:
            self._on_datagram("own")
            return
        now = self._clock()
        peer = self._peer(message.sender, addr, now)
        if peer is None:
            return
        if isinstance(message, PeerBlocks):
            self._apply_blocks(peer, message, now)
        else:
            self._apply_counts(peer, message, now)

    def _apply_counts(self, peer: _Peer, message: PeerMessage, now: float) -> None:
        stale = 0
        for row in message.rows:
            held = peer.rows.get(row.key)
            if held is not None and held[0] >= message.seq:
                stale += 1  # a newer datagram set it already (reordered or replayed)
                continue
            peer.rows[row.key] = (
                message.seq,
                row.in_flight,
                row.routed_tokens,
                row.routed_kv_tokens,
                row.adapters,
            )
        if message.rows and stale == len(message.rows):
            self._on_datagram("old")
            return
        peer.heard_s = now
        self._on_datagram("accepted")

    def _apply_blocks(self, peer: _Peer, message: PeerBlocks, now: float) -> None:
        """Hold the blocks of a routed request for the peer (``result="blocks"``;
        ``"blocks_ignored"`` when the backend is unknown here or not tracked, nobody
        listens, or the peer holds `MAX_HELD_RUNS` runs already; ``"old"`` for a request
        that has ended or a run held already: reordered or replayed), release them when it
        ended, and everything below the peer's watermark."""
        peer.heard_s = now
        self._advance(peer, message.oldest)
        request = message.request
        if message.kind == ENDED:
            self._release(peer, request)
            self._on_datagram("accepted")
            return
        if message.kind == WATERMARK:
            self._on_datagram("accepted")
            return
        runs = peer.holds.get(request)
        if request < peer.watermark or (runs is not None and message.keys[0] in runs):
            self._on_datagram("old")
            return
        backend = self._backends.get(message.key)
        listener = self.on_blocks
        if (
            backend is None
            or listener is None
            or peer.held_runs >= MAX_HELD_RUNS
            or not listener(*backend, message.keys, True)
        ):
            self._on_datagram("blocks_ignored")
            return
        if runs is None:
            runs = peer.holds[request] = {}
        runs[message.keys[0]] = (*backend, message.keys)
        peer.held_runs += 1
        self._on_datagram("blocks")

    def _advance(self, peer: _Peer, oldest: int) -> None:
        """The peer says every request below `oldest` has ended: release their holds."""
        if oldest <= peer.watermark:
            return
        peer.watermark = oldest
        for request in [r for r in peer.holds if r < oldest]:
            self._release(peer, request)

    def _release(self, peer: _Peer, request: int) -> None:
        runs = peer.holds.pop(request, None)
        if runs is None:
            return
        peer.held_runs -= len(runs)
        listener = self.on_blocks
        if listener is not None:
            for model, url, keys in runs.values():
                listener(model, url, keys, False)

    def _drop(self, sender: int) -> None:
        """Forget `sender` (expired, or restarted as a new sender): release what it held."""
        peer = self._peers.pop(sender)
        for request in list(peer.holds):
            self._release(peer, request)

    def _peer(self, sender: int, addr: tuple[object, ...], now: float) -> _Peer | None:
        """The record of `sender`, new if need be (None, counted, when too many live)."""
        peer = self._peers.get(sender)
        if peer is None:
            # A new sender from the address another one used is that gateway restarted (one
            # socket, one process): its old counts go now, not after expire_s.
            for old in [s for s, p in self._peers.items() if p.addr == tuple(addr)]:
                self._drop(old)
            if len(self._peers) >= MAX_PEERS:
                self._forget(now)
                if len(self._peers) >= MAX_PEERS:
                    self._on_datagram("too_many_peers")
                    return None
            peer = self._peers[sender] = _Peer(now, tuple(addr))
        return peer

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a peer that is not up yet: expected, retried anyway.
        log.debug("peers: %s", exc)

    def _forget(self, now: float) -> None:
        cutoff = now - self.config.expire_s
        for sender in [s for s, p in self._peers.items() if p.heard_s < cutoff]:
            self._drop(sender)

    # --- sending -----------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_pending = False
        keys = sorted(self._changed)
        self._changed.clear()
        self._send(keys)

    def _send(self, keys: list[int], *, announce: bool = False) -> None:
        """Send the counts of `keys` to every peer (`announce`: one empty datagram when
        there are none, so that the peers know this gateway is alive)."""
        transport = self._transport
        if transport is None or not self._targets or not (keys or announce):
            return
        datagrams = []
        for rows in _datagrams([PeerRow(k, *self._own[k]) for k in keys]):
            self._seq += 1
            datagrams.append(encode(self._secret, self.sender, self._seq, rows, self.group))
        self._send_all(transport, datagrams)

    def _send_all(self, transport: asyncio.DatagramTransport, datagrams: list[bytes]) -> None:
        """Each of `datagrams` to every peer address, counted (`on_sent`)."""
        sent = errors = 0
        for datagram in datagrams:
            for target in self._targets:
                try:
                    transport.sendto(datagram, target)
                    sent += 1
                except OSError:
                    errors += 1
        self._on_sent(sent, errors)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            self._send(sorted(self._own), announce=True)
            if self._request and self._transport is not None:
                # Each recent end once more (a peer that missed it releases its blocks now,
                # one that did not ignores it), then the watermark.
                ended, self._ended = self._ended, []
                datagrams = [self._blocks_datagram(ENDED, request) for request in ended]
                datagrams.append(self._blocks_datagram(WATERMARK, 0))
                self._send_all(self._transport, datagrams)
            self._forget(self._clock())

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_s)
            await self._resolve()

    async def _resolve(self) -> None:
        """Every address each configured name resolves to now, in the socket's family (a
        name that does not resolve keeps its previous addresses)."""
        assert self._loop is not None
        family = self._sock.family
        previous = self._by_name
        by_name: dict[str, tuple[tuple[object, ...], ...]] = {}
        for entry in self.config.addresses:
            host, port = split_host_port(entry)
            try:
                infos = await self._loop.getaddrinfo(
                    host, port, family=family, type=socket.SOCK_DGRAM
                )
            except OSError as exc:
                if entry not in previous:
                    log.warning("peers: cannot resolve %s: %s", entry, exc)
                by_name[entry] = previous.get(entry, ())
                continue
            by_name[entry] = tuple(dict.fromkeys(info[4] for info in infos))
        self._by_name = by_name
        self._targets = tuple(dict.fromkeys(a for addrs in by_name.values() for a in addrs))


def _datagrams(rows: list[PeerRow]) -> list[list[PeerRow]]:
    """`rows` split, in order, into as few datagrams as `fits` allows (one empty datagram
    when there are none: the heartbeat's announcement)."""
    batches: list[list[PeerRow]] = [[]]
    used = 0  # version 2 bytes of the last batch
    adapters = False  # whether a row of the last batch carries adapters
    for row in rows:
        size = row.size()
        with_adapters = adapters or bool(row.adapters)
        full = used + size > ROOM if with_adapters else len(batches[-1]) >= V1_ROWS
        if batches[-1] and full:
            batches.append([])
            used, with_adapters = 0, bool(row.adapters)
        batches[-1].append(row)
        used += size
        adapters = with_adapters
    return batches


class PeerSlot:
    """One backend's `sal_gateway.state.PeerCounts` over the network."""

    __slots__ = ("_key", "_network")

    def __init__(self, network: PeerNetwork, key: int) -> None:
        self._network = network
        self._key = key

    def publish(
        self,
        in_flight: int,
        routed_tokens: int,
        routed_kv_tokens: int,
        adapters: Collection[str] = (),
    ) -> None:
        """Send the counts, and the pending `adapters` with ``peers.share_adapters``."""
        keys: tuple[int, ...] = ()
        if self._network.config.share_adapters:
            keys = tuple(sorted(adapter_key(name) for name in adapters))[:MAX_ADAPTERS]
        self._network.publish(self._key, (in_flight, routed_tokens, routed_kv_tokens), keys)

    def others(self) -> tuple[int, int, int]:
        return self._network.others(self._key)

    def other_adapters(self) -> frozenset[int]:
        """The peers' pending adapters (none without ``peers.share_adapters``)."""
        if not self._network.config.share_adapters:
            return frozenset()
        return self._network.other_adapters(self._key)


class BothCounts:
    """A worker's `sal_gateway.state.PeerCounts` when it has both: the other workers of its
    host (shared memory) and the gateways on other hosts (`PeerSlot`). Publishes to both;
    the others are the sum of both (the host's workers drop each other's datagrams, so
    nobody is counted twice)."""

    __slots__ = ("_local", "_remote")

    def __init__(self, local: PeerCounts, remote: PeerCounts) -> None:
        self._local = local
        self._remote = remote

    def publish(
        self,
        in_flight: int,
        routed_tokens: int,
        routed_kv_tokens: int,
        adapters: Collection[str] = (),
    ) -> None:
        self._local.publish(in_flight, routed_tokens, routed_kv_tokens, adapters)
        self._remote.publish(in_flight, routed_tokens, routed_kv_tokens, adapters)

    def others(self) -> tuple[int, int, int]:
        a = self._local.others()
        b = self._remote.others()
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]

    def other_adapters(self) -> frozenset[int]:
        return self._local.other_adapters() | self._remote.other_adapters()
