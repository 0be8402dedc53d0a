"""Subscribers to every backend's vLLM KV-cache events, on a thread of their own.

``routing.prefix_cache: kv_events``: one ZMQ SUB socket per backend, all on ONE thread
(`KvEventSubscribers`), off the request path. ZMQ reconnects a SUB socket by itself (a
replica restarting on the same endpoint is picked up again; nothing is lost but the events
sent while it was away). The thread reads each message, decodes and translates it into the
gateway's block keys (`kv_events.BlockKeyMap`: the CPU cost of hashing stays on this thread)
and queues the resulting `kv_events.Ops`; the main loop drains the queue in bounded slices
(`DRAIN_BATCH` messages per callback) and applies them to the `PrefixTracker`, so no message,
however large or frequent, holds the event loop for long.

Bounds: each socket's receive high-water mark (`RCVHWM`) and maximum message size
(`kv_events.MAX_PAYLOAD_BYTES`) cap what ZMQ buffers; at most `MAX_BACKLOG` translated
messages wait for the main loop (beyond: dropped as ``backlog``, as when the loop is stalled).
A sequence-number gap (lost messages) is counted as ``gap``; a sequence that goes back
(the publisher restarted) forgets the backend's hash map. Every drop is counted in
``sal_kv_events_dropped_total{reason}``; nothing a publisher sends can raise on either thread.

Replay (``routing.kv_events_replay_port`` or ``models[].kv_events_replay_endpoints``: the
``replay_endpoint`` of the replica's ``--kv-events-config``): vLLM's publisher keeps its last
``buffer_steps`` messages (default 10,000) and sends them again to a DEALER that asks with a
start sequence number (8 bytes big-endian), each as ``(b"", topic, seq, payload)``, then
``(b"", b"", -1, b"")``. The subscriber asks in two cases. The *catch-up*: once the gateway
keys the backend's blocks (`tracked`: its block size is known), from sequence 0, so that a
gateway that starts or restarts after its replicas learns what they cached since (within
their buffer); at most `MAX_CATCH_UPS` at a time (a fleet's buffers are large), the rest in
turn, live messages applied meanwhile and carried again by the catch-up (the latest message
decides each block, as in the engine). And on a *gap*, from the first message lost. While a
replay runs, the live messages wait (at most `RCVHWM`) and are applied after it, in order,
those the replay already carried skipped. Replayed messages are read only while the main
loop's backlog has room (`MAX_BACKLOG`; ZMQ holds the rest, `REPLAY_RCVHWM`), so a replay
is never dropped as ``backlog``. A replay that sends nothing for `REPLAY_TIMEOUT_S`, or more
than `MAX_REPLAY_MESSAGES`, is abandoned (``replay_timeout``; no replay for a gap then for
`REPLAY_COOLDOWN_S`), its socket closed, and the waiting messages applied (the loss counted
as a ``gap``). A gap a replay could not fill (the buffer had moved on) is counted, never
asked for again. Replayed messages are counted in ``sal_kv_events_total`` as
``replayed_messages``.

Needs the ``kv-events`` extra (``pyzmq``, ``msgspec``); imported only in that mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq

from sal_gateway.kv_events import MAX_PAYLOAD_BYTES, BlockKeyMap, Ops, seq_of
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.prefix_cache import PrefixTracker

logger = logging.getLogger("sal_gateway.kv_subscriber")

RCVHWM = 10_000
"""Messages ZMQ buffers per socket before it drops (one per engine step)."""
MAX_BACKLOG = 2_000
"""Translated messages waiting for the main loop; beyond, new ones are dropped."""
DRAIN_BATCH = 64
"""Messages the main loop applies per callback (then it yields and continues)."""
POLL_TIMEOUT_MS = 100
"""Longest the thread waits before it looks at membership changes again."""
READ_BURST = 256
"""Messages read from one socket before the thread turns to the others."""
REPLAY_TIMEOUT_S = 10.0
"""Longest a replay may send nothing (vLLM's publisher answers between engine steps, within
0.1 s when idle; the subscriber reads on while the main loop keeps up)."""
MAX_CATCH_UPS = 2
"""Catch-up replays (whole buffers) running at once; the others wait their turn."""
BACKLOG_WAIT_S = 0.005
"""The thread's pause while a replay waits for the main loop's backlog to drain."""
REPLAY_COOLDOWN_S = 30.0
"""After a replay failed, gaps are only counted for this long."""
MAX_REPLAY_MESSAGES = 20_000
"""Messages one replay may carry (vLLM's ``buffer_steps`` defaults to 10,000)."""
REPLAY_RCVHWM = MAX_REPLAY_MESSAGES
"""The replay socket's receive high-water mark: a whole default buffer fits, so the
publisher's ROUTER (which drops at its peer's mark) never has to drop a replayed message."""

Key = tuple[str, str]
"""(model, backend URL)."""


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where one backend's KV events come from."""

    events: str
    """The publisher's PUB endpoint."""
    replay: str | None = None
    """Its replay (ROUTER) endpoint; None: no replay."""


@dataclass(slots=True)
class _Source:
    key: Key
    endpoints: Endpoints
    socket: zmq.Socket[bytes]
    keymap: BlockKeyMap = field(default_factory=BlockKeyMap)
    last_seq: int | None = None
    replay: zmq.Socket[bytes] | None = None
    """The DEALER of the replay running now (None: none runs)."""
    replay_deadline_s: float = 0.0
    replayed: int = 0
    """Messages the running replay carried so far."""
    waiting: deque[list[bytes]] = field(default_factory=deque)
    """Live messages received while a replay runs, applied after it."""
    caught_up: bool = False
    """The catch-up replay (from sequence 0) was started."""
    catching_up: bool = False
    """The running replay is the catch-up."""
    replay_after_s: float = 0.0
    """No replay for a gap before this (monotonic; after one failed)."""


class KvEventSubscribers:
    """See the module docstring. `add()`/`remove()`/`stop()` from the main loop."""

    def __init__(self, tracker: PrefixTracker, metrics: GatewayMetrics, topic: str = "") -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._topic = topic.encode()
        self._commands: queue.SimpleQueue[tuple[str, Key, Endpoints | None]] = queue.SimpleQueue()
        self._ready: deque[tuple[Key, Ops]] = deque()
        self._drain_scheduled = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._endpoints: dict[Key, Endpoints] = {}
        """Main loop's view of the subscriptions."""
        self._tracked: set[Key] = set()
        """Subscriptions whose catch-up replay was asked for (main loop)."""
        # The subscriber thread's own (set up by `_run`, touched by no other thread):
        self._zctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[bytes], _Source] = {}

    # --- main loop ---------------------------------------------------------------------

    def add(self, model: str, url: str, endpoints: Endpoints) -> None:
        """Subscribe to `url`'s publisher at `endpoints` (no-op when already subscribed)."""
        key = (model, url)
        if self._endpoints.get(key) == endpoints:
            return
        self._endpoints[key] = endpoints
        self._tracked.discard(key)
        self._ensure_thread()
        self._commands.put(("add", key, endpoints))

    def remove(self, model: str, url: str) -> None:
        if self._endpoints.pop((model, url), None) is not None:
            self._tracked.discard((model, url))
            self._commands.put(("remove", (model, url), None))

    def tracked(self, model: str, url: str) -> None:
        """The prefix tracker keys `url`'s blocks now: ask its publisher, once per
        subscription, for what it still buffers (when it has a replay endpoint)."""
        key = (model, url)
        endpoints = self._endpoints.get(key)
        if endpoints is None or endpoints.replay is None or key in self._tracked:
            return
        self._tracked.add(key)
        self._commands.put(("catch_up", key, None))

    def subscribed(self) -> dict[Key, Endpoints]:
        return dict(self._endpoints)

    async def stop(self) -> None:
        """End the thread and close its sockets (idempotent)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
        self._thread = None

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sal-kv-events", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        """Apply up to `DRAIN_BATCH` translated messages; reschedule while more wait."""
        self._drain_scheduled.clear()
        for _ in range(DRAIN_BATCH):
            try:
                (model, url), ops = self._ready.popleft()
            except IndexError:
                return
            if (model, url) in self._endpoints:
                self.apply(model, url, ops)
        if self._ready:
            self._schedule_drain()

    def apply(self, model: str, url: str, ops: Ops) -> None:
        """Apply one message's operations to the tracker and count them (main loop)."""
        tracker, kinds = self._tracker, self._metrics.kv_events
        if ops.cleared:
            tracker.clear(model, url)
            kinds.labels(model, url, "cleared").inc()
        for keys in ops.stored:
            tracker.store(model, url, keys)
        if ops.stored:
            kinds.labels(model, url, "stored_blocks").inc(sum(len(k) for k in ops.stored))
        if ops.removed:
            tracker.evict(model, url, ops.removed)
            kinds.labels(model, url, "removed_blocks").inc(len(ops.removed))

    def _schedule_drain(self) -> None:
        loop = self._loop
        if loop is None or self._drain_scheduled.is_set():
            return
        self._drain_scheduled.set()
        with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
            loop.call_soon_threadsafe(self._drain)

    # --- the subscriber thread ---------------------------------------------------------

    def _run(self) -> None:
        ctx = self._zctx = zmq.Context()
        poller = self._poller
        sources: dict[Key, _Source] = {}
        catch_ups: deque[Key] = deque()
        try:
            while not self._stop.is_set():
                self._apply_commands(ctx, sources, catch_ups)
                self._start_catch_ups(sources, catch_ups)
                try:
                    ready = dict(poller.poll(POLL_TIMEOUT_MS)) if sources else {}
                except zmq.ZMQError:
                    ready = {}
                if not sources:
                    self._stop.wait(POLL_TIMEOUT_MS / 1000)
                for sock in ready:
                    source = self._by_socket.get(sock)
                    if source is None:
                        continue
                    if sock is source.replay:
                        self._read_replay(source)
                    elif sock is source.socket:
                        self._read(source)
                now_s = time.monotonic()
                held_back = False
                backlog_full = len(self._ready) >= MAX_BACKLOG
                for source in sources.values():
                    if source.replay is not None and backlog_full:
                        # This side holds the replay back, not the publisher.
                        source.replay_deadline_s = now_s + REPLAY_TIMEOUT_S
                    elif source.replay is not None and now_s > source.replay_deadline_s:
                        self._replay_failed(source, "sent nothing in time")
                    if source.replay is None and source.waiting:
                        self._apply_waiting(source)
                    held_back |= source.replay is not None or bool(source.waiting)
                if held_back and backlog_full:
                    self._stop.wait(BACKLOG_WAIT_S)  # the main loop catches up first
        except Exception:  # the thread must not die silently; the loop keeps routing
            logger.exception("the KV-event subscriber thread failed")
        finally:
            for source in sources.values():
                source.socket.close(linger=0)
                if source.replay is not None:
                    source.replay.close(linger=0)
            ctx.term()

    def _start_catch_ups(self, sources: dict[Key, _Source], catch_ups: deque[Key]) -> None:
        """Start waiting catch-up replays while fewer than `MAX_CATCH_UPS` run."""
        running = sum(1 for s in sources.values() if s.replay is not None and s.catching_up)
        for _ in range(len(catch_ups)):
            if running >= MAX_CATCH_UPS:
                return
            key = catch_ups.popleft()
            source = sources.get(key)
            if source is None or source.caught_up:
                continue  # gone, or done
            if source.replay is not None or source.waiting:
                catch_ups.append(key)  # a gap's replay runs: after it
                continue
            source.caught_up = True
            # Everything from 0 again, in order, those applied already too (the blocks they
            # stored could not be keyed before): the latest message decides each block, as
            # it did in the engine.
            source.last_seq = None
            if self._start_replay(source, 0):
                source.catching_up = True
                running += 1

    def _apply_commands(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        sources: dict[Key, _Source],
        catch_ups: deque[Key],
    ) -> None:
        while True:
            try:
                op, key, endpoints = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "catch_up":
                catch_ups.append(key)
                continue
            old = sources.pop(key, None)
            if old is not None:
                if old.replay is not None:
                    self._end_replay(old, keep_waiting=False)
                self._poller.unregister(old.socket)
                self._by_socket.pop(old.socket, None)
                old.socket.close(linger=0)
            if op != "add" or endpoints is None:
                continue
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 1024)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            try:
                sock.connect(endpoints.events)
            except zmq.ZMQError as exc:
                logger.warning("cannot subscribe to KV events at %s: %s", endpoints.events, exc)
                sock.close(linger=0)
                continue
            source = sources[key] = _Source(key, endpoints, sock)
            self._by_socket[sock] = source
            self._poller.register(sock, zmq.POLLIN)
            logger.info("subscribed to KV events of %s at %s", key[1], endpoints.events)

    def _drop(self, source: _Source, reason: str, n: int = 1) -> None:
        model, url = source.key
        self._metrics.kv_events_dropped.labels(model, url, reason).inc(n)

    def _recv(self, sock: zmq.Socket[bytes], source: _Source) -> list[bytes] | None:
        """One message from `sock`; None when none waits (or the socket failed: counted)."""
        try:
            return sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        except zmq.ZMQError:
            self._drop(source, "garbled")
            return None

    def _read(self, source: _Source) -> None:
        for _ in range(READ_BURST):
            frames = self._recv(source.socket, source)
            if frames is None:
                return
            if source.replay is not None or source.waiting:  # after those before it
                if len(source.waiting) >= RCVHWM:
                    self._drop(source, "backlog")
                else:
                    source.waiting.append(frames)
                continue
            if (
                self._lost_before(source, frames)
                and source.endpoints.replay is not None
                and time.monotonic() >= source.replay_after_s
            ):
                # Ask for what was lost; this message waits for the replay.
                assert source.last_seq is not None
                source.waiting.append(frames)
                self._start_replay(source, source.last_seq + 1)
                continue
            self._queue(source, self._translate(source, frames))

    def _read_replay(self, source: _Source) -> None:
        replayed = self._metrics.kv_events.labels(*source.key, "replayed_messages")
        for _ in range(READ_BURST):
            if len(self._ready) >= MAX_BACKLOG:
                return  # ZMQ holds the rest until the main loop catches up
            sock = source.replay
            frames = None if sock is None else self._recv(sock, source)
            if frames is None:
                return
            source.replay_deadline_s = time.monotonic() + REPLAY_TIMEOUT_S
            # (b"", topic, seq, payload); the end: (b"", b"", -1, b"").
            if len(frames) != 4 or frames[0]:
                self._drop(source, "garbled")
                continue
            seq = seq_of(frames[2])
            if seq == -1:
                self._end_replay(source)
                return
            source.replayed += 1
            if source.replayed > MAX_REPLAY_MESSAGES:
                self._replay_failed(source, "sent too many messages")
                return
            if seq is not None and source.last_seq is not None and seq <= source.last_seq:
                continue  # already applied (or a replayer going back: nothing to learn)
            replayed.inc()
            self._queue(source, self._translate(source, frames[1:]))

    def _start_replay(self, source: _Source, start: int) -> bool:
        """Ask `source`'s publisher for its buffered messages from sequence `start`; whether
        the request went out."""
        endpoint = source.endpoints.replay
        if endpoint is None or source.replay is not None or self._zctx is None:
            return False
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 1024)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            # Queued until the connection is up (a DEALER never drops a first message).
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("cannot ask %s for a KV-event replay: %s", endpoint, exc)
            sock.close(linger=0)
            return False
        source.replay = sock
        source.replayed = 0
        source.replay_deadline_s = time.monotonic() + REPLAY_TIMEOUT_S
        self._by_socket[sock] = source
        self._poller.register(sock, zmq.POLLIN)
        logger.info("asked %s for its KV events from sequence %d", source.key[1], start)
        return True

    def _replay_failed(self, source: _Source, why: str) -> None:
        """Abandon the running replay; ask for none after a gap for `REPLAY_COOLDOWN_S` (a
        replica without a replay socket would hold every gap's messages that long)."""
        logger.warning("KV-event replay from %s %s: abandoned", source.endpoints.replay, why)
        self._drop(source, "replay_timeout")
        source.replay_after_s = time.monotonic() + REPLAY_COOLDOWN_S
        self._end_replay(source)

    def _end_replay(self, source: _Source, *, keep_waiting: bool = True) -> None:
        """Close the running replay; the live messages that waited for it are applied next
        (`_apply_waiting`, from the thread's loop), or dropped (not `keep_waiting`)."""
        sock = source.replay
        if sock is not None:
            self._poller.unregister(sock)
            self._by_socket.pop(sock, None)
            sock.close(linger=0)
            source.replay = None
        source.catching_up = False
        if not keep_waiting:
            source.waiting.clear()

    def _apply_waiting(self, source: _Source) -> None:
        """Apply the live messages that waited for a replay, in order, while the main loop's
        backlog has room (the rest next time), skipping those the replay already carried; a
        gap left among them is counted, not asked for again."""
        waiting = source.waiting
        while waiting and len(self._ready) < MAX_BACKLOG:
            frames = waiting.popleft()
            seq = seq_of(frames[1]) if len(frames) == 3 else None
            if seq is not None and source.last_seq is not None and 0 <= seq <= source.last_seq:
                continue
            self._queue(source, self._translate(source, frames))

    def _queue(self, source: _Source, ops: Ops) -> None:
        """Count `ops`' drops and queue the rest for the main loop."""
        for reason, n in ops.dropped.items():
            self._drop(source, reason, n)
        if ops.empty:
            return
        if len(self._ready) >= MAX_BACKLOG:
            self._drop(source, "backlog")
            return
        self._ready.append((source.key, ops))
        self._schedule_drain()

    @staticmethod
    def _lost_before(source: _Source, frames: list[bytes]) -> bool:
        """Whether messages were lost before this live one (its sequence skips ahead)."""
        seq = seq_of(frames[1]) if len(frames) == 3 else None
        return seq is not None and source.last_seq is not None and seq > source.last_seq + 1

    def _translate(self, source: _Source, frames: list[bytes]) -> Ops:
        if len(frames) != 3:
            ops = Ops()
            ops.drop("garbled")
            return ops
        seq = seq_of(frames[1])
        gap = False
        if seq is not None and source.last_seq is not None:
            if seq < source.last_seq:  # the publisher restarted: its old hashes are gone
                source.keymap.clear()
            elif seq > source.last_seq + 1:
                gap = True
        if seq is not None:
            source.last_seq = seq
        ops = source.keymap.decode(frames[2], self._tracker.block_size(source.key[0]))
        if gap:
            ops.drop("gap")
        return ops


def endpoint_for(url: str, port: int, explicit: dict[str, str]) -> str:
    """The KV-event endpoint of backend `url`: the configured one, else the backend's host
    on `port`."""
    if url in explicit:
        return explicit[url]
    host = urlsplit(url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def endpoints_for(
    url: str,
    port: int,
    explicit: dict[str, str],
    replay_port: int | None,
    explicit_replay: dict[str, str],
) -> Endpoints:
    """Backend `url`'s publisher and replay endpoints (`endpoint_for` each; no replay when
    neither `replay_port` nor `explicit_replay` names one)."""
    replay = None
    if url in explicit_replay or replay_port is not None:
        replay = endpoint_for(url, replay_port or 0, explicit_replay)
    return Endpoints(endpoint_for(url, port, explicit), replay)
