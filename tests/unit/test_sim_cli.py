"""``sal-bench simulate`` and ``sal-bench experiments`` (`bench.cli`)."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import experiments
from bench.cli import COMMANDS, main
from bench.progress import ProgressBar
from engine_sim.trace import load_azure_csv
from tests.conftest import DATA_DIR

CSV_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _trace(tmp_path: Path, n: int = 60) -> Path:
    rows = [
        f"2023-11-16 18:00:{i // 2:02d}.{(i % 2) * 5}000000,{100 + 37 * i},{5 + i % 20}\n"
        for i in range(n)
    ]
    path = tmp_path / "trace.csv"
    path.write_text(CSV_HEADER + "".join(rows))
    return path


def _simulate_args(trace: Path, *extra: str) -> list[str]:
    return [
        "simulate",
        "--trace",
        str(trace),
        "--replicas",
        "2",
        "--router",
        "sal",
        "--scheduler",
        "larry",
        "--load-factor",
        "2",
        "--profile",
        "llama3-8b-a100",
        *extra,
    ]


def test_simulate_json_reports_the_latency_percentiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate_args(_trace(tmp_path), "--json", "--seed", "3")) == 0
    body = json.loads(capsys.readouterr().out)
    summary = body["summary"]
    assert summary["requests"] == 60
    assert summary["unfinished"] == 0
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p95_s"] <= summary["ttft_p99_s"]
    assert 0 < summary["tgt_p50_s"] <= summary["tgt_p95_s"] <= summary["tgt_p99_s"]
    assert summary["norm_ttft_p50_ms_per_token"] > 0
    assert summary["preemption_rate"] >= 0
    assert summary["throughput_rps"] > 0
    assert body["config"]["scheduler"] == "larry"
    assert sum(body["routed_per_replica"]) == 60


def test_simulate_is_deterministic_and_load_factor_compresses_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path)
    outputs = []
    for factor in ("2", "2", "0.5"):
        args = _simulate_args(trace, "--json")
        args[args.index("--load-factor") + 1] = factor
        assert main(args) == 0
        outputs.append(json.loads(capsys.readouterr().out)["summary"])
    assert outputs[0] == outputs[1]
    # A quarter of the arrival rate stretches the 30 s trace to ~120 s of requests.
    assert outputs[2]["makespan_s"] > 3 * outputs[0]["makespan_s"]


def test_simulate_prints_a_table_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate_args(_trace(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 (s)" in out
    assert "normalized TTFT p95 (ms/token)" in out
    assert "preemptions per 100 requests" in out


def test_simulate_reports_a_missing_trace_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate_args(tmp_path / "nope.csv")) == 2
    assert "nope.csv" in capsys.readouterr().err


def test_simulate_replays_the_committed_chat_trace_without_trace_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _simulate_args(Path("unused"), "--json", "--duration-s", "20")
    del args[1:3]  # no --trace: the chat trace in the repository's data/
    assert main(args) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["config"]["trace"] == str(DATA_DIR / "AzureLLMInferenceTrace_conv.csv")
    window = load_azure_csv(DATA_DIR / "AzureLLMInferenceTrace_conv.csv", duration_s=20)
    assert body["summary"]["requests"] == len(window) > 0


def test_a_missing_trace_names_the_data_folder_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # An installed copy with no clone beside it: the error says how to provide the traces.
    monkeypatch.setenv("SAL_DATA_DIR", str(tmp_path))
    args = _simulate_args(Path("unused"))
    del args[1:3]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "AzureLLMInferenceTrace_conv.csv") in err
    assert "SAL_DATA_DIR" in err
    assert "Traceback" not in err


def test_unknown_router_is_rejected_with_the_known_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _simulate_args(_trace(tmp_path))
    args[args.index("--router") + 1] = "fastest"
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "least_requests" in capsys.readouterr().err


def test_the_subcommand_registry_lists_simulate_and_experiments() -> None:
    assert {"simulate", "experiments"} <= {c.name for c in COMMANDS}


def test_experiments_write_tables_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tiny plan over the real traces: same code path as --quick, a few seconds long.
    tiny = replace(
        experiments.QUICK,
        single_window_s=15.0,
        single_loads=(1.0, 3.0),
        single_workloads=("chat",),
        fleet_window_s=10.0,
        fleet_workloads=("chat-bursty",),
        fleets=(("llama3-8b-a100", 8),),
        routers=("sal", "p2c", "random"),
    )
    monkeypatch.setattr(experiments, "QUICK", tiny)
    out = tmp_path / "results"
    data = str(DATA_DIR)
    assert main(["experiments", "--quick", "--out", str(out), "--data-dir", data]) == 0
    report = (out / "results.md").read_text()
    assert "LARRY vs the next-best engine scheduler" in report
    assert "SAL vs the next-best of P2C / Random" in report
    assert "| larry a=1 |" in report
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["fleet_8xllama3-8b-a100_chat-bursty_1x.png", "single_chat.png"]
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    rows = json.loads((out / "results.json").read_text())["rows"]
    # 2 loads x 8 schedulers, 3 engine schedulers x 3 routers, 1 what-if SAL variant,
    # 5 staleness settings.
    assert len(rows) == 2 * len(experiments.SINGLE_SCHEDULERS) + 3 * 3 + 1 + 5
    assert {r["scheduler"] for r in rows} >= {"larry_tail", "tgi"}
    assert "sensitivity to poll staleness" in report
    assert "What-if: SAL with ties broken" in report


def test_experiments_need_the_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiments", "--quick", "--data-dir", str(tmp_path)]) == 2
    assert "--data-dir" in capsys.readouterr().err


def test_progress_bar_redraws_one_line_and_ends_it() -> None:
    stream = io.StringIO()
    bar = ProgressBar("simulating", stream=stream, width=10)
    for done in (0, 10, 10, 50, 100):
        bar(done, 100)
    bar(100, 100)  # calls after the end are ignored
    text = stream.getvalue()
    assert text.count("\n") == 1
    assert text.endswith("[##########] 100/100 requests\n")
    assert text.count("\r") == 4  # the repeated 10/100 is not redrawn
