"""The per-backend state table: what the gateway believes about each backend right now.

Pure (no I/O, no asyncio): the pollers write poll results into it, the request path reads
`BackendView`s from it for the policy and records what it routed. All times are the gateway's
monotonic clock (``now_s`` passed in, or the table's injected `clock`), so a backend's clock
skew never makes state look fresh.

Rules:

* A backend is *eligible* when it has a successful poll no older than ``stale_after_s``, its
  engine showed *progress* no longer than ``stale_after_s`` ago, and it is not ejected and not
  suspect. Unknown or stale state is never treated as idle.
* **Progress** (liveness judged by the engine, not by its HTTP server): a ``/stats`` snapshot
  shows progress when its ``time`` heartbeat changed since the previous snapshot and, if the
  engine has requests waiting or running, its ``step`` changed too. Both are compared with the
  engine's own previous values and the moment is taken on the gateway's clock (the receipt of
  the poll), so clock skew between the hosts cannot make a frozen engine look alive. An engine
  frozen behind a live API server keeps serving its last snapshot: it stops being eligible
  ``stale_after_s`` after its last progress. The first snapshot counts as progress. For stock
  vLLM read through ``/metrics`` (no heartbeat) every good poll counts as progress: liveness
  there means "the API server answers", nothing more.
* ``eject_after_failures`` consecutive failed polls eject it; one good poll re-admits it.
* When no backend of a model is eligible, `degraded_views` names the ones still worth a try
  (recent engine progress, not ejected or suspect; or content relayed from it within
  ``stale_after_s``, whatever its polls say); the proxy routes there by fewest in-flight
  requests rather than refusing (``routing.degraded_max_progress_age_s``).
* **Relayed content is proof of life** (`StateTable.relayed`): a replica whose ``/stats``
  polls time out on a busy host while its streams deliver tokens serves; it is ejected from
  SAL's choice (its state is unknown) but stays a degraded candidate, so a fleet whose
  other replicas are down answers rather than 503s. A frozen API server relays nothing.
* **A backend must serve the model.** One whose ``/v1/models`` answered without the pool's
  model (a wrong address, a replica started with another ``--served-model-name``: every
  request sent there meets vLLM's 404) is neither eligible nor a degraded candidate until an
  answer lists the model again (`StateTable.set_served`, fed by `sal_gateway.model_catalog`).
  Not read yet, or the read failed: it is taken to serve it.
* A connect failure seen by the proxy marks it *suspect* (not eligible) until its next good
  poll, so retries and the next requests avoid it without waiting for N poll failures.
* **Accounting between polls never forgets.** Each routed request's prompt tokens are added
  to the backend's queued prefill tokens and subtracted from its free KV tokens while its
  `Ticket` is *unacknowledged*. A poll acknowledges only tickets sent before the snapshot was
  written, minus ``accounting_grace_s`` (the request's transit to the engine): only those can
  be in the engine's own numbers. Tickets sent later keep counting until a later snapshot
  covers them; a ticket whose request ended first stops counting then. See
  `record_poll_success` for how the snapshot's write time is mapped onto our clock.
* Backends read through stock vLLM ``/metrics`` (no queued-token count there) use the prompt
  tokens of the gateway's own in-flight requests that have not received a first byte yet as
  their queued prefill tokens.
* **A replica cannot claim less queue than the gateway knows it has.** The prompt tokens of
  the gateway's own in-flight *streams* that have not received a first byte yet are still
  waiting or prefilling there, so they floor the queued prefill tokens of a ``/stats``
  backend too: a replica whose ``/stats`` under-reports its queue (a bug, a snapshot of the
  wrong engine) would otherwise look idle to SAL and draw every request while they wait.
  Only streams count: a non-streamed answer's first byte comes when generation ends.
* **Workers of one host share that accounting** (``listen.workers``, `PeerCounts`): each
  publishes its in-flight requests and unacknowledged tokens per backend, and a backend's
  view adds the other workers' to its own, so a worker never decides blind to what the
  others routed since the snapshot, nor to the LoRA slots their adapters' requests took
  since then (`lora_slots`). The other workers' unacknowledged tokens may already be
  in this worker's snapshot for the few milliseconds until their own polls acknowledge them:
  an overestimate, never a request forgotten.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Protocol

from sal_core.lora_slots import can_start
from sal_core.policies import BackendView
from sal_core.stats import ReplicaStats
from sal_gateway.shared_accounting import adapter_key

SOURCES = ("stats", "metrics", "none")
"""Where a backend's state comes from: sal-stats/1 ``/stats``, vLLM ``/metrics``, nothing."""

OFFSET_WINDOW = 64
"""Polls over which the engine's clock offset is estimated (6.4 s at the default 10 Hz)."""

NO_PEERS = (0, 0, 0)


class PeerCounts(Protocol):
    """One backend's accounting shared with the other workers of this host
    (`sal_gateway.shared_accounting.SharedSlot`)."""

    def publish(
        self,
        in_flight: int,
        routed_tokens: int,
        routed_kv_tokens: int,
        adapters: Collection[str] = (),
    ) -> None:
        """Make this process's counts for the backend, and the LoRA `adapters` of its
        requests there that no snapshot includes yet, visible to the other workers."""

    def others(self) -> tuple[int, int, int]:
        """The other workers' (in flight, unacknowledged prefill tokens, KV tokens)."""

    def other_adapters(self) -> frozenset[int]:
        """The other workers' pending LoRA adapters here, as
        `sal_gateway.shared_accounting.adapter_key` hashes (empty where not shared)."""


DEFAULT_BUDGET_SPREAD_MAX = 4.0


def cap_budgets(views: list[BackendView], spread: float) -> list[BackendView]:
    """`views` with every per-step token budget capped at `spread` times the smallest one
    an eligible backend of the pool reports (pure; `spread` 0: unchanged).

    SAL divides a replica's queue by its budget, so a replica whose ``/stats`` claims a huge
    ``max_num_batched_tokens`` (a bug, a hostile replica) would look idle however long its
    queue, and take nearly every request. Replicas of one pool normally run one
    configuration; a fleet that mixes GPUs keeps its real differences up to `spread`."""
    if spread <= 0 or len(views) < 2:
        return views
    floor = min((v.max_num_batched_tokens for v in views if v.eligible), default=0)
    if floor < 1:
        return views
    cap = max(1, int(floor * spread))
    if all(v.max_num_batched_tokens <= cap for v in views):
        return views
    return [
        replace(v, max_num_batched_tokens=cap) if v.max_num_batched_tokens > cap else v
        for v in views
    ]


def shows_progress(previous: ReplicaStats | None, current: ReplicaStats) -> bool:
    """Whether `current` proves the engine advanced since `previous` (both from ``/stats``).

    The heartbeat ``time`` must have changed (an idle LARRY engine restamps it every 0.2 s,
    the emulator stamps it when serving); while requests wait or run, ``step`` must have
    changed as well. A changed value in either direction counts (an engine restarted on the
    same address starts a new series)."""
    if previous is None:
        return True
    if current.time == previous.time:
        return False
    busy = current.num_waiting + current.num_running > 0
    return not busy or current.step != previous.step


@dataclass(slots=True)
class BackendState:
    """Mutable state of one backend (owned by `StateTable`)."""

    url: str
    fallback_max_num_batched_tokens: int = 2048
    stats: ReplicaStats | None = None
    source: str = "none"
    last_ok_s: float | None = None
    """Gateway time of the last successful poll (its receipt)."""
    last_outcome_s: float | None = None
    """Gateway time of the last poll outcome recorded, good or failed (its receipt)."""
    progress_s: float | None = None
    """Gateway time at which the engine last showed progress (`shows_progress`)."""
    consecutive_failures: int = 0
    ejected: bool = False
    suspect: bool = False
    in_flight: int = 0
    routed_tokens_since_poll: int = 0
    """Prefill tokens of routed requests that no snapshot is known to include yet (with a
    prefix cache source: each request's tokens the replica was not predicted to hold)."""
    routed_kv_tokens_since_poll: int = 0
    """The new KV tokens those requests take (their prompts less the predicted cached tokens
    a running request holds: `sal_core.policies.BackendView.cached_held_tokens`)."""
    prefill_pending_tokens: int = 0
    """Prompt tokens of in-flight requests still waiting for their first byte."""
    stream_pending_tokens: int = 0
    """Of those, the streamed requests' (a floor under the queue a ``/stats`` reports)."""
    removed: bool = False
    serves_other: tuple[str, ...] | None = None
    """What the backend's ``/v1/models`` listed when it did not list the pool's model; None
    while it serves the model (or has not answered)."""
    relayed_s: float | None = None
    """Gateway time at which content from this backend last reached the gateway (a response
    body chunk of a request routed to it): its API server and engine answer."""
    unacked: deque[Ticket] = field(default_factory=deque)
    """Tickets whose tokens may still be missing from the engine's numbers, in send order
    (acknowledged or released ones are dropped lazily from the left)."""
    offsets_s: deque[float] = field(default_factory=lambda: deque(maxlen=OFFSET_WINDOW))
    """Recent ``engine time - our wall time at receipt`` (for `_written_at`)."""
    peers: PeerCounts | None = None
    """The other workers' accounting of this backend (``listen.workers``); None: alone."""

    def publish(self) -> None:
        """Share this process's counts with the other workers (a removed backend's late
        releases stay quiet: a re-added one under the same address owns the entry)."""
        if self.peers is not None and not self.removed:
            self.peers.publish(
                self.in_flight,
                self.routed_tokens_since_poll,
                self.routed_kv_tokens_since_poll,
                self.pending_adapters(),
            )

    def pending_adapters(self) -> set[str]:
        """LoRA adapters of requests routed here that no snapshot includes yet."""
        return {t.adapter for t in self.unacked if t.adapter is not None and not t.acked}

    def peer_counts(self) -> tuple[int, int, int]:
        """The other workers' (in flight, unacknowledged tokens, KV tokens) here."""
        return NO_PEERS if self.peers is None else self.peers.others()

    def age_s(self, now_s: float) -> float | None:
        return None if self.last_ok_s is None else max(0.0, now_s - self.last_ok_s)

    def progress_age_s(self, now_s: float) -> float | None:
        return None if self.progress_s is None else max(0.0, now_s - self.progress_s)

    def relayed_age_s(self, now_s: float) -> float | None:
        return None if self.relayed_s is None else max(0.0, now_s - self.relayed_s)

    def is_eligible(self, now_s: float, stale_after_s: float) -> bool:
        age = self.age_s(now_s)
        progress_age = self.progress_age_s(now_s)
        return (
            age is not None
            and age <= stale_after_s
            and progress_age is not None
            and progress_age <= stale_after_s
            and not self.ejected
            and not self.suspect
            and not self.removed
            and self.serves_other is None
        )

    def free_kv_tokens(self, peer_kv_tokens: int | None = None) -> int:
        """Free KV tokens now: the snapshot's, less what this process and (by default,
        `peer_counts`) the other workers routed since."""
        if self.stats is None:
            return 0
        if peer_kv_tokens is None:
            peer_kv_tokens = self.peer_counts()[2]
        routed = self.routed_kv_tokens_since_poll + peer_kv_tokens
        return max(0, self.stats.free_kv_tokens - routed)

    def queued_prefill_tokens(self, peer_tokens: int | None = None) -> int:
        """Queued prefill tokens now: the snapshot's plus what this process and (by
        default, `peer_counts`) the other workers routed since, floored by this process's
        streams waiting for a first byte."""
        if self.stats is None:
            return 0
        if self.source == "metrics":
            return self.prefill_pending_tokens
        if peer_tokens is None:
            peer_tokens = self.peer_counts()[1]
        reported = self.stats.queued_prefill_tokens + self.routed_tokens_since_poll + peer_tokens
        return max(reported, self.stream_pending_tokens)

    def max_num_batched_tokens(self) -> int:
        if self.stats is None or self.stats.max_num_batched_tokens <= 0:
            return self.fallback_max_num_batched_tokens
        return self.stats.max_num_batched_tokens

    def view(self, eligible: bool) -> BackendView:
        """What a policy sees of this backend (the prefix-cache fields stay 0 here: the
        request path fills them per request when a cache source is configured)."""
        stats = self.stats
        peer_in_flight, peer_tokens, peer_kv_tokens = self.peer_counts()
        return BackendView(
            url=self.url,
            eligible=eligible,
            in_flight=self.in_flight + peer_in_flight,
            free_kv_tokens=self.free_kv_tokens(peer_kv_tokens),
            queued_prefill_tokens=self.queued_prefill_tokens(peer_tokens),
            max_num_batched_tokens=self.max_num_batched_tokens(),
            num_waiting=0 if stats is None else stats.num_waiting,
            kv_tokens_total=0 if stats is None else stats.kv_blocks_total * stats.block_size,
            num_running=0 if stats is None else stats.num_running,
        )

    def lora_occupied(self) -> frozenset[str] | None:
        """The adapters holding this backend's LoRA slots now: those its engine ran at the
        last poll, plus those of requests routed here that no snapshot includes yet (routed
        to a free slot, they take it). None when its slots are unknown (LoRA off, a stock
        replica without the metric, an older ``/stats``)."""
        stats = self.stats
        if stats is None or stats.max_loras <= 0:
            return None
        return frozenset(stats.lora_running).union(self.pending_adapters())

    def acknowledge_before(self, cutoff_s: float) -> None:
        """Stop counting every ticket sent before `cutoff_s` (a snapshot includes them)."""
        unacked = self.unacked
        changed = False
        while unacked and unacked[0].sent_s < cutoff_s:
            ticket = unacked.popleft()
            if not ticket.acked:
                ticket.acked = True
                changed = True
                self.routed_tokens_since_poll -= ticket.prompt_tokens
                self.routed_kv_tokens_since_poll -= ticket.kv_tokens
        if changed:
            self.publish()

    def _written_at(self, engine_time_s: float, now_s: float, wall_s: float) -> float:
        """Our monotonic time at which the engine wrote a snapshot stamped `engine_time_s`,
        received at `now_s` (monotonic) = `wall_s` (our wall clock).

        ``engine_time_s - wall_s`` is the engine's clock skew minus the snapshot's age at
        receipt; its maximum over recent polls estimates the skew (minus the smallest age
        seen), so ``max - current`` estimates this snapshot's age without trusting either
        wall clock's absolute value. The estimate errs late by at most that smallest age
        (a few ms when the engine publishes often), which ``accounting_grace_s`` covers."""
        offset = engine_time_s - wall_s
        self.offsets_s.append(offset)
        return now_s - (max(self.offsets_s) - offset)


@dataclass(slots=True)
class Ticket:
    """One routed request's hold on a backend's accounting; `StateTable.release` frees it."""

    backend: BackendState
    prompt_tokens: int
    """Prefill tokens it adds to the backend's queue (the prompt, less what the backend was
    predicted to have cached)."""
    sent_s: float = 0.0
    """Gateway time at which the request was routed."""
    kv_tokens: int = -1
    """New KV tokens it takes there (negative when built: the same as `prompt_tokens`)."""
    streamed: bool = False
    """A stream: its first byte comes with its first token (`stream_pending_tokens`)."""
    first_byte_seen: bool = False
    released: bool = False
    acked: bool = False
    """The engine's numbers include this request (or it ended): its tokens no longer count."""
    on_release: Callable[[], None] | None = None
    """Called once when the request ends (the prefix index's hold on its blocks)."""
    adapter: str | None = None
    """The LoRA adapter the request named (None: the base model): until the engine's numbers
    include the request, it holds one of the backend's LoRA slots (`BackendState.lora_occupied`)."""

    def __post_init__(self) -> None:
        if self.kv_tokens < 0:
            self.kv_tokens = self.prompt_tokens


@dataclass(slots=True)
class StateTable:
    """Backends per model, in configuration/discovery order (the policies' tie-break order)."""

    stale_after_s: float
    eject_after_failures: int
    accounting_grace_s: float = 0.05
    """Transit allowance: a snapshot written at t covers requests sent before t - grace."""
    clock: Callable[[], float] = time.monotonic
    """Stamps tickets routed without an explicit time (the gateway's monotonic clock)."""
    peers: Callable[[str, str], PeerCounts | None] | None = None
    """The shared accounting entry of a (model, url) backend (``listen.workers``); None,
    or a None entry: that backend is accounted by this process alone."""
    budget_spread_max: float = DEFAULT_BUDGET_SPREAD_MAX
    """`cap_budgets`' spread (``routing.budget_spread_max``; 0: no cap)."""
    _pools: dict[str, dict[str, BackendState]] = field(default_factory=dict)

    # --- membership ---------------------------------------------------------------------

    def add_model(self, model: str) -> None:
        self._pools.setdefault(model, {})

    def add_backend(
        self, model: str, url: str, fallback_max_num_batched_tokens: int = 2048
    ) -> bool:
        """Add `url` to `model`'s pool; False when it was already there."""
        pool = self._pools.setdefault(model, {})
        if url in pool:
            return False
        backend = pool[url] = BackendState(url, fallback_max_num_batched_tokens)
        if self.peers is not None:
            backend.peers = self.peers(model, url)
            backend.publish()  # zeros: a re-added address starts a new count
        return True

    def remove_backend(self, model: str, url: str) -> BackendState | None:
        """Remove `url`; its in-flight requests keep their tickets and finish normally."""
        backend = self._pools.get(model, {}).pop(url, None)
        if backend is not None:
            backend.removed = True
        return backend

    def models(self) -> list[str]:
        return list(self._pools)

    def backends(self, model: str) -> list[BackendState]:
        return list(self._pools.get(model, {}).values())

    def get(self, model: str, url: str) -> BackendState | None:
        return self._pools.get(model, {}).get(url)

    # --- poll results -------------------------------------------------------------------

    def record_poll_success(
        self,
        model: str,
        url: str,
        stats: ReplicaStats,
        source: str,
        now_s: float,
        *,
        wall_s: float | None = None,
        sent_s: float | None = None,
    ) -> bool:
        """A good poll received at `now_s`: replace the numbers, judge progress, acknowledge
        the tickets the snapshot covers, re-admit.

        When was the snapshot written, on our clock? ``/stats`` with `wall_s` (our wall clock
        at receipt): from its ``time`` via `BackendState._written_at` (skew-proof). Otherwise
        (``/metrics``, read live while the poll was answered): `sent_s`, when the poll was
        sent, or else `now_s`. Never later than `now_s`, so a ticket routed after the
        receipt is never acknowledged by it. Returns True when this re-admitted an ejected or
        suspect backend."""
        backend = self.get(model, url)
        if backend is None:
            return False
        readmitted = backend.ejected or backend.suspect
        previous = backend.stats if backend.source == "stats" else None
        if source != "stats" or shows_progress(previous, stats):
            backend.progress_s = now_s
        if source == "stats" and wall_s is not None:
            if previous is not None and stats.step < previous.step:
                backend.offsets_s.clear()  # a restarted engine: maybe another host's clock
            written_s = backend._written_at(stats.time, now_s, wall_s)
        else:
            written_s = now_s if sent_s is None else sent_s
        backend.acknowledge_before(min(written_s, now_s) - self.accounting_grace_s)
        backend.stats = stats
        backend.source = source
        backend.last_ok_s = now_s
        backend.last_outcome_s = now_s
        backend.consecutive_failures = 0
        backend.ejected = False
        backend.suspect = False
        return readmitted

    def record_poll_failure(self, model: str, url: str, now_s: float | None = None) -> bool:
        """A failed poll (received at `now_s`); returns True when this failure ejected the
        backend."""
        backend = self.get(model, url)
        if backend is None:
            return False
        if now_s is not None:
            backend.last_outcome_s = now_s
        backend.consecutive_failures += 1
        if not backend.ejected and backend.consecutive_failures >= self.eject_after_failures:
            backend.ejected = True
            return True
        return False

    def set_served(self, model: str, url: str, served: tuple[str, ...]) -> bool:
        """`url` answered ``/v1/models`` with the model names `served`: it is routable for
        `model` only if they include it. Returns True when that changed."""
        backend = self.get(model, url)
        if backend is None:
            return False
        other = None if model in served else served
        changed = (other is None) != (backend.serves_other is None)
        backend.serves_other = other
        return changed

    def serving_elsewhere(self, model: str) -> list[BackendState]:
        """`model`'s backends whose ``/v1/models`` lists other models only."""
        return [b for b in self._pools.get(model, {}).values() if b.serves_other is not None]

    def mark_suspect(self, model: str, url: str) -> None:
        """The proxy could not connect: avoid the backend until its next good poll."""
        backend = self.get(model, url)
        if backend is not None:
            backend.suspect = True

    def last_outcome_s(self, model: str) -> float | None:
        """When the newest poll outcome (good or failed) of any of `model`'s backends was
        received; None before the first. Far behind the clock, it says the pollers have not
        been running (the gateway's own process was not scheduled), not that the backends
        are down: those polls fail, and their failures are outcomes too."""
        times = [b.last_outcome_s for b in self._pools.get(model, {}).values()]
        return max((t for t in times if t is not None), default=None)

    # --- the request path ---------------------------------------------------------------

    def views(self, model: str, now_s: float) -> list[BackendView]:
        """What the policy sees for `model`'s pool now (same order as `backends()`)."""
        stale_after_s = self.stale_after_s
        views = [
            b.view(b.is_eligible(now_s, stale_after_s)) for b in self._pools.get(model, {}).values()
        ]
        return cap_budgets(views, self.budget_spread_max)

    def lora_slots(self, model: str, adapter: str) -> tuple[set[str], set[str]]:
        """For a request for `adapter`, one pass over `model`'s backends whose LoRA slots are
        known: (URLs where it would wait for a slot, every slot held by other adapters
        (`sal_core.lora_slots.can_start`); URLs whose slots hold `adapter` now, its
        requests running there or routed there since the last poll)."""
        blocked: set[str] = set()
        holders: set[str] = set()
        key: int | None = None
        for backend in self._pools.get(model, {}).values():
            occupied = backend.lora_occupied()
            if occupied is None or backend.stats is None:
                continue
            others = frozenset[int]() if backend.peers is None else backend.peers.other_adapters()
            if others:  # compare as the shared block does: by `adapter_key`
                key = adapter_key(adapter) if key is None else key
                keys = others.union(adapter_key(name) for name in occupied)
                holds, free = key in keys, can_start(key, backend.stats.max_loras, keys)
            else:
                holds, free = (
                    adapter in occupied,
                    can_start(adapter, backend.stats.max_loras, occupied),
                )
            if holds:
                holders.add(backend.url)
            elif not free:
                blocked.add(backend.url)
        return blocked, holders

    def lora_blocked(self, model: str, adapter: str) -> set[str]:
        """The first half of `lora_slots`."""
        return self.lora_slots(model, adapter)[0]

    def lora_holders(self, model: str, adapter: str) -> set[str]:
        """The second half of `lora_slots`."""
        return self.lora_slots(model, adapter)[1]

    def degraded_views(self, model: str, now_s: float, max_age_s: float) -> list[BackendView]:
        """Views for *degraded routing*, used only when no backend of `model` is eligible
        (Envoy's "panic" mode, made liveness-aware): a backend is a candidate when it is not
        ejected, suspect or removed and its engine showed progress at most `max_age_s` ago
        and at most ``stale_after_s`` later than the freshest candidate's. A transient
        starvation that makes every backend look a little stale at once (a busy host: the
        polls come late) then still routes, while an engine frozen for longer than its peers
        stays out: its progress age only grows. A backend whose content reached the gateway
        at most ``stale_after_s`` ago is a candidate too (its age: that of the content),
        ejected or suspect or not: it is serving now, however its polls fare. Nothing has
        progressed within `max_age_s` and nothing was relayed: no candidate (the fleet is
        down; the caller answers 503)."""
        pool = self._pools.get(model, {}).values()
        ages: dict[str, float] = {}
        for b in pool:
            if b.removed or b.serves_other is not None:
                continue
            age = b.progress_age_s(now_s)
            if b.ejected or b.suspect or (age is not None and age > max_age_s):
                age = None
            relayed = b.relayed_age_s(now_s)
            if relayed is not None and relayed <= self.stale_after_s:
                age = relayed if age is None else min(age, relayed)
            if age is not None:
                ages[b.url] = age
        freshest = min(ages.values(), default=0.0)
        views = [
            b.view(b.url in ages and ages[b.url] <= freshest + self.stale_after_s) for b in pool
        ]
        return cap_budgets(views, self.budget_spread_max)

    def is_live(self, model: str, url: str, now_s: float) -> bool:
        """Whether `url`'s engine is demonstrably alive now: a fresh good poll and recent
        progress (`BackendState.is_eligible` without the suspect mark, which a connect
        failure of another request sets). Read by the relay of a silent stream, once per
        check, to tell a request queued on a working engine from one on a frozen replica."""
        backend = self.get(model, url)
        if backend is None:
            return False
        age = backend.age_s(now_s)
        progress_age = backend.progress_age_s(now_s)
        return (
            age is not None
            and age <= self.stale_after_s
            and progress_age is not None
            and progress_age <= self.stale_after_s
            and not backend.ejected
        )

    def is_ready(self, now_s: float) -> bool:
        """Every model has at least one eligible backend."""
        return all(
            any(b.is_eligible(now_s, self.stale_after_s) for b in pool.values())
            for pool in self._pools.values()
        )

    def route(
        self,
        model: str,
        url: str,
        prompt_tokens: int,
        sent_s: float | None = None,
        kv_tokens: int | None = None,
        *,
        streamed: bool = False,
        adapter: str | None = None,
    ) -> Ticket:
        """Account a request just routed to `url` at `sent_s` (default: `clock()`): its
        `prompt_tokens` of prefill and `kv_tokens` of new KV (default: the same), and, for a
        `streamed` one, a floor under the backend's queue until its first byte (and, for an
        `adapter`'s, a LoRA slot until the engine's numbers include it); raises
        KeyError for an unknown backend. Send times are kept non-decreasing per backend
        (an earlier one is moved up to the last: later acknowledgement, never earlier)."""
        backend = self._pools[model][url]
        unacked = backend.unacked
        while unacked and unacked[0].acked:
            unacked.popleft()
        if sent_s is None:
            sent_s = self.clock()
        if unacked and sent_s < unacked[-1].sent_s:
            sent_s = unacked[-1].sent_s
        kv = prompt_tokens if kv_tokens is None else kv_tokens
        backend.in_flight += 1
        backend.routed_tokens_since_poll += prompt_tokens
        backend.routed_kv_tokens_since_poll += kv
        backend.prefill_pending_tokens += prompt_tokens
        if streamed:
            backend.stream_pending_tokens += prompt_tokens
        ticket = Ticket(backend, prompt_tokens, sent_s, kv, streamed, adapter=adapter)
        unacked.append(ticket)
        backend.publish()
        return ticket

    @staticmethod
    def first_byte(ticket: Ticket) -> None:
        """The backend started answering: its prompt is no longer pending prefill for us."""
        if not ticket.first_byte_seen and not ticket.released:
            ticket.first_byte_seen = True
            ticket.backend.prefill_pending_tokens -= ticket.prompt_tokens
            if ticket.streamed:
                ticket.backend.stream_pending_tokens -= ticket.prompt_tokens

    @staticmethod
    def relayed(ticket: Ticket, now_s: float) -> None:
        """Content of `ticket`'s request reached the gateway at `now_s` (gateway clock): its
        backend is alive, whatever its polls say (`degraded_views`)."""
        ticket.backend.relayed_s = now_s

    @staticmethod
    def release(ticket: Ticket) -> None:
        """The request is over (any outcome): it stops counting anywhere. Idempotent."""
        if ticket.released:
            return
        StateTable.first_byte(ticket)
        ticket.released = True
        if ticket.on_release is not None:
            ticket.on_release()
            ticket.on_release = None
        backend = ticket.backend
        backend.in_flight -= 1
        if not ticket.acked:
            ticket.acked = True
            backend.routed_tokens_since_poll -= ticket.prompt_tokens
            backend.routed_kv_tokens_since_poll -= ticket.kv_tokens
        backend.publish()
