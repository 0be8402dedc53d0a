"""``sal-bench experiments``: the paper's experiments on the simulator, with one command.

    sal-bench experiments [--quick] --out docs/results [--data-dir DIR]

Reads the two Azure traces from the repository's ``data/`` (elsewhere: ``--data-dir`` or
``SAL_DATA_DIR``, see `engine_sim.data`). Writes ``results.md`` (markdown tables),
``results.json`` (every run's numbers) and PNG plots (`bench.plots`) to the output folder:

(a) one replica (Llama-3-8B on A100), engine schedulers {fcfs, larry alpha 1/500/1000,
    no_preempt, trail_plus, larry_tail, tgi}, workloads chat / chat-bursty / code, load
    0.5x..3x of 1x;
(b) fleets of 8 x Llama-3-8B/A100 and 4 x Llama-3-70B-FP8/2xH100: routers {sal, p2c, random,
    round_robin, least_requests} x engine schedulers {larry, fcfs, trail_plus}, chat with the
    trace's own timestamps and with bursty arrivals.

Workloads (Azure LLM inference trace 2023): ``chat`` = the conversation trace with its own
timestamps (inter-arrival CV ~1.1: close to Poisson); ``chat-bursty`` = chat lengths on the
code trace's timestamps, stretched to the chat trace's mean rate (inter-arrival CV ~13);
``code`` = the code trace with its own timestamps. Lengths are clipped to Llama-3's 8,192-token
context. Each run replays a window of the trace (see `Plan`), so the whole command fits in
about 15 minutes on one laptop core (``--quick``: about a minute).

"1x" (the paper: the load at which the deployment is "neither under- nor over-provisioned"):
per length distribution (chat or code) and profile, half of the knee rate of one FCFS replica,
where the knee is the arrival rate at which its p50 TTFT reaches twice the unloaded value under
Poisson arrivals with those lengths (`calibrate_base_load`, bisection). So 1x runs the replica
at about half of what it can take before queueing sets in, 2x at the knee, 3x past it; bursty
variants of a workload run at the same mean rates as the smooth ones. The values in
`BASE_LOAD` were measured with ``sal-bench experiments --calibrate``. A fleet of N replicas
runs at N times the single-replica 1x (the same load per replica).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine_sim.data import AZURE_CHAT, AZURE_CODE, data_dir, missing_message

HELP = "reproduce the paper's experiments: markdown tables + PNG plots in one folder"

Row = dict[str, Any]

WORKLOADS = ("chat", "chat-bursty", "code")
CHAT_CSV = AZURE_CHAT
CODE_CSV = AZURE_CODE

LENGTHS = {"chat": "chat", "chat-bursty": "chat", "code": "code"}
"""Which length distribution each workload carries."""

BASE_LOAD: dict[tuple[str, str], float] = {
    # Measured with `sal-bench experiments --calibrate` (1,200 s windows, seed 0): the
    # Poisson knees are at trace load factors 1.01 (chat, 8B), 1.04 (code, 8B) and
    # 0.95 (chat, 70B).
    ("chat", "llama3-8b-a100"): 0.505,
    ("code", "llama3-8b-a100"): 0.521,
    ("chat", "llama3-70b-fp8-h100x2"): 0.475,
    # Code on 70B (for `sal-bench capacity`), measured the same way: knee at 0.95.
    ("code", "llama3-70b-fp8-h100x2"): 0.475,
}
"""Trace load factor that is "1x" for ONE replica, per (lengths, profile); see module doc."""


def base_load(workload: str, profile: str) -> float:
    """The trace load factor of 1x for one replica of `profile` serving `workload`."""
    return BASE_LOAD[(LENGTHS[workload], profile)]


SINGLE_SCHEDULERS: tuple[tuple[str, str, float], ...] = (
    ("fcfs", "fcfs", 1.0),
    ("larry a=1", "larry", 1.0),
    ("larry a=500", "larry", 500.0),
    ("larry a=1000", "larry", 1000.0),
    ("no_preempt", "no_preempt", 1.0),
    ("trail_plus", "trail_plus", 1.0),
    ("larry_tail", "larry_tail", 1.0),
    ("tgi", "tgi", 1.0),
)
"""(label, engine scheduler, alpha) of experiment (a). ``larry_tail`` runs its defaults
(`sal_core.larry_tail.TailParams`), ``tgi`` TGI's (`sal_core.tgi.TgiParams`); their own
comparison over five trace windows is ``sal-bench larry-tail``."""

FLEET_SCHEDULERS: tuple[tuple[str, str, float], ...] = (
    ("larry", "larry", 1.0),
    ("fcfs", "fcfs", 1.0),
    ("trail_plus", "trail_plus", 1.0),
)
ROUTERS = ("sal", "p2c", "random", "round_robin", "least_requests")
FLEETS: tuple[tuple[str, int], ...] = (("llama3-8b-a100", 8), ("llama3-70b-fp8-h100x2", 4))


@dataclass(frozen=True, slots=True)
class Plan:
    """How much of everything to run (full or ``--quick``)."""

    single_window_s: float
    """Trace seconds replayed per single-replica run."""
    single_loads: tuple[float, ...]
    single_workloads: tuple[str, ...]
    fleet_window_s: float
    fleet_loads: tuple[float, ...]
    fleet_workloads: tuple[str, ...]
    fleets: tuple[tuple[str, int], ...]
    routers: tuple[str, ...]


FULL = Plan(
    single_window_s=600.0,
    single_loads=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0),
    single_workloads=WORKLOADS,
    fleet_window_s=300.0,
    fleet_loads=(1.0, 2.0),
    fleet_workloads=("chat", "chat-bursty"),
    fleets=FLEETS,
    routers=ROUTERS,
)
QUICK = Plan(
    single_window_s=180.0,
    single_loads=(0.5, 1.0, 2.0, 3.0),
    single_workloads=("chat", "code"),
    fleet_window_s=120.0,
    fleet_loads=(1.0,),
    fleet_workloads=("chat", "chat-bursty"),
    fleets=FLEETS,
    routers=ROUTERS,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=data_dir(),
        help="folder of the Azure trace CSVs (the repository's data/)",
    )
    parser.add_argument("--quick", action="store_true", help="short windows (about a minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random/p2c (0)")
    parser.add_argument(
        "--calibrate", action="store_true", help="measure 1x (BASE_LOAD) and print it"
    )


def _load(
    workload: str, data_dir: Path, window_s: float, load_factor: float, seed: int
) -> list[Any]:
    """`workload`'s first `window_s` seconds, arrival rate times `load_factor`.

    ``poisson-chat`` / ``poisson-code`` (calibration only): the lengths with Poisson arrivals
    at the trace's mean rate.
    """
    from bench.workload import WorkloadSpec, build_requests

    chat, code = data_dir / CHAT_CSV, data_dir / CODE_CSV
    spec = {
        "chat": WorkloadSpec(trace=chat),
        "chat-bursty": WorkloadSpec(trace=chat, arrivals="retime", timestamps_from=code),
        "code": WorkloadSpec(trace=code),
        "poisson-chat": WorkloadSpec(trace=chat, arrivals="gamma", gamma_cv=1.0),
        "poisson-code": WorkloadSpec(trace=code, arrivals="gamma", gamma_cv=1.0),
    }[workload]
    # Windows are cut from the trace after retiming would be wrong for "chat-bursty" (the
    # window must be of the bursty timeline), so the window is applied to the result.
    reqs = build_requests(replace(spec, seed=seed))
    reqs = [r for r in reqs if r.arrival_s < window_s]
    from engine_sim.trace import scale_load

    return scale_load(reqs, load_factor)


def _run_one(
    reqs: Sequence[Any],
    *,
    profile: str,
    replicas: int,
    router: str,
    scheduler: str,
    alpha: float,
    seed: int,
    policy: Any = None,
    poll_interval_s: float = 0.1,
    stats_delay_s: float = 0.0,
    accounting: str = "ticket",
) -> tuple[dict[str, Any], float]:
    from engine_sim.simulator import RouterConfig, simulate

    started = time.perf_counter()
    result = simulate(
        reqs,
        replicas=replicas,
        scheduler=scheduler,
        profile=profile,
        alpha=alpha,
        router=RouterConfig(
            policy=router,
            seed=seed,
            poll_interval_s=poll_interval_s,
            stats_delay_s=stats_delay_s,
            accounting=accounting,
        ),
        policy=policy,
    )
    return result.summary.to_dict(), time.perf_counter() - started


def calibrate_base_load(
    lengths: str, profile: str, data_dir: Path, window_s: float, seed: int = 0
) -> float:
    """Half the trace load factor at which one FCFS replica serving `lengths` ("chat" or
    "code") with Poisson arrivals reaches twice its unloaded p50 TTFT."""

    def p50(factor: float) -> float:
        reqs = _load(f"poisson-{lengths}", data_dir, window_s, factor, seed)
        summary, _ = _run_one(
            reqs,
            profile=profile,
            replicas=1,
            router="round_robin",
            scheduler="fcfs",
            alpha=1.0,
            seed=seed,
        )
        return float(summary["ttft_p50_s"])

    unloaded = p50(0.02)
    lo, hi = 0.02, 4.0
    for _ in range(9):
        mid = math.sqrt(lo * hi)
        if p50(mid) <= 2.0 * unloaded:
            lo = mid
        else:
            hi = mid
    return round(lo / 2, 3)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_single(plan: Plan, data_dir: Path, seed: int, log: Callable[[str], None]) -> list[Row]:
    """Experiment (a): one replica, every engine scheduler, load sweep."""
    profile = "llama3-8b-a100"
    rows: list[Row] = []
    for workload in plan.single_workloads:
        base = base_load(workload, profile)
        for load_x in plan.single_loads:
            reqs = _load(workload, data_dir, plan.single_window_s, base * load_x, seed)
            for label, scheduler, alpha in SINGLE_SCHEDULERS:
                summary, wall_s = _run_one(
                    reqs,
                    profile=profile,
                    replicas=1,
                    router="round_robin",
                    scheduler=scheduler,
                    alpha=alpha,
                    seed=seed,
                )
                log(
                    f"(a) {workload} {load_x:g}x {label}: p50 TTFT "
                    f"{summary['ttft_p50_s']:.3f}s ({wall_s:.1f}s)"
                )
                rows.append(
                    {
                        "experiment": "single",
                        "workload": workload,
                        "profile": profile,
                        "replicas": 1,
                        "router": "-",
                        "scheduler": label,
                        "load_x": load_x,
                        "trace_load_factor": base * load_x,
                        **summary,
                    }
                )
    return rows


def run_fleets(plan: Plan, data_dir: Path, seed: int, log: Callable[[str], None]) -> list[Row]:
    """Experiment (b): fleets, every router x engine scheduler."""
    rows: list[Row] = []
    for profile, replicas in plan.fleets:
        for workload in plan.fleet_workloads:
            for load_x in plan.fleet_loads:
                factor = base_load(workload, profile) * replicas * load_x
                reqs = _load(workload, data_dir, plan.fleet_window_s, factor, seed)
                for label, scheduler, alpha in FLEET_SCHEDULERS:
                    for router in plan.routers:
                        summary, wall_s = _run_one(
                            reqs,
                            profile=profile,
                            replicas=replicas,
                            router=router,
                            scheduler=scheduler,
                            alpha=alpha,
                            seed=seed,
                        )
                        log(
                            f"(b) {replicas}x{profile} {workload} {load_x:g}x {label} "
                            f"{router}: p50 TGT {summary['tgt_p50_s']:.3f}s ({wall_s:.1f}s)"
                        )
                        rows.append(
                            {
                                "experiment": "fleet",
                                "workload": workload,
                                "profile": profile,
                                "replicas": replicas,
                                "router": router,
                                "scheduler": label,
                                "load_x": load_x,
                                "trace_load_factor": factor,
                                **summary,
                            }
                        )
    return rows


def run_ablation(plan: Plan, data_dir: Path, seed: int, log: Callable[[str], None]) -> list[Row]:
    """What-if: SAL with ties broken by position, as the paper allows (`bench.ablations`), LARRY."""
    from bench.ablations import SalPositionTies

    rows: list[Row] = []
    for profile, replicas in plan.fleets:
        for workload in plan.fleet_workloads:
            for load_x in plan.fleet_loads:
                factor = base_load(workload, profile) * replicas * load_x
                reqs = _load(workload, data_dir, plan.fleet_window_s, factor, seed)
                summary, wall_s = _run_one(
                    reqs,
                    profile=profile,
                    replicas=replicas,
                    router="sal",
                    scheduler="larry",
                    alpha=1.0,
                    seed=seed,
                    policy=SalPositionTies(seed),
                )
                log(
                    f"(what-if) {replicas}x{profile} {workload} {load_x:g}x larry "
                    f"sal_position_ties: p50 TGT {summary['tgt_p50_s']:.3f}s ({wall_s:.1f}s)"
                )
                rows.append(
                    {
                        "experiment": "ablation",
                        "workload": workload,
                        "profile": profile,
                        "replicas": replicas,
                        "router": SalPositionTies.name,
                        "scheduler": "larry",
                        "load_x": load_x,
                        "trace_load_factor": factor,
                        **summary,
                    }
                )
    return rows


STALENESS: tuple[tuple[float, float], ...] = (
    (0.1, 0.0),
    (0.5, 0.0),
    (2.0, 0.0),
    (0.1, 0.25),
    (0.1, 1.0),
)
"""(poll_interval_s, stats_delay_s) of the SAL staleness sweep; (0.1, 0) is the default."""


def run_staleness(plan: Plan, data_dir: Path, seed: int, log: Callable[[str], None]) -> list[Row]:
    """SAL's sensitivity to poll period and poll latency: first fleet, highest load, LARRY."""
    profile, replicas = plan.fleets[0]
    load_x = max(plan.fleet_loads)
    rows: list[Row] = []
    for workload in plan.fleet_workloads:
        factor = base_load(workload, profile) * replicas * load_x
        reqs = _load(workload, data_dir, plan.fleet_window_s, factor, seed)
        for poll_s, delay_s in STALENESS:
            summary, wall_s = _run_one(
                reqs,
                profile=profile,
                replicas=replicas,
                router="sal",
                scheduler="larry",
                alpha=1.0,
                seed=seed,
                poll_interval_s=poll_s,
                stats_delay_s=delay_s,
            )
            log(
                f"(staleness) {replicas}x{profile} {workload} {load_x:g}x poll {poll_s:g}s "
                f"delay {delay_s:g}s: p50 TGT {summary['tgt_p50_s']:.3f}s ({wall_s:.1f}s)"
            )
            rows.append(
                {
                    "experiment": "staleness",
                    "workload": workload,
                    "profile": profile,
                    "replicas": replicas,
                    "router": "sal",
                    "scheduler": "larry",
                    "load_x": load_x,
                    "trace_load_factor": factor,
                    "poll_interval_s": poll_s,
                    "stats_delay_s": delay_s,
                    **summary,
                }
            )
    return rows


def model_sources() -> dict[str, str]:
    """SHA-256 (first 12 hex digits) of the code the numbers depend on, to spot stale results."""
    import hashlib
    import importlib

    out: dict[str, str] = {}
    for name in (
        "engine_sim.engine",
        "engine_sim.schedulers",
        "engine_sim.cost_model",
        "engine_sim.simulator",
        "sal_core.larry",
        "sal_core.larry_tail",
        "sal_core.drain_rate",
        "sal_core.tgi",
        "sal_core.policies",
        "sal_core.beta",
    ):
        module = importlib.import_module(name)
        source = Path(str(module.__file__)).read_bytes()
        out[name] = hashlib.sha256(source).hexdigest()[:12]
    return out


def run(args: argparse.Namespace) -> int:
    from bench.report import write_report

    plan = QUICK if args.quick else FULL
    for name in (CHAT_CSV, CODE_CSV):
        if not (args.data_dir / name).is_file():
            missing = missing_message(args.data_dir / name, "--data-dir")
            print(f"sal-bench experiments: error: {missing}", file=sys.stderr)
            return 2
    if args.calibrate:
        for lengths, profile in BASE_LOAD:
            base = calibrate_base_load(lengths, profile, args.data_dir, plan.single_window_s)
            print(f"({lengths!r}, {profile!r}): {base},  # 1x trace load factor", flush=True)
        return 0
    started = time.perf_counter()
    rows = run_single(plan, args.data_dir, args.seed, _log)
    rows += run_fleets(plan, args.data_dir, args.seed, _log)
    rows += run_ablation(plan, args.data_dir, args.seed, _log)
    rows += run_staleness(plan, args.data_dir, args.seed, _log)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "quick": bool(args.quick),
        "seed": args.seed,
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
        "base_load": {f"{w}/{p}": v for (w, p), v in BASE_LOAD.items()},
        "wall_s": round(time.perf_counter() - started, 1),
        "model_sources_sha256": model_sources(),
    }
    (args.out / "results.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n"
    )
    write_report(rows, meta, args.out)
    _log(f"wrote {args.out}/results.md, results.json and plots in {meta['wall_s']} s")
    return 0
