"""Turn workload options (trace file, arrivals, load factor, window) into a request list.

Shared by `sal-bench simulate` and the experiments so both mean the same thing by a load
factor and by "bursty". Reads files; everything else is `engine_sim.trace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine_sim.trace import (
    TraceError,
    TraceRequest,
    load_azure_csv,
    retime,
    scale_load,
    with_gamma_arrivals,
)

ARRIVALS = ("trace", "gamma", "retime")
"""``trace``: the file's own timestamps; ``gamma``: gamma inter-arrivals at the trace's
mean rate with CV `gamma_cv`; ``retime``: the timestamps of `timestamps_from` (another
trace, e.g. the bursty code trace) carrying this trace's lengths, at this trace's mean rate."""


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Everything that defines the requests of one run."""

    trace: Path
    load_factor: float = 1.0
    """Multiplies the arrival rate (2.0: twice the requests per second)."""
    arrivals: str = "trace"
    gamma_cv: float = 4.0
    timestamps_from: Path | None = None
    start_s: float = 0.0
    """Start of the window, seconds into the (unscaled) trace."""
    duration_s: float | None = None
    """Length of the window in (unscaled) trace seconds; None = to the end."""
    context_limit_tokens: int | None = 8192
    """Clip prompt + output to this context (Llama-3's 8,192); None = no clipping."""
    seed: int = 0


def build_requests(spec: WorkloadSpec) -> list[TraceRequest]:
    """The requests of `spec`, sorted by arrival, arrival rate scaled by the load factor.

    The window is cut from the trace *before* arrivals are replaced and the load is scaled,
    so a window of 600 s at load factor 2 replays those 600 s of requests in 300 s.
    """
    reqs = load_azure_csv(
        spec.trace,
        context_limit_tokens=spec.context_limit_tokens,
        start_s=spec.start_s,
        duration_s=spec.duration_s,
    )
    if spec.arrivals == "gamma":
        reqs = with_gamma_arrivals(reqs, cv=spec.gamma_cv, seed=spec.seed)
    elif spec.arrivals == "retime":
        if spec.timestamps_from is None:
            raise TraceError("arrivals 'retime' needs a timestamps trace (--timestamps-from)")
        stamps = load_azure_csv(spec.timestamps_from)
        reqs = retime(reqs, stamps)
    elif spec.arrivals != "trace":
        raise TraceError(f"unknown arrivals {spec.arrivals!r} (known: {', '.join(ARRIVALS)})")
    return scale_load(reqs, spec.load_factor)
