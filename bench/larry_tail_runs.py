"""The runs behind ``sal-bench larry-tail``: trace windows, scheduler variants, one replica.

Pure apart from reading the traces. `window_requests` cuts window ``k`` (600 trace seconds,
``[600 k, 600 (k + 1))``) of a workload; `VARIANTS` names every engine scheduler the
comparison runs, with its parameters; `run_variant` replays one window through one replica
of Llama-3-8B on A100 with one variant and returns its summary. `bench.larry_tail` sweeps
them and writes the report.

Windows 0, 1, 2 are the *tuning* windows (the tail guard's defaults were chosen on them);
windows 3 and 4 are *held out* (never looked at while tuning). The traces span about an
hour, so five whole windows exist per workload. ``chat-bursty`` window ``k`` carries chat
window ``k``'s lengths on the code trace's timestamps from code window ``k`` onwards
(wrapping around the end of the trace), stretched to the chat window's mean rate, as the
single-replica experiment does for its one window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine_sim.cost_model import get_profile
from engine_sim.data import AZURE_CHAT, AZURE_CODE
from engine_sim.engine import EngineConfig, EngineModel
from engine_sim.schedulers import (
    EngineScheduler,
    FcfsScheduler,
    HeadroomFcfsScheduler,
    LarryScheduler,
    LarryTailScheduler,
    TgiScheduler,
)
from engine_sim.simulator import RouterConfig, Simulation, submit_to_engine_model
from engine_sim.trace import TraceRequest, load_azure_csv, retime, scale_load
from sal_core.larry_tail import TailParams

PROFILE = "llama3-8b-a100"
WINDOW_S = 600.0
WORKLOADS = ("chat", "chat-bursty", "code")
LOADS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
TUNING_WINDOWS = (0, 1, 2)
HELD_OUT_WINDOWS = (3, 4)
CONTEXT_LIMIT_TOKENS = 8192

BASE_LOAD = {"chat": 0.505, "chat-bursty": 0.505, "code": 0.521}
"""Trace load factor of 1x for one replica (`bench.experiments.BASE_LOAD`, same values)."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One engine scheduler of the comparison: a label and how to build it."""

    label: str
    build: Callable[[EngineConfig], EngineScheduler]
    description: str
    hindsight_share: float = 0.0
    """> 0: a what-if no scheduler can run: `build` is ignored, and each run first replays
    its requests with FCFS, then with the tail guard's headroom and one fixed deadline for
    every request, this share of *that run's* FCFS p99 (`hindsight_build`)."""


DEFAULT_HEADROOM = TailParams().headroom


def _tail(**kwargs: Any) -> Callable[[EngineConfig], EngineScheduler]:
    params = TailParams(**kwargs)
    return lambda config: LarryTailScheduler(config, params)


VARIANTS: tuple[Variant, ...] = (
    Variant("fcfs", FcfsScheduler, "vLLM's FCFS"),
    Variant(
        "fcfs+headroom",
        lambda c: HeadroomFcfsScheduler(c, DEFAULT_HEADROOM),
        f"FCFS with the same KV headroom ({DEFAULT_HEADROOM:g} of the blocks; vLLM's --watermark)",
    ),
    Variant("larry", LarryScheduler, "paper LARRY, alpha 1"),
    Variant(
        "larry_tail",
        _tail(),
        "the shipped default (`TailParams()`): pinned after 1 s + 0.5 x the largest FCFS-wait "
        "estimate of the last 60 s (issue 10's baseline rule), plus the headroom",
    ),
    Variant(
        "larry_tail margin 0.25 s",
        _tail(margin_s=0.25),
        "the same with a 0.25 s margin (the default until the capacity measurements: a better "
        "max at light loads, less capacity)",
    ),
    Variant(
        "larry_tail margin 1.5 s",
        _tail(margin_s=1.5),
        "the same with a 1.5 s margin (between the default and the capacity option: already "
        "the 2 s margin's tail)",
    ),
    Variant(
        "larry_tail margin 2 s",
        _tail(margin_s=2.0),
        "the same with a 2 s margin (paper LARRY's capacity at SLO, a worse max at light loads)",
    ),
    Variant(
        "larry_tail fcfs_due",
        _tail(pin="fcfs_due", slack=1.5, cap=1.0, margin_s=0.25),
        "the per-request rule: pinned at 1.5 x its own FCFS-wait estimate (at most the largest "
        "recent one) + 0.25 s, plus the headroom",
    ),
    Variant("tgi", TgiScheduler, "TGI admission: waiting-served ratio 1.2, 20 waiting tokens"),
    Variant(
        "hindsight deadline (what-if)",
        FcfsScheduler,
        "no scheduler can run it: every request pinned once it has waited half of FCFS's p99 "
        "on the same requests (known only afterwards), LARRY's order before, plus the "
        "headroom; how much room there is when the coming peak is known",
        hindsight_share=0.5,
    ),
)
"""Every scheduler of the comparison, in table order."""


def variant(label: str) -> Variant:
    """The variant called `label` (`KeyError` names the known ones)."""
    for v in VARIANTS:
        if v.label == label:
            return v
    raise KeyError(f"unknown variant {label!r} (known: {', '.join(v.label for v in VARIANTS)})")


def _cyclic_stamps(stamps: list[TraceRequest], start_s: float) -> list[TraceRequest]:
    """`stamps` from `start_s` on, then from the start again (times kept increasing)."""
    head = [r for r in stamps if r.arrival_s >= start_s]
    tail = [r for r in stamps if r.arrival_s < start_s]
    if not head:
        return stamps
    gap = stamps[-1].arrival_s - stamps[0].arrival_s
    shift = head[-1].arrival_s - head[0].arrival_s + gap / max(1, len(stamps) - 1)
    first = head[0].arrival_s
    out = [replace(r, arrival_s=r.arrival_s - first) for r in head]
    out += [replace(r, arrival_s=r.arrival_s - tail[0].arrival_s + shift) for r in tail]
    return out


def window_requests(workload: str, window: int, data_dir: Path) -> list[TraceRequest]:
    """Window `window` of `workload` at trace load factor 1 (arrivals from 0)."""
    start_s = window * WINDOW_S
    if workload == "code":
        return load_azure_csv(
            data_dir / AZURE_CODE,
            context_limit_tokens=CONTEXT_LIMIT_TOKENS,
            start_s=start_s,
            duration_s=WINDOW_S,
        )
    chat = load_azure_csv(
        data_dir / AZURE_CHAT,
        context_limit_tokens=CONTEXT_LIMIT_TOKENS,
        start_s=start_s,
        duration_s=WINDOW_S,
    )
    if workload == "chat":
        return chat
    if workload != "chat-bursty":
        raise KeyError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
    stamps = _cyclic_stamps(load_azure_csv(data_dir / AZURE_CODE), start_s)
    bursty = retime(chat, stamps)
    return [r for r in bursty if r.arrival_s < WINDOW_S]


def run_variant(
    requests: list[TraceRequest], build: Callable[[EngineConfig], EngineScheduler]
) -> dict[str, Any]:
    """Replay `requests` through one replica with the scheduler `build` makes; the summary
    (`engine_sim.results.Summary` fields) plus ``ttft_max_s``."""
    cost = get_profile(PROFILE)
    config = EngineConfig(num_kv_blocks=cost.num_kv_blocks(16), model_name=PROFILE)
    engine = EngineModel(config, cost, policy=build(config))
    sim = Simulation(requests, [engine], submit_to_engine_model, RouterConfig("round_robin"))
    result = sim.run()
    out = result.summary.to_dict()
    out["ttft_max_s"] = max((o.ttft_s for o in result.outcomes), default=float("nan"))
    return out


def hindsight_build(
    requests: list[TraceRequest], share: float
) -> Callable[[EngineConfig], EngineScheduler]:
    """The tail guard with one fixed deadline, `share` of FCFS's p99 TTFT on `requests`
    (replayed first): the `Variant.hindsight_share` what-if."""
    fcfs_p99 = float(run_variant(requests, FcfsScheduler)["ttft_p99_s"])
    return _tail(pin="adaptive_aging", slack=0.0, margin_s=share * fcfs_p99)


def build_for(
    v: Variant, requests: list[TraceRequest]
) -> Callable[[EngineConfig], EngineScheduler]:
    """How to build `v`'s scheduler for a run on `requests`."""
    return hindsight_build(requests, v.hindsight_share) if v.hindsight_share > 0 else v.build


def load_requests(workload: str, window: int, load_x: float, data_dir: Path) -> list[TraceRequest]:
    """Window `window` of `workload` at `load_x` times its 1x."""
    return scale_load(window_requests(workload, window, data_dir), BASE_LOAD[workload] * load_x)
