"""The fleet simulator: N engine replicas on a virtual clock, routed by the gateway's policies.

One `Simulation` replays a trace (`engine_sim.trace`) through replicas that follow the
`ReplicaEngine` protocol (`engine_sim.engine.EngineModel` in production; tests may pass a
fake). Routing uses the gateway's own objects, imported, not re-written:
`sal_gateway.policies.make_policy()`, `BackendView`, `RouteRequest`, and
`sal_gateway.beta.BetaEstimator` fed with every finished request.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine_sim.cost_model import get_profile
from engine_sim.engine import EngineConfig, EngineModel, SimRequest
from engine_sim.results import RequestOutcome, Summary, summarize
from engine_sim.trace import TraceRequest
from sal_gateway.beta import BetaEstimator
from sal_gateway.policies import BackendView, Policy, RouteRequest, make_policy
from sal_gateway.stats import ReplicaStats


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
    """A name in `sal_gateway.policies.POLICIES`."""
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

    def __post_init__(self) -> None:
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
    """SAL's beta estimate after the last finished request."""


ACCOUNTING = ("ticket", "reset")
"""Between-poll accounting rules (`RouterConfig.accounting`)."""


@dataclass(slots=True)
class _Ticket:
    sent_s: float
    prompt_tokens: int
    counted: bool = True


@dataclass(slots=True)
class _RouterView:
    """The router's picture of one replica: last snapshot + what it routed there since."""

    snapshot: ReplicaStats
    routed_tokens: int = 0
    """Prompt tokens of routed requests the snapshot does not include (as far as we know)."""
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
            self.unacked.clear()
            return
        cutoff_s = snapshot.time - config.accounting_grace_s
        while self.unacked and self.unacked[0].sent_s < cutoff_s:
            self._uncount(self.unacked.popleft())

    def route(self, prompt_tokens: int, now_s: float) -> _Ticket:
        ticket = _Ticket(now_s, prompt_tokens)
        self.routed_tokens += prompt_tokens
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
            self.routed_tokens -= ticket.prompt_tokens

    def backend_view(self, url: str) -> BackendView:
        snap = self.snapshot
        return BackendView(
            url=url,
            eligible=True,
            in_flight=self.in_flight,
            free_kv_tokens=max(0, snap.free_kv_tokens - self.routed_tokens),
            queued_prefill_tokens=snap.queued_prefill_tokens + self.routed_tokens,
            max_num_batched_tokens=max(1, snap.max_num_batched_tokens),
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
    ) -> None:
        """`policy` overrides the policy named in `router` (for what-if studies only)."""
        if not engines:
            raise SimulationError("need at least one replica")
        self._requests = sorted(requests, key=lambda r: r.arrival_s)
        self._engines = list(engines)
        self._submit = submit
        self._router_cfg = router or RouterConfig()
        self._policy: Policy = policy or make_policy(self._router_cfg.policy, self._router_cfg.seed)
        self._beta = BetaEstimator(seed=self._router_cfg.beta_seed)
        self._max_sim_s = math.inf if max_sim_s is None else max_sim_s
        self._urls = [f"sim://replica-{i}" for i in range(len(engines))]
        first_s = self._requests[0].arrival_s if self._requests else 0.0
        self._views = [_RouterView(e.stats(first_s)) for e in self._engines]
        self._busy = [False] * len(engines)
        self._pending: list[StepOutcome | None] = [None] * len(engines)
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._snapshots: deque[tuple[float, list[ReplicaStats]]] = deque()
        self._first_token_s: dict[str, float] = {}
        self._preemptions: dict[str, int] = {}
        self._replica_of: dict[str, int] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._index_of: dict[str, int] = {}
        self._outcomes: list[RequestOutcome] = []
        self._routed = [0] * len(engines)
        self._steps = 0

    def _push(self, time_s: float, prio: int, replica: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time_s, prio, self._seq, replica))

    def _poll_times(self) -> list[float]:
        """Poll instants whose snapshot some routing decision will read (sorted, unique)."""
        period = self._router_cfg.poll_interval_s
        delay = self._router_cfg.stats_delay_s
        indices = sorted(
            {math.floor(max(0.0, r.arrival_s - delay) / period) for r in self._requests}
        )
        return [k * period for k in indices]

    def run(self, progress: ProgressCallback | None = None) -> SimResult:
        """Replay the whole trace, let every request finish (or stop at `max_sim_s`)."""
        for t in self._poll_times():
            self._push(t, _PRIO_POLL, -1)
        total = len(self._requests)
        report_every = max(1, total // 100)
        next_report = report_every
        next_arrival = 0
        now_s = 0.0
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
                    self._take_snapshot(now_s)
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
            final_beta=self._beta.beta,
        )

    def _take_snapshot(self, now_s: float) -> None:
        self._snapshots.append((now_s, [e.stats(now_s) for e in self._engines]))

    def _refresh_views(self, now_s: float) -> None:
        """Apply the newest snapshot that has reached the router by `now_s`."""
        ready_by_s = now_s - self._router_cfg.stats_delay_s
        latest: tuple[float, list[ReplicaStats]] | None = None
        while self._snapshots and self._snapshots[0][0] <= ready_by_s:
            latest = self._snapshots.popleft()
        if latest is None:
            return
        for view, snap in zip(self._views, latest[1], strict=True):
            view.apply(snap, self._router_cfg)

    def _arrive(self, index: int, now_s: float) -> None:
        req = self._requests[index]
        self._refresh_views(now_s)
        backends = [v.backend_view(u) for v, u in zip(self._views, self._urls, strict=True)]
        decision = self._policy.select(
            RouteRequest(prompt_tokens=req.prompt_tokens, beta=self._beta.beta), backends
        )
        replica = decision.index
        request_id = f"r{index}"
        self._replica_of[request_id] = replica
        self._index_of[request_id] = index
        self._tickets[request_id] = self._views[replica].route(req.prompt_tokens, now_s)
        self._routed[replica] += 1
        self._submit(self._engines[replica], request_id, now_s, req)
        if not self._busy[replica]:
            self._busy[replica] = True
            self._push(now_s, _PRIO_WAKE, replica)

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
        for request_id in result.preempted:
            self._preemptions[request_id] = self._preemptions.get(request_id, 0) + 1
        for finished in result.finished:
            request_id = finished.request_id
            index = self._index_of[request_id]
            req = self._requests[index]
            self._views[replica].finish(self._tickets.pop(request_id), self._router_cfg)
            self._beta.observe(req.prompt_tokens, req.output_tokens)
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
                )
            )


def submit_to_engine_model(
    engine: ReplicaEngine, request_id: str, arrival_s: float, req: TraceRequest
) -> None:
    """The `RequestSubmitter` for `EngineModel` replicas (what `simulate()` uses)."""
    if not isinstance(engine, EngineModel):
        raise SimulationError(f"expected an EngineModel, got {type(engine).__name__}")
    engine.add_request(
        SimRequest(
            request_id=request_id,
            arrival_s=arrival_s,
            prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens,
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
) -> SimResult:
    """Replay `requests` through `replicas` `EngineModel`s of one cost profile.

    Engines use vLLM's defaults (block size 16, 256 sequences, a 2,048-token step budget,
    chunked prefill) and the KV capacity the profile's GPU memory leaves
    (`CostProfile.num_kv_blocks`).
    """
    cost = get_profile(profile)
    config = EngineConfig(
        num_kv_blocks=cost.num_kv_blocks(block_size),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduler=scheduler,
        alpha=alpha,
        model_name=profile,
    )
    engines = [EngineModel(config, cost) for _ in range(replicas)]
    sim = Simulation(
        requests, engines, submit_to_engine_model, router, max_sim_s=max_sim_s, policy=policy
    )
    return sim.run(progress)
