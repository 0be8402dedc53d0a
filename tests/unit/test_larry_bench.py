"""The LARRY-vs-FCFS benchmark's trace slicing and statistics (no vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.larry_vllm_bench import format_table, load_trace_slice, percentile

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


def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([], 50) != percentile([], 50)  # NaN when there are no samples


def test_markdown_table() -> None:
    table = format_table(["metric", "larry"], [("TTFT p50 (s)", "0.100")])
    assert table.splitlines() == ["| metric | larry |", "|---|---|", "| TTFT p50 (s) | 0.100 |"]
