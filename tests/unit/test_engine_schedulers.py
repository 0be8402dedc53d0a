"""Engine scheduling policies: which request runs first, and who gets preempted."""

from __future__ import annotations

import pytest

from engine_sim.cost_model import PROFILES
from engine_sim.engine import EngineConfig, EngineModel, SimRequest
from sal_core.larry import larry_order

TINY = PROFILES["tiny-cpu"]


def engine_for(scheduler: str, num_kv_blocks: int, **overrides: object) -> EngineModel:
    kwargs: dict[str, object] = {"num_kv_blocks": num_kv_blocks, "scheduler": scheduler}
    kwargs.update(overrides)
    return EngineModel(EngineConfig(**kwargs), TINY)  # type: ignore[arg-type]


def drain(engine: EngineModel, requests: list[SimRequest]) -> int:
    """Run to completion (arrivals on the virtual clock); returns total preemptions seen."""
    pending = sorted(requests, key=lambda r: r.arrival_s)
    now_s, k, preemptions = 0.0, 0, 0
    while k < len(pending) or engine.has_work():
        while k < len(pending) and pending[k].arrival_s <= now_s:
            engine.add_request(pending[k])
            k += 1
        if not engine.has_work():
            now_s = pending[k].arrival_s
            continue
        result = engine.step(now_s)
        preemptions += len(result.preempted)
        now_s += result.duration_s
    return preemptions


def head_of_line_scenario() -> tuple[SimRequest, SimRequest, SimRequest]:
    """A 20-block engine: a long-running blocker holds 13-16 blocks, then a big prompt
    (8 blocks, cannot fit) arrives before a small one (1 block, fits)."""
    blocker = SimRequest("blocker", 0.0, prompt_tokens=200, output_tokens=50)
    big = SimRequest("big", 0.01, prompt_tokens=120, output_tokens=2)
    small = SimRequest("small", 0.02, prompt_tokens=16, output_tokens=2)
    return blocker, big, small


def test_fcfs_stops_at_the_first_request_that_does_not_fit() -> None:
    blocker, big, small = head_of_line_scenario()
    drain(engine_for("fcfs", 20), [blocker, big, small])
    # The small request could have run beside the blocker, but FCFS does not look past
    # the big one: head-of-line blocking.
    assert blocker.finish_s is not None
    assert small.first_token_s is not None
    assert small.first_token_s > blocker.finish_s
    assert big.first_token_s is not None
    assert big.first_token_s <= small.first_token_s


def test_larry_admits_the_small_prompt_past_the_big_one() -> None:
    blocker, big, small = head_of_line_scenario()
    drain(engine_for("larry", 20), [blocker, big, small])
    assert blocker.finish_s is not None
    assert small.finish_s is not None
    assert small.finish_s < blocker.finish_s
    assert big.first_token_s is not None
    assert big.first_token_s > blocker.finish_s


def test_larry_with_large_alpha_degenerates_to_fcfs() -> None:
    blocker, big, small = head_of_line_scenario()
    drain(engine_for("larry", 20, alpha=1e6), [blocker, big, small])
    assert small.first_token_s is not None
    assert blocker.finish_s is not None
    assert small.first_token_s > blocker.finish_s


def test_larry_admits_in_exactly_the_vllm_patch_order() -> None:
    """The engine model's LARRY is `sal_core.larry.larry_order`, not a re-write.

    One sequence slot and one-token outputs: every step admits exactly one request (the
    head of LARRY's order over what is still waiting at that step) and finishes it.
    """
    requests = [
        SimRequest("a", 0.0, 700, 1),
        SimRequest("b", 0.5, 40, 1),
        SimRequest("c", 1.0, 300, 1),
        SimRequest("d", 9.0, 90, 1),
    ]
    engine = engine_for("larry", 400, max_num_batched_tokens=4096, max_num_seqs=1, alpha=3.0)
    for r in requests:
        engine.add_request(r)
    remaining = list(requests)
    admitted: list[str] = []
    now_s = 10.0
    while remaining:
        expected_head = larry_order(
            remaining,
            now_s=now_s,
            alpha=3.0,
            block_size=16,
            arrival_s=lambda r: r.arrival_s,
            uncomputed_tokens=lambda r: r.prompt_tokens,
            request_id=lambda r: r.request_id,
        )[0]
        result = engine.step(now_s)
        assert [rid for rid, _ in result.new_tokens] == [expected_head.request_id]
        remaining.remove(expected_head)
        admitted.append(expected_head.request_id)
        now_s += result.duration_s
    assert admitted[0] == "b"
    assert admitted != ["a", "b", "c", "d"]


@pytest.mark.parametrize("scheduler", ["fcfs", "larry", "trail_plus"])
def test_kv_pressure_preempts_with_dynamic_allocation(scheduler: str) -> None:
    requests = [SimRequest(f"r{i}", 0.0, 40, 100) for i in range(4)]
    assert drain(engine_for(scheduler, 12), requests) > 0
    assert sum(r.num_preemptions for r in requests) > 0


def test_no_preempt_reserves_the_full_output_and_never_preempts() -> None:
    requests = [SimRequest(f"r{i}", 0.0, 40, 100) for i in range(4)]
    engine = engine_for("no_preempt", 12)
    for r in requests:
        engine.add_request(r)
    engine.step(0.0)
    # 40 + 100 tokens = 9 blocks reserved; a second request does not fit the other 3.
    assert engine.num_running == 1
    assert engine.free_blocks == 3
    assert drain(engine, []) == 0
    assert all(r.num_preemptions == 0 for r in requests)
    assert all(r.output_done == 100 for r in requests)


def trail_scenario() -> list[SimRequest]:
    """20 blocks: a blocker (17 blocks at most), then a long-output and a short-output
    request of 12-block prompts: only one of them fits at a time."""
    return [
        SimRequest("blocker", 0.0, prompt_tokens=250, output_tokens=20),
        SimRequest("long", 0.0, prompt_tokens=180, output_tokens=100),
        SimRequest("short", 0.001, prompt_tokens=180, output_tokens=5),
    ]


def test_trail_plus_runs_the_shortest_remaining_output_first() -> None:
    _, long, short = trail = trail_scenario()
    drain(engine_for("trail_plus", 20, trail_c=0.0), trail)
    assert short.finish_s is not None
    assert long.first_token_s is not None
    assert short.finish_s < long.first_token_s
    _, long, short = fcfs = trail_scenario()
    drain(engine_for("fcfs", 20), fcfs)
    assert long.finish_s is not None
    assert short.first_token_s is not None
    assert long.finish_s < short.first_token_s


def test_trail_plus_preempts_an_early_long_request_for_a_shorter_one() -> None:
    engine = engine_for("trail_plus", 20, trail_c=0.8)
    long = SimRequest("long", 0.0, prompt_tokens=200, output_tokens=100)
    engine.add_request(long)
    now_s = 0.0
    for _ in range(3):
        now_s += engine.step(now_s).duration_s
    assert long.output_done == 3
    short = SimRequest("short", now_s, prompt_tokens=150, output_tokens=3)
    engine.add_request(short)
    result = engine.step(now_s)
    assert result.preempted == ["long"]
    assert long.num_preemptions == 1
    drain(engine, [])
    assert short.finish_s is not None
    assert long.finish_s is not None
    assert short.finish_s < long.finish_s


def test_trail_plus_with_c_zero_does_not_preempt_a_decoding_request() -> None:
    engine = engine_for("trail_plus", 20, trail_c=0.0)
    long = SimRequest("long", 0.0, prompt_tokens=200, output_tokens=100)
    engine.add_request(long)
    now_s = 0.0
    for _ in range(3):
        now_s += engine.step(now_s).duration_s
    engine.add_request(SimRequest("short", now_s, prompt_tokens=150, output_tokens=3))
    assert engine.step(now_s).preempted == []
    assert long.num_preemptions == 0
