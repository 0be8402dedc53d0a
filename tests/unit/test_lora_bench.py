"""``sal-bench lora`` (`bench.lora_bench`, `bench.lora_report`): what it measures and how it
reports it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import lora_bench
from bench.cli import main
from bench.lora_report import headline, peers_headline, render, workers_headline

META = {
    "command": "sal-bench lora",
    "wall_s": 1.0,
    "plan": {"replicas": 8, "profile": "p", "windows": 3, "window_s": 300.0},
    "adapters": 32,
    "zipf_s": 1.0,
    "loads": {"chat": 2.0},
}


def _row(router: str, lora: str, window: int, p95: float) -> dict[str, object]:
    return {
        "workload": "chat",
        "load_fraction": 0.5,
        "max_loras": 4,
        "window": window,
        "router": router,
        "lora": lora,
        "ttft_p50_s": 0.1,
        "ttft_p95_s": p95,
        "ttft_p99_s": 2 * p95,
        "tgt_p50_s": 5.0,
    }


def test_the_report_pairs_windows_and_takes_the_best_baseline_per_window() -> None:
    rows = []
    for window in range(3):
        for router, worse in (("round_robin", 4.0), ("p2c", 6.0), ("least_requests", 8.0)):
            rows.append(_row(router, "blind", window, worse + window))
            rows.append(_row(router, "slots", window, 2.0))
            rows.append(_row(router, "affinity", window, 1.0))
        rows.append(_row("sal", "blind", window, 3.0))
        rows.append(_row("sal", "slots", window, 1.0))
        rows.append(_row("sal", "no_full", window, 0.75))
        rows.append(_row("sal", "affinity", window, 0.5))
    cells = headline(rows, ("chat", 0.5, 4))
    # Round robin is the best blind baseline in every window: 4, 5, 6 s against 0.5 s.
    assert cells["best baseline blind to LoRA slots"]["TTFT p95"] == "10x [8–12] win"
    assert cells["best baseline with the same rule"]["TTFT p95"] == "2x win"
    assert cells["SAL with the free-slot filter only"]["TTFT p50"] == "1x tie"
    assert cells["SAL without the all-full step (fewest in flight)"]["TTFT p95"] == "1.5x win"
    text = render(rows, META)
    assert "## chat, load 0.5 x, --max-loras 4" in text
    rule = "+ gateway rule (free slot, then affinity; all full: fewest in flight)"
    assert f"| sal | {rule} | 0.1 | 0.5 | 1 | 5 |" in text
    # A comparison the run left out (SAL without its no_full rows) reads "—".
    partial = [r for r in rows if not (r["router"] == "sal" and r["lora"] == "no_full")]
    assert (
        headline(partial, ("chat", 0.5, 4))["SAL without the all-full step (fewest in flight)"][
            "TTFT p95"
        ]
        == "—"
    )


def test_the_workers_section_pairs_shared_adapters_with_apart_and_one_gateway() -> None:
    rows = []
    for window in range(3):
        for router in ("round_robin", "p2c", "least_requests", "sal"):
            for lora in ("blind", "slots", "no_full", "affinity"):
                rows.append({**_row(router, lora, window, 1.0), "setup": "one"})
        for setup, p95 in (
            ("workers", 1.0 + window / 100),
            ("workers_apart", 2.0),
            ("peers", 1.5),
            ("peers_apart", 3.0),
        ):
            rows.append({**_row("sal", "affinity", window, p95), "setup": setup})
    cells = workers_headline(rows, ("chat", 0.5, 4), "sal")
    assert cells["{k} workers not sharing adapters / TTFT p95"] == "1.98x [1.96–2] win"
    assert cells["one gateway / TTFT p95"] == "0.99x [0.98–1] tie"
    assert cells["{k} gateways with peers / TTFT p95"] == "1.49x [1.47–1.5] win"
    assert workers_headline(rows, ("chat", 0.5, 4), "p2c") == {}  # no workers' runs
    assert peers_headline(rows, ("chat", 0.5, 4), "sal") == {
        "TTFT p95": "2x win",
        "TTFT p99": "2x win",
    }
    text = render(rows, {**META, "workers": 4})
    assert "| sal | 4 workers, adapters not shared | 0.1 | 2 | 4 | 5 |" in text
    assert "| sal | 1.98x [1.96–2] win |" in text
    # The single-gateway tables never mix in the workers' runs.
    rule = "+ gateway rule (free slot, then affinity; all full: fewest in flight)"
    assert f"| sal | {rule} | 0.1 | 1 | 2 | 5 |" in text


def test_a_missing_trace_is_refused_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lora", "--data-dir", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


@pytest.mark.slow
def test_the_quick_command_shows_what_lora_slots_are_worth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        lora_bench, "QUICK", lora_bench.Plan(("chat",), "llama3-8b-a100", 4, 120.0, 2)
    )
    monkeypatch.setattr(lora_bench, "ROUTERS", ("p2c", "sal"))
    monkeypatch.setattr(lora_bench, "MAX_LORAS", (8,))
    monkeypatch.setattr(lora_bench, "LOAD_FRACTIONS", (0.5,))
    assert main(["lora", "--quick", "--out", str(tmp_path)]) == 0  # in this process
    rows = json.loads((tmp_path / "lora.json").read_text())["rows"]
    # windows x routers x (LoRA routing of one gateway + workers and gateways with peers,
    # sharing adapters or not)
    assert len(rows) == 2 * 2 * (4 + 4)
    p95 = {
        (r["router"], r["lora"], r["window"]): r["ttft_p95_s"] for r in rows if r["setup"] == "one"
    }
    # With eight slots each for 32 adapters on 4 replicas, routing blind to the slots makes
    # requests queue behind other adapters: the gateway's rule is far better, every window.
    for window in range(2):
        for router in ("p2c", "sal"):
            assert p95[(router, "affinity", window)] * 2 < p95[(router, "blind", window)]
    report = (tmp_path / "lora.md").read_text()
    assert "| SAL with the gateway's rule against |" in report
    assert "| 4 workers sharing adapters against |" in report
