"""Metrics hygiene: series of removed backends disappear; nothing grows with backend churn."""

from __future__ import annotations

import dataclasses

from engine_sim.fake_vllm import default_stats
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.state import StateTable


def _touch_every_backend_series(metrics: GatewayMetrics, model: str, url: str) -> None:
    """What routing, a finished request, a retry and a failed poll leave behind."""
    series = metrics.series(model, url, "sal")
    series.ttft.observe(0.1)
    series.generation.observe(1.0)
    series.ok_requests.inc()
    series.routing_decisions.inc()
    metrics.requests.labels(model, url, "502").inc()
    metrics.retries.labels(model=model, backend=url).inc()
    metrics.stream_errors.labels(model=model, backend=url).inc()
    metrics.ejections.labels(model=model, backend=url).inc()
    metrics.poll_errors.labels(model, url, "timeout").inc()


def test_backend_churn_does_not_grow_the_exposition() -> None:
    metrics = GatewayMetrics("test")
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    table.add_backend("m", "http://static:1")
    table.record_poll_success("m", "http://static:1", default_stats(), "stats", now_s=0.0)
    _touch_every_backend_series(metrics, "m", "http://static:1")
    metrics.requests.labels("unknown", "none", "404").inc()
    sizes = []
    for generation in range(10):
        for i in range(20):  # 20 backends come, serve, and go: discovery churn
            url = f"http://10.0.{generation}.{i}:8000"
            table.add_backend("m", url)
            table.record_poll_success("m", url, default_stats(), "stats", now_s=0.0)
            _touch_every_backend_series(metrics, "m", url)
        metrics.refresh(table, 0.0, {"m": 2.0})
        assert b"10.0." in metrics.exposition()
        for i in range(20):
            url = f"http://10.0.{generation}.{i}:8000"
            table.remove_backend("m", url)
            metrics.forget_backend("m", url)
        metrics.refresh(table, 0.0, {"m": 2.0})
        text = metrics.exposition()
        assert b"10.0." not in text
        # Process metrics (RSS, CPU seconds) change their digits between scrapes: leave them out.
        sizes.append(
            sum(len(line) for line in text.splitlines() if not line.startswith(b"process_"))
        )
    assert len(set(sizes)) == 1  # the same size after every round of churn
    assert b"http://static:1" in text  # the backend still in the pool keeps its series
    assert b'backend="none"' in text  # requests that never reached a backend too


def test_late_requests_of_a_removed_backend_are_swept_at_the_next_scrape() -> None:
    metrics = GatewayMetrics("test")
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    table.add_backend("m", "http://gone:1")
    table.remove_backend("m", "http://gone:1")
    metrics.forget_backend("m", "http://gone:1")
    # A request that was in flight on it finishes after the removal.
    _touch_every_backend_series(metrics, "m", "http://gone:1")
    assert b"http://gone:1" in metrics.exposition()
    metrics.refresh(table, 0.0, {})
    assert b"http://gone:1" not in metrics.exposition()


def test_progress_age_is_exported_per_backend() -> None:
    metrics = GatewayMetrics("test")
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    table.add_backend("m", "http://a:1")
    table.add_backend("m", "http://b:1")
    table.record_poll_success("m", "http://a:1", default_stats(), "stats", now_s=10.0)
    metrics.refresh(table, 10.25, {})
    text = metrics.exposition().decode()
    assert 'sal_backend_progress_age_seconds{backend="http://a:1",model="m"} 0.25' in text
    assert 'sal_backend_progress_age_seconds{backend="http://b:1",model="m"} +Inf' in text


def test_lora_slots_are_exported_for_replicas_that_report_them() -> None:
    metrics = GatewayMetrics("test")
    table = StateTable(stale_after_s=1.0, eject_after_failures=3)
    for url in ("http://a:1", "http://b:1"):
        table.add_backend("m", url)
    lora = dataclasses.replace(default_stats(), max_loras=4, lora_running=("x",))
    table.record_poll_success("m", "http://a:1", lora, "stats", now_s=10.0)
    table.record_poll_success("m", "http://b:1", default_stats(), "stats", now_s=10.0)
    table.route("m", "http://a:1", 100, sent_s=10.1, adapter="y")  # takes a second slot
    metrics.refresh(table, 10.2, {})
    text = metrics.exposition().decode()
    assert 'sal_backend_lora_slots{backend="http://a:1",model="m"} 4.0' in text
    assert 'sal_backend_lora_slots_used{backend="http://a:1",model="m"} 2.0' in text
    assert 'sal_backend_lora_slots{backend="http://b:1"' not in text  # LoRA off there
