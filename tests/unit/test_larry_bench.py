"""The LARRY-vs-FCFS benchmark's trace slicing and statistics (no vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.larry_vllm_bench import (
    BENCH_SCHEDULERS,
    RunResult,
    _scheduler_args,
    format_table,
    launcher_scheduler,
    load_trace_slice,
    main,
    parse_counters,
    ratio_rows,
    replay_order,
    summary_rows,
)

TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,4000,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
"""


def test_trace_slice_rescales_time_prompts_and_caps_outputs(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    requests = load_trace_slice(
        path, start_row=1, count=2, load_factor=2.0, max_prompt_tokens=1000, max_output_tokens=60
    )
    assert len(requests) == 2
    assert requests[0].send_at_s == 0.0
    # 0.227 s apart in the trace, twice the rate here.
    assert requests[1].send_at_s == pytest.approx((51.2224670 - 50.9951690) / 2)
    # The longest prompt of the slice (4000) becomes 1000; the others keep their proportion.
    assert [r.prompt_tokens for r in requests] == [1000, round(879 / 4)]
    assert [r.output_tokens for r in requests] == [60, 55]


def test_short_prompts_are_not_scaled_up(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    requests = load_trace_slice(
        path, start_row=3, count=5, load_factor=1.0, max_prompt_tokens=1000, max_output_tokens=60
    )
    assert [r.prompt_tokens for r in requests] == [91]


def test_markdown_table() -> None:
    table = format_table(["metric", "larry"], [("TTFT p50 (s)", "0.100")])
    assert table.splitlines() == ["| metric | larry |", "|---|---|", "| TTFT p50 (s) | 0.100 |"]


def test_ratios_pair_each_run_with_fcfs_on_the_same_slice() -> None:
    def run(scheduler: str, index: int, ttft: list[float]) -> RunResult:
        return RunResult(scheduler, index, ttft_s=ttft, norm_ttft_s_per_token=ttft)

    results = [
        run("fcfs", 0, [1.0, 2.0, 4.0]),
        run("fcfs", 1, [2.0, 4.0, 8.0]),
        run("larry_tail", 0, [0.5, 1.0, 2.0]),
        run("larry_tail", 1, [2.0, 4.0, 8.0]),
    ]
    rows = {row[0]: row[1] for row in ratio_rows(results, ["fcfs", "larry_tail"])}
    # Run 0 halves every latency, run 1 ties: the median of 0.5 and 1.0, with the spread.
    assert rows["TTFT p50"] == "0.75 (0.5-1), 1/2 < 1"
    assert rows["TTFT max"] == "0.75 (0.5-1), 1/2 < 1"
    summary = {row[0]: row[1:] for row in summary_rows(results, ["fcfs", "larry_tail"])}
    assert summary["TTFT p50 (s)"] == ("3 (2-4)", "2.5 (1-4)")


def test_headroom_reaches_the_replica_as_vllm_and_larry_tail_settings() -> None:
    assert _scheduler_args("fcfs+headroom", 0.05) == ["--watermark", "0.05"]
    assert _scheduler_args("larry_tail", 0.05) == [
        "--additional-config",
        '{"larry_tail": {"headroom": 0.05}}',
    ]
    assert _scheduler_args("larry", 0.05) == []
    assert _scheduler_args("larry+noprefix", 0.05) == ["--no-enable-prefix-caching"]
    assert launcher_scheduler("larry+noprefix") == "larry"
    assert set(BENCH_SCHEDULERS) >= {"fcfs", "fcfs+headroom", "larry", "larry_tail"}


def test_a_margin_variant_runs_the_tail_guard_with_that_margin() -> None:
    assert launcher_scheduler("larry_tail+margin2") == "larry_tail"
    assert launcher_scheduler("larry_tail+margin0.25") == "larry_tail"
    assert _scheduler_args("larry_tail+margin2", 0.05) == [
        "--additional-config",
        '{"larry_tail": {"headroom": 0.05, "margin_s": 2.0}}',
    ]
    assert launcher_scheduler("larry_tail+margin") is None
    assert launcher_scheduler("larry+margin2") is None


def test_interleaved_order_runs_each_slice_on_every_scheduler_first_in_turn() -> None:
    order = replay_order(["fcfs", "larry", "larry_tail"], 3, "interleaved")
    assert order == [
        (0, "fcfs"), (0, "larry"), (0, "larry_tail"),
        (1, "larry"), (1, "larry_tail"), (1, "fcfs"),
        (2, "larry_tail"), (2, "fcfs"), (2, "larry"),
    ]  # fmt: skip
    grouped = replay_order(["fcfs", "larry"], 2, "grouped")
    assert grouped == [(0, "fcfs"), (1, "fcfs"), (0, "larry"), (1, "larry")]


@pytest.mark.parametrize("schedulers", ["fcfs,lary", "fcfs,fcfs", "larry_tail+marginx"])
def test_unknown_or_repeated_schedulers_are_refused_before_any_replica_starts(
    schedulers: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    assert main(["--trace", str(trace), "--schedulers", schedulers]) == 2
    assert "--schedulers among" in capsys.readouterr().err


def test_preemptions_and_engine_steps_are_read_from_vllm_metrics() -> None:
    text = (
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0\n'
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"} 40.0\n'
        'vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 812.0\n'
        'vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 9000.0\n'
    )
    assert parse_counters(text) == (3, 812)
    assert parse_counters("") == (0, 0)
