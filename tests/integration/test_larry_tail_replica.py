"""The tail-guarded LARRY (`--sal-scheduler larry_tail`) in a real vLLM-on-CPU replica.

Two replica starts (~1-2 min each on a shared CPU box), the same forced state as
`tests/integration/test_engine_replica.py`: a blocker decodes (``--max-num-seqs 1``) while
three long and four short prompts are queued behind it, longs first, each sent once `/stats`
shows the previous one waiting; then the blocker is aborted and the admission order is read
from `/stats`. Nothing is inferred from durations.

* ``margin_s`` 1000 s: no request can be due, so the order is LARRY's (shorts first), which
  proves the class is installed and reorders.
* ``margin_s`` 0 and ``slack`` 0: every waiting request is due as soon as the guard has a
  drain rate (measured while the blocker runs with the queue backlogged; the test waits
  1.5 s after queueing, three times the 0.5 s of backlog the estimate needs), so pinned
  requests go in arrival order (longs first): the pin overrides LARRY inside vLLM.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sal_core.stats import parse_stats
from tests.integration.test_engine_replica import (
    LONG_TOKENS,
    PRESSURE_ARGS,
    QUEUED,
    SHORT_TOKENS,
    admission_samples,
    queued_after,
)
from tests.vllm_support import run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TAIL_PORT = 20014
BACKLOG_WAIT_S = 1.5


def tail_replica(model_dir: Path, section: dict[str, float]) -> Iterator[str]:
    extra = (*PRESSURE_ARGS, "--additional-config", json.dumps({"larry_tail": section}))
    with run_replica(model_dir, TAIL_PORT, scheduler="larry_tail", extra_args=extra) as url:
        yield url


@pytest.fixture
def unpinned_url(long_model_dir: Path) -> Iterator[str]:
    yield from tail_replica(long_model_dir, {"margin_s": 1000.0, "headroom": 0.0})


@pytest.fixture
def pinned_url(long_model_dir: Path) -> Iterator[str]:
    yield from tail_replica(long_model_dir, {"margin_s": 0.0, "slack": 0.0, "headroom": 0.0})


def states(url: str, settle_s: float) -> dict[int, int]:
    samples = admission_samples(url, settle_s=settle_s)
    seen = dict(asyncio.run(samples))
    assert any(0 < w < QUEUED for w in seen), seen
    return seen


def test_not_due_larry_tail_orders_like_larry(unpinned_url: str) -> None:
    seen = states(unpinned_url, settle_s=BACKLOG_WAIT_S)
    larry = [SHORT_TOKENS] * 4 + [LONG_TOKENS] * 3
    for waiting, queued in seen.items():
        assert queued == queued_after(larry[: QUEUED - waiting]), seen
    with httpx.Client(timeout=10.0) as client:
        stats = parse_stats(client.get(f"{unpinned_url}/stats").json())
    assert stats.scheduler == "larry_tail"
    assert stats.alpha == 1.0


def test_due_requests_are_pinned_in_arrival_order(pinned_url: str) -> None:
    seen = states(pinned_url, settle_s=BACKLOG_WAIT_S)
    arrival = [LONG_TOKENS] * 3 + [SHORT_TOKENS] * 4
    for waiting, queued in seen.items():
        assert queued == queued_after(arrival[: QUEUED - waiting]), seen
