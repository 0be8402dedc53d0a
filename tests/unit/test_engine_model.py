"""The engine model's mechanics: KV accounting, budgets, chunked prefill, preemption, TTFT."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sim.cost_model import PROFILES, CostProfile
from engine_sim.engine import EngineConfig, EngineModel, SimRequest, StepResult
from engine_sim.schedulers import ENGINE_SCHEDULERS
from sal_core.stats import parse_stats

TINY = PROFILES["tiny-cpu"]


@dataclass
class Trace:
    """Everything observable from one run, checked after every step by `run`."""

    steps: list[StepResult] = field(default_factory=list)
    tokens: Counter[str] = field(default_factory=Counter)
    finished: list[SimRequest] = field(default_factory=list)
    max_running: int = 0


def make_engine(
    scheduler: str = "fcfs", profile: CostProfile = TINY, **overrides: object
) -> EngineModel:
    kwargs: dict[str, object] = {"num_kv_blocks": 64, "block_size": 16, "scheduler": scheduler}
    kwargs.update(overrides)
    return EngineModel(EngineConfig(**kwargs), profile)  # type: ignore[arg-type]


def check_invariants(engine: EngineModel, live: list[SimRequest]) -> None:
    cfg = engine.config
    held = sum(r.kv_blocks for r in live if r.finish_s is None)
    assert 0 <= engine.free_blocks <= cfg.num_kv_blocks
    assert held + engine.free_blocks == cfg.num_kv_blocks
    assert engine.num_running <= cfg.max_num_seqs
    for r in live:
        if r.finish_s is None:
            assert r.kv_blocks * cfg.block_size >= r.num_computed_tokens
            assert 0 <= r.output_done < r.output_tokens


def run(engine: EngineModel, requests: list[SimRequest], max_steps: int = 200_000) -> Trace:
    """Feed `requests` at their arrival times on a virtual clock until all finish."""
    pending = sorted(requests, key=lambda r: r.arrival_s)
    trace = Trace()
    now_s = 0.0
    k = 0
    for _ in range(max_steps):
        while k < len(pending) and pending[k].arrival_s <= now_s:
            engine.add_request(pending[k])
            k += 1
        if not engine.has_work():
            if k == len(pending):
                return trace
            now_s = pending[k].arrival_s
            continue
        result = engine.step(now_s)
        trace.steps.append(result)
        trace.max_running = max(trace.max_running, engine.num_running)
        for request_id, n in result.new_tokens:
            trace.tokens[request_id] += n
        trace.finished.extend(result.finished)
        check_invariants(engine, pending)
        now_s += result.duration_s
    raise AssertionError("engine did not drain")


def random_requests(
    seed: int, n: int, max_prompt: int = 600, max_output: int = 120
) -> list[SimRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(40.0)
        out.append(SimRequest(f"r{i}", t, rng.randint(1, max_prompt), rng.randint(1, max_output)))
    return out


@pytest.mark.parametrize("scheduler", sorted(ENGINE_SCHEDULERS))
def test_every_request_finishes_with_exactly_its_output_tokens(scheduler: str) -> None:
    engine = make_engine(scheduler, num_kv_blocks=80, max_num_batched_tokens=256)
    requests = random_requests(seed=3, n=150)
    trace = run(engine, requests)
    assert len(trace.finished) == len(requests)
    for r in requests:
        assert trace.tokens[r.request_id] == r.output_tokens
        assert r.output_done == r.output_tokens
        assert r.first_token_s is not None
        assert r.finish_s is not None
        assert r.arrival_s < r.first_token_s <= r.finish_s
    assert engine.free_blocks == engine.config.num_kv_blocks
    assert engine.queued_prefill_tokens == 0


@settings(max_examples=40, deadline=None)
@given(
    scheduler=st.sampled_from(sorted(ENGINE_SCHEDULERS)),
    seed=st.integers(0, 10_000),
    num_kv_blocks=st.integers(30, 120),
    budget=st.sampled_from([16, 64, 512]),
    max_num_seqs=st.integers(1, 8),
    chunked=st.booleans(),
    full=st.booleans(),
)
def test_kv_accounting_never_negative_nor_over_capacity(
    scheduler: str,
    seed: int,
    num_kv_blocks: int,
    budget: int,
    max_num_seqs: int,
    chunked: bool,
    full: bool,
) -> None:
    engine = make_engine(
        scheduler,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget if chunked else 512,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        reserve_full_prompt=full,
    )
    requests = random_requests(seed, n=25, max_prompt=300, max_output=150)
    trace = run(engine, requests)  # `run` checks the invariants after every step
    assert len(trace.finished) == len(requests)
    assert trace.max_running <= max_num_seqs


@pytest.mark.parametrize("scheduler", sorted(ENGINE_SCHEDULERS))
def test_chunked_prefill_respects_the_token_budget(scheduler: str) -> None:
    engine = make_engine(scheduler, num_kv_blocks=200, max_num_batched_tokens=100)
    trace = run(engine, random_requests(seed=5, n=60))
    assert all(s.prefill_tokens + s.decode_seqs <= 100 for s in trace.steps)
    # Long prompts were really split: some steps ran exactly a full budget.
    assert any(s.prefill_tokens + s.decode_seqs == 100 for s in trace.steps)


def test_first_token_is_at_the_end_of_the_step_that_completes_the_prompt() -> None:
    engine = make_engine(num_kv_blocks=100, max_num_batched_tokens=512)
    req = SimRequest("a", 0.0, prompt_tokens=1200, output_tokens=3)
    engine.add_request(req)
    now_s = 0.0
    for expected_prefill in (512, 512, 176):
        result = engine.step(now_s)
        assert result.prefill_tokens == expected_prefill
        now_s += result.duration_s
    assert result.new_tokens == [("a", 1)]
    assert req.first_token_s == pytest.approx(now_s)
    decode_step = engine.step(now_s)
    assert (decode_step.prefill_tokens, decode_step.decode_seqs) == (0, 1)


def test_without_chunked_prefill_a_prompt_over_the_budget_waits() -> None:
    engine = make_engine(
        num_kv_blocks=100, max_num_batched_tokens=300, enable_chunked_prefill=False
    )
    engine.add_request(SimRequest("long", 0.0, 250, 5))
    engine.add_request(SimRequest("short", 0.0, 100, 5))
    first = engine.step(0.0)
    # "long" takes 250 of 300 tokens; "short" (100) does not fit the rest and is not split.
    assert first.prefill_tokens == 250
    assert engine.num_waiting == 1


def test_preemption_under_kv_pressure_is_counted_per_request() -> None:
    # 12 blocks of 16 tokens: four 40-token prompts fit, their 100-token outputs do not.
    engine = make_engine("fcfs", num_kv_blocks=12)
    requests = [SimRequest(f"r{i}", 0.0, 40, 100) for i in range(4)]
    trace = run(engine, requests)
    preempted_ids = [rid for s in trace.steps for rid in s.preempted]
    assert preempted_ids, "memory pressure must preempt"
    assert engine.num_preemptions == len(preempted_ids)
    per_request = Counter(preempted_ids)
    for r in requests:
        assert r.num_preemptions == per_request[r.request_id]
        assert trace.tokens[r.request_id] == r.output_tokens
    # vLLM preempts the most recently admitted request, never the oldest running one.
    assert requests[0].num_preemptions == 0


def test_preempted_request_recomputes_prompt_and_generated_tokens() -> None:
    engine = make_engine("fcfs", num_kv_blocks=6)
    a = SimRequest("a", 0.0, 32, 60)
    b = SimRequest("b", 0.0, 32, 60)
    engine.add_request(a)
    engine.add_request(b)
    now_s = 0.0
    while not b.num_preemptions:
        now_s += engine.step(now_s).duration_s
    assert b.num_computed_tokens == 0
    assert b.kv_blocks == 0
    assert engine.get("b") is b
    # Its queued prefill is its prompt plus everything it had generated.
    assert engine.queued_prefill_tokens == 32 + b.output_done


def test_no_preemption_step_admits_nothing_else() -> None:
    """vLLM skips the waiting queue in a step that had to preempt."""
    engine = make_engine("fcfs", num_kv_blocks=5)
    engine.add_request(SimRequest("a", 0.0, 32, 40))
    engine.add_request(SimRequest("b", 0.0, 32, 40))
    now_s = 0.0
    while True:
        result = engine.step(now_s)
        now_s += result.duration_s
        if result.preempted:
            break
    assert engine.num_waiting == 1
    assert "b" not in [rid for rid, _ in result.new_tokens]


@pytest.mark.parametrize("reserve_full_prompt", [True, False])
def test_admission_checks_the_whole_prompt_like_vllm_0_32(reserve_full_prompt: bool) -> None:
    """vLLM 0.32 admits a waiting request only if blocks for its whole prompt are free
    (``--scheduler-reserve-full-isl``), then allocates chunk by chunk."""
    engine = make_engine(
        num_kv_blocks=20, max_num_batched_tokens=64, reserve_full_prompt=reserve_full_prompt
    )
    holder = SimRequest("holder", 0.0, 190, 50)  # 12 blocks once prefilled
    engine.add_request(holder)
    now_s = 0.0
    while holder.output_done == 0:
        now_s += engine.step(now_s).duration_s
    engine.add_request(SimRequest("big", now_s, 200, 5))  # 13 blocks > 8 free
    engine.step(now_s)
    if reserve_full_prompt:
        assert engine.num_waiting == 1
    else:
        # Only the first 63-token chunk (4 blocks) had to fit.
        assert engine.num_waiting == 0
        assert engine.num_running == 2


def test_max_num_seqs_caps_the_running_set() -> None:
    engine = make_engine(num_kv_blocks=500, max_num_seqs=3)
    trace = run(engine, [SimRequest(f"r{i}", 0.0, 20, 30) for i in range(10)])
    assert trace.max_running == 3


def test_abort_frees_blocks_and_forgets_the_request() -> None:
    engine = make_engine(num_kv_blocks=50)
    engine.add_request(SimRequest("a", 0.0, 100, 50))
    engine.add_request(SimRequest("b", 0.0, 100, 50))
    engine.step(0.0)
    assert engine.free_blocks < 50
    engine.abort("a")
    engine.abort("b")
    engine.abort("never-seen")
    assert engine.free_blocks == 50
    assert not engine.has_work()
    assert engine.queued_prefill_tokens == 0


def test_a_request_that_can_never_fit_is_rejected() -> None:
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(ValueError, match="needs 80 KV tokens"):
        engine.add_request(SimRequest("huge", 0.0, 60, 20))
    engine.add_request(SimRequest("x", 0.0, 1, 1))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(SimRequest("x", 0.0, 1, 1))


def test_unknown_scheduler_names_the_known_ones() -> None:
    known = "fcfs, fcfs_headroom, larry, larry_tail, no_preempt, tgi, trail_plus"
    with pytest.raises(ValueError, match=known):
        EngineConfig(num_kv_blocks=10, scheduler="sjf")


def test_stats_follow_the_contract_and_count_queued_prefill() -> None:
    engine = make_engine("larry", num_kv_blocks=40, max_num_batched_tokens=64, alpha=2.0)
    engine.add_request(SimRequest("a", 0.0, 200, 5))
    engine.add_request(SimRequest("b", 0.0, 30, 5))
    before = parse_stats(engine.stats(1.5).to_dict())
    assert before.queued_prefill_tokens == 230
    assert (before.num_waiting, before.num_running) == (2, 0)
    assert before.time == 1.5
    assert before.scheduler == "larry"
    assert before.alpha == 2.0
    engine.step(0.0)
    after = parse_stats(engine.stats(2.0).to_dict())
    assert after.step == 1
    assert after.queued_prefill_tokens == 230 - 64
    # LARRY admits the small prompt first: b (30 tokens, 2 blocks), then a 34-token chunk
    # of a (3 blocks).
    assert after.kv_blocks_free == 40 - (2 + 3)
    assert after.free_kv_tokens == after.kv_blocks_free * 16


@pytest.mark.parametrize("scheduler", sorted(ENGINE_SCHEDULERS))
def test_runs_are_deterministic(scheduler: str) -> None:
    def one_run() -> list[tuple[str, float | None, float | None, int]]:
        engine = make_engine(scheduler, num_kv_blocks=60, max_num_batched_tokens=128)
        requests = random_requests(seed=11, n=80)
        run(engine, requests)
        return [(r.request_id, r.first_token_s, r.finish_s, r.num_preemptions) for r in requests]

    assert one_run() == one_run()
