"""The cost model against published anchor points (sources and tolerances in
docs/engine_model.md, section "Anchors")."""

from __future__ import annotations

import pytest

from engine_sim.cost_model import (
    PROFILES,
    CostProfile,
    decode_time_s,
    iteration_time_s,
    prefill_time_s,
)
from engine_sim.engine import EngineConfig, EngineModel, SimRequest

A100_8B = PROFILES["llama3-8b-a100"]
H100X2_70B = PROFILES["llama3-70b-fp8-h100x2"]


def closed_loop_output_tok_s(
    profile: CostProfile, concurrency: int, prompt: int, output: int, rounds: int = 6
) -> tuple[float, float]:
    """`vllm bench serve --max-concurrency C --request-rate inf` on the engine model.

    Keeps `concurrency` requests in flight (a new one arrives when one finishes) and
    returns (output tokens per second, mean time per output token after the first).
    """
    engine = EngineModel(
        EngineConfig(num_kv_blocks=profile.num_kv_blocks(), max_num_batched_tokens=2048),
        profile,
    )
    total = concurrency * rounds
    issued = 0
    done: list[SimRequest] = []
    now_s = 0.0
    for _ in range(concurrency):
        engine.add_request(SimRequest(f"r{issued}", now_s, prompt, output))
        issued += 1
    while engine.has_work():
        result = engine.step(now_s)
        now_s += result.duration_s
        for req in result.finished:
            done.append(req)
            if issued < total:
                engine.add_request(SimRequest(f"r{issued}", now_s, prompt, output))
                issued += 1
    tpots = [
        (r.finish_s - r.first_token_s) / (output - 1)
        for r in done
        if r.finish_s is not None and r.first_token_s is not None
    ]
    return total * output / now_s, sum(tpots) / len(tpots)


def test_8b_a100_single_stream_decode_matches_the_measured_75_tokens_per_s() -> None:
    # Anchor A1: vLLM 0.23, Llama-3.1-8B bf16, one A100-40GB, 1024-in/128-out, C=1:
    # ~75 output tokens/s (77% of the HBM roofline). Tolerance 15%.
    _, tpot_s = closed_loop_output_tok_s(A100_8B, 1, 1024, 128)
    assert 1.0 / tpot_s == pytest.approx(75.0, rel=0.15)


def test_8b_a100_batching_gain_at_concurrency_8_matches_the_measured_6_6x() -> None:
    # Anchor A2: same sweep, output throughput at C=8 is ~6.6x that at C=1. Tolerance 20%.
    one, _ = closed_loop_output_tok_s(A100_8B, 1, 1024, 128)
    eight, _ = closed_loop_output_tok_s(A100_8B, 8, 1024, 128)
    assert eight / one == pytest.approx(6.6, rel=0.20)


def model_flops_utilisation(profile: CostProfile, prompt_tokens: int) -> float:
    flops = 2.0 * profile.matmul_params * prompt_tokens
    return flops / prefill_time_s(profile, prompt_tokens) / profile.peak_flops


@pytest.mark.parametrize("prompt_tokens", [1024, 2048, 4096])
def test_8b_a100_prefill_runs_at_a_published_utilisation(prompt_tokens: int) -> None:
    # Anchor A3: a long prefill is compute-bound (Sarathi, Agrawal et al. 2023) and
    # reaches 45-72% of bf16 peak; 72% is FlashAttention-2's best end-to-end GPT result
    # on A100 (Dao 2023: 225 of 312 TFLOPS).
    assert 0.45 <= model_flops_utilisation(A100_8B, prompt_tokens) <= 0.72


def test_70b_fp8_h100x2_decode_step_matches_the_18_ms_anchor() -> None:
    # Anchor A4: "a single decode step takes about 18 ms" for Llama-3-70B (the issue).
    # On 2xH100 FP8 the weights (~70 GB) stream at 6.7 TB/s; tolerance 25%.
    step_s = decode_time_s(H100X2_70B, batch=1, context_per_seq=4096)
    assert step_s == pytest.approx(0.018, rel=0.25)


@pytest.mark.parametrize("profile", [A100_8B, H100X2_70B], ids=lambda p: p.name)
def test_no_prefill_is_faster_than_the_hardware_peak(profile: CostProfile) -> None:
    for prompt_tokens in (128, 1024, 4096, 16384):
        floor_s = 2.0 * profile.matmul_params * prompt_tokens / profile.peak_flops
        assert prefill_time_s(profile, prompt_tokens) > floor_s


def test_the_issue_120_ms_70b_prefill_is_below_any_physical_floor() -> None:
    """Why we do not match "4,096-token prefill of a 70B model on A100 ~120 ms": it needs
    5.8e14 FLOPs, 1.85 s at one A100's bf16 peak and still 146 ms at the FP8 peak of two
    H100s. Our 70B profile stays above that floor (docs/engine_model.md, "Anchors")."""
    flops = 2.0 * 70.6e9 * 4096
    assert flops / 312e12 > 1.8
    assert flops / (2 * 1979e12) > 0.120
    assert prefill_time_s(H100X2_70B, 4096) > flops / (2 * 1979e12)


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=lambda p: p.name)
def test_iteration_time_grows_with_work_and_is_zero_when_idle(profile: CostProfile) -> None:
    assert iteration_time_s(profile, 0, 0, 0) == 0.0
    base = iteration_time_s(profile, 0, 8, 8 * 1000)
    assert iteration_time_s(profile, 0, 64, 64 * 1000) > base
    assert iteration_time_s(profile, 0, 8, 8 * 8000) > base
    assert iteration_time_s(profile, 1024, 8, 8 * 1000 + 1024) > base
    # Decode is memory-bound: 8 sequences cost far less than 8 single-sequence steps.
    assert base < 2 * decode_time_s(profile, 1, 1000)


def test_kv_capacity_is_gpu_memory_minus_weights() -> None:
    # Llama-3-8B bf16 (16.06 GB) on 40 GiB at 0.9 utilisation, 128 KiB per token.
    tokens_8b = A100_8B.num_kv_blocks(16) * 16
    assert tokens_8b == pytest.approx((0.9 * 40 * 2**30 - 16.06e9 - 2 * 2**30) / 131072, abs=16)
    # 70B FP8 on 2 x 80 GiB, 320 KiB per token: room for ~230k tokens.
    tokens_70b = H100X2_70B.num_kv_blocks(16) * 16
    assert 200_000 < tokens_70b < 260_000
    assert PROFILES["tiny-cpu"].num_kv_blocks(16) == 1024
