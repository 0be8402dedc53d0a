"""The soak benchmark's numbers: one row per period, and the end-of-run summary (pure, no I/O).

`period_row()` turns the outcomes that completed in one period plus two scrapes of the
gateway's ``/metrics`` (the period's start and end) into a `Row`; `summary()` adds them up and
fits the RSS and descriptor slopes (least squares over the rows after the first, which
includes start-up growth). `bench.soak` calls them once per period.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.faultload import MetricKey, Outcome, metric_sum
from bench.tables import format_table
from sal_core.percentile import percentile

ROW_HEADERS = (
    "minute", "ok", "err_event", "http_err", "lost", "dup", "p50_s", "p99_s",
    "rss_mib", "fds", "tasks", "lag_p99_ms", "kills",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    """One period of the soak (see `ROW_HEADERS` for the printed columns)."""

    minute: float
    ok: int
    error_event: int
    http_error: int
    lost: int
    duplicated: int
    p50_s: float
    p99_s: float
    rss_mib: float
    fds: float
    tasks: float
    lag_p99_ms: float
    kills: int

    def cells(self) -> list[object]:
        return [
            round(self.minute, 2), self.ok, self.error_event, self.http_error, self.lost,
            self.duplicated, self.p50_s, self.p99_s, self.rss_mib, self.fds, self.tasks,
            self.lag_p99_ms, self.kills,
        ]  # fmt: skip


def histogram_quantile(
    start: Mapping[MetricKey, float], end: Mapping[MetricKey, float], name: str, q: float
) -> float:
    """Upper bucket bound below which a fraction `q` of the observations made between the two
    scrapes fell (NaN without observations; the largest finite bound for the ``+Inf`` bucket)."""
    buckets: dict[float, float] = {}
    for (sample, labels), value in end.items():
        if sample != f"{name}_bucket":
            continue
        le = float(dict(labels)["le"])
        buckets[le] = buckets.get(le, 0.0) + value - start.get((sample, labels), 0.0)
    if not buckets:
        return math.nan
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return math.nan
    for le in bounds:
        if buckets[le] >= q * total:
            return (
                le
                if math.isfinite(le)
                else max((b for b in bounds if math.isfinite(b)), default=math.inf)
            )
    return math.nan


def period_row(
    minute: float,
    outcomes: Sequence[Outcome],
    start: Mapping[MetricKey, float],
    end: Mapping[MetricKey, float],
    *,
    proc_rss_bytes: float,
    proc_fds: float,
    kills: int,
) -> Row:
    """The row of one period: `outcomes` completed in it, `start`/`end` the gateway's
    ``/metrics`` at its bounds; RSS and fds come from the gateway's own metrics when it
    exports them, else from ``/proc`` (`proc_rss_bytes`, `proc_fds`)."""
    kinds = {
        k: sum(1 for o in outcomes if o.kind == k)
        for k in ("ok", "error_event", "http_error", "lost", "duplicated")
    }
    good = [o.latency_s for o in outcomes if o.kind == "ok"]
    rss = metric_sum(end, "process_resident_memory_bytes") or proc_rss_bytes
    fds = metric_sum(end, "process_open_fds") or proc_fds
    has_tasks = any(name == "sal_event_loop_tasks" for name, _ in end)
    lag = histogram_quantile(start, end, "sal_event_loop_lag_seconds", 0.99)
    return Row(
        minute=minute,
        ok=kinds["ok"],
        error_event=kinds["error_event"],
        http_error=kinds["http_error"],
        lost=kinds["lost"],
        duplicated=kinds["duplicated"],
        p50_s=percentile(good, 50),
        p99_s=percentile(good, 99),
        rss_mib=rss / 2**20,
        fds=fds,
        tasks=metric_sum(end, "sal_event_loop_tasks") if has_tasks else math.nan,
        lag_p99_ms=lag * 1000,
        kills=kills,
    )


def slope_per_minute(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (NaN with fewer than two finite points)."""
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
    if len(points) < 2:
        return math.nan
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return math.nan
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def summary(rows: Sequence[Row], *, sent: int, unanswered: int) -> dict[str, Any]:
    """Totals and slopes; `unanswered` (requests without any outcome) count as lost."""
    steady = rows[1:] if len(rows) > 2 else rows
    totals = {
        "sent": sent,
        "ok": sum(r.ok for r in rows),
        "error_event": sum(r.error_event for r in rows),
        "http_error": sum(r.http_error for r in rows),
        "lost": sum(r.lost for r in rows) + unanswered,
        "duplicated": sum(r.duplicated for r in rows),
        "kills": sum(r.kills for r in rows),
    }
    xs = [r.minute for r in steady]
    return {
        "totals": totals,
        "rss_mib_per_min": slope_per_minute(xs, [r.rss_mib for r in steady]),
        "fds_per_min": slope_per_minute(xs, [r.fds for r in steady]),
        "tasks_per_min": slope_per_minute(xs, [r.tasks for r in steady]),
        "rows": [asdict(r) for r in rows],
    }


def format_summary(result: Mapping[str, Any]) -> str:
    t = result["totals"]
    return (
        f"totals: sent {t['sent']}, ok {t['ok']}, error events {t['error_event']}, "
        f"HTTP errors {t['http_error']}, lost {t['lost']}, duplicated {t['duplicated']}, "
        f"replica kills {t['kills']}\n"
        f"slopes after the first period: RSS {result['rss_mib_per_min']:+.3f} MiB/min, "
        f"fds {result['fds_per_min']:+.3f}/min, tasks {result['tasks_per_min']:+.3f}/min"
    )


def format_rows(rows: Sequence[Row]) -> str:
    """All rows as one Markdown table (for the end of the run and the README)."""
    return format_table(ROW_HEADERS, [r.cells() for r in rows])


_WIDTH = 10


def header_lines() -> str:
    """The header of the live table, in the fixed widths `row_line` uses."""
    head = "| " + " | ".join(h.rjust(_WIDTH) for h in ROW_HEADERS) + " |"
    return head + "\n|" + "|".join("-" * (_WIDTH + 2) for _ in ROW_HEADERS) + "|"


def row_line(row: Row) -> str:
    """One live table line (printed as each period ends)."""
    cells = [_cell(c) for c in row.cells()]
    return "| " + " | ".join(c.rjust(_WIDTH) for c in cells) + " |"


def _cell(value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
