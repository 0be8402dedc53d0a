"""Time one routing decision per policy over a pool of backends (pure `policies.py`, no I/O).

The snapshot is random but seeded (every backend eligible except every 16th, varied free KV and
queued tokens), and one request of 1,000 prompt tokens is routed over and over. The result is
the per-call time of `Policy.select()` (the pure decision), plus, for SAL, the whole
per-request routing work the gateway does on its event loop: `StateTable.views()` (building
the 64 `BackendView` snapshots) followed by `select()`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from sal_gateway.policies import POLICIES, BackendView, RouteRequest, make_policy
from sal_gateway.state import StateTable
from sal_gateway.stats import ReplicaStats

_MODEL = "tiny"


@dataclass(frozen=True)
class DecisionTiming:
    """Per-call statistics of one policy's `select()` (microseconds)."""

    policy: str
    backends: int
    calls: int
    mean_us: float
    p50_us: float
    p99_us: float


def make_snapshot(n_backends: int, seed: int = 0) -> list[BackendView]:
    """A seeded pool of ``n_backends`` views with varied load; every 16th one is ineligible."""
    rng = random.Random(seed)
    return [
        BackendView(
            url=f"http://10.0.{i // 256}.{i % 256}:8000",
            eligible=i % 16 != 15,
            in_flight=rng.randrange(0, 64),
            free_kv_tokens=rng.randrange(0, 200_000),
            queued_prefill_tokens=rng.randrange(0, 50_000),
            max_num_batched_tokens=8192,
        )
        for i in range(n_backends)
    ]


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


def time_policy(name: str, n_backends: int, calls: int, batch: int = 50) -> DecisionTiming:
    """Time ``calls`` decisions of policy ``name``, in batches of ``batch`` calls per sample.

    Batching keeps the timer's own cost (~50 ns) out of the per-call numbers; p50/p99 are
    over the per-batch means.
    """
    policy = make_policy(name, seed=0)
    backends = make_snapshot(n_backends)
    request = RouteRequest(prompt_tokens=1000, beta=2.0)
    for _ in range(batch):  # warm-up
        policy.select(request, backends)
    samples: list[float] = []
    for _ in range(max(1, calls // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            policy.select(request, backends)
        samples.append((time.perf_counter() - start) / batch * 1e6)
    samples.sort()
    return DecisionTiming(
        policy=name,
        backends=n_backends,
        calls=len(samples) * batch,
        mean_us=sum(samples) / len(samples),
        p50_us=_percentile(samples, 0.50),
        p99_us=_percentile(samples, 0.99),
    )


def _state_table(n_backends: int, seed: int = 0) -> StateTable:
    """A `StateTable` of one model with ``n_backends`` freshly polled backends (at t=0)."""
    rng = random.Random(seed)
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    for view in make_snapshot(n_backends, seed):
        table.add_backend(_MODEL, view.url)
        stats = ReplicaStats(
            time=0.0, step=1, model=_MODEL, scheduler="larry", alpha=1.0, block_size=16,
            kv_blocks_total=20_000, kv_blocks_free=view.free_kv_tokens // 16,
            free_kv_tokens=view.free_kv_tokens,
            queued_prefill_tokens=view.queued_prefill_tokens,
            num_waiting=rng.randrange(0, 20), num_running=rng.randrange(0, 64),
            max_num_batched_tokens=view.max_num_batched_tokens, max_num_seqs=256,
        )  # fmt: skip
        table.record_poll_success(_MODEL, view.url, stats, "stats", now_s=0.0)
    return table


def time_request_path(name: str, n_backends: int, calls: int) -> DecisionTiming:
    """Time what the gateway does per request: `StateTable.views()` then `Policy.select()`."""
    policy = make_policy(name, seed=0)
    table = _state_table(n_backends)
    request = RouteRequest(prompt_tokens=1000, beta=2.0)
    samples: list[float] = []
    for _ in range(max(1, calls // 50)):
        start = time.perf_counter()
        for _ in range(50):
            policy.select(request, table.views(_MODEL, 0.5))
        samples.append((time.perf_counter() - start) / 50 * 1e6)
    samples.sort()
    return DecisionTiming(
        policy=f"{name}: views() + select()",
        backends=n_backends,
        calls=len(samples) * 50,
        mean_us=sum(samples) / len(samples),
        p50_us=_percentile(samples, 0.50),
        p99_us=_percentile(samples, 0.99),
    )


def time_all_policies(n_backends: int = 64, calls: int = 20_000) -> list[DecisionTiming]:
    """`time_policy` for every registered policy, then SAL's whole per-request path."""
    rows = [time_policy(name, n_backends, calls) for name in sorted(POLICIES)]
    rows.append(time_request_path("sal", n_backends, calls))
    return rows
