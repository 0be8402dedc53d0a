"""Do the gateway's pollers keep their cadence while the request path saturates the CPU?

``python -m bench.poll_cadence [--duration-s 8] [--concurrency 200 300] [--cpu-hogs N]
[--json PATH]``

Starts the same processes as `bench.gateway_bench` (two fake backends, the real gateway; no
client-stack proxies), then for each cell runs closed-loop SSE streams through the gateway
(the paced fake, the shape of `bench.gateway_bench`'s "paced" section, and the fast fake,
which saturates the machine) while a sampler scrapes the gateway's ``/metrics`` every 100 ms.
Per cell it reports:

* requests, errors and 503s seen by the clients ("no eligible backend": a replica declared
  stale while healthy);
* the state age of each backend as the gateway saw it at each scrape (p50 / p99 / max) and
  how many scrapes found a backend not eligible (``sal_backend_healthy 0``);
* ejections, and, where the gateway exports them, poll errors by reason and the poll interval
  histogram (``sal_poll_interval_seconds``: p50 / p99).

``--cpu-hogs N`` runs N busy-looping processes during each cell (other tenants of a shared
machine), so that "the request path saturates the CPU" is reproducible on an idle machine.

Works against any gateway version (it only reads metrics that exist), so it measures the
"before" and the "after" of a change alike. Loopback only; bounded in time and count.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.gateway_bench import (
    FAST_MODEL,
    PACED_MODEL,
    _loadgen_args,
    _parse_loadgen,
    running_servers,
    settle,
)
from sal_core.percentile import percentile

SCRAPE_EVERY_S = 0.1
STALE_AFTER_S = 1.0


def scrape(gateway: str, timeout_s: float = 2.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The gateway's metric samples by name (``[(labels, value), ...]``)."""
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


class Sampler(threading.Thread):
    """Scrapes ``/metrics`` every `SCRAPE_EVERY_S` until stopped; keeps per-backend samples."""

    def __init__(self, gateway: str) -> None:
        super().__init__(name="metrics sampler", daemon=True)
        self.gateway = gateway
        self.ages: dict[str, list[float]] = {}
        self.unhealthy: dict[str, int] = {}
        self.scrapes = 0
        self.failed_scrapes = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SCRAPE_EVERY_S):
            try:
                samples = scrape(self.gateway)
            except OSError:
                self.failed_scrapes += 1
                continue
            self.scrapes += 1
            for labels, value in samples.get("sal_backend_state_age_seconds", []):
                self.ages.setdefault(labels["model"], []).append(value)
            for labels, value in samples.get("sal_backend_healthy", []):
                model = labels["model"]
                self.unhealthy[model] = self.unhealthy.get(model, 0) + (value == 0)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10.0)


def _counter_sum(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str
) -> float:
    return sum(
        v
        for labels, v in samples.get(name, [])
        if all(labels.get(k) == w for k, w in match.items())
    )


def _histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus-style quantile from cumulative (le, count) buckets (linear within a bucket)."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def _poll_intervals(before: dict[str, Any], after: dict[str, Any], model: str) -> dict[str, float]:
    def buckets(samples: dict[str, Any]) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, v in samples.get("sal_poll_interval_seconds_bucket", []):
            if labels.get("model", model) == model:
                le = float(labels["le"])
                out[le] = out.get(le, 0.0) + v
        return out

    b0, b1 = buckets(before), buckets(after)
    if not b1:
        return {}
    delta = [(le, b1[le] - b0.get(le, 0.0)) for le in b1]
    return {
        "poll_interval_p50_ms": _histogram_quantile(delta, 0.5) * 1e3,
        "poll_interval_p99_ms": _histogram_quantile(delta, 0.99) * 1e3,
        "polls": max(c for _, c in delta),
    }


_HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def run_cell(
    gateway: str, model: str, concurrency: int, duration_s: float, cpu_hogs: int = 0
) -> dict[str, Any]:
    """One load cell through the gateway with the sampler running; returns its row."""
    settle(gateway)
    before = scrape(gateway)
    sampler = Sampler(gateway)
    sampler.start()
    hogs = [
        subprocess.Popen([sys.executable, "-c", _HOG.format(s=duration_s + 2.0)])
        for _ in range(cpu_hogs)
    ]
    args = _loadgen_args(
        f"{gateway}/v1/completions", model, concurrency, True, duration_s, 1_000_000
    )
    try:
        proc = subprocess.run(args, capture_output=True, check=False, timeout=duration_s + 120.0)
    finally:
        sampler.stop()
        for hog in hogs:
            hog.kill()
            hog.wait()
    result = _parse_loadgen(proc.returncode, proc.stdout, proc.stderr)
    after = scrape(gateway)

    def delta(name: str, **match: str) -> float:
        return _counter_sum(after, name, **match) - _counter_sum(before, name, **match)

    ages = sampler.ages.get(model, [])
    row: dict[str, Any] = {
        "model": model,
        "concurrency": concurrency,
        "cpu_hogs": cpu_hogs,
        "requests": len(result.latency_s),
        "errors": result.errors,
        "http_503": delta("sal_requests_total", model=model, status="503"),
        "ejections": delta("sal_backend_ejections_total", model=model),
        "scrapes": sampler.scrapes,
        "failed_scrapes": sampler.failed_scrapes,
        "not_eligible_scrapes": sampler.unhealthy.get(model, 0),
        "state_age_p50_ms": percentile(ages, 50) * 1e3 if ages else math.nan,
        "state_age_p99_ms": percentile(ages, 99) * 1e3 if ages else math.nan,
        "state_age_max_ms": max(ages) * 1e3 if ages else math.nan,
        "error_sample": result.error_sample[:200],
    }
    reasons: dict[str, float] = {}
    for labels, v in after.get("sal_poll_errors_total", []):
        if labels.get("model") == model:
            prior = _counter_sum(before, "sal_poll_errors_total", **labels)
            reasons[labels["reason"]] = reasons.get(labels["reason"], 0.0) + v - prior
    row["poll_errors"] = {k: v for k, v in reasons.items() if v}
    row.update(_poll_intervals(before, after, model))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.poll_cadence", description=__doc__)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[200, 300])
    parser.add_argument("--cpu-hogs", type=int, default=0, help="busy processes per cell")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from engine_patch import tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="sal-poll-cadence-") as tmp:
        work = Path(tmp)
        model_dir = tiny_model.build(work / "tiny-llama", max_model_len=4096)
        with running_servers(work, model_dir, with_stacks=False) as ep:
            for model in (PACED_MODEL, FAST_MODEL):
                for c in args.concurrency:
                    row = run_cell(ep.gateway, model, c, args.duration_s, args.cpu_hogs)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    cols = [
        "model", "concurrency", "cpu_hogs", "requests", "errors", "http_503", "ejections",
        "not_eligible_scrapes", "scrapes", "state_age_p50_ms", "state_age_p99_ms",
        "state_age_max_ms", "poll_interval_p50_ms", "poll_interval_p99_ms", "poll_errors",
    ]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c, "-")
            cells.append(f"{v:.0f}" if isinstance(v, float) and math.isfinite(v) else str(v))
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
