"""The gateway benchmark as a user runs it: ``python -m bench.gateway_bench --quick``.

A smoke test: the command finishes, prints every table, and its raw report holds measurements
from every section (requests went through the gateway, every routing policy was timed, the
tokenizer counted the intended prompt sizes). No speed is asserted: numbers belong in the
printed tables, not in test verdicts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sal_core.policies import POLICIES

pytestmark = pytest.mark.slow


def test_quick_benchmark_prints_every_section(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gateway_bench", "--quick", "--no-stacks", "--json",
         str(report_path)],
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for title in (
        "## Added latency, saturating",
        "## Added latency, paced",
        "## Throughput of one gateway process",
        "## Routing decision time, 64 backends",
        "## Prefix cache cost per request",
        "## Tokenization",
    ):
        assert title in result.stdout
    report = json.loads(report_path.read_text())
    for section in ("added_latency", "paced_latency"):
        assert [row["concurrency"] for row in report[section]] == [1, 50, 200]
        assert all(row["requests"] > 0 for row in report[section])
    assert report["throughput"]["gateway_req_per_s"] > 0
    assert all(row["p50_us"] > 0 for row in report["prefix_costs"])
    steps = [row["step"] for row in report["prefix_costs"]]
    assert any(step.startswith("workers (8): tell the others a request") for step in steps), steps
    assert any(step.startswith("workers: apply another worker's") for step in steps), steps
    assert any(step.startswith("peers (8 gateways): tell the others") for step in steps), steps
    assert any(step.startswith("peers: apply another gateway's") for step in steps), steps
    timed = {row["policy"] for row in report["decisions"]}
    assert set(POLICIES) <= timed
    assert "sal: views() + select(), 8 workers sharing" in timed
    assert "sal: views() + select(), 8 gateways telling each other" in timed
    tokens = {row["name"]: row["tokens"] for row in report["tokenization"]}
    assert abs(tokens["completions text ~1k tokens"] - 1000) <= 50
    assert tokens["completions token IDs (1k)"] == 1000
