"""The fleet simulator (`engine_sim.simulator`) driving real `EngineModel` replicas."""

from __future__ import annotations

import pytest

from bench.ablations import SalPositionTies
from engine_sim.cost_model import PROFILES, CostProfile, prefill_time_s
from engine_sim.engine import EngineConfig, EngineModel, SimRequest, StepResult
from engine_sim.simulator import (
    RouterConfig,
    Simulation,
    SimulationError,
    simulate,
    submit_to_engine_model,
)
from engine_sim.trace import TraceRequest, gamma_arrivals
from sal_core.beta import BetaEstimator

PROFILE_8B = "llama3-8b-a100"


def _workload(n: int, rate_per_s: float, seed: int = 3) -> list[TraceRequest]:
    times = gamma_arrivals(n, rate_per_s, cv=2.0, seed=seed)
    return [
        TraceRequest(t, 200 + (i * 7919) % 3000, 10 + (i * 104729) % 300)
        for i, t in enumerate(times)
    ]


class RecordingEngine(EngineModel):
    """An `EngineModel` that keeps every request it was given (to compare timestamps)."""

    def __init__(self, config: EngineConfig, profile: CostProfile) -> None:
        super().__init__(config, profile)
        self.seen: list[SimRequest] = []

    def add_request(self, req: SimRequest) -> None:
        self.seen.append(req)
        super().add_request(req)


def test_every_request_finishes_and_times_match_the_engines_own_clock() -> None:
    cost = PROFILES[PROFILE_8B]
    config = EngineConfig(num_kv_blocks=cost.num_kv_blocks(16))
    engines = [RecordingEngine(config, cost) for _ in range(3)]
    reqs = _workload(300, rate_per_s=6.0)
    result = Simulation(reqs, engines, submit_to_engine_model, RouterConfig("sal")).run()
    assert result.unfinished == 0
    assert len(result.outcomes) == 300
    assert sum(result.routed_per_replica) == 300
    seen = {r.request_id: r for e in engines for r in e.seen}
    for out in result.outcomes:
        engine_req = seen[out.request_id]
        assert out.first_token_s == pytest.approx(engine_req.first_token_s)
        assert out.finish_s == pytest.approx(engine_req.finish_s)
        assert out.num_preemptions == engine_req.num_preemptions
        assert out.arrival_s <= out.first_token_s <= out.finish_s


def test_one_request_on_an_idle_replica_takes_exactly_the_cost_model_prefill() -> None:
    result = simulate([TraceRequest(5.0, 1500, 1)], replicas=1, profile=PROFILE_8B)
    (out,) = result.outcomes
    assert out.ttft_s == pytest.approx(prefill_time_s(PROFILES[PROFILE_8B], 1500))
    assert out.tgt_s == out.ttft_s


def test_idle_replicas_cost_no_steps() -> None:
    # Two requests a long time apart: one step per output token each, nothing in between.
    reqs = [TraceRequest(0.0, 100, 5), TraceRequest(10_000.0, 100, 5)]
    result = simulate(reqs, replicas=4, router=RouterConfig("round_robin"))
    assert result.steps == 10
    assert result.end_s == pytest.approx(result.outcomes[-1].finish_s)


@pytest.mark.parametrize("router", ["sal", "p2c", "random", "round_robin", "least_requests"])
def test_runs_are_deterministic_for_a_seed(router: str) -> None:
    reqs = _workload(200, rate_per_s=8.0)
    runs = [
        simulate(reqs, replicas=4, router=RouterConfig(router, seed=11)).outcomes for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_the_seed_changes_random_routing() -> None:
    reqs = _workload(200, rate_per_s=8.0)
    a = simulate(reqs, replicas=4, router=RouterConfig("random", seed=1))
    b = simulate(reqs, replicas=4, router=RouterConfig("random", seed=2))
    assert a.routed_per_replica != b.routed_per_replica


def test_sal_spreads_a_burst_within_one_poll_period_by_local_accounting() -> None:
    # Four requests in the same 100 ms poll period, all replicas idle at the last poll:
    # without between-poll accounting SAL would send all of them to replica 0.
    reqs = [TraceRequest(0.01 * i, 1000, 10) for i in range(4)]
    result = simulate(reqs, replicas=4, router=RouterConfig("sal"))
    assert result.routed_per_replica == [1, 1, 1, 1]


def test_stale_state_keeps_finished_work_on_the_books_until_the_next_poll() -> None:
    # The earlier, forgetful rule ("reset"): a request to replica 0 finishes long before the
    # second arrives, and only a snapshot tells the router so.
    reqs = [TraceRequest(0.0, 1000, 2), TraceRequest(50.0, 1000, 2)]

    def router(**kw: float) -> RouterConfig:
        return RouterConfig("sal", accounting="reset", **kw)

    fresh = simulate(reqs, replicas=2, router=router(poll_interval_s=0.1))
    # With a fresh poll the router sees replica 0 idle again (ties go to the first replica).
    assert [o.replica for o in fresh.outcomes] == [0, 0]
    # With a poll period longer than the run, the router only has its own accounting, which
    # assumes nothing finished: replica 0 still looks busy.
    stale = simulate(reqs, replicas=2, router=router(poll_interval_s=1000.0))
    assert [o.replica for o in stale.outcomes] == [0, 1]
    # A snapshot delivered late has the same effect as a missing one.
    late = simulate(reqs, replicas=2, router=router(poll_interval_s=0.1, stats_delay_s=60.0))
    assert [o.replica for o in late.outcomes] == [0, 1]


def test_a_finished_request_stops_counting_without_waiting_for_a_poll() -> None:
    # The gateway's rule ("ticket"): the router saw the request end, so replica 0 is idle
    # again even though no snapshot reached it since.
    reqs = [TraceRequest(0.0, 1000, 2), TraceRequest(50.0, 1000, 2)]
    stale = simulate(reqs, replicas=2, router=RouterConfig("sal", poll_interval_s=1000.0))
    assert [o.replica for o in stale.outcomes] == [0, 0]


def test_requests_routed_after_a_delayed_snapshot_was_taken_keep_counting() -> None:
    # Snapshots reach the router 250 ms after they were taken. A long prompt goes to replica
    # 0, a short one to replica 1 (both keep decoding for a while). The third request is
    # routed when the snapshot taken at t=0, before either request, arrives: with "reset" it
    # wipes both off the books, every replica looks idle with one request in flight, and the
    # tie goes to replica 0, still busy with its 8,000-token prefill; with "ticket" the long
    # prompt keeps counting on replica 0 until a snapshot that includes it arrives.
    reqs = [
        TraceRequest(0.01, 8000, 400),
        TraceRequest(0.02, 100, 400),
        TraceRequest(0.26, 500, 10),
    ]

    def replicas(accounting: str) -> list[int]:
        router = RouterConfig("sal", stats_delay_s=0.25, accounting=accounting)
        return [o.replica for o in simulate(reqs, replicas=2, router=router).outcomes]

    assert replicas("reset") == [0, 1, 0]
    assert replicas("ticket") == [0, 1, 1]


def test_router_config_rejects_unknown_accounting() -> None:
    with pytest.raises(SimulationError, match="accounting"):
        RouterConfig(accounting="forget")


def test_least_requests_counts_in_flight_until_the_last_token() -> None:
    # A long request occupies replica 0; later short ones must avoid it while it runs.
    reqs = [TraceRequest(0.0, 100, 500)] + [TraceRequest(1.0 + i, 100, 2) for i in range(3)]
    result = simulate(reqs, replicas=2, router=RouterConfig("least_requests"))
    assert [o.replica for o in sorted(result.outcomes, key=lambda o: o.arrival_s)] == [0, 1, 1, 1]


def test_sal_beta_is_learned_from_finished_requests() -> None:
    reqs = _workload(100, rate_per_s=2.0)
    result = simulate(reqs, replicas=2, router=RouterConfig("sal", beta_seed=2.0))
    expected = BetaEstimator(seed=2.0)
    for r in reqs:
        expected.observe(r.prompt_tokens, r.output_tokens)
    assert result.final_beta == pytest.approx(expected.beta)


def test_more_load_means_longer_waits_on_one_fcfs_replica() -> None:
    reqs = _workload(400, rate_per_s=1.0)
    light = simulate(reqs, replicas=1).summary
    heavy = simulate(
        [TraceRequest(r.arrival_s / 8, r.prompt_tokens, r.output_tokens) for r in reqs], replicas=1
    ).summary
    assert heavy.ttft_p50_s > 2 * light.ttft_p50_s
    assert heavy.tgt_p95_s > light.tgt_p95_s


def test_an_engine_that_makes_no_progress_is_reported() -> None:
    class Stuck(EngineModel):
        def step(self, now_s: float) -> StepResult:
            return StepResult(0.0, [], [], [])

    cost = PROFILES[PROFILE_8B]
    engine = Stuck(EngineConfig(num_kv_blocks=cost.num_kv_blocks(16)), cost)
    sim = Simulation([TraceRequest(0.0, 10, 1)], [engine], submit_to_engine_model)
    with pytest.raises(SimulationError, match=r"step of 0\.0 s"):
        sim.run()


def test_max_sim_s_stops_an_overloaded_run_and_counts_the_unfinished() -> None:
    reqs = [TraceRequest(0.0, 1000, 1000) for _ in range(50)]
    result = simulate(reqs, replicas=1, max_sim_s=5.0)
    assert result.unfinished > 0
    assert result.summary.unfinished == result.unfinished
    assert len(result.outcomes) + result.unfinished == 50


def test_progress_is_reported_up_to_the_total() -> None:
    calls: list[tuple[int, int]] = []
    simulate(_workload(300, rate_per_s=5.0), replicas=2, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (300, 300)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_sal_breaks_ties_by_in_flight_and_spreads_load_unlike_the_position_variant() -> None:
    # Sequential short requests that never overlap in prefill: SAL's loads tie at every
    # decision. The product SAL spreads them by in-flight count; the paper-literal
    # position tie-break (the what-if variant) keeps choosing replica 0.
    reqs = [TraceRequest(0.5 * i, 100, 200) for i in range(8)]
    product = simulate(reqs, replicas=4, router=RouterConfig("sal"))
    variant = simulate(reqs, replicas=4, policy=SalPositionTies())
    assert variant.routed_per_replica[0] == 8
    assert min(product.routed_per_replica) >= 1
    assert max(product.routed_per_replica) <= 3
