"""``sal-bench sensitivity`` (`bench.sensitivity`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sensitivity
from bench.cli import main
from bench.sensitivity import BetaProbe, implied_beta
from engine_sim.trace import TraceRequest
from sal_core.policies import BackendView, RouteRequest


def test_implied_beta_is_total_tokens_over_output_tokens() -> None:
    reqs = [TraceRequest(0.0, 300, 100), TraceRequest(1.0, 500, 100)]
    assert implied_beta(reqs) == pytest.approx(5.0)


def test_a_fixed_beta_overrides_the_estimate_and_memory_bound_decisions_are_counted() -> None:
    # Backend 0 lacks memory for the prompt, backend 1 has a long queue: beta decides.
    pool = [
        BackendView(
            "a", True, 0, free_kv_tokens=900, queued_prefill_tokens=0, max_num_batched_tokens=2048
        ),
        BackendView(
            "b",
            True,
            0,
            free_kv_tokens=10**6,
            queued_prefill_tokens=20_000,
            max_num_batched_tokens=2048,
        ),
    ]
    request = RouteRequest(prompt_tokens=1000, beta=500.0)
    low, high = BetaProbe(0.01), BetaProbe(None)
    # 100 tokens missing on a; nothing runs there: freed at beta tokens per step.
    assert low.select(request, pool).index == 1  # 100 / 0.01 > 21,000 / 2048
    assert high.select(request, pool).index == 0  # the request's own beta: 100 / 500
    assert (low.decisions, low.memory_bound) == (1, 1)


@pytest.mark.slow
def test_the_quick_command_writes_report_json_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sensitivity, "QUICK", sensitivity.Plan(("code",), "llama3-8b-a100", 2, 120.0, 3)
    )
    monkeypatch.setattr(sensitivity, "BETAS", (1.0, 75.0))
    monkeypatch.setattr(sensitivity, "POLL_PERIODS_S", (0.1, 1.0))
    monkeypatch.setattr(sensitivity, "DELAYS_S", (0.0, 0.5))
    assert main(["sensitivity", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sensitivity.json").read_text())["rows"]
    knobs = {r["knob"] for r in rows}
    assert knobs == {
        "baseline",
        "beta",
        "beta_small_kv",
        "baseline_small_kv",
        "poll_interval_s",
        "stats_delay_s",
    }
    assert {r["window"] for r in rows} == {0, 1, 2}
    md = (tmp_path / "sensitivity.md").read_text()
    assert "running estimate" in md
    assert "memory term positive" in md
    assert (tmp_path / "sensitivity.png").stat().st_size > 1000
