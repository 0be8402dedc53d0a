"""Time one routing decision per policy over a pool of backends (pure `policies.py`, no I/O).

The snapshot is random but seeded (every backend eligible except every 16th, varied free KV and
queued tokens), and one request of 1,000 prompt tokens is routed over and over. The result is
the per-call time of `Policy.select()`, the work the gateway does once per request on its
event loop (building the `BackendView` snapshot is the state table's job, timed separately as
``snapshot`` only to show its order of magnitude).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from sal_gateway.policies import POLICIES, BackendView, RouteRequest, make_policy


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


def time_snapshot(n_backends: int, calls: int) -> DecisionTiming:
    """Time building a fresh ``n_backends`` `BackendView` list (what a state table does)."""
    template = make_snapshot(n_backends)
    samples: list[float] = []
    for _ in range(max(1, calls // 50)):
        start = time.perf_counter()
        for _ in range(50):
            [
                BackendView(
                    url=b.url,
                    eligible=b.eligible,
                    in_flight=b.in_flight,
                    free_kv_tokens=b.free_kv_tokens,
                    queued_prefill_tokens=b.queued_prefill_tokens,
                    max_num_batched_tokens=b.max_num_batched_tokens,
                )
                for b in template
            ]
        samples.append((time.perf_counter() - start) / 50 * 1e6)
    samples.sort()
    return DecisionTiming(
        policy="(snapshot build)",
        backends=n_backends,
        calls=len(samples) * 50,
        mean_us=sum(samples) / len(samples),
        p50_us=_percentile(samples, 0.50),
        p99_us=_percentile(samples, 0.99),
    )


def time_all_policies(n_backends: int = 64, calls: int = 20_000) -> list[DecisionTiming]:
    """`time_policy` for every registered policy, then the snapshot build, in a fixed order."""
    rows = [time_policy(name, n_backends, calls) for name in sorted(POLICIES)]
    rows.append(time_snapshot(n_backends, calls))
    return rows
