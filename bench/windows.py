"""The benchmark workloads as whole traces, and the trace windows that serve as seeds.

``chat`` (the Azure conversation trace with its own timestamps), ``chat-bursty`` (chat
lengths on the code trace's timestamps, stretched to the chat trace's mean rate) and ``code``
(the Azure code trace), clipped to Llama-3's 8,192-token context, exactly as
`bench.experiments` builds them. Seed k of a multi-seed benchmark replays the k-th window of
`window_s` trace seconds (shifted to start at 0): a different slice of real traffic, the
honest kind of repetition for a deterministic simulator. Reads the trace files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from engine_sim.data import AZURE_CHAT, AZURE_CODE
from engine_sim.trace import TraceRequest

WORKLOADS = ("chat", "chat-bursty", "code")
REUSE_WORKLOADS: frozenset[str] = frozenset()
"""Workloads whose prompts share prefixes, where stacks with ``needs_reuse`` run (the Azure
traces carry lengths only: none yet)."""


def workload_trace(name: str, data_dir: Path) -> list[TraceRequest]:
    """The whole trace of workload `name` (unscaled), sorted by arrival."""
    from bench.workload import WorkloadSpec, build_requests

    chat, code = data_dir / AZURE_CHAT, data_dir / AZURE_CODE
    specs = {
        "chat": WorkloadSpec(trace=chat),
        "chat-bursty": WorkloadSpec(trace=chat, arrivals="retime", timestamps_from=code),
        "code": WorkloadSpec(trace=code),
    }
    if name not in specs:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return build_requests(specs[name])


def window(reqs: Sequence[TraceRequest], index: int, window_s: float) -> list[TraceRequest]:
    """The `index`-th `window_s` slice of `reqs`, shifted to start at 0 (unscaled)."""
    start = index * window_s
    return [
        replace(r, arrival_s=r.arrival_s - start)
        for r in reqs
        if start <= r.arrival_s < start + window_s
    ]
