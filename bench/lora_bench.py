"""``sal-bench lora``: routing a multi-tenant LoRA fleet, with and without LoRA slots.

    sal-bench lora [--quick] [--out docs/results] [--jobs N] [--data-dir DIR]

vLLM starts a waiting request only if its adapter is already in the step's batch or the
batch holds fewer than ``--max-loras`` adapters; otherwise the request waits, however idle
the replica otherwise is (`engine_sim.engine.EngineConfig.max_loras` models it as vLLM's
scheduler does). A router blind to that sends an adapter's request to a replica whose slots
other adapters hold. The gateway's LoRA rule (`sal_core.lora_slots`, on for every policy)
sends it where it can start now, when some replica can, and among those to one already
running its adapter unless that one's queue is more than a step longer.

Each Azure trace window (chat, code; lengths and arrival times as recorded) is given a
Zipf-popular adapter per request (`engine_sim.adapters.with_adapters`: `ADAPTERS` adapters,
exponent `ZIPF_S`) and replayed through 8 Llama-3-8B replicas on A100-40GB running stock
vLLM's FCFS order with ``--max-loras`` `MAX_LORAS`, at `LOAD_FRACTIONS` of the load at which
p2c+fcfs nears its capacity without adapters (`bench.gateways.LOADS`), by round robin, p2c,
least requests and SAL, each blind to LoRA slots, with the free-slot filter only, with that
filter and then the replicas already running the adapter, and with the gateway's rule (which
adds, when every slot is held, the replicas with the fewest requests in flight), on 8
windows. Then each router with the gateway's rule as `WORKERS` workers of one host
(``listen.workers``) sharing their accounting, with and without the adapters each routed
since its last poll, and as `WORKERS` gateways on separate hosts (``peers``; `SETUPS`).
LoRA's kernel cost and adapter loading are not modelled (the same for every router).

Writes ``lora.md`` and ``lora.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.cells import log, refused, run_cells, window_tasks
from engine_sim.data import data_dir

HELP = "LoRA fleets: each router blind to LoRA slots and with the gateway's rules (simulator)"

Row = dict[str, Any]

ROUTERS = ("round_robin", "p2c", "least_requests", "sal")
ADAPTERS = 32
ZIPF_S = 1.0
MAX_LORAS = (4, 8)
"""``--max-loras`` values (vLLM's default is 1: with 32 adapters on 8 replicas every
router then queues for minutes; deployments serving many adapters raise it)."""
LOAD_FRACTIONS = (0.5, 1.0)
LORA_ROUTING = ("blind", "slots", "no_full", "affinity")
"""How each router treats LoRA slots: not at all; only the free-slot filter
(`sal_core.lora_slots.prefer_free_slots`); that filter, then the replicas already running the
adapter (`sal_core.lora_slots.prefer_running_adapter`); the gateway's rule, which adds, when
every replica's slots are held, the replicas with the fewest requests in flight
(`sal_core.lora_slots.fewest_in_flight`; all three: `sal_core.lora_slots.lora_route`)."""
WORKERS = 4
"""Gateway workers of one host (``listen.workers``) in the several-workers runs."""
SETUPS = ("one", "workers", "workers_apart", "peers", "peers_apart")
"""Who routes: one gateway; `WORKERS` workers sharing their between-poll accounting
(``listen.workers``, arrivals split round robin), including the adapters each routed since
its last poll (`sal_gateway.shared_accounting`); the same workers sharing counts but not
adapters (the gateway before it shared them); `WORKERS` gateways on separate hosts telling
each other the same at every change, 1 ms apart (``peers``), and with their counts but not
their adapters. All but the first use the gateway's rule."""


@dataclass(frozen=True, slots=True)
class Plan:
    workloads: tuple[str, ...]
    profile: str
    replicas: int
    window_s: float
    windows: int


FULL = Plan(("chat", "code"), "llama3-8b-a100", 8, 300.0, 8)
QUICK = Plan(("chat",), "llama3-8b-a100", 4, 120.0, 3)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="(data/)")
    parser.add_argument("--quick", action="store_true", help="small fleet, short windows")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (1)")


def _cell(task: tuple[str, int, Plan, Path]) -> list[Row]:
    from bench.experiments import base_load
    from bench.gateways import LOADS
    from bench.stacks import Stack, run_stack
    from bench.windows import window, workload_trace
    from engine_sim.adapters import with_adapters
    from engine_sim.simulator import RouterConfig
    from engine_sim.trace import scale_load

    workload, index, plan, folder = task
    recorded = window(workload_trace(workload, folder), index, plan.window_s)
    rows: list[Row] = []
    for fraction in LOAD_FRACTIONS:
        factor = fraction * LOADS[workload] * base_load(workload, plan.profile) * plan.replicas
        reqs = with_adapters(
            scale_load(recorded, factor), adapters=ADAPTERS, zipf_s=ZIPF_S, seed=index
        )
        for max_loras in MAX_LORAS:
            runs = [(router, lora, "one") for router in ROUTERS for lora in LORA_ROUTING]
            runs += [(router, "affinity", setup) for router in ROUTERS for setup in SETUPS[1:]]
            for router, lora, setup in runs:
                started = time.perf_counter()
                workers: dict[str, Any] = {}
                if setup.startswith("peers"):
                    workers = {
                        "gateways": WORKERS,
                        "gossip_interval_s": 0.0,
                        "shared_adapters": setup == "peers",
                    }
                elif setup != "one":
                    workers = {
                        "gateways": WORKERS,
                        "shared_accounting": True,
                        "shared_adapters": setup == "workers",
                    }
                config = RouterConfig(
                    seed=index,
                    lora_slots=lora != "blind",
                    lora_affinity=lora in ("no_full", "affinity"),
                    lora_when_full=lora == "affinity",
                    **workers,
                )
                result = run_stack(
                    reqs,
                    Stack(router, router, {"scheduler": "fcfs", "max_loras": max_loras}),
                    profile=plan.profile,
                    replicas=plan.replicas,
                    router=config,
                )
                s = result.summary
                rows.append(
                    {
                        "workload": workload,
                        "load_fraction": fraction,
                        "max_loras": max_loras,
                        "window": index,
                        "router": router,
                        "lora": lora,
                        "setup": setup,
                        "requests": len(reqs),
                        "ttft_p50_s": s.ttft_p50_s,
                        "ttft_p95_s": s.ttft_p95_s,
                        "ttft_p99_s": s.ttft_p99_s,
                        "tgt_p50_s": s.tgt_p50_s,
                        "preemption_rate": s.preemption_rate,
                    }
                )
                log(
                    f"{workload} window {index} load {fraction:g} max_loras {max_loras} "
                    f"{router} {lora} {setup}: TTFT p95 {s.ttft_p95_s:.3f}s "
                    f"({time.perf_counter() - started:.1f}s)"
                )
    return rows


def run(args: argparse.Namespace) -> int:
    from bench.gateways import LOADS
    from bench.lora_report import write_report

    if (code := refused("lora", args.data_dir, args.jobs)) is not None:
        return code
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    tasks = window_tasks(plan.workloads, plan.windows, plan, args.data_dir)
    rows = run_cells(_cell, tasks, args.jobs)
    meta = {
        "plan": asdict(plan),
        "loads": {w: LOADS[w] for w in plan.workloads},
        "adapters": ADAPTERS,
        "zipf_s": ZIPF_S,
        "max_loras": MAX_LORAS,
        "load_fractions": LOAD_FRACTIONS,
        "workers": WORKERS,
        "wall_s": round(time.perf_counter() - started, 1),
        "command": "sal-bench lora" + (" --quick" if args.quick else ""),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = write_report(rows, meta, args.out)
    print(text)
    log(f"wrote {args.out}/lora.md, lora.json in {meta['wall_s']} s")
    return 0
