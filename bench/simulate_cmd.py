"""``sal-bench simulate``: replay one trace through a simulated fleet and print the numbers.

    sal-bench simulate [--trace PATH] --replicas N --router NAME --scheduler NAME \\
        --load-factor F --profile NAME [--alpha A] [--duration-s S] [--seed N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "replay a trace through N simulated replicas behind a routing policy"

_PROGRESS_MIN_REQUESTS = 2000
"""Runs with at least this many requests draw a progress bar on stderr."""


def configure(parser: argparse.ArgumentParser) -> None:
    from bench.workload import ARRIVALS
    from engine_sim.cost_model import PROFILES
    from engine_sim.data import AZURE_CHAT, data_dir
    from engine_sim.schedulers import ENGINE_SCHEDULERS
    from sal_core.policies import POLICIES

    parser.add_argument(
        "--trace",
        type=Path,
        default=data_dir() / AZURE_CHAT,
        help=f"Azure LLM trace CSV (the chat trace in the repository's data/: {AZURE_CHAT})",
    )
    parser.add_argument("--replicas", type=int, default=1, help="number of replicas (1)")
    parser.add_argument("--router", choices=sorted(POLICIES), default="sal", help="(sal)")
    parser.add_argument(
        "--scheduler", choices=sorted(ENGINE_SCHEDULERS), default="fcfs", help="(fcfs)"
    )
    parser.add_argument("--load-factor", type=float, default=1.0, help="arrival-rate x (1.0)")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="llama3-8b-a100", help="(llama3-8b-a100)"
    )
    parser.add_argument("--alpha", type=float, default=1.0, help="LARRY's alpha (1.0)")
    parser.add_argument("--duration-s", type=float, default=None, help="trace window length")
    parser.add_argument("--start-s", type=float, default=0.0, help="trace window start (0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random/p2c/gamma (0)")
    parser.add_argument("--arrivals", choices=ARRIVALS, default="trace", help="(trace)")
    parser.add_argument("--gamma-cv", type=float, default=4.0, help="CV for gamma arrivals")
    parser.add_argument("--timestamps-from", type=Path, default=None, help="for --arrivals retime")
    parser.add_argument("--context-limit", type=int, default=8192, help="clip lengths (8192)")
    parser.add_argument("--poll-interval-s", type=float, default=0.1, help="/stats period")
    parser.add_argument("--stats-delay-s", type=float, default=0.0, help="snapshot age (0)")
    parser.add_argument("--beta-seed", type=float, default=2.0, help="SAL's initial beta")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from bench.progress import ProgressBar
    from bench.workload import WorkloadSpec, build_requests
    from engine_sim.data import missing_message
    from engine_sim.simulator import RouterConfig, SimulationError, simulate
    from engine_sim.trace import TraceError

    for option, path in (("--trace", args.trace), ("--timestamps-from", args.timestamps_from)):
        if path is not None and not path.is_file():
            print(f"sal-bench simulate: error: {missing_message(path, option)}", file=sys.stderr)
            return 2
    try:
        requests = build_requests(
            WorkloadSpec(
                trace=args.trace,
                load_factor=args.load_factor,
                arrivals=args.arrivals,
                gamma_cv=args.gamma_cv,
                timestamps_from=args.timestamps_from,
                start_s=args.start_s,
                duration_s=args.duration_s,
                context_limit_tokens=args.context_limit,
                seed=args.seed,
            )
        )
        router = RouterConfig(
            policy=args.router,
            poll_interval_s=args.poll_interval_s,
            stats_delay_s=args.stats_delay_s,
            beta_seed=args.beta_seed,
            seed=args.seed,
        )
        show = not args.no_progress and len(requests) >= _PROGRESS_MIN_REQUESTS
        result = simulate(
            requests,
            replicas=args.replicas,
            scheduler=args.scheduler,
            profile=args.profile,
            alpha=args.alpha,
            router=router,
            progress=ProgressBar("simulating") if show else None,
        )
    except (OSError, TraceError, SimulationError, ValueError) as exc:
        print(f"sal-bench simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        body = {
            "config": {
                "trace": str(args.trace),
                "replicas": args.replicas,
                "router": args.router,
                "scheduler": args.scheduler,
                "alpha": args.alpha,
                "load_factor": args.load_factor,
                "profile": args.profile,
                "arrivals": args.arrivals,
                "seed": args.seed,
            },
            "summary": result.summary.to_dict(),
            "routed_per_replica": result.routed_per_replica,
            "engine_steps": result.steps,
            "final_beta": result.final_beta,
        }
        print(json.dumps(body, indent=2, allow_nan=False, default=str))
    else:
        from engine_sim.results import format_table

        print(
            f"{args.replicas} x {args.profile}, router {args.router}, scheduler "
            f"{args.scheduler}, load x{args.load_factor:g}, arrivals {args.arrivals}"
        )
        print(format_table(result.summary))
    return 0
