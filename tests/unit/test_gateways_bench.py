"""Herding measures of ``sal-bench gateways`` (`bench.gateways`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gateways
from bench.cli import main
from bench.gateways import busiest_share, unseen_share
from engine_sim.simulator import RoutingRecord


def test_unseen_share_counts_work_another_gateway_sent_after_my_snapshot() -> None:
    decisions = [
        RoutingRecord(0.00, 0, 1, 0.0),
        RoutingRecord(0.05, 1, 1, 0.0),  # gateway 0 sent to replica 1 at 0.00, unseen by 1
        RoutingRecord(0.06, 1, 2, 0.0),  # nobody else sent to replica 2
        RoutingRecord(0.20, 0, 1, 0.10),  # gateway 1's request to 1 was at 0.05: seen
    ]
    assert unseen_share(decisions) == pytest.approx(1 / 4)
    assert unseen_share([RoutingRecord(t / 10, 0, 0, 0.0) for t in range(5)]) == 0.0


def test_busiest_share_is_the_top_replicas_share_per_poll_period() -> None:
    herd = [RoutingRecord(0.01 * i, i % 4, 3, 0.0) for i in range(4)]
    spread = [RoutingRecord(0.01 * i, i % 4, i, 0.0) for i in range(4)]
    assert busiest_share(herd, 0.1) == 1.0
    assert busiest_share(spread, 0.1) == 0.25


@pytest.mark.slow
def test_the_quick_command_writes_report_json_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = gateways.Plan(("code",), "llama3-8b-a100", 4, (1, 4), 120.0, 3, "round_robin")
    monkeypatch.setattr(gateways, "QUICK", tiny)
    monkeypatch.setattr(gateways, "ROUTERS", ("sal", "sal_shared", "sal_near", "p2c", "random"))
    assert main(["gateways", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gateways.json").read_text())["rows"]
    assert {(r["router"], r["gateways"]) for r in rows} >= {("sal", 4), ("random", 1)}
    assert all(r["unseen_share"] == 0.0 for r in rows if r["gateways"] == 1)
    # Sharing workers herd less than independent gateways, window by window.
    by = {(r["router"], r["gateways"], r["window"]): r["unseen_share"] for r in rows}
    for window in range(3):
        assert by[("sal_shared", 4, window)] < by[("sal", 4, window)]
    md = (tmp_path / "gateways.md").read_text()
    assert "unseen co-routing" in md
    assert "| sal_near | 4 |" in md
    assert (tmp_path / "gateways.png").stat().st_size > 1000
