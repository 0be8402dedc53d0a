"""The engine model schedules exactly like vLLM's real V1 scheduler (differential test).

vLLM's own `Scheduler` (stock FCFS) and the LARRY patch's `LarryScheduler` run on CPU, no
model, fed fabricated outputs (one token per request whose prefill completed), the way
vLLM's ``tests/v1/core`` drive it. The engine model runs the same workload in lockstep; at
every step both must schedule the same tokens for the same requests, preempt the same
requests and finish the same ones.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest

# torch and vLLM emit DeprecationWarnings at import time; `filterwarnings=error` would turn
# them into collection errors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import LoRAConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from engine_patch.scheduler import LarryScheduler
    from tests.vllm_scheduler_support import (
        BLOCK_SIZE,
        Clock,
        engine_step,
        make_request,
        make_scheduler,
    )

from engine_sim.cost_model import PROFILES
from engine_sim.engine import EngineConfig, EngineModel, SimRequest


@pytest.fixture(autouse=True)
def stats_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The LARRY patch publishes /stats snapshots; keep them in the test's directory.
    monkeypatch.setenv("SAL_STATS_PREFIX", str(tmp_path / "stats"))


ADAPTERS = ("chat", "sql", "code", "legal")


def vllm_request(req: SimRequest, token: int) -> Request:
    """`req` for vLLM, its prompt one token (from `token`) repeated; its adapter, if any, as
    a `LoRARequest` (ids from 1, as vLLM numbers them)."""
    lora = None
    if req.adapter is not None:
        lora = LoRARequest(req.adapter, ADAPTERS.index(req.adapter) + 1, f"/a/{req.adapter}")
    return make_request(
        req.request_id,
        req.prompt_tokens,
        req.arrival_s,
        max_tokens=req.output_tokens,
        prompt=[token % 1900 + 20] * req.prompt_tokens,
        lora_request=lora,
    )


def workload(seed: int, n: int) -> list[tuple[int, SimRequest]]:
    """(step at which it arrives, request): bursts of long and short prompts and outputs."""
    rng = random.Random(seed)
    out = []
    step = 0
    for i in range(n):
        step += rng.choice([0, 0, 1, 3, 8])
        prompt = rng.choice([rng.randint(1, 40), rng.randint(100, 700)])
        output = rng.choice([rng.randint(1, 8), rng.randint(30, 200)])
        out.append((step, SimRequest(f"r{i:03d}", step * 0.05, prompt, output)))
    return out


CASES = [
    # scheduler, usable blocks, budget, max_num_seqs, chunked, alpha, max_loras
    pytest.param("fcfs", 60, 256, 16, True, None, 0, id="fcfs-tight-kv-chunked"),
    pytest.param("fcfs", 400, 512, 4, True, None, 0, id="fcfs-seq-limited"),
    pytest.param("fcfs", 70, 1024, 32, False, None, 0, id="fcfs-no-chunking"),
    pytest.param("larry", 60, 256, 16, True, 1.0, 0, id="larry-tight-kv"),
    pytest.param("larry", 120, 512, 8, True, 50.0, 0, id="larry-alpha-50"),
    # --enable-lora --max-loras 2, four adapters and the base model: vLLM skips a request
    # whose adapter would be a third in the batch and considers the ones behind it.
    pytest.param("fcfs", 400, 512, 16, True, None, 2, id="fcfs-lora-slots"),
    pytest.param("larry", 120, 256, 16, True, 1.0, 2, id="larry-lora-slots"),
]


@pytest.mark.parametrize(
    ("scheduler", "blocks", "budget", "max_seqs", "chunked", "alpha", "max_loras"), CASES
)
def test_engine_model_schedules_like_vllm_step_by_step(
    tiny_model_dir: Path,
    scheduler: str,
    blocks: int,
    budget: int,
    max_seqs: int,
    chunked: bool,
    alpha: float | None,
    max_loras: int,
) -> None:
    cls = LarryScheduler if scheduler == "larry" else Scheduler
    clock = Clock(now_s=0.0)
    real = make_scheduler(
        cls,
        tiny_model_dir,
        num_blocks=blocks + 1,  # block 0 is vLLM's null block
        max_num_batched_tokens=budget,
        max_model_len=4096 if chunked else budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        alpha=alpha,
        clock=clock,
    )
    if max_loras:
        real.lora_config = LoRAConfig(max_loras=max_loras)  # as --enable-lora sets it
    model = EngineModel(
        EngineConfig(
            num_kv_blocks=blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            scheduler=scheduler,
            alpha=1.0 if alpha is None else alpha,
            max_loras=max_loras,
        ),
        PROFILES["tiny-cpu"],
    )
    arrivals = workload(seed=blocks + budget, n=60)
    if max_loras:
        rng = random.Random(max_loras)
        for _, req in arrivals:
            req.adapter = rng.choice([*ADAPTERS, None])
    skipped_for_a_slot = 0
    k = 0
    preemptions = 0
    for step in range(20_000):
        clock.now_s = step * 0.05
        while k < len(arrivals) and arrivals[k][0] <= step:
            req = arrivals[k][1]
            real.add_request(vllm_request(req, k))
            model.add_request(req)
            k += 1
        if not model.has_work():
            assert not real.requests
            if k == len(arrivals):
                break
            continue
        output, engine_out = engine_step(real)
        real_finished = sorted(
            o.request_id for outs in engine_out.values() for o in outs.outputs if o.finished
        )
        live = [r for _, r in arrivals[:k] if r.finish_s is None]
        before = {r.request_id: r.num_computed_tokens for r in live}
        result = model.step(clock.now_s)
        preempted = set(result.preempted)
        # A victim is never one already scheduled in the step (vLLM pops from the end).
        scheduled = {
            r.request_id: r.num_computed_tokens - before[r.request_id]
            for r in live
            if r.request_id not in preempted and r.num_computed_tokens != before[r.request_id]
        }
        assert scheduled == dict(output.num_scheduled_tokens), f"step {step}"
        assert preempted == set(output.preempted_req_ids or ()), f"step {step}"
        assert sorted(r.request_id for r in result.finished) == real_finished, f"step {step}"
        assert model.free_blocks == real.kv_cache_manager.block_pool.get_num_free_blocks()
        preemptions += len(preempted)
        if max_loras:
            running = {r.adapter for r in live if r.num_computed_tokens and r.adapter}
            assert len(running) <= max_loras, f"step {step}"
            waits = [r for r in live if not r.num_computed_tokens and r.adapter not in running]
            skipped_for_a_slot += bool(waits and len(running) == max_loras)
    assert k == len(arrivals)
    assert not model.has_work()
    if blocks <= 70:
        assert preemptions > 0, "the tight-KV cases must exercise preemption"
    if max_loras:
        assert skipped_for_a_slot > 0, "the LoRA cases must make requests wait for a slot"
