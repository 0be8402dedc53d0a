"""``sal-bench gateways``: routing quality with K independent gateways (simulator).

    sal-bench gateways [--quick] [--out docs/results] [--jobs N] [--data-dir DIR]

Users run several gateway processes (a Kubernetes Deployment, several workers on one host).
Each keeps its own between-poll accounting and its own in-flight counts, and polls every
replica on its own phase; each receives 1/K of the traffic. This replays the workloads of
`bench.windows` through a fleet with K = 1, 2, 4, 8 gateways (`RouterConfig.gateways`) for
every router of `ROUTERS`, on three trace windows, and reports per router and K:

* TTFT p50 / p95 (median [min-max] over the windows) and their ratio to K = 1;
* **unseen co-routing** (`unseen_share`): the share of decisions that sent a request to a
  replica another gateway had sent one to after the snapshot this gateway decided on was
  taken, i.e. work it could not see. Random routing gives the chance level; a router that
  herds (several gateways choosing the same replica between polls) sits above it;
* **busiest share** (`busiest_share`): within each poll period, the share of its decisions
  that went to the replica chosen most often (1 / replicas is perfect spreading).

Workloads run at one load each (`LOADS`), near p2c+fcfs's capacity (`docs/results/capacity.md`),
where routing decides the tail. Writes ``gateways.md``, ``gateways.json`` and
``gateways.png``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.cells import log, refused, run_cells, window_tasks
from engine_sim.data import data_dir

HELP = (
    "routing quality and herding with K = 1, 2, 4, 8 gateways, independent or sharing "
    "their accounting as one host's workers do (simulator)"
)

Row = dict[str, Any]

ROUTERS = (
    "sal",
    "sal_shared",
    "sal_near",
    "sal_peers",
    "sal_peers_1ms",
    "sal_gossip",
    "p2c",
    "least_requests",
    "round_robin",
    "random",
)
"""`sal_shared` is `sal` on the workers of one host sharing their between-poll accounting
(``listen.workers`` with ``listen.share_accounting``; `RouterConfig.shared_accounting`);
`sal_near` is the herding fix for gateways that cannot share it (separate hosts,
`sal_core.policies.SALNearBest`). `sal_peers` is `sal` on separate hosts telling each other
their accounting at every change (``peers``, `sal_gateway.peers`); `sal_gossip`, a what-if
not built, tells it on a timer instead (`GOSSIP`)."""

SHARED = {"sal_shared": "sal"}
"""Rows whose gateways share their accounting, and the policy they run."""

GOSSIP = {
    "sal_peers": (0.0, 0.0002),
    "sal_peers_1ms": (0.0, 0.001),
    "sal_gossip": (0.025, 0.001),
}
"""Rows whose gateways tell each other their accounting (`RouterConfig.gossip_interval_s`,
`gossip_delay_s`), all running `sal`: at every change with 0.2 ms of network delay (what
``peers`` does within one cluster), the same with 1 ms (a slower network, or a busy event
loop on the receiving side), and every 25 ms with 1 ms."""

LOADS = {"chat": 2.0, "chat-bursty": 0.5, "code": 0.6}
"""Load (multiples of the fleet's 1x) per workload: near p2c+fcfs's capacity on 8 x 8B."""


@dataclass(frozen=True, slots=True)
class Plan:
    workloads: tuple[str, ...]
    profile: str
    replicas: int
    gateways: tuple[int, ...]
    window_s: float
    windows: int
    split: str


FULL = Plan(
    ("chat", "chat-bursty", "code"), "llama3-8b-a100", 8, (1, 2, 4, 8), 300.0, 3, "round_robin"
)
QUICK = Plan(("chat-bursty",), "llama3-8b-a100", 8, (1, 4, 8), 120.0, 3, "round_robin")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="(data/)")
    parser.add_argument("--quick", action="store_true", help="one workload, short windows")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (1)")
    parser.add_argument(
        "--split", choices=("round_robin", "random"), default=None, help="arrival split"
    )


def unseen_share(decisions: Sequence[Any]) -> float:
    """Share of decisions to a replica another gateway routed to since this one's snapshot.

    A decision (time t, gateway g, replica r, snapshot taken at s) counts when some other
    gateway routed a request to r at a time in [s, t): work g could not know about. With one
    gateway it is 0 by definition.
    """
    if not decisions:
        return 0.0
    per_replica: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for d in decisions:
        per_replica[d.replica].append((d.time_s, d.gateway))
    times = {r: [t for t, _ in rows] for r, rows in per_replica.items()}
    hits = 0
    for d in decisions:
        rows = per_replica[d.replica]
        lo = bisect.bisect_left(times[d.replica], d.snapshot_s)
        hi = bisect.bisect_left(times[d.replica], d.time_s)
        if any(g != d.gateway for _, g in rows[lo:hi]):
            hits += 1
    return hits / len(decisions)


def busiest_share(decisions: Sequence[Any], period_s: float) -> float:
    """Decision-weighted mean, over poll periods with >= 2 decisions, of the share of a
    period's decisions that went to its most chosen replica."""
    periods: dict[int, Counter[int]] = defaultdict(Counter)
    for d in decisions:
        periods[int(d.time_s // period_s)][d.replica] += 1
    total = top = 0
    for counts in periods.values():
        n = sum(counts.values())
        if n >= 2:
            total += n
            top += max(counts.values())
    return top / total if total else 0.0


def _cell(task: tuple[str, int, Plan, Path]) -> list[Row]:
    """Every router and K on one (workload, window)."""
    from bench.experiments import base_load
    from bench.stacks import Stack, run_stack
    from bench.windows import window, workload_trace
    from engine_sim.simulator import RouterConfig
    from engine_sim.trace import scale_load

    workload, index, plan, folder = task
    reqs = window(workload_trace(workload, folder), index, plan.window_s)
    factor = LOADS[workload] * base_load(workload, plan.profile) * plan.replicas
    reqs = scale_load(reqs, factor)
    rows: list[Row] = []
    for router in ROUTERS:
        for k in plan.gateways:
            started = time.perf_counter()
            policy = SHARED.get(router, "sal" if router in GOSSIP else router)
            interval_s, delay_s = GOSSIP.get(router, (None, 0.0))
            config = RouterConfig(
                seed=index,
                gateways=k,
                gateway_split=plan.split,
                shared_accounting=router in SHARED,
                gossip_interval_s=interval_s,
                gossip_delay_s=delay_s,
            )
            result = run_stack(
                reqs,
                Stack(router, policy),
                profile=plan.profile,
                replicas=plan.replicas,
                router=config,
            )
            s = result.summary
            row = {
                "workload": workload,
                "load_x": LOADS[workload],
                "window": index,
                "router": router,
                "gateways": k,
                "requests": len(reqs),
                "ttft_p50_s": s.ttft_p50_s,
                "ttft_p95_s": s.ttft_p95_s,
                "ttft_p99_s": s.ttft_p99_s,
                "tgt_p50_s": s.tgt_p50_s,
                "unseen_share": unseen_share(result.decisions),
                "busiest_share": busiest_share(result.decisions, config.poll_interval_s),
                "routed_max_share": max(result.routed_per_replica) / max(1, len(reqs)),
            }
            rows.append(row)
            log(
                f"{workload} window {index} {router} K={k}: TTFT p95 {s.ttft_p95_s:.3f}s "
                f"unseen {row['unseen_share']:.3f} ({time.perf_counter() - started:.1f}s)"
            )
    return rows


def measure(plan: Plan, folder: Path, jobs: int) -> list[Row]:
    return run_cells(_cell, window_tasks(plan.workloads, plan.windows, plan, folder), jobs)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from bench.gateways_report import write_report

    if (code := refused("gateways", args.data_dir, args.jobs)) is not None:
        return code
    plan = QUICK if args.quick else FULL
    if args.split:
        plan = replace(plan, split=args.split)
    started = time.perf_counter()
    rows = measure(plan, args.data_dir, args.jobs)
    meta = {
        "plan": asdict(plan),
        "loads": LOADS,
        "wall_s": round(time.perf_counter() - started, 1),
        "command": "sal-bench gateways" + (" --quick" if args.quick else ""),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateways.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(rows, meta, args.out)
    log(f"wrote {args.out}/gateways.md, gateways.json, gateways.png in {meta['wall_s']} s")
    return 0
