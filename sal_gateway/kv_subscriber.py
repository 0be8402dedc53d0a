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

Needs the ``kv-events`` extra (``pyzmq``, ``msgspec``); imported only in that mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
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

Key = tuple[str, str]
"""(model, backend URL)."""


@dataclass(slots=True)
class _Source:
    key: Key
    endpoint: str
    socket: zmq.Socket[bytes]
    keymap: BlockKeyMap = field(default_factory=BlockKeyMap)
    last_seq: int | None = None


class KvEventSubscribers:
    """See the module docstring. `add()`/`remove()`/`stop()` from the main loop."""

    def __init__(self, tracker: PrefixTracker, metrics: GatewayMetrics, topic: str = "") -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._topic = topic.encode()
        self._commands: queue.SimpleQueue[tuple[str, Key, str]] = queue.SimpleQueue()
        self._ready: deque[tuple[Key, Ops]] = deque()
        self._drain_scheduled = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._endpoints: dict[Key, str] = {}
        """Main loop's view of the subscriptions."""

    # --- main loop ---------------------------------------------------------------------

    def add(self, model: str, url: str, endpoint: str) -> None:
        """Subscribe to `url`'s publisher at `endpoint` (no-op when already subscribed)."""
        key = (model, url)
        if self._endpoints.get(key) == endpoint:
            return
        self._endpoints[key] = endpoint
        self._ensure_thread()
        self._commands.put(("add", key, endpoint))

    def remove(self, model: str, url: str) -> None:
        if self._endpoints.pop((model, url), None) is not None:
            self._commands.put(("remove", (model, url), ""))

    def subscribed(self) -> dict[Key, str]:
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
        ctx = zmq.Context()
        poller = zmq.Poller()
        sources: dict[Key, _Source] = {}
        by_socket: dict[zmq.Socket[bytes], _Source] = {}
        try:
            while not self._stop.is_set():
                self._apply_commands(ctx, poller, sources, by_socket)
                try:
                    ready = dict(poller.poll(POLL_TIMEOUT_MS)) if sources else {}
                except zmq.ZMQError:
                    ready = {}
                if not sources:
                    self._stop.wait(POLL_TIMEOUT_MS / 1000)
                for sock in ready:
                    source = by_socket.get(sock)
                    if source is not None:
                        self._read(source)
        except Exception:  # the thread must not die silently; the loop keeps routing
            logger.exception("the KV-event subscriber thread failed")
        finally:
            for source in sources.values():
                source.socket.close(linger=0)
            ctx.term()

    def _apply_commands(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        sources: dict[Key, _Source],
        by_socket: dict[zmq.Socket[bytes], _Source],
    ) -> None:
        while True:
            try:
                op, key, endpoint = self._commands.get_nowait()
            except queue.Empty:
                return
            old = sources.pop(key, None)
            if old is not None:
                poller.unregister(old.socket)
                by_socket.pop(old.socket, None)
                old.socket.close(linger=0)
            if op != "add":
                continue
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 1024)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                logger.warning("cannot subscribe to KV events at %s: %s", endpoint, exc)
                sock.close(linger=0)
                continue
            source = sources[key] = _Source(key, endpoint, sock)
            by_socket[sock] = source
            poller.register(sock, zmq.POLLIN)
            logger.info("subscribed to KV events of %s at %s", key[1], endpoint)

    def _read(self, source: _Source) -> None:
        model, url = source.key
        dropped = self._metrics.kv_events_dropped
        for _ in range(READ_BURST):
            try:
                frames = source.socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError:
                dropped.labels(model, url, "garbled").inc()
                return
            ops = self._translate(source, frames)
            for reason, n in ops.dropped.items():
                dropped.labels(model, url, reason).inc(n)
            if ops.empty:
                continue
            if len(self._ready) >= MAX_BACKLOG:
                dropped.labels(model, url, "backlog").inc()
                continue
            self._ready.append((source.key, ops))
            self._schedule_drain()

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
