"""What the workers of one host tell each other: the prompt blocks they route.

``listen.share_prefix_index``. With ``routing.prefix_cache: approximate`` each gateway
process indexes the blocks *it* routed (`sal_gateway.prefix_cache`). The kernel spreads
connections over the workers of ``listen.workers``, so the turns of one conversation, sent
over different connections (a chat application's pool, a load balancer in front), reach
different workers, and a worker that did not route turn 1 does not know where its prefix is.
In the simulator (``sal-bench prefix --only workers``: multi-turn chat, 4 replicas, each
request to a worker at random) 4 or 8 workers that do not tell each other kept about half of
one gateway's hit rate or less, with a p95 TTFT 3-5x worse; told, they tie one gateway
(README, "Many gateways").

How: the supervisor creates a private folder (mode 0700, removed when the workers have
stopped); worker i listens on a Unix stream socket ``w<i>.sock`` there and connects to every
other worker's (retried until each is up, and after a lost connection). After routing a
request whose blocks it indexed, and again when that request ends, a worker writes one
length-prefixed message to every other worker (`PrefixShare.tell`: routed or ended, model,
backend URL, block keys). Writing never blocks: the bytes wait in the connection's buffer
while the other worker is busy; a worker not connected (yet), or one with
`SEND_BUFFER_BYTES` already waiting for it, misses the message (counted). The receiving
worker applies each connection's messages in order (`MESSAGES_PER_TURN` at a time, so a
backlog does not hold its loop): its index takes the blocks as cached on that backend and
held by a running request, or releases them (`PrefixTracker.told`), so each worker's index
is the one a single gateway would keep. Only the leading `MAX_KEYS` blocks travel (a
131k-token prompt at vLLM's 16-token blocks). Unix datagrams were tried first: Linux queues
at most ``net.unix.max_dgram_qlen`` (10) datagrams per socket, so a worker busy for a few
milliseconds under load would have missed messages.

Holds matter where KV binds: in the simulator (40 GB replicas) workers told of routed
blocks only, not of their holds, kept 30 % of prompt tokens cached instead of one gateway's
37 % and had twice its p95 TTFT (a block another worker's running request holds looked
evictable, so SAL charged its reuse free KV). Each "ended" message names its request by the
sender's sequence number, so it releases exactly what its "routed" message held: a worker
that missed the "routed" one is not sent the "ended" one, and an unknown number releases
nothing. A missed "ended" message (the receiving worker stalled with `SEND_BUFFER_BYTES`
waiting for it) leaves those blocks held until the sender's connection ends
(`sal_prefix_share_messages_total{outcome="dropped"}`); the receiver releases everything a
worker still holds when its connection ends. Evictions are not shared: each worker
evicts by the same LRU rule from the same blocks. ``kv_events`` mode needs none of this:
every worker reads the engines' events. Linux and macOS (Unix sockets).

Wire format (`encode` / `decode`, pure): ``b"SP1"``, ``b"H"`` (routed, held) or ``b"E"``
(ended), the request's sequence number at its sender (8 bytes, big-endian), model and URL
each as a 2-byte big-endian length and UTF-8, then the keys (none in an "ended" message) as
little-endian signed 64-bit integers (Python's hash of a tuple of ints,
`sal_core.prefix.chain_hashes`, agrees across processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import sys
import tempfile
from array import array
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

MAGIC = b"SP1"
HELD = b"H"
"""Message kind: a request with these blocks was routed (held until it ends)."""
ENDED = b"E"
"""Message kind: that request ended (its blocks stay cached, unheld)."""
MAX_KEYS = 8192
"""Most block keys one datagram carries (64 KiB of keys): a prompt's leading blocks."""
MAX_MESSAGE_BYTES = 4 + 8 + 2 * (2 + 0xFFFF) + 8 * MAX_KEYS
"""The largest well-formed message; a longer frame closes the connection."""
MESSAGES_PER_TURN = 64
"""Messages applied before the receiving task lets the event loop run other work."""
SEND_BUFFER_BYTES = 8 << 20
"""Bytes that may wait for one other worker (it is stalled) before messages to it drop."""
MAX_HOLDS = 1 << 16
"""Most requests one other worker may have routed and not ended (more are not held)."""
RETRY_S = 0.1
"""Pause between connection attempts to a worker that is not up (yet)."""

Told = Callable[[str, str, Sequence[int], bool], bool]
"""What a worker does with another worker's message: ``(model, url, keys, held)``; `held`
True: a request with these blocks was routed to `url` (returns whether they are now held,
so that its end releases them); False: it ended (the routed message's keys again)."""
Outcome = Callable[[str], None]
"""Counts one message by outcome: ``sent``, ``dropped`` (the receiving worker was not
connected, or stalled with `SEND_BUFFER_BYTES` waiting for it), ``received``, ``garbled``."""


def _nothing() -> None:
    return None


class ShareError(ValueError):
    """Bytes that are not a well-formed message."""


def encode(model: str, url: str, keys: Sequence[int], held: bool, seq: int) -> bytes:
    """One message: request `seq` (the sender's count) routed with these blocks (`held`) or
    ended (its keys need not travel again: `keys` may be empty), `model`, `url` and the
    first `MAX_KEYS` of `keys`."""
    m, u = model.encode(), url.encode()
    if len(m) > 0xFFFF or len(u) > 0xFFFF:
        raise ShareError("model or URL too long")
    body = array("q", keys[:MAX_KEYS])
    if body.itemsize != 8:  # pragma: no cover - every supported platform has 8-byte 'q'
        raise ShareError("no 64-bit integers")
    if sys.byteorder == "big":  # pragma: no cover - the wire is little-endian
        body.byteswap()
    return b"".join(
        (
            MAGIC,
            HELD if held else ENDED,
            struct.pack(">Q", seq),
            struct.pack(">H", len(m)),
            m,
            struct.pack(">H", len(u)),
            u,
            body.tobytes(),
        )
    )


def decode(data: bytes) -> tuple[str, str, list[int], bool, int]:
    """``(model, url, keys, held, seq)`` of one message; raises `ShareError` when it is not
    one."""
    if not data.startswith(MAGIC):
        raise ShareError("bad magic")
    kind = data[len(MAGIC) : len(MAGIC) + 1]
    if kind not in (HELD, ENDED):
        raise ShareError("bad kind")
    pos = len(MAGIC) + 1
    if pos + 8 > len(data):
        raise ShareError("truncated")
    (seq,) = struct.unpack_from(">Q", data, pos)
    pos += 8
    fields: list[str] = []
    for _ in range(2):
        if pos + 2 > len(data):
            raise ShareError("truncated")
        (n,) = struct.unpack_from(">H", data, pos)
        pos += 2
        if pos + n > len(data):
            raise ShareError("truncated")
        try:
            fields.append(data[pos : pos + n].decode())
        except UnicodeDecodeError:
            raise ShareError("not UTF-8") from None
        pos += n
    rest = len(data) - pos
    if rest % 8 or rest // 8 > MAX_KEYS:
        raise ShareError("bad key block")
    keys = array("q")
    keys.frombytes(data[pos:])
    if sys.byteorder == "big":  # pragma: no cover - the wire is little-endian
        keys.byteswap()
    return fields[0], fields[1], keys.tolist(), kind == HELD, seq


@dataclass(frozen=True, slots=True)
class ShareSpec:
    """Where one worker's socket and its siblings' are (made by `create_folder`)."""

    folder: str
    index: int
    workers: int

    def path(self, worker: int) -> str:
        return os.path.join(self.folder, f"w{worker}.sock")


def create_folder() -> str:
    """The supervisor's private folder for the workers' sockets (mode 0700)."""
    return tempfile.mkdtemp(prefix="sal-prefix-share-")


def remove_folder(folder: str) -> None:
    """Remove the folder once every worker has stopped."""
    shutil.rmtree(folder, ignore_errors=True)


class PrefixShare:
    """One worker's end (see the module docstring). Main loop only: `start` and `aclose`
    inside the running loop; `tell` from the request path."""

    def __init__(self, spec: ShareSpec, on_told: Told, on_outcome: Outcome) -> None:
        self._spec = spec
        self._on_told = on_told
        self._on_outcome = on_outcome
        self._peers = [i for i in range(spec.workers) if i != spec.index]
        self._links: dict[int, asyncio.StreamWriter] = {}
        self._incoming: set[asyncio.StreamWriter] = set()
        self._seq = 0
        self.held_requests = 0
        """Other workers' requests whose prompt blocks this worker's index holds now."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen for the other workers' messages and connect to theirs (retried until
        each is up). Raises `OSError` when this worker's socket cannot be bound."""
        path = self._spec.path(self._spec.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a worker of an earlier run in the same folder
        self._server = await asyncio.start_unix_server(self._serve, path=path)
        for peer in self._peers:
            self._spawn(self._connect(peer), f"prefix share connect {peer}")

    @property
    def connected(self) -> int:
        """Other workers this end can write to now."""
        return sum(not link.is_closing() for link in self._links.values())

    def tell(self, model: str, url: str, keys: Sequence[int]) -> Callable[[], None]:
        """Tell every other worker that a request with these blocks was just routed to `url`;
        the returned callable tells them it ended (only those that were told it was routed).
        Never blocks: a worker not connected yet, or with `SEND_BUFFER_BYTES` waiting for it
        already, misses the message (counted)."""
        if not keys or not self._peers:
            return _nothing
        self._seq += 1
        seq = self._seq
        try:
            routed = encode(model, url, keys, True, seq)
        except ShareError:
            self._on_outcome("dropped")
            return _nothing
        told = [peer for peer in self._peers if self._send(peer, routed)]
        if not told:
            return _nothing

        def ended() -> None:
            message = encode(model, url, (), False, seq)
            for peer in told:
                self._send(peer, message)

        return ended

    def _send(self, peer: int, message: bytes) -> bool:
        link = self._links.get(peer)
        if (
            link is None
            or link.is_closing()
            or link.transport.get_write_buffer_size() > SEND_BUFFER_BYTES
        ):
            self._on_outcome("dropped")
            return False
        link.write(len(message).to_bytes(4, "big") + message)
        self._on_outcome("sent")
        return True

    async def _connect(self, peer: int) -> None:
        """Connect to `peer` (retried every `RETRY_S` until it is up), and again whenever
        the connection is lost, until this end closes."""
        path = self._spec.path(peer)
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path)
            except OSError:  # not up yet (no socket file, or not listening)
                await asyncio.sleep(RETRY_S)
                continue
            self._links[peer] = writer
            try:
                await reader.read()  # the peer never writes back: returns when it closes
            finally:
                self._links.pop(peer, None)
                writer.close()
            await asyncio.sleep(RETRY_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Apply one other worker's messages, in order, until it disconnects or sends
        something that is not a message (then the connection is closed). An "ended" message
        releases what its "routed" one held, found by its sequence number (an unknown one
        releases nothing); whatever that worker still holds is released when its connection
        ends."""
        applied = 0
        holds: dict[int, tuple[str, str, list[int]]] = {}
        self._incoming.add(writer)
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "big")
                if size > MAX_MESSAGE_BYTES:
                    self._on_outcome("garbled")
                    return
                data = await reader.readexactly(size)
                try:
                    model, url, keys, held, seq = decode(data)
                except ShareError:
                    self._on_outcome("garbled")
                    return
                self._on_outcome("received")
                if held:
                    if (
                        seq not in holds
                        and len(holds) < MAX_HOLDS
                        and self._on_told(model, url, keys, True)
                    ):
                        holds[seq] = (model, url, keys)
                        self.held_requests += 1
                else:
                    routed = holds.pop(seq, None)
                    if routed is not None:
                        self.held_requests -= 1
                        self._on_told(*routed, False)
                applied += 1
                if applied % MESSAGES_PER_TURN == 0:
                    await asyncio.sleep(0)  # a backlog must not hold the loop
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self.held_requests -= len(holds)
            for model, url, keys in holds.values():
                self._on_told(model, url, keys, False)
            self._incoming.discard(writer)
            writer.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop listening and connecting; close every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in [*self._links.values(), *self._incoming]:
            link.close()
        self._links.clear()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        with contextlib.suppress(OSError):
            os.unlink(self._spec.path(self._spec.index))
