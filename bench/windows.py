"""The benchmark workloads as whole traces, and the trace windows that serve as seeds.

``chat`` (the Azure conversation trace with its own timestamps), ``chat-bursty`` (chat
lengths on the code trace's timestamps, stretched to the chat trace's mean rate) and ``code``
(the Azure code trace), clipped to Llama-3's 8,192-token context, exactly as
`bench.experiments` builds them. Seed k of a multi-seed benchmark replays the k-th window of
`window_s` trace seconds (shifted to start at 0): a different slice of real traffic, the
honest kind of repetition for a deterministic simulator. Reads the trace files.

``multiturn`` is the one workload with prefix reuse: multi-turn conversations from
`engine_sim.workloads.multi_turn_chat` (each prompt = the conversation so far + a new
message, ShareGPT lengths, think times `MULTITURN_THINK_S`). It has no trace to slice: seed k
generates conversations with seed k, starting during `window_s` seconds, and its load is the
rate of new conversations (more users, each thinking as long), not a compressed clock, which
would also shorten think times and so change how much reuse survives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from engine_sim.data import AZURE_CHAT, AZURE_CODE, SHAREGPT_STATS
from engine_sim.trace import TraceRequest
from engine_sim.workloads import ChatSpec, load_sharegpt_lengths, multi_turn_chat

WORKLOADS = ("chat", "chat-bursty", "code")
"""Workloads replayed from a trace (`workload_trace`, `window`)."""
GENERATED_WORKLOADS = ("multiturn",)
"""Workloads generated per seed (`multiturn_window`)."""
REUSE_WORKLOADS: frozenset[str] = frozenset({"multiturn"})
"""Workloads whose prompts share prefixes: replicas run with prefix caching (vLLM's default),
prefix-aware routers read the router's approximate index, and stacks with ``needs_reuse`` run
(the Azure traces carry lengths only, no content)."""

MULTITURN_THINK_S = (5.0, 60.0)
"""Think time between a conversation's turns (uniform): the regime where reuse can survive in
the fleet's KV cache (`docs/results/prefix.md`)."""
MULTITURN_RATE_1X: dict[str, float] = {
    "llama31-8b-a100-80gb": 0.141,
    "llama31-8b-a100": 0.054,
}
"""New conversations per second per replica at the ``multiturn`` workload's 1x, per profile:
half the knee (the rate at which one FCFS replica with prefix caching reaches twice its
unloaded p50 TTFT; knees 0.283 and 0.108 conversations/s, seed 0, 300 s of starts), as for
the trace workloads (``docs/simulator.md``, "Workloads and 1x"). The 40 GB replica's knee is
2.6x lower: its KV cache keeps far less of each conversation between turns."""


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


def multiturn_window(
    lengths: Sequence[tuple[int, int]], index: int, window_s: float, rate_per_s: float
) -> list[TraceRequest]:
    """Seed `index` of the ``multiturn`` workload: conversations starting at `rate_per_s`
    (Poisson) for `window_s` seconds, every turn of each (later turns arrive after the
    window). `lengths`: `multiturn_lengths`."""
    spec = ChatSpec(
        conversations=max(2, round(rate_per_s * window_s)),
        rate_per_s=rate_per_s,
        think_time_s=MULTITURN_THINK_S,
    )
    return multi_turn_chat(spec, lengths, seed=index)


def multiturn_lengths(data_dir: Path) -> list[tuple[int, int]]:
    """The ShareGPT (message, answer) token lengths the ``multiturn`` workload draws from."""
    return load_sharegpt_lengths(data_dir / SHAREGPT_STATS)
