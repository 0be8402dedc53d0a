"""The fleet simulator: N engine replicas on a virtual clock, routed by the gateway's policies.

One `Simulation` replays a trace (`engine_sim.trace`) through replicas that follow the
`ReplicaEngine` protocol (`engine_sim.engine.EngineModel` in production; tests may pass a
fake). Routing uses the gateway's own objects, imported, not re-written:
`sal_core.policies.make_policy()`, `BackendView`, `RouteRequest`, and
`sal_core.beta.BetaEstimator` fed with every finished request.

The router sees state the way the gateway does:

* a `/stats` snapshot of every replica (`ReplicaEngine.stats(now)`), taken every
  `poll_interval_s` and delivered `stats_delay_s` later (the staleness knob);
* between polls, local accounting: each routed request's prompt tokens are added to that
  replica's queued prefill tokens and subtracted from its free KV tokens ("assumes nothing
  finished") until a snapshot that includes the request reaches the router: one written
  at least `accounting_grace_s` after the request was routed, exactly as the gateway's state
  table does (`sal_gateway.state`); a request that finished first stops counting then.
  ``accounting="reset"`` restores the gateway's earlier rule (every snapshot that reaches
  the router resets the accounting, forgetting requests routed after it was taken), for
  before/after comparisons;
* in-flight counts from its own bookkeeping (+1 when routed, -1 when the last token is out).

Several gateways (`RouterConfig.gateways` = K > 1), as when users run several gateway
replicas or workers: each gateway gets its share of the arrivals (round-robin or seeded
random split), and keeps everything above for itself: its own snapshots of every replica
(polls offset by ``poll_interval_s / K`` from one gateway to the next), its own between-poll
accounting and in-flight counts (only of the requests it routed), its own beta estimate (fed
by its own finished requests) and its own policy object. Nothing is shared but the replicas,
unless `RouterConfig.shared_accounting` (the workers of one host, ``listen.workers``): then
each decides on its own snapshots plus the sum of every gateway's in-flight counts and
between-poll accounting; or `RouterConfig.gossip_interval_s` (gateways on separate hosts
telling each other, ``peers``): the same sum with the others' counts as they were
`RouterConfig.gossip_delay_s` earlier. Every decision is logged (`SimResult.decisions`) so
herding can be measured.

Event loop: a heap of next-event times. A busy replica has exactly one pending event, the
end of its current iteration (`step(now)` returns the iteration's duration; its tokens are
delivered then); an idle replica has none and is woken by the next request routed to it.
Polls are taken only for poll periods in which some request is routed (the snapshot is never
read otherwise), which keeps hour-long runs cheap without changing any decision.
Deterministic for a seed: no wall clock, no unordered iteration, seeded policies.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from engine_sim.cost_model import get_profile
from engine_sim.engine import EngineConfig, EngineModel, SimRequest
from engine_sim.results import RequestOutcome, Summary, summarize
from engine_sim.router_cache import CACHE_SOURCES, CacheView, RouterCache
from engine_sim.trace import TraceRequest
from sal_core.beta import BetaEstimator
from sal_core.lora_slots import can_start, lora_route
from sal_core.policies import (
    DEFAULT_MIN_MATCH_TOKENS,
    BackendView,
    Policy,
    PolicySettings,
    RouteRequest,
    make_policy,
)
from sal_core.stats import ReplicaStats

PEER_KEYS_PER_DATAGRAM = 170
"""Block keys one ``peers`` datagram carries (`sal_gateway.peer_wire.BLOCK_KEYS_PER_DATAGRAM`;
a test keeps the two equal)."""
PEER_MAX_DATAGRAMS = 8
"""Datagrams one request's prompt is told in (`sal_gateway.peers.MAX_BLOCK_DATAGRAMS`)."""
PEER_HEARTBEAT_S = 0.1
"""``peers.heartbeat_s``'s default: each end is sent again on the next heartbeat."""


class SimulationError(RuntimeError):
    """The simulation cannot go on (an engine that makes no progress, a bad config)."""


class FinishedRequest(Protocol):
    """What the simulator reads from a finished engine request."""

    @property
    def request_id(self) -> str: ...


class StepOutcome(Protocol):
    """What the simulator reads from one engine iteration (`engine_sim.engine.StepResult`)."""

    @property
    def duration_s(self) -> float: ...
    @property
    def new_tokens(self) -> Sequence[tuple[str, int]]: ...
    @property
    def finished(self) -> Sequence[FinishedRequest]: ...
    @property
    def preempted(self) -> Sequence[str]: ...


class ReplicaEngine(Protocol):
    """The part of `engine_sim.engine.EngineModel` the simulator drives."""

    def has_work(self) -> bool: ...
    def step(self, now_s: float) -> StepOutcome: ...
    def stats(self, now_s: float) -> ReplicaStats: ...


RequestSubmitter = Callable[[ReplicaEngine, str, float, TraceRequest], None]
"""Hands one request to an engine: ``(engine, request_id, arrival_s, request)``."""

ProgressCallback = Callable[[int, int], None]
"""Called with ``(finished, total)`` about every 1% of requests and once at the end."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the simulated gateway routes and how fresh its view of the replicas is."""

    policy: str = "sal"
    """A name in `sal_core.policies.POLICIES`."""
    poll_interval_s: float = 0.1
    """Period of the `/stats` polls (the gateway's ``routing.poll_interval_s``)."""
    stats_delay_s: float = 0.0
    """Age of a snapshot when the router starts using it (poll latency; staleness knob)."""
    beta_seed: float = 2.0
    """SAL's configured beta before any request finished (``routing.beta_seed``)."""
    seed: int = 0
    """Seed of the random / p2c policies."""
    accounting: str = "ticket"
    """``"ticket"`` (the gateway's rule) or ``"reset"`` (its earlier, forgetful rule)."""
    accounting_grace_s: float = 0.05
    """The gateway's ``routing.accounting_grace_s`` (``"ticket"`` accounting only)."""
    gateways: int = 1
    """Independent gateways in front of the same replicas (see the module docstring)."""
    gateway_split: str = "round_robin"
    """How arrivals are split among the gateways: ``"round_robin"`` by arrival order or
    ``"random"`` (seeded by `seed`), as a Kubernetes Service or a shared port does with many
    clients' connections; ``"session"``: each conversation's requests all reach the gateway
    its first one reached (a client whose keep-alive connection carries the conversation)."""
    share_prefix_index: bool = False
    """Several gateways (`gateways` > 1) tell each other, at once, the blocks of every prompt
    they route and when its request ends (``listen.share_prefix_index``: the workers of one
    host), so each one's ``approximate`` index holds, and holds for as long, what every
    gateway routed."""
    peer_prefix_blocks: bool = False
    """Several gateways (`gateways` > 1) on separate hosts tell each other the blocks of
    every prompt they route and when its request ends (``peers.share_prefix_blocks``),
    which reach the others `gossip_delay_s` later; each indexes them as cached there, most
    recent, held until the end arrives. False: each indexes only what it routed."""
    peer_prefix_holds: bool = True
    """With `peer_prefix_blocks`: the told blocks are held until the request's end arrives
    (the gateway's rule). False: indexed unheld and nobody tells the end (a what-if: the
    first version of ``peers.share_prefix_blocks``)."""
    peer_datagram_loss: float = 0.0
    """With `peer_prefix_blocks`: the chance that each datagram to each other gateway is
    lost (UDP). A prompt goes out as runs of `PEER_KEYS_PER_DATAGRAM` keys, at most
    `PEER_MAX_DATAGRAMS` of them: a gateway learns the runs before the first it lost (a
    prefix match cannot reach past a missing run) and holds those. A lost end is made good
    by the sender's watermark (its oldest request not ended, on every datagram and
    heartbeat): released once every earlier request of the sender has ended, `gossip_delay_s`
    later (the heartbeat's up to 0.1 s is not added). Loss of the watermark itself is not
    modelled (the next datagram or heartbeat carries it again)."""
    cache_source: str = "none"
    """What the router knows of each replica's prefix cache (`engine_sim.router_cache`):
    ``"none"``, ``"approximate"`` (its own index of routed blocks; each gateway its own) or
    ``"oracle"`` (the engines' true contents, as vLLM's KV events would tell)."""
    min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS
    """`sal_core.policies.PolicySettings.min_match_tokens` (``routing.prefix_min_match_tokens``)."""
    shared_accounting: bool = False
    """Several gateways (`gateways` > 1) are the workers of one host sharing their
    between-poll accounting (``listen.share_accounting``, `sal_gateway.shared_accounting`):
    each decides on its own snapshot plus every gateway's in-flight requests and
    unacknowledged tokens (and, with `shared_adapters`, the adapters they routed that no
    snapshot includes yet). False: each counts only what it routed itself."""
    shared_adapters: bool = True
    """With `shared_accounting` or `gossip_interval_s`, and `lora_slots`: a replica's LoRA
    slots count the adapters every gateway routed there since its snapshot (the gateway's
    workers share them in the same block, ``peers`` in the same datagram). False: each
    counts only its own (the gateway before it shared them)."""
    gossip_interval_s: float | None = None
    """Several gateways on separate hosts telling each other their between-poll accounting
    over the network. Every `gossip_interval_s` each gateway sends its in-flight counts and
    unacknowledged tokens, which reach the others `gossip_delay_s` later; each decides on
    its own fresh counts plus the others' latest. 0: at every change, what ``peers`` does
    (`sal_gateway.peers`); a positive interval is a what-if the gateway does not offer.
    None: off."""
    gossip_delay_s: float = 0.001
    """One-way network delay of a gossip message (see `gossip_interval_s`)."""
    lora_slots: bool = True
    """Before the policy scores an adapter's request, narrow the candidates as the gateway
    does for every policy (`sal_core.lora_slots.lora_route`): to the replicas that can
    start it now, when one can, and among them to those already running its adapter
    unless their queues are more than a step longer. A replica's slots are the last
    snapshot's ``lora_running`` plus the adapters this gateway routed there since. False:
    the policy alone (what a LoRA-blind router does)."""
    lora_affinity: bool = True
    """With `lora_slots`: prefer the replicas already running the adapter (the gateway's
    rule). False: only the free-slot filter (a what-if: the gateway always prefers them)."""
    lora_when_full: bool = True
    """With `lora_slots`: when every replica's slots are held, the replicas with the fewest
    requests in flight (`sal_core.lora_slots.fewest_in_flight`, the gateway's rule). False:
    the policy chooses among all of them (the rule before it)."""

    def __post_init__(self) -> None:
        if self.gateways < 1:
            raise SimulationError(f"gateways must be >= 1, got {self.gateways}")
        if self.gateway_split not in GATEWAY_SPLITS:
            raise SimulationError(
                f"gateway_split must be one of {', '.join(GATEWAY_SPLITS)}, "
                f"got {self.gateway_split!r}"
            )
        if self.cache_source not in CACHE_SOURCES:
            raise SimulationError(
                f"cache_source must be one of {', '.join(CACHE_SOURCES)}, got {self.cache_source!r}"
            )
        if self.accounting not in ACCOUNTING:
            raise SimulationError(
                f"accounting must be one of {', '.join(ACCOUNTING)}, got {self.accounting!r}"
            )
        if self.accounting_grace_s < 0:
            raise SimulationError(f"accounting_grace_s must be >= 0, got {self.accounting_grace_s}")
        if not self.poll_interval_s > 0:
            raise SimulationError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        if self.stats_delay_s < 0:
            raise SimulationError(f"stats_delay_s must be >= 0, got {self.stats_delay_s}")
        if (self.gossip_interval_s or 0.0) < 0 or self.gossip_delay_s < 0:
            raise SimulationError(
                f"gossip_interval_s and gossip_delay_s must be >= 0, got "
                f"{self.gossip_interval_s} and {self.gossip_delay_s}"
            )
        if self.gossip_interval_s is not None and self.shared_accounting:
            raise SimulationError("gossip_interval_s and shared_accounting exclude each other")
        if not 0.0 <= self.peer_datagram_loss < 1.0:
            raise SimulationError(
                f"peer_datagram_loss must be in [0, 1), got {self.peer_datagram_loss}"
            )


@dataclass(slots=True)
class SimResult:
    """Everything a run measured."""

    outcomes: list[RequestOutcome]
    unfinished: int
    summary: Summary
    routed_per_replica: list[int]
    steps: int
    """Engine iterations simulated, all replicas together."""
    end_s: float
    """Virtual time at which the run ended."""
    final_beta: float
    """SAL's beta estimate after the last finished request (gateway 0's)."""
    decisions: list[RoutingRecord] = field(default_factory=list)
    """Every routing decision, in arrival order."""
    aborted: bool = False
    """Stopped early because the `LateAbort` bound was crossed (the rest is unfinished)."""
    peer_resent_ends: int = 0
    """`RouterConfig.peer_datagram_loss`: request ends whose datagram to another gateway was
    lost and whose copy on the next heartbeat arrived."""
    peer_lost_ends: int = 0
    """Request ends lost on the way twice (both copies): left to the sender's watermark."""
    peer_lost_ends_released: int = 0
    """Of those, the ones the sender's watermark released before the run ended."""
    peer_watermark_wait_s: float | None = None
    """Mean time the blocks of a lost end stayed held past their request's end, until the
    sender's watermark passed it (None: none was released)."""


@dataclass(frozen=True, slots=True)
class LateAbort:
    """Stop a run as soon as more than `max_late` requests are certain to have a TTFT above
    `ttft_s` (their first token came later, or they have waited longer without one).

    For searches that only need to know whether a load meets a TTFT objective (`sal-bench
    capacity`): past saturation the queues, and the cost of simulating each step, grow
    without bound, and the verdict is known long before the last request finishes.
    """

    ttft_s: float
    max_late: int


class RoutingRecord(NamedTuple):
    """One routing decision: who routed which request where, on how old a picture."""

    time_s: float
    """When the request arrived (and was routed)."""
    gateway: int
    replica: int
    snapshot_s: float
    """When the snapshot the gateway decided on was taken (its newest by then)."""


ACCOUNTING = ("ticket", "reset")
"""Between-poll accounting rules (`RouterConfig.accounting`)."""
GATEWAY_SPLITS = ("round_robin", "random", "session")
"""How arrivals are split among several gateways (`RouterConfig.gateway_split`)."""


_Told = tuple[int, int, int, set[str]]
"""What one gateway tells the others of one replica (gossip): in flight, unacknowledged
prefill and KV tokens, and the adapters of its requests there that no snapshot includes."""


@dataclass(slots=True)
class _Ticket:
    sent_s: float
    queued_tokens: int
    """Prefill tokens it adds to the replica's queue (its uncached prompt tokens)."""
    kv_tokens: int
    """Free KV tokens it takes (prompt tokens not in blocks a running request holds)."""
    counted: bool = True
    adapter: str | None = None


@dataclass(slots=True)
class _RouterView:
    """The router's picture of one replica: last snapshot + what it routed there since."""

    snapshot: ReplicaStats
    routed_tokens: int = 0
    """Prefill tokens of routed requests the snapshot does not include (as far as we know)."""
    routed_kv_tokens: int = 0
    """KV tokens those requests take (equal to `routed_tokens` without a prefix cache)."""
    in_flight: int = 0
    unacked: deque[_Ticket] = field(default_factory=deque)

    def apply(self, snapshot: ReplicaStats, config: RouterConfig) -> None:
        """A snapshot reached the router (`sal_gateway.state.StateTable.record_poll_success`;
        the simulator has one clock, so the snapshot's ``time`` needs no skew mapping)."""
        self.snapshot = snapshot
        if config.accounting == "reset":
            # The earlier rule: even requests routed while that poll was in flight drop off
            # the books (with `stats_delay_s` > 0, before the engine could count them).
            self.routed_tokens = 0
            self.routed_kv_tokens = 0
            self.unacked.clear()
            return
        cutoff_s = snapshot.time - config.accounting_grace_s
        while self.unacked and self.unacked[0].sent_s < cutoff_s:
            self._uncount(self.unacked.popleft())

    def route(
        self, queued_tokens: int, kv_tokens: int, now_s: float, adapter: str | None = None
    ) -> _Ticket:
        ticket = _Ticket(now_s, queued_tokens, kv_tokens, adapter=adapter)
        self.routed_tokens += queued_tokens
        self.routed_kv_tokens += kv_tokens
        self.in_flight += 1
        self.unacked.append(ticket)
        return ticket

    def finish(self, ticket: _Ticket, config: RouterConfig) -> None:
        self.in_flight -= 1
        if config.accounting == "ticket":
            self._uncount(ticket)

    def _uncount(self, ticket: _Ticket) -> None:
        if ticket.counted:
            ticket.counted = False
            self.routed_tokens -= ticket.queued_tokens
            self.routed_kv_tokens -= ticket.kv_tokens

    def lora_occupied(self, others: Iterable[str] = ()) -> frozenset[str] | None:
        """The adapters holding the replica's LoRA slots as far as the router knows (the
        snapshot's, plus those it routed there that no snapshot includes yet, plus `others`:
        the other workers' such adapters, when shared); None when the replica reports no
        slots (`sal_gateway.state.BackendState.lora_occupied`)."""
        snap = self.snapshot
        if snap.max_loras <= 0:
            return None
        return frozenset(snap.lora_running).union(self.pending_adapters(), others)

    def pending_adapters(self) -> set[str]:
        """Adapters this router sent here that no snapshot it saw includes yet."""
        return {t.adapter for t in self.unacked if t.counted and t.adapter is not None}

    def counts(self) -> tuple[int, int, int]:
        """(in flight, unacknowledged prefill tokens, their KV tokens)."""
        return self.in_flight, self.routed_tokens, self.routed_kv_tokens

    def backend_view(
        self, url: str, cache: CacheView, counts: tuple[int, int, int] | None = None
    ) -> BackendView:
        """`counts` replaces this gateway's own `counts()` (shared accounting: all of
        them summed, as the gateway's workers see it)."""
        snap = self.snapshot
        in_flight, routed, routed_kv = counts or self.counts()
        return BackendView(
            url=url,
            eligible=True,
            in_flight=in_flight,
            free_kv_tokens=max(0, snap.free_kv_tokens - routed_kv),
            queued_prefill_tokens=snap.queued_prefill_tokens + routed,
            max_num_batched_tokens=max(1, snap.max_num_batched_tokens),
            cached_tokens=cache.cached_tokens,
            cached_held_tokens=cache.held_tokens,
            num_waiting=snap.num_waiting,
            kv_tokens_total=snap.kv_blocks_total * snap.block_size,
            indexed_tokens=cache.indexed_tokens,
            num_running=snap.num_running,
        )


# Event priorities at equal times: iteration ends (tokens delivered, requests finished) are
# seen before polls, polls before arrivals, and an idle replica woken by an arrival steps only
# after every arrival of that instant was routed.
_PRIO_STEP_END = 0
_PRIO_POLL = 1
_PRIO_ARRIVAL = 2
_PRIO_WAKE = 3


class Simulation:
    """One replay of `requests` through `engines`; call `run()` once."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        engines: Sequence[ReplicaEngine],
        submit: RequestSubmitter,
        router: RouterConfig | None = None,
        *,
        max_sim_s: float | None = None,
        policy: Policy | None = None,
        abort: LateAbort | None = None,
    ) -> None:
        """`policy` overrides the policy named in `router` (for what-if studies, one gateway);
        `abort` stops the run early (`LateAbort`)."""
        if not engines:
            raise SimulationError("need at least one replica")
        self._requests = sorted(requests, key=lambda r: r.arrival_s)
        self._engines = list(engines)
        self._submit = submit
        cfg = self._router_cfg = router or RouterConfig()
        if policy is not None and cfg.gateways > 1:
            raise SimulationError("a policy object can only stand in for one gateway")
        settings = PolicySettings(min_match_tokens=cfg.min_match_tokens)
        # Gateway 0 keeps the configured seed, so one gateway decides exactly as before.
        self._policies: list[Policy] = [policy or make_policy(cfg.policy, cfg.seed, settings)]
        self._policies += [
            make_policy(cfg.policy, cfg.seed + g, settings) for g in range(1, cfg.gateways)
        ]
        self._betas = [BetaEstimator(seed=cfg.beta_seed) for _ in range(cfg.gateways)]
        self._gateway_of = _split(self._requests, cfg)
        self._max_sim_s = math.inf if max_sim_s is None else max_sim_s
        self._urls = [f"sim://replica-{i}" for i in range(len(engines))]
        first_s = self._requests[0].arrival_s if self._requests else 0.0
        self._views = [
            [_RouterView(e.stats(first_s)) for e in self._engines] for _ in range(cfg.gateways)
        ]
        self._decisions: list[RoutingRecord] = []
        # Gossip between gateways: each gateway's counts after every change (time, counts
        # per replica), oldest first, kept back to the newest one a reader may still use.
        self._gossip_history: list[deque[tuple[float, list[_Told]]]] = [
            deque() for _ in range(cfg.gateways)
        ]
        # Each gateway keeps its own index of what it routed (approximate), or reads the
        # engines' truth (oracle).
        self._caches = [
            _router_cache(cfg.cache_source, self._urls, views, self._engines)
            for views in self._views
        ]
        # Prompt blocks the other gateways told each one over the network (peer_prefix_blocks):
        # a heap of (time it hears them, arrival order, replica, keys, held).
        self._heard_blocks: list[list[tuple[float, int, int, list[int], bool | None]]] = [
            [] for _ in range(cfg.gateways)
        ]
        self._heard_order = 0
        # peer_datagram_loss: each gateway numbers its requests; what each other gateway
        # heard of a request (receiver -> its keys); the sender's requests not ended; and
        # its ends that were lost, waiting for its watermark to pass them.
        self._loss_rng = random.Random(f"peer-datagram-loss-{cfg.seed}")
        self._peer_next = [0] * cfg.gateways
        self._peer_open: list[set[int]] = [set() for _ in range(cfg.gateways)]
        self._peer_heard: dict[str, tuple[int, dict[int, list[int]]]] = {}
        self._peer_lost_ends: list[list[tuple[int, int, int, list[int], float]]] = [
            [] for _ in range(cfg.gateways)
        ]
        self.peer_resent_ends = 0
        """Ends whose datagram was lost and whose heartbeat copy arrived."""
        self.peer_lost_ends = 0
        """Ends lost on the way twice (`peer_datagram_loss`): left to the watermark."""
        self.peer_watermark_releases = 0
        """Of those, the ones a watermark released before the run ended."""
        self.peer_watermark_wait_s = 0.0
        """Summed over those: how long the blocks stayed held past their request's end."""
        # The paper's Eq. 2 counts every prompt token on every replica, also between polls.
        self._account_cache = self._caches[0].enabled and self._policies[0].name != "sal_paper"
        self._keys: dict[str, list[int]] = {}
        self._predicted: dict[str, int] = {}
        self._busy = [False] * len(engines)
        self._pending: list[StepOutcome | None] = [None] * len(engines)
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._snapshots: list[deque[tuple[float, list[ReplicaStats]]]] = [
            deque() for _ in range(cfg.gateways)
        ]
        self._first_token_s: dict[str, float] = {}
        self._preemptions: dict[str, int] = {}
        self._replica_of: dict[str, int] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._index_of: dict[str, int] = {}
        self._outcomes: list[RequestOutcome] = []
        self._routed = [0] * len(engines)
        self._steps = 0
        self._abort = abort
        self._late = 0
        """Requests whose first token came more than ``abort.ttft_s`` after arrival."""
        self._overdue: set[str] = set()
        """Requests past ``abort.ttft_s`` since arrival with no first token yet."""
        self._next_due = 0
        """Index (arrival order) of the next request to check for being overdue."""

    def _push(self, time_s: float, prio: int, replica: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time_s, prio, self._seq, replica))

    def _poll_times(self, gateway: int) -> list[float]:
        """Poll instants of `gateway` whose snapshot one of its decisions will read (sorted)."""
        period = self._router_cfg.poll_interval_s
        delay = self._router_cfg.stats_delay_s
        phase = period * gateway / self._router_cfg.gateways
        indices = {
            math.floor((max(0.0, r.arrival_s - delay) - phase) / period)
            for r, g in zip(self._requests, self._gateway_of, strict=True)
            if g == gateway
        }
        return [k * period + phase for k in sorted(indices) if k >= 0]

    def run(self, progress: ProgressCallback | None = None) -> SimResult:
        """Replay the whole trace, let every request finish (or stop at `max_sim_s`)."""
        for gateway in range(self._router_cfg.gateways):
            for t in self._poll_times(gateway):
                # A poll event carries its gateway where a step event carries its replica.
                self._push(t, _PRIO_POLL, gateway)
        total = len(self._requests)
        report_every = max(1, total // 100)
        next_report = report_every
        next_arrival = 0
        now_s = 0.0
        aborted = False
        while True:
            arrival_key = (
                (self._requests[next_arrival].arrival_s, _PRIO_ARRIVAL)
                if next_arrival < total
                else (math.inf, _PRIO_ARRIVAL)
            )
            event_key = (self._heap[0][0], self._heap[0][1]) if self._heap else (math.inf, 0)
            if arrival_key[0] == math.inf and event_key[0] == math.inf:
                break
            if event_key <= arrival_key:
                now_s, prio, _, replica = heapq.heappop(self._heap)
                if now_s > self._max_sim_s:
                    break
                if prio == _PRIO_POLL:
                    self._take_snapshot(replica, now_s)
                else:
                    self._step_boundary(replica, now_s)
            else:
                now_s = arrival_key[0]
                if now_s > self._max_sim_s:
                    break
                self._arrive(next_arrival, now_s)
                next_arrival += 1
            if progress is not None and len(self._outcomes) >= next_report:
                progress(len(self._outcomes), total)
                next_report = len(self._outcomes) + report_every
            if self._abort is not None and self._doomed(now_s, next_arrival):
                aborted = True
                break
        if progress is not None:
            progress(len(self._outcomes), total)
        self._outcomes.sort(key=lambda o: self._index_of[o.request_id])
        unfinished = total - len(self._outcomes)
        return SimResult(
            outcomes=self._outcomes,
            unfinished=unfinished,
            summary=summarize(self._outcomes, unfinished),
            routed_per_replica=list(self._routed),
            steps=self._steps,
            end_s=now_s,
            final_beta=self._betas[0].beta,
            decisions=self._decisions,
            aborted=aborted,
            peer_resent_ends=self.peer_resent_ends,
            peer_lost_ends=self.peer_lost_ends,
            peer_lost_ends_released=self.peer_watermark_releases,
            peer_watermark_wait_s=(
                self.peer_watermark_wait_s / self.peer_watermark_releases
                if self.peer_watermark_releases
                else None
            ),
        )

    def _doomed(self, now_s: float, arrived: int) -> bool:
        """Whether more than ``abort.max_late`` requests are certainly late by `now_s`
        (amortized O(1): each arrived request is checked once for being overdue)."""
        assert self._abort is not None
        due_by_s = now_s - self._abort.ttft_s
        first = self._first_token_s
        while self._next_due < arrived and self._requests[self._next_due].arrival_s < due_by_s:
            request_id = f"r{self._next_due}"
            if request_id not in first and request_id in self._tickets:
                self._overdue.add(request_id)
            self._next_due += 1
        return self._late + len(self._overdue) > self._abort.max_late

    def _take_snapshot(self, gateway: int, now_s: float) -> None:
        self._snapshots[gateway].append((now_s, [e.stats(now_s) for e in self._engines]))

    def _refresh_views(self, gateway: int, now_s: float) -> None:
        """Apply the newest snapshot that has reached `gateway` by `now_s`."""
        ready_by_s = now_s - self._router_cfg.stats_delay_s
        snapshots = self._snapshots[gateway]
        latest: tuple[float, list[ReplicaStats]] | None = None
        while snapshots and snapshots[0][0] <= ready_by_s:
            latest = snapshots.popleft()
        if latest is None:
            return
        for replica, (view, snap) in enumerate(zip(self._views[gateway], latest[1], strict=True)):
            view.apply(snap, self._router_cfg)
            self._caches[gateway].on_snapshot(replica, snap.kv_blocks_total, snap.block_size)
        self._counts_changed(gateway, now_s)

    def _arrive(self, index: int, now_s: float) -> None:
        req = self._requests[index]
        gateway = self._gateway_of[index]
        self._refresh_views(gateway, now_s)
        views = self._views[gateway]
        cache = self._caches[gateway]
        keys: list[int] = []
        if cache.enabled and req.blocks is not None:
            # The router sees the prompt only (the engine also caches repeated outputs).
            keys = req.blocks.keys(cache.block_size)[: req.prompt_tokens // cache.block_size]
        if self._router_cfg.peer_prefix_blocks:
            heard_blocks = self._heard_blocks[gateway]
            while heard_blocks and heard_blocks[0][0] <= now_s:
                _, _, told_replica, told_keys, told_held = heapq.heappop(heard_blocks)
                if told_held is None:
                    cache.on_heard(told_replica, told_keys)
                elif told_held:
                    cache.on_told(told_replica, told_keys)
                else:
                    cache.on_finish(told_replica, told_keys)
        holds = cache.lookup(keys)
        counts: list[tuple[int, int, int] | None] = [None] * len(views)
        if self._router_cfg.shared_accounting and len(self._views) > 1:
            for r in range(len(views)):
                every = [gateway_views[r].counts() for gateway_views in self._views]
                counts[r] = (
                    sum(c[0] for c in every),
                    sum(c[1] for c in every),
                    sum(c[2] for c in every),
                )
        elif self._router_cfg.gossip_interval_s is not None and len(self._views) > 1:
            heard = self._gossip(gateway, now_s)
            for r in range(len(views)):
                own = views[r].counts()
                counts[r] = (
                    own[0] + sum(h[r][0] for h in heard),
                    own[1] + sum(h[r][1] for h in heard),
                    own[2] + sum(h[r][2] for h in heard),
                )
        backends = [
            v.backend_view(u, hold, c)
            for v, u, hold, c in zip(views, self._urls, holds, counts, strict=True)
        ]
        if req.adapter is not None and self._router_cfg.lora_slots:
            blocked, holders = set(), set()
            cfg = self._router_cfg
            share = cfg.shared_adapters and len(self._views) > 1
            told = (
                self._gossip(gateway, now_s) if share and cfg.gossip_interval_s is not None else []
            )
            for r, (v, u) in enumerate(zip(views, self._urls, strict=True)):
                others: set[str] = set()
                if share and cfg.shared_accounting:
                    for g, gateway_views in enumerate(self._views):
                        if g != gateway:
                            others |= gateway_views[r].pending_adapters()
                for heard_from in told:
                    others |= heard_from[r][3]
                occupied = v.lora_occupied(others)
                if occupied is None:
                    continue
                if req.adapter in occupied:
                    if self._router_cfg.lora_affinity:
                        holders.add(u)
                elif not can_start(req.adapter, v.snapshot.max_loras, occupied):
                    blocked.add(u)
            backends, _ = lora_route(backends, blocked, holders, when_full=cfg.lora_when_full)
        decision = self._policies[gateway].select(
            RouteRequest(
                req.prompt_tokens,
                self._betas[gateway].beta,
                _affinity_key(req),
                self._betas[gateway].mean_output_tokens,
            ),
            backends,
        )
        replica = decision.index
        request_id = f"r{index}"
        self._replica_of[request_id] = replica
        self._index_of[request_id] = index
        self._decisions.append(RoutingRecord(now_s, gateway, replica, views[0].snapshot.time))
        hold = holds[replica] if self._account_cache else CacheView()
        self._tickets[request_id] = views[replica].route(
            req.prompt_tokens - hold.cached_tokens,
            req.prompt_tokens - hold.held_tokens,
            now_s,
            req.adapter,
        )
        if keys:
            cache.on_route(replica, keys)
            if self._router_cfg.share_prefix_index:
                for other in self._caches:
                    if other is not cache:
                        other.on_told(replica, keys)
            if self._router_cfg.peer_prefix_blocks:
                self._tell_peers(gateway, request_id, replica, keys, now_s)
            self._keys[request_id] = keys
            self._predicted[request_id] = holds[replica].cached_tokens
        self._routed[replica] += 1
        self._counts_changed(gateway, now_s)
        self._submit(self._engines[replica], request_id, now_s, req)
        if not self._busy[replica]:
            self._busy[replica] = True
            self._push(now_s, _PRIO_WAKE, replica)

    def _tell_peers(
        self, gateway: int, request_id: str, replica: int, keys: list[int], now_s: float
    ) -> None:
        """``peers.share_prefix_blocks``: the other gateways hear `keys` routed to `replica`
        `gossip_delay_s` later, each what its datagrams that arrived carry."""
        cfg = self._router_cfg
        told = keys[: PEER_KEYS_PER_DATAGRAM * PEER_MAX_DATAGRAMS]
        heard_at_s = now_s + cfg.gossip_delay_s
        held = True if cfg.peer_prefix_holds else None
        number = self._peer_next[gateway]
        self._peer_next[gateway] += 1
        self._peer_open[gateway].add(number)
        heard_by: dict[int, list[int]] = {}
        for g in range(len(self._heard_blocks)):
            if g == gateway:
                continue
            heard = told
            if cfg.peer_datagram_loss > 0:
                for start in range(0, len(told), PEER_KEYS_PER_DATAGRAM):
                    if self._loss_rng.random() < cfg.peer_datagram_loss:
                        heard = told[:start]
                        break
            if heard:
                heard_by[g] = heard
                self._hear(g, heard_at_s, replica, heard, held)
        self._peer_heard[request_id] = (number, heard_by)

    def _hear(
        self, gateway: int, at_s: float, replica: int, keys: list[int], held: bool | None
    ) -> None:
        """`gateway` hears at `at_s` that `keys` were routed to `replica` (`held`), or that
        their request ended (`held` False)."""
        self._heard_order += 1
        heapq.heappush(self._heard_blocks[gateway], (at_s, self._heard_order, replica, keys, held))

    def _tell_peers_ended(self, gateway: int, request_id: str, replica: int, now_s: float) -> None:
        """The request ended: each other gateway that holds its blocks hears so
        `gossip_delay_s` later; one whose datagram was lost hears the copy the next heartbeat
        sends (`PEER_HEARTBEAT_S` later: the longest wait); one that lost both, once the
        sender's watermark passes the request. Unheld (`peer_prefix_holds` False): nobody
        tells."""
        cfg = self._router_cfg
        heard_at_s = now_s + cfg.gossip_delay_s
        number, heard_by = self._peer_heard.pop(request_id)
        lost = self._peer_lost_ends[gateway]

        def arrives() -> bool:
            return cfg.peer_datagram_loss <= 0 or self._loss_rng.random() >= cfg.peer_datagram_loss

        for g, keys in heard_by.items() if cfg.peer_prefix_holds else ():
            if arrives():
                self._hear(g, heard_at_s, replica, keys, False)
            elif arrives():
                self._hear(g, heard_at_s + PEER_HEARTBEAT_S, replica, keys, False)
                self.peer_resent_ends += 1
            else:
                lost.append((number, g, replica, keys, now_s))
                self.peer_lost_ends += 1
        open_numbers = self._peer_open[gateway]
        open_numbers.discard(number)
        if not lost:
            return
        watermark = min(open_numbers) if open_numbers else self._peer_next[gateway]
        still = []
        for entry in lost:
            if entry[0] < watermark:
                _, g, lost_replica, keys, lost_s = entry
                self._hear(g, heard_at_s, lost_replica, keys, False)
                self.peer_watermark_releases += 1
                self.peer_watermark_wait_s += now_s - lost_s
            else:
                still.append(entry)
        self._peer_lost_ends[gateway] = still

    def _counts_changed(self, gateway: int, now_s: float) -> None:
        """Remember `gateway`'s counts as of `now_s` for the others (gossip only)."""
        if self._router_cfg.gossip_interval_s is not None and len(self._views) > 1:
            counts = [(*v.counts(), v.pending_adapters()) for v in self._views[gateway]]
            history = self._gossip_history[gateway]
            if history and history[-1][0] == now_s:
                history.pop()
            history.append((now_s, counts))

    def _gossip(self, gateway: int, now_s: float) -> list[list[_Told]]:
        """The other gateways' counts as last heard by `now_s`: each sends its counts every
        `gossip_interval_s` (on a phase of its own, offset by interval / K from one gateway
        to the next, like the polls; 0: at every change), and they arrive
        `gossip_delay_s` later."""
        interval_s = self._router_cfg.gossip_interval_s
        assert interval_s is not None
        k = len(self._views)
        heard: list[list[_Told]] = []
        for g in range(k):
            if g == gateway:
                continue
            sent_s = now_s - self._router_cfg.gossip_delay_s
            if interval_s > 0:
                phase_s = interval_s * g / k
                tick_s = math.floor((sent_s - phase_s) / interval_s) * interval_s + phase_s
                sent_s = min(sent_s, tick_s)  # min: float rounding
            history = self._gossip_history[g]
            while len(history) > 1 and history[1][0] <= sent_s:
                history.popleft()
            if history and history[0][0] <= sent_s:
                heard.append(history[0][1])
        return heard

    def _step_boundary(self, replica: int, now_s: float) -> None:
        """End the replica's running iteration (deliver its tokens), then start the next."""
        done = self._pending[replica]
        if done is not None:
            self._deliver(replica, done, now_s)
            self._pending[replica] = None
        engine = self._engines[replica]
        if not engine.has_work():
            self._busy[replica] = False
            return
        result = engine.step(now_s)
        self._steps += 1
        if not result.duration_s > 0:
            raise SimulationError(
                f"replica {replica} returned a step of {result.duration_s} s at t={now_s}"
            )
        self._pending[replica] = result
        self._push(now_s + result.duration_s, _PRIO_STEP_END, replica)

    def _deliver(self, replica: int, result: StepOutcome, now_s: float) -> None:
        first = self._first_token_s
        for request_id, count in result.new_tokens:
            if count > 0 and request_id not in first:
                first[request_id] = now_s
                if self._abort is not None:
                    self._count_if_late(request_id, now_s)
        for request_id in result.preempted:
            self._preemptions[request_id] = self._preemptions.get(request_id, 0) + 1
        for finished in result.finished:
            request_id = finished.request_id
            index = self._index_of[request_id]
            req = self._requests[index]
            gateway = self._gateway_of[index]
            self._views[gateway][replica].finish(self._tickets.pop(request_id), self._router_cfg)
            self._counts_changed(gateway, now_s)
            keys = self._keys.pop(request_id, None)
            if keys is not None:
                told = self._caches if self._router_cfg.share_prefix_index else ()
                for cache in told or (self._caches[gateway],):
                    cache.on_finish(replica, keys)
                if self._router_cfg.peer_prefix_blocks:
                    self._tell_peers_ended(gateway, request_id, replica, now_s)
            self._betas[gateway].observe(req.prompt_tokens, req.output_tokens)
            self._outcomes.append(
                RequestOutcome(
                    request_id=request_id,
                    replica=replica,
                    arrival_s=req.arrival_s,
                    prompt_tokens=req.prompt_tokens,
                    output_tokens=req.output_tokens,
                    first_token_s=first.pop(request_id, now_s),
                    finish_s=now_s,
                    num_preemptions=self._preemptions.pop(request_id, 0),
                    cached_tokens=int(getattr(finished, "num_cached_tokens", 0)),
                    predicted_cached_tokens=self._predicted.pop(request_id, 0),
                )
            )

    def _count_if_late(self, request_id: str, first_token_s: float) -> None:
        assert self._abort is not None
        self._overdue.discard(request_id)  # counted below instead
        arrival_s = self._requests[self._index_of[request_id]].arrival_s
        if first_token_s - arrival_s > self._abort.ttft_s:
            self._late += 1


def _split(requests: Sequence[TraceRequest], config: RouterConfig) -> list[int]:
    """The gateway of each request (in arrival order)."""
    k = config.gateways
    if config.gateway_split == "session":
        # A conversation stays with the gateway its first turn reached (a client's keep-alive
        # connection stays with one worker); a request with no session goes anywhere.
        rng = random.Random(f"gateway-split-{config.seed}")
        of_session: dict[str, int] = {}
        out = []
        for r in requests:
            g = rng.randrange(k)
            out.append(g if r.session is None else of_session.setdefault(r.session, g))
        return out
    if config.gateway_split == "random":
        rng = random.Random(f"gateway-split-{config.seed}")
        return [rng.randrange(k) for _ in range(len(requests))]
    return [i % k for i in range(len(requests))]


def _affinity_key(req: TraceRequest) -> str | None:
    """What `prefix_affinity` hashes: the session, else the prompt's first chunk."""
    if req.session is not None:
        return req.session
    first = req.blocks.first_chunk if req.blocks is not None else None
    return None if first is None else f"chunk-{first}"


def _router_cache(
    source: str, urls: Sequence[str], views: Sequence[_RouterView], engines: Sequence[object]
) -> RouterCache:
    block_size = views[0].snapshot.block_size
    if source != "oracle":
        return RouterCache(source, urls, block_size)
    if not all(isinstance(e, EngineModel) for e in engines):
        raise SimulationError("the oracle cache source needs EngineModel replicas")
    return RouterCache(source, urls, block_size, [e for e in engines if isinstance(e, EngineModel)])


def submit_to_engine_model(
    engine: ReplicaEngine, request_id: str, arrival_s: float, req: TraceRequest
) -> None:
    """The `RequestSubmitter` for `EngineModel` replicas (what `simulate()` uses); with
    prefix caching on, the request carries its block keys."""
    if not isinstance(engine, EngineModel):
        raise SimulationError(f"expected an EngineModel, got {type(engine).__name__}")
    keys: list[int] = []
    if engine.cache is not None and req.blocks is not None:
        keys = req.blocks.keys(engine.config.block_size)
    engine.add_request(
        SimRequest(
            request_id=request_id,
            arrival_s=arrival_s,
            prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens,
            block_keys=keys,
            adapter=req.adapter,
        )
    )


def simulate(
    requests: Sequence[TraceRequest],
    *,
    replicas: int,
    scheduler: str = "fcfs",
    profile: str = "llama3-8b-a100",
    alpha: float = 1.0,
    router: RouterConfig | None = None,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    progress: ProgressCallback | None = None,
    max_sim_s: float | None = None,
    policy: Policy | None = None,
    enable_prefix_caching: bool = False,
    kv_scale: float = 1.0,
) -> SimResult:
    """Replay `requests` through `replicas` `EngineModel`s of one cost profile.

    Engines use vLLM's defaults (block size 16, 256 sequences, a 2,048-token step budget,
    chunked prefill) and the KV capacity the profile's GPU memory leaves
    (`CostProfile.num_kv_blocks`); prefix caching only with `enable_prefix_caching`.
    `kv_scale` multiplies that capacity, the compute unchanged: a what-if for "the same
    fleet with more KV per replica" (FP8 KV halves the bytes per token, x2).
    """
    if not (kv_scale > 0 and kv_scale < float("inf")):
        raise ValueError(f"kv_scale must be a finite number > 0, got {kv_scale}")
    cost = get_profile(profile)
    config = EngineConfig(
        num_kv_blocks=max(1, int(cost.num_kv_blocks(block_size) * kv_scale)),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduler=scheduler,
        alpha=alpha,
        model_name=profile,
        enable_prefix_caching=enable_prefix_caching,
    )
    engines = [EngineModel(config, cost) for _ in range(replicas)]
    sim = Simulation(
        requests, engines, submit_to_engine_model, router, max_sim_s=max_sim_s, policy=policy
    )
    return sim.run(progress)
