"""Fuzz tier: >= 10,000 hostile requests against ``sal-gateway serve`` over real sockets.

What a user would notice if it broke: some malformed request (bad JSON, wrong types, huge or
oddly encoded bodies, odd methods, paths and headers, request chat templates including
runaway ones) crashes the gateway, answers 5xx (a gateway fault) instead of a 4xx, leaks
memory or descriptors, or stalls the event loop so that normal clients, sending well-formed
requests at the same time, fail or slow down. Deterministic: one fixed seed.
The same run is `sal-bench fuzz` (bench/fuzz_bench.py), which also prints latencies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fuzz_bench import run_fuzz, running_gateway

pytestmark = pytest.mark.slow

N_HOSTILE = 10_000
SEED = 8


def test_ten_thousand_hostile_requests(tmp_path: Path, tiny_model_dir: Path) -> None:
    with running_gateway(tmp_path, tiny_model_dir) as url:
        r = run_fuzz(url, N_HOSTILE, seed=SEED, concurrency=16, quiet=50)
        log = (tmp_path / "gateway.log").read_text(errors="replace")
    assert r.sent == N_HOSTILE
    assert r.alive, "the gateway stopped answering /health"
    assert r.server_errors == [], r.server_errors[:20]
    assert "Traceback" not in log, log[-4000:]
    assert "Fatal error" not in log, log[-4000:]
    # Unparsable HTTP is refused and counted, but not logged once per request: a client
    # sending garbage cannot flood the log (one line per 10 s, with the count dropped).
    assert log.count("Invalid HTTP request received.") <= r.duration_s / 10 + 2
    # Only bodies over the size limit may go unanswered: the gateway answers 413 before
    # reading them, and closing with unread input resets the connection under the client.
    assert set(r.unanswered) <= {"sizes"}, r.unanswered
    assert sum(r.unanswered.values()) <= N_HOSTILE * 0.01
    # Normal clients were served throughout, the loop was never blocked for long.
    assert r.well_formed_failures == [], r.well_formed_failures[:20]
    assert len(r.fuzz_latency_s) > 10
    # The aim is 50 ms. With large bodies handled in worker processes we measure p99
    # <= 25 ms at load average ~6 and <= 75 ms at 8-15 (other jobs on the same 2 cores);
    # with that work in GIL-sharing threads it was 150-250 ms: 100 ms catches that regression
    # and leaves one histogram bucket for CI noise.
    assert r.lag_p99_s <= 0.1, f"event loop lag p99 <= {r.lag_p99_s} s"
    # Memory and descriptors bounded (large bodies are read a few at a time and processed in
    # workers; the gateway grew 20-45 MiB per run, 140-300 MiB when threads did that work).
    assert r.rss_after - r.rss_before < 128 * 2**20, (r.rss_before, r.rss_after)
    assert r.fds_after <= r.fds_before + 20
