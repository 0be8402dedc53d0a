"""The soak benchmark as a user runs it, shortened: ``sal-bench soak --minutes 1``.

A smoke test: the gateway and three emulated replicas start as processes, replicas are
SIGKILLed and restarted on their ports under streaming load, the live table is printed, and
every request ended as exactly one answer or one explicit error (nothing lost, nothing
duplicated, exit status 0). No speed or memory bound is asserted: those numbers are the
benchmark's output, not a test verdict.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak_report import ROW_HEADERS

pytestmark = pytest.mark.slow

REPLICAS = 3


def _free_run(n: int, start: int = 24000, stop: int = 25000) -> int:
    """The first port p in [start, stop) with p .. p+n-1 all bindable now."""
    for base in range(start, stop - n):
        sockets = []
        try:
            for port in range(base, base + n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports in [{start}, {stop})")


def test_one_minute_soak_loses_nothing(tmp_path: Path) -> None:
    result_path = tmp_path / "soak.json"
    cmd = [
        sys.executable, "-m", "bench.cli", "soak", "--minutes", "1", "--replicas", str(REPLICAS),
        "--row-every-s", "20", "--kill-every-s", "15", "--down-s", "2",
        "--base-port", str(_free_run(REPLICAS + 1)), "--json", str(result_path),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("|") and "minute" in line)
    assert [c.strip() for c in header.strip("|").split("|")] == list(ROW_HEADERS)
    rows = [line for line in lines if line.startswith("|") and line.strip("| ")[:1].isdigit()]
    assert len(rows) == 3  # one per 20 s period
    assert any(line.startswith("totals:") for line in lines)
    result = json.loads(result_path.read_text())
    totals = result["totals"]
    assert totals["lost"] == 0
    assert totals["duplicated"] == 0
    assert totals["kills"] >= 2
    assert totals["ok"] > 0
    assert totals["sent"] == totals["ok"] + totals["error_event"] + totals["http_error"]
    assert not result["restart_failures"]
    assert all(row["rss_mib"] > 0 and row["fds"] > 0 for row in result["rows"])
