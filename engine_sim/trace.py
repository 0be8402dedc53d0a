"""Workload traces for the simulator: Azure LLM inference CSVs and arrival processes.

Pure apart from `load_azure_csv()` (reads one file). A trace is a list of `TraceRequest`
sorted by arrival; arrival times are seconds since the trace's first request.

* `load_azure_csv()` reads ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure LLM inference
  trace 2023: ``..._conv.csv`` ~ the paper's SW-Chat, ``..._code.csv`` ~ SW-Code), optionally
  clipped to a context limit and cut to a time window.
* `scale_load()` multiplies the arrival rate by a load factor (F = 2: inter-arrival times
  halved, twice the requests per second, same length distribution).
* Bursty arrivals (the paper used the bursty Azure Functions invocation trace):
  `retime()` puts one trace's lengths on another trace's timestamps (the code trace's
  timestamps carrying chat lengths), `gamma_arrivals()` draws gamma inter-arrival times with a
  coefficient of variation above 1 (seeded).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_sim.workloads import TokenBlocks


class TraceError(ValueError):
    """A trace file or a trace transformation that cannot be used (names the cause)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload: when it arrives and how long it is."""

    arrival_s: float
    """Seconds since the first request of the trace."""
    prompt_tokens: int
    """Prompt (context) tokens, >= 1."""
    output_tokens: int
    """Forced output length (``ignore_eos`` + ``max_tokens``), >= 1."""
    blocks: TokenBlocks | None = None
    """Prefix structure of its tokens (`engine_sim.workloads`); None: shares nothing with
    any other request (the Azure traces)."""
    session: str | None = None
    """Conversation it belongs to (what a session header would carry); None: unknown."""
    adapter: str | None = None
    """The LoRA adapter it names (`engine_sim.workloads.with_adapters`); None: the base
    model."""


def _parse_timestamp(text: str) -> float:
    # Azure writes 7 fractional digits ("18:15:46.6805900"); fromisoformat takes at most 6.
    head, _, frac = text.strip().partition(".")
    base = datetime.fromisoformat(head).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def clip_lengths(
    prompt_tokens: int, output_tokens: int, context_limit_tokens: int
) -> tuple[int, int]:
    """Fit one request into a context window: prompt first, then as much output as fits.

    The prompt keeps at most ``limit - 1`` tokens so that at least one output token fits;
    the output is cut so that ``prompt + output <= limit``.
    """
    if context_limit_tokens < 2:
        raise TraceError(f"context limit must be >= 2 tokens, got {context_limit_tokens}")
    prompt = max(1, min(prompt_tokens, context_limit_tokens - 1))
    output = max(1, min(output_tokens, context_limit_tokens - prompt))
    return prompt, output


def load_azure_csv(
    path: str | Path,
    *,
    context_limit_tokens: int | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> list[TraceRequest]:
    """Read an Azure LLM inference trace CSV into requests sorted by arrival.

    Rows with zero tokens are kept with their length raised to 1 (vLLM needs a non-empty
    prompt and ``max_tokens >= 1``). With `context_limit_tokens`, lengths are clipped by
    `clip_lengths()`. `start_s`/`duration_s` keep the window ``[start_s, start_s + duration_s)``
    of the trace and shift it to start at 0. Raises `TraceError` on a malformed file.
    """
    rows: list[tuple[float, int, int]] = []
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        needed = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not needed <= set(reader.fieldnames):
            raise TraceError(f"{path}: expected columns {sorted(needed)}, got {reader.fieldnames}")
        for line_no, row in enumerate(reader, start=2):
            try:
                ts = _parse_timestamp(row["TIMESTAMP"])
                prompt = max(1, int(row["ContextTokens"]))
                output = max(1, int(row["GeneratedTokens"]))
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{line_no}: bad row {row!r}: {exc}") from None
            if context_limit_tokens is not None:
                prompt, output = clip_lengths(prompt, output, context_limit_tokens)
            rows.append((ts, prompt, output))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] + start_s
    end = math.inf if duration_s is None else t0 + duration_s
    out = [TraceRequest(ts - t0, p, o) for ts, p, o in rows if t0 <= ts < end]
    if not out:
        raise TraceError(f"{path}: no requests in the window start={start_s}s dur={duration_s}s")
    return out


def scale_load(requests: Sequence[TraceRequest], load_factor: float) -> list[TraceRequest]:
    """Multiply the arrival rate by `load_factor` (arrival times divided by it)."""
    if not load_factor > 0 or not math.isfinite(load_factor):
        raise TraceError(f"load factor must be a finite number > 0, got {load_factor}")
    return [replace(r, arrival_s=r.arrival_s / load_factor) for r in requests]


def mean_rate_per_s(requests: Sequence[TraceRequest]) -> float:
    """Requests per second over the span of the trace (first to last arrival)."""
    if len(requests) < 2:
        raise TraceError("need at least two requests to compute a rate")
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    if span_s <= 0:
        raise TraceError("all requests arrive at the same time")
    return (len(requests) - 1) / span_s


def retime(
    lengths: Sequence[TraceRequest], timestamps: Sequence[TraceRequest], *, match_rate: bool = True
) -> list[TraceRequest]:
    """Put `lengths`' token counts, in order, on `timestamps`' arrival times.

    The result has ``min(len(lengths), len(timestamps))`` requests. With `match_rate`, the
    timestamps are stretched so that the mean arrival rate equals that of `lengths` (so the
    load factor keeps its meaning; only the burstiness changes).
    """
    n = min(len(lengths), len(timestamps))
    if n < 2:
        raise TraceError("need at least two requests in both traces")
    factor = 1.0
    if match_rate:
        factor = mean_rate_per_s(timestamps[:n]) / mean_rate_per_s(lengths[:n])
    t0 = timestamps[0].arrival_s
    return [
        TraceRequest((timestamps[i].arrival_s - t0) * factor, r.prompt_tokens, r.output_tokens)
        for i, r in enumerate(lengths[:n])
    ]


def gamma_arrivals(n: int, rate_per_s: float, cv: float, seed: int) -> list[float]:
    """`n` arrival times (first at 0) with gamma inter-arrivals of the given rate and CV.

    CV = 1 is a Poisson process; CV > 1 is burstier (shape ``k = 1 / cv**2``).
    """
    if n < 1 or not rate_per_s > 0 or not cv > 0:
        raise TraceError(f"need n >= 1, rate > 0, cv > 0; got {n}, {rate_per_s}, {cv}")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    scale_s = 1.0 / (rate_per_s * shape)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.gammavariate(shape, scale_s))
    return times


def with_gamma_arrivals(
    requests: Sequence[TraceRequest], cv: float, seed: int
) -> list[TraceRequest]:
    """The same lengths, in order, with gamma arrivals at the trace's own mean rate."""
    times = gamma_arrivals(len(requests), mean_rate_per_s(requests), cv, seed)
    return [replace(r, arrival_s=t) for r, t in zip(requests, times, strict=True)]
