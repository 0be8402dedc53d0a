"""The README's first quick-start command: the gateway in front of emulated replicas."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_serves_the_builtin_load_through_every_replica(tiny_model_dir: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [
        sys.executable,
        "-m",
        "sal_gateway.cli",
        "demo",
        "--port",
        "0",
        "--replicas",
        "3",
        "--requests",
        "24",
        "--rate-per-s",
        "12",
        "--time-scale",
        "0.2",
        "--exit-after-load",
        "--model-dir",
        str(tiny_model_dir),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"SAL gateway \(sal\) on http://127\.0\.0\.1:\d+ in front of 3 emulated", out)
    assert "succeeded            24/24" in out
    shares = re.findall(r"routed to http://127\.0\.0\.1:\d+\s+([\d.]+)%", out)
    assert len(shares) == 3, out  # SAL spread the load over every replica
    assert sum(float(s) for s in shares) == pytest.approx(100.0, abs=0.5)
    # The replicas' prefix-cache hit rate is shown (whether a follow-up lands where its
    # prefix is cached depends on timing here; tests/integration/test_emulator.py forces it).
    hits = re.search(r"prefix-cache hits\s+([\d.]+)% of prompt tokens", out)
    assert hits is not None, out
    assert 0.0 <= float(hits.group(1)) <= 100.0
    # And what a cache of the fleet's KV (x1, x2, x4) could keep, from the gateway's metrics:
    # the emulated replicas report their KV, so the estimate counted every prompt.
    could = re.search(r"fleet could keep\s+x1 (\d+)% / x2 (\d+)% / x4 (\d+)%", out)
    assert could is not None, out
    x1, x2, x4 = (int(v) for v in could.groups())
    assert x1 <= x2 <= x4 <= 100  # a larger LRU cache holds what a smaller one holds


def test_demo_rejects_impossible_flags() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sal_gateway.cli", "demo", "--replicas", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--replicas must be >= 1, got 0" in done.stderr
