"""What a simulation run measured: per-request outcomes and their summary.

Pure. The simulator returns one `RequestOutcome` per request; `summarize()` turns them into
the numbers the paper reports (TTFT, normalized TTFT, total generation time percentiles,
preemption rate, throughput), which the CLI prints as a table or JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sal_core.percentile import percentile


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request as the client saw it (times on the simulator's virtual clock)."""

    request_id: str
    replica: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float
    finish_s: float
    num_preemptions: int
    cached_tokens: int = 0
    """Prompt tokens the replica found in its prefix cache (no prefill for them)."""
    predicted_cached_tokens: int = 0
    """Prompt tokens the router predicted the chosen replica held (its cache source)."""

    @property
    def ttft_s(self) -> float:
        """Time to first token, queueing and prefill included."""
        return self.first_token_s - self.arrival_s

    @property
    def tgt_s(self) -> float:
        """Total generation time: arrival to last token."""
        return self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class Summary:
    """The headline numbers of one run."""

    requests: int
    unfinished: int
    """Requests still in flight when the run stopped (excluded from the latency numbers)."""
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    norm_ttft_p50_ms_per_token: float
    """TTFT / prompt tokens (the paper's normalized TTFT), in ms per prompt token."""
    norm_ttft_p95_ms_per_token: float
    norm_ttft_p99_ms_per_token: float
    tgt_p50_s: float
    tgt_p95_s: float
    tgt_p99_s: float
    preemption_rate: float
    """Preemptions per finished request."""
    preempted_request_share: float
    """Share of finished requests preempted at least once."""
    throughput_rps: float
    """Finished requests per second of simulated time (first arrival to last finish)."""
    output_tokens_per_s: float
    makespan_s: float
    hit_rate: float = 0.0
    """Prompt tokens served from a prefix cache / all prompt tokens (achieved)."""
    predicted_hit_rate: float = 0.0
    """Prompt tokens the router predicted cached on the chosen replica / all prompt tokens."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(outcomes: Sequence[RequestOutcome], unfinished: int = 0) -> Summary:
    """Summarize finished requests; `unfinished` only counts those that did not finish."""
    ttft = [o.ttft_s for o in outcomes]
    norm_ms = [1000.0 * o.ttft_s / max(1, o.prompt_tokens) for o in outcomes]
    tgt = [o.tgt_s for o in outcomes]
    n = len(outcomes)
    if n:
        start = min(o.arrival_s for o in outcomes)
        makespan = max(o.finish_s for o in outcomes) - start
    else:
        makespan = 0.0
    preemptions = sum(o.num_preemptions for o in outcomes)
    preempted = sum(1 for o in outcomes if o.num_preemptions > 0)
    out_tokens = sum(o.output_tokens for o in outcomes)
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    return Summary(
        requests=n,
        unfinished=unfinished,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p95_s=percentile(ttft, 95),
        ttft_p99_s=percentile(ttft, 99),
        ttft_mean_s=sum(ttft) / n if n else math.nan,
        norm_ttft_p50_ms_per_token=percentile(norm_ms, 50),
        norm_ttft_p95_ms_per_token=percentile(norm_ms, 95),
        norm_ttft_p99_ms_per_token=percentile(norm_ms, 99),
        tgt_p50_s=percentile(tgt, 50),
        tgt_p95_s=percentile(tgt, 95),
        tgt_p99_s=percentile(tgt, 99),
        preemption_rate=preemptions / n if n else 0.0,
        preempted_request_share=preempted / n if n else 0.0,
        throughput_rps=n / makespan if makespan > 0 else 0.0,
        output_tokens_per_s=out_tokens / makespan if makespan > 0 else 0.0,
        makespan_s=makespan,
        hit_rate=sum(o.cached_tokens for o in outcomes) / prompt_tokens if prompt_tokens else 0.0,
        predicted_hit_rate=(
            sum(o.predicted_cached_tokens for o in outcomes) / prompt_tokens
            if prompt_tokens
            else 0.0
        ),
    )


_TABLE_ROWS: tuple[tuple[str, str, float], ...] = (
    ("TTFT p50 (s)", "ttft_p50_s", 1.0),
    ("TTFT p95 (s)", "ttft_p95_s", 1.0),
    ("TTFT p99 (s)", "ttft_p99_s", 1.0),
    ("normalized TTFT p50 (ms/token)", "norm_ttft_p50_ms_per_token", 1.0),
    ("normalized TTFT p95 (ms/token)", "norm_ttft_p95_ms_per_token", 1.0),
    ("normalized TTFT p99 (ms/token)", "norm_ttft_p99_ms_per_token", 1.0),
    ("total generation time p50 (s)", "tgt_p50_s", 1.0),
    ("total generation time p95 (s)", "tgt_p95_s", 1.0),
    ("total generation time p99 (s)", "tgt_p99_s", 1.0),
    ("preemptions per 100 requests", "preemption_rate", 100.0),
    ("requests preempted (%)", "preempted_request_share", 100.0),
    ("throughput (req/s)", "throughput_rps", 1.0),
    ("output throughput (tokens/s)", "output_tokens_per_s", 1.0),
)


def format_table(summary: Summary) -> str:
    """A two-column plain-text table for terminals."""
    values = summary.to_dict()
    lines = [f"{'requests finished':<34}{summary.requests:>12d}"]
    if summary.unfinished:
        lines.append(f"{'requests unfinished':<34}{summary.unfinished:>12d}")
    for label, key, scale in _TABLE_ROWS:
        lines.append(f"{label:<34}{values[key] * scale:>12.4g}")
    if summary.hit_rate or summary.predicted_hit_rate:
        lines.append(f"{'prefix-cache hit rate (%)':<34}{summary.hit_rate * 100:>12.4g}")
        lines.append(f"{'predicted hit rate (%)':<34}{summary.predicted_hit_rate * 100:>12.4g}")
    return "\n".join(lines)
