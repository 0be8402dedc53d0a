"""``sal-bench sensitivity``: how much SAL depends on beta, the poll period and the stats delay.

    sal-bench sensitivity [--quick] [--out docs/results] [--jobs N] [--data-dir DIR]

SAL's Eq. 2 weighs missing memory by beta = (mean_in + mean_out) / mean_out, which the
gateway estimates from finished requests (`sal_core.beta.BetaEstimator`); the paper leaves
its value open. Its picture of each replica is a ``/stats`` snapshot polled every
``poll_interval_s`` and ``stats_delay_s`` old when it arrives, kept current in between by the
ticket accounting (``routing.accounting_grace_s``). This sweeps each knob alone, the others at
the gateway's defaults (running beta, 100 ms polls, no delay), for sal+fcfs on 8 x 8B, at the
loads of `bench.gateways.LOADS` (near p2c+fcfs's capacity), three trace windows each:

* beta fixed at `BETAS` (spanning the values the traces imply: about 6.5 for chat, about
  75 for code, and beyond) against the running estimate, on the profile's replicas and on
  memory-bound ones (`SMALL_KV_BLOCKS`), counting the decisions in which the memory term
  could matter at all (`BetaProbe`);
* poll period `POLL_PERIODS_S` (no delay);
* stats delay `DELAYS_S` (100 ms polls).

Each row reports TTFT p50 / p95 and the paired ratio "best baseline / SAL" (best of p2c and
least_requests per window and metric; > 1: SAL better). Writes ``sensitivity.md``,
``sensitivity.json`` and ``sensitivity.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.cells import log, refused, run_cells, window_tasks
from engine_sim.data import data_dir
from sal_core.policies import SAL, BackendView, Decision, RouteRequest

HELP = "SAL's sensitivity to beta, poll period and stats delay (simulator, 3 windows)"

Row = dict[str, Any]

BETAS = (1.0, 2.0, 6.5, 20.0, 75.0, 250.0)
POLL_PERIODS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
DELAYS_S = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)
BASELINES = ("p2c", "least_requests")


class BetaProbe(SAL):
    """SAL with beta held at `beta` (None: the running estimate, as the gateway), counting
    the decisions in which the memory term could matter (what-if only, never the gateway)."""

    name = "sal_beta_probe"

    def __init__(self, beta: float | None, seed: int | None = None) -> None:
        super().__init__(seed)
        self.beta = beta
        self.decisions = 0
        self.memory_bound = 0
        """Decisions where some eligible backend had fewer free KV tokens than the prompt
        (only then is SAL's memory term positive, so only then can beta change anything)."""

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        self.decisions += 1
        if any(b.eligible and b.free_kv_tokens < request.prompt_tokens for b in backends):
            self.memory_bound += 1
        if self.beta is not None:
            request = replace(request, beta=self.beta)
        return super().select(request, backends)


SMALL_KV_BLOCKS = 2000
"""The memory-bound variant of the beta sweep: 32k KV tokens per replica (a fifth of an
A100-40GB's after the 8B weights), where the memory term does bind."""


@dataclass(frozen=True, slots=True)
class Plan:
    workloads: tuple[str, ...]
    profile: str
    replicas: int
    window_s: float
    windows: int


FULL = Plan(("chat", "chat-bursty", "code"), "llama3-8b-a100", 8, 300.0, 3)
QUICK = Plan(("chat-bursty", "code"), "llama3-8b-a100", 4, 120.0, 3)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="(data/)")
    parser.add_argument("--quick", action="store_true", help="small fleet, short windows")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (1)")


def implied_beta(reqs: Sequence[Any]) -> float:
    """beta = (mean_in + mean_out) / mean_out of a request list (what a long run converges to)."""
    total_in = sum(int(r.prompt_tokens) for r in reqs)
    total_out = sum(int(r.output_tokens) for r in reqs)
    return (total_in + total_out) / max(1, total_out)


def _cells() -> list[tuple[str, str, float]]:
    """(knob, router, value) of every run in one window: baselines, then each sweep."""
    cells = [("baseline", b, 0.0) for b in BASELINES]
    for knob in ("beta", "beta_small_kv"):
        cells.append((knob, "sal", 0.0))  # 0: the running estimate
        cells += [(knob, "sal", b) for b in BETAS]
    cells += [("baseline_small_kv", b, 0.0) for b in BASELINES]
    cells += [("poll_interval_s", "sal", p) for p in POLL_PERIODS_S]
    cells += [("stats_delay_s", "sal", d) for d in DELAYS_S]
    return cells


def _cell(task: tuple[str, int, Plan, Path]) -> list[Row]:
    from bench.experiments import base_load
    from bench.gateways import LOADS
    from bench.stacks import Stack, run_stack
    from bench.windows import window, workload_trace
    from engine_sim.simulator import RouterConfig
    from engine_sim.trace import scale_load

    workload, index, plan, folder = task
    reqs = window(workload_trace(workload, folder), index, plan.window_s)
    beta_implied = implied_beta(reqs)
    factor = LOADS[workload] * base_load(workload, plan.profile) * plan.replicas
    reqs = scale_load(reqs, factor)
    rows: list[Row] = []
    for knob, router, value in _cells():
        config = RouterConfig(seed=index)
        probe: BetaProbe | None = None
        engine: dict[str, Any] = {"scheduler": "fcfs"}
        if knob.endswith("small_kv"):
            engine["num_kv_blocks"] = SMALL_KV_BLOCKS
        if knob == "poll_interval_s":
            config = replace(config, poll_interval_s=value)
        elif knob == "stats_delay_s":
            config = replace(config, stats_delay_s=value)
        elif knob.startswith("beta"):
            probe = BetaProbe(value if value > 0 else None, seed=index)
        started = time.perf_counter()
        result = run_stack(
            reqs,
            Stack(router, router, engine),
            profile=plan.profile,
            replicas=plan.replicas,
            router=config,
            policy=probe,
        )
        s = result.summary
        rows.append(
            {
                "workload": workload,
                "load_x": LOADS[workload],
                "window": index,
                "knob": knob,
                "router": router,
                "value": value,
                "implied_beta": beta_implied,
                "final_beta": result.final_beta,
                "memory_bound_share": (
                    probe.memory_bound / max(1, probe.decisions) if probe else None
                ),
                "preemption_rate": s.preemption_rate,
                "ttft_p50_s": s.ttft_p50_s,
                "ttft_p95_s": s.ttft_p95_s,
                "ttft_p99_s": s.ttft_p99_s,
                "tgt_p50_s": s.tgt_p50_s,
            }
        )
        log(
            f"{workload} window {index} {knob}={value:g} {router}: TTFT p95 "
            f"{s.ttft_p95_s:.3f}s ({time.perf_counter() - started:.1f}s)"
        )
    return rows


def measure(plan: Plan, folder: Path, jobs: int) -> list[Row]:
    return run_cells(_cell, window_tasks(plan.workloads, plan.windows, plan, folder), jobs)


def run(args: argparse.Namespace) -> int:
    from bench.sensitivity_report import write_report

    if (code := refused("sensitivity", args.data_dir, args.jobs)) is not None:
        return code
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows = measure(plan, args.data_dir, args.jobs)
    from bench.gateways import LOADS

    meta = {
        "plan": asdict(plan),
        "loads": LOADS,
        "betas": BETAS,
        "poll_periods_s": POLL_PERIODS_S,
        "delays_s": DELAYS_S,
        "wall_s": round(time.perf_counter() - started, 1),
        "command": "sal-bench sensitivity" + (" --quick" if args.quick else ""),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sensitivity.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(rows, meta, args.out)
    log(f"wrote {args.out}/sensitivity.md, sensitivity.json, sensitivity.png in {meta['wall_s']} s")
    return 0
