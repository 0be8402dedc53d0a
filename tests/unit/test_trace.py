"""Trace loading and arrival processes (`engine_sim.trace`)."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from engine_sim.trace import (
    TraceError,
    TraceRequest,
    clip_lengths,
    gamma_arrivals,
    load_azure_csv,
    mean_rate_per_s,
    retime,
    scale_load,
    with_gamma_arrivals,
)
from tests.conftest import DATA_DIR as DATA

CSV_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path: Path, rows: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(CSV_HEADER + rows)
    return path


def test_azure_csv_times_are_relative_sorted_and_keep_sub_microsecond_digits(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        "2023-11-16 18:15:47.5000000,200,20\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n",
    )
    reqs = load_azure_csv(path)
    assert [r.prompt_tokens for r in reqs] == [374, 200, 396]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(0.81941, abs=1e-6)
    assert reqs[2].arrival_s == pytest.approx(4.314579, abs=1e-6)


def test_window_and_context_clipping(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "2023-11-16 18:00:00.0,100,10\n"
        "2023-11-16 18:00:05.0,9000,500\n"
        "2023-11-16 18:00:10.0,0,0\n"
        "2023-11-16 18:00:20.0,50,5\n",
    )
    reqs = load_azure_csv(path, context_limit_tokens=4096, start_s=5.0, duration_s=10.0)
    # The window [5, 15) keeps the 2nd and 3rd rows, shifted to start at 0.
    assert [r.arrival_s for r in reqs] == [0.0, 5.0]
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == (4095, 1)
    # Zero-length rows become the smallest request vLLM accepts.
    assert (reqs[1].prompt_tokens, reqs[1].output_tokens) == (1, 1)


def test_clip_lengths_keeps_prompt_and_output_within_the_limit() -> None:
    assert clip_lengths(100, 50, 4096) == (100, 50)
    assert clip_lengths(4000, 500, 4096) == (4000, 96)
    with pytest.raises(TraceError):
        clip_lengths(10, 10, 1)


def test_malformed_csv_names_the_problem(tmp_path: Path) -> None:
    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="expected columns"):
        load_azure_csv(bad_header)
    with pytest.raises(TraceError, match=r"trace.csv:3"):
        load_azure_csv(_write(tmp_path, "2023-11-16 18:00:00.0,1,1\n2023-11-16 x,1,1\n"))


def test_the_committed_chat_trace_loads_whole() -> None:
    reqs = load_azure_csv(DATA / "AzureLLMInferenceTrace_conv.csv")
    assert len(reqs) == 19366
    assert 58 * 60 < reqs[-1].arrival_s < 59 * 60
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))


def test_load_factor_multiplies_the_arrival_rate_and_keeps_lengths() -> None:
    reqs = [TraceRequest(float(i), 10 + i, 5) for i in range(10)]
    doubled = scale_load(reqs, 2.0)
    assert mean_rate_per_s(doubled) == pytest.approx(2 * mean_rate_per_s(reqs))
    assert [r.arrival_s for r in doubled] == [i / 2 for i in range(10)]
    assert [r.prompt_tokens for r in doubled] == [r.prompt_tokens for r in reqs]
    with pytest.raises(TraceError):
        scale_load(reqs, 0.0)


def test_retime_puts_lengths_on_other_timestamps_at_the_same_mean_rate() -> None:
    lengths = [TraceRequest(i * 0.5, 100 + i, 10 + i) for i in range(5)]
    bursty = [TraceRequest(t, 1, 1) for t in (10.0, 10.1, 10.2, 18.0, 30.0)]
    out = retime(lengths, bursty)
    assert [(r.prompt_tokens, r.output_tokens) for r in out] == [
        (r.prompt_tokens, r.output_tokens) for r in lengths
    ]
    assert mean_rate_per_s(out) == pytest.approx(mean_rate_per_s(lengths))
    # The shape of the bursty timestamps is kept: the first three stay bunched together.
    assert out[2].arrival_s - out[0].arrival_s < 0.1 * (out[4].arrival_s - out[0].arrival_s)


def test_gamma_arrivals_have_the_requested_rate_and_burstiness_and_are_seeded() -> None:
    times = gamma_arrivals(20000, rate_per_s=5.0, cv=3.0, seed=7)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.15)
    assert gamma_arrivals(100, 5.0, 3.0, seed=7) == times[:100]
    assert gamma_arrivals(100, 5.0, 3.0, seed=8) != times[:100]


def test_with_gamma_arrivals_keeps_lengths_and_rate() -> None:
    reqs = [TraceRequest(i * 0.1, 100 + i, 7) for i in range(3000)]
    out = with_gamma_arrivals(reqs, cv=2.0, seed=1)
    assert [r.prompt_tokens for r in out] == [r.prompt_tokens for r in reqs]
    assert mean_rate_per_s(out) == pytest.approx(mean_rate_per_s(reqs), rel=0.15)
