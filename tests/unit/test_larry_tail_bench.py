"""`sal-bench larry-tail`: trace windows, the aims check and the report (no long runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.larry_tail import main
from bench.larry_tail_report import aims_met, aims_summary, aims_table, render
from bench.larry_tail_runs import (
    HELD_OUT_WINDOWS,
    TUNING_WINDOWS,
    VARIANTS,
    WINDOW_S,
    build_for,
    run_variant,
    variant,
    window_requests,
)
from engine_sim.cost_model import get_profile
from engine_sim.data import data_dir
from engine_sim.engine import EngineConfig
from engine_sim.schedulers import LarryTailScheduler
from engine_sim.trace import TraceRequest


def run(p50: float, p99: float, mx: float) -> dict[str, Any]:
    return {"ttft_p50_s": p50, "ttft_p99_s": p99, "ttft_max_s": mx}


def test_aims_against_fcfs_on_the_same_requests() -> None:
    fcfs = run(10.0, 50.0, 60.0)
    larry = run(1.0, 90.0, 120.0)
    ok = aims_met(run(4.0, 51.0, 65.0), fcfs, larry)
    assert ok == {"p99": True, "max": True, "p50": True, "light": None}
    bad = aims_met(run(6.0, 51.5, 66.5), fcfs, larry)
    assert bad == {"p99": False, "max": False, "p50": False, "light": None}


def test_lighter_loads_need_70_percent_of_larrys_own_gain() -> None:
    fcfs, larry = run(0.8, 5.0, 6.0), run(0.4, 9.0, 12.0)
    assert aims_met(run(0.52, 5.0, 6.0), fcfs, larry)["light"] is True
    assert aims_met(run(0.53, 5.0, 6.0), fcfs, larry)["light"] is False
    # No gain for LARRY to keep: met.
    assert aims_met(run(0.8, 5.0, 6.0), fcfs, run(0.8, 5.0, 6.0))["light"] is True


def _rows() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    for window in (0, 3):
        for label, p99 in (("fcfs", 50.0), ("larry", 80.0), ("larry_tail", 50.5 + window)):
            rows.append(
                {
                    "workload": "code",
                    "window": window,
                    "held_out": window == 3,
                    "load_x": 2.0,
                    "scheduler": label,
                    "requests": 100,
                    "ttft_p50_s": 2.0 if label != "fcfs" else 10.0,
                    "ttft_p95_s": 1.0,
                    "ttft_p99_s": p99,
                    "ttft_max_s": 60.0,
                    "norm_ttft_p50_ms_per_token": 1.0,
                    "norm_ttft_p95_ms_per_token": 1.0,
                    "preemption_rate": 0.0,
                    "tgt_p50_s": 1.0,
                }
            )
    meta = {
        "loads": [2.0],
        "windows": [0, 3],
        "tuning_windows": [0],
        "held_out_windows": [3],
        "workloads": ["code"],
        "variants": {"fcfs": "", "larry": "", "larry_tail": ""},
    }
    return rows, meta


def test_an_aim_missed_in_a_held_out_window_is_shown_in_bold() -> None:
    rows, meta = _rows()
    table = "\n".join(aims_table(rows, meta, "larry_tail"))
    # p99 50.5 <= 51 in the tuning window, 53.5 > 51 in the held-out one.
    assert "| code | 2x | 1/1 · **0/1** | 1/1 · 1/1 | 1/1 · 1/1 | - · - |" in table
    assert "p99 1/2" in table


def test_report_has_ratios_with_their_spread() -> None:
    rows, meta = _rows()
    text = render(rows, meta)
    # larry_tail p99 / FCFS: 50.5/50 and 53.5/50 -> median 1.04, range 1.01-1.07.
    assert "| larry_tail | 1.04 (1.01-1.07) |" in text
    assert "held-out windows only" in text


def test_windows_are_disjoint_600_s_slices_with_tuning_and_held_out_apart() -> None:
    assert not set(TUNING_WINDOWS) & set(HELD_OUT_WINDOWS)
    assert len(TUNING_WINDOWS) >= 3
    folder = data_dir()
    for workload in ("chat", "chat-bursty", "code"):
        first = window_requests(workload, 0, folder)
        last = window_requests(workload, 4, folder)
        for reqs in (first, last):
            assert len(reqs) > 500
            assert reqs[0].arrival_s >= 0
            assert reqs[-1].arrival_s < WINDOW_S
        assert [r.prompt_tokens for r in first[:20]] != [r.prompt_tokens for r in last[:20]]
    labels = [v.label for v in VARIANTS]
    assert {"fcfs", "fcfs+headroom", "larry", "larry_tail", "tgi"} <= set(labels)


def test_cli_refuses_unknown_schedulers_and_windows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schedulers", "sjf"]) == 2
    assert "--schedulers must be among" in capsys.readouterr().err
    assert main(["--windows", "7"]) == 2
    assert main(["--report-only", "--out", str(Path("/nonexistent"))]) == 2


def test_the_summary_counts_busy_runs_that_meet_p50_p99_and_max_at_once() -> None:
    rows, meta = _rows()
    lines = aims_summary(rows, meta, "fcfs")
    # Window 0 meets all three; window 3 misses the p99 (53.5 > 51): 1 of 2 busy runs.
    assert "| larry_tail | 1/2 | 2/2 | 2/2 | - | 0/1 | 1/2 |" in lines


def test_the_hindsight_what_if_pins_at_half_of_fcfss_own_p99() -> None:
    # An overloaded minute: 400 requests of 1,500-3,000 prompt tokens at 6.7/s.
    reqs = [
        TraceRequest(0.15 * i, 1_500 + (i * 7_919) % 1_500, 50 + (i * 104_729) % 200)
        for i in range(400)
    ]
    fcfs_p99 = run_variant(reqs, variant("fcfs").build)["ttft_p99_s"]
    assert fcfs_p99 > 5.0
    build = build_for(variant("hindsight deadline (what-if)"), reqs)
    config = EngineConfig(num_kv_blocks=get_profile("llama3-8b-a100").num_kv_blocks(16))
    scheduler = build(config)
    assert isinstance(scheduler, LarryTailScheduler)
    assert scheduler.guard.params.slack == 0.0
    assert scheduler.guard.params.margin_s == pytest.approx(0.5 * fcfs_p99)
    # Every other variant builds what it names, whatever the requests.
    assert build_for(variant("larry_tail"), reqs) is variant("larry_tail").build
