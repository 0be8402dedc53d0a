"""LoRA in the simulator: adapter mixes, the engine model's ``--max-loras`` slots and the
simulated router's LoRA rule (the gateway's `sal_core.lora_slots.lora_route`).

The engine model's slots are checked step by step against vLLM's real scheduler in
`tests/unit/test_engine_vllm_parity.py`; these are the readable cases.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from engine_sim.adapters import adapter_names, with_adapters
from engine_sim.cost_model import PROFILES
from engine_sim.engine import EngineConfig, EngineModel, SimRequest
from engine_sim.simulator import RouterConfig, Simulation, submit_to_engine_model
from engine_sim.trace import TraceError, TraceRequest

PROFILE = "llama3-8b-a100"


def test_adapters_follow_their_zipf_popularity_and_the_seed() -> None:
    reqs = [TraceRequest(i * 0.1, 100, 10) for i in range(6000)]
    named = with_adapters(reqs, adapters=8, zipf_s=1.0, seed=3)
    assert named == with_adapters(reqs, adapters=8, zipf_s=1.0, seed=3)
    assert named != with_adapters(reqs, adapters=8, zipf_s=1.0, seed=4)
    counts = Counter(r.adapter for r in named)
    assert set(counts) == set(adapter_names(8))
    # Zipf 1 over 8: the first draws 1 / H(8) = 37 % of the requests, the last 4.6 %.
    assert counts["lora-00"] / 6000 == pytest.approx(0.368, abs=0.03)
    assert counts["lora-07"] / 6000 == pytest.approx(0.046, abs=0.015)
    assert [(r.arrival_s, r.prompt_tokens) for r in named] == [
        (r.arrival_s, r.prompt_tokens) for r in reqs
    ]
    half = Counter(r.adapter is None for r in with_adapters(reqs, adapters=8, base_share=0.5))
    assert half[True] / 6000 == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    "kwargs", [{"adapters": 0}, {"adapters": 2, "zipf_s": -1.0}, {"adapters": 2, "base_share": 1.5}]
)
def test_bad_adapter_mixes_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(TraceError):
        with_adapters([TraceRequest(0.0, 10, 10)], **kwargs)  # type: ignore[arg-type]


def test_a_request_waits_for_a_slot_while_those_behind_it_start() -> None:
    cost = PROFILES[PROFILE]
    engine = EngineModel(EngineConfig(num_kv_blocks=1000, max_loras=1), cost)
    for rid, adapter, output in [("x1", "x", 3), ("y1", "y", 3), ("x2", "x", 3), ("base", None, 3)]:
        engine.add_request(SimRequest(rid, 0.0, 20, output, adapter=adapter))
    result = engine.step(0.0)
    assert result.prefill_tokens == 60  # x1, x2 and the base request; y1 waits for x's slot
    stats = engine.stats(0.0)
    assert (stats.max_loras, stats.lora_running, stats.num_waiting) == (1, ("x",), 1)
    now_s = result.duration_s
    started_y = None
    for _ in range(10):
        result = engine.step(now_s)
        now_s += result.duration_s
        if result.prefill_tokens == 20:
            started_y = engine.stats(now_s).lora_running
            break
    assert started_y == ("y",)  # only once every x request had ended


def _run(reqs: list[TraceRequest], max_loras: int, **router: object) -> Simulation:
    cost = PROFILES[PROFILE]
    config = EngineConfig(num_kv_blocks=cost.num_kv_blocks(16), max_loras=max_loras)
    engines = [EngineModel(config, cost) for _ in range(2)]
    cfg = replace(RouterConfig(policy="round_robin"), **router)  # type: ignore[arg-type]
    return Simulation(reqs, engines, submit_to_engine_model, cfg)


def test_the_router_sends_an_adapter_past_a_replica_whose_slot_another_holds() -> None:
    # Round robin would send y to replica 0, whose only slot x holds for about 10 s.
    reqs = [
        TraceRequest(0.0, 100, 1000, adapter="x"),
        TraceRequest(0.01, 100, 1000),  # the base model: holds no slot on replica 1
        TraceRequest(0.5, 100, 5, adapter="y"),
    ]
    blind = _run(reqs, 1, lora_slots=False).run()
    ruled = _run(reqs, 1).run()
    y_blind, y_ruled = blind.outcomes[2], ruled.outcomes[2]
    assert (y_blind.replica, y_ruled.replica) == (0, 1)
    assert y_blind.first_token_s > reqs[0].arrival_s + 5.0  # after x's 1,000 tokens
    assert y_ruled.first_token_s - y_ruled.arrival_s < 0.5


def test_the_router_keeps_an_adapter_where_it_runs_and_spares_free_slots() -> None:
    # Two slots per replica. x runs on replica 0; round robin would give x's next request
    # replica 1's free slot; the rule keeps it on 0 (its queue is within a step).
    reqs = [
        TraceRequest(0.0, 100, 400, adapter="x"),
        TraceRequest(0.5, 100, 5, adapter="x"),
        TraceRequest(0.6, 100, 5, adapter="x"),
    ]
    ruled = _run(reqs, 2).run()
    assert [d.replica for d in ruled.decisions] == [0, 0, 0]
    only_slots = _run(reqs, 2, lora_affinity=False).run()
    assert [d.replica for d in only_slots.decisions] == [0, 1, 0]


@pytest.mark.parametrize(
    "workers",
    [
        {"gateways": 2, "shared_accounting": True},
        {"gateways": 2, "gossip_interval_s": 0.0, "gossip_delay_s": 0.001},
    ],
    ids=["workers", "peers"],
)
def test_gateways_sharing_accounting_see_each_others_pending_adapters(
    workers: dict[str, object],
) -> None:
    # Two gateways (round-robin split), one slot per replica. Gateway 0 sends x to replica
    # 0; 10 ms later, before any poll shows x there, gateway 1's own round robin also points
    # at replica 0. Sharing pending adapters (workers through memory, peers by gossip), it
    # sees the slot taken and sends y to replica 1; not sharing them, y waits behind x's
    # 1,000 tokens.
    reqs = [TraceRequest(0.0, 100, 1000, adapter="x"), TraceRequest(0.01, 100, 5, adapter="y")]
    shared = _run(reqs, 1, **workers).run()
    apart = _run(reqs, 1, shared_adapters=False, **workers).run()
    assert [d.gateway for d in shared.decisions] == [0, 1]
    assert [d.replica for d in shared.decisions] == [0, 1]
    assert [d.replica for d in apart.decisions] == [0, 0]
    y_shared, y_apart = (
        next(o for o in r.outcomes if o.request_id == "r1") for r in (shared, apart)
    )
    assert y_shared.first_token_s - y_shared.arrival_s < 0.5
    assert y_apart.first_token_s > 5.0  # after x's 1,000 tokens
