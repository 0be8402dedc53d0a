"""SAL with a realistic ``/stats`` delay, before and after the accounting fix (issue 8).

    python -m bench.stats_delay --out docs/results/stats_delay.md [--data-dir DIR]

Every headline fleet number (`bench.experiments`) uses a stats delay of 0: a snapshot reaches
the router the instant it is taken. Real polls take time: the snapshot is written, read by the
API server, serialised, sent, parsed. This replays the fleet experiment with the snapshot
reaching the router 0, 50 and 200 ms after it was taken (poll period 100 ms), under both
between-poll accounting rules of the simulated gateway (`engine_sim.simulator.RouterConfig`):

* ``reset`` (before): every snapshot that reaches the router resets the local accounting,
  forgetting the requests routed while it was on its way;
* ``ticket`` (after, the gateway's rule now): a snapshot stops the counting of only the
  requests routed at least ``accounting_grace_s`` (50 ms) before it was taken.

The fleets of `bench.experiments` (8 x llama3-8b-a100, 4 x llama3-70b-fp8-h100x2) with LARRY
engines, workloads chat and chat-bursty, at 1x and 2x (the knee), three seeds: seed k replays
the k-th 300 s window of the trace (a different slice of traffic; the seed also seeds p2c and
random). The baselines (p2c, least_requests, round_robin, random) use no snapshot at all (only
the router's own in-flight counts), so neither the delay nor the accounting rule can change
them: they run once per window. Writes the markdown report (means over the seeds; every run
in the JSON) to ``--out`` and the raw rows next to it (``.json``). About 6 CPU-minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.experiments import CHAT_CSV, CODE_CSV, _run_one, base_load
from engine_sim.data import data_dir

FLEETS = (("llama3-8b-a100", 8), ("llama3-70b-fp8-h100x2", 4))
LOADS_X = (1.0, 2.0)
WINDOW_S = 300.0
SEEDS = (0, 1, 2)
DELAYS_S = (0.0, 0.05, 0.2)
POLL_INTERVAL_S = 0.1
WORKLOADS = ("chat", "chat-bursty")
BASELINES = ("p2c", "least_requests", "round_robin", "random")
METRICS = ("ttft_p50_s", "ttft_p95_s", "tgt_p50_s", "tgt_p95_s")

Row = dict[str, Any]


def _workload(name: str, data_dir: Path) -> list[Any]:
    """The whole trace of `name` (unscaled), sorted by arrival."""
    from bench.workload import WorkloadSpec, build_requests

    chat, code = data_dir / CHAT_CSV, data_dir / CODE_CSV
    spec = {
        "chat": WorkloadSpec(trace=chat),
        "chat-bursty": WorkloadSpec(trace=chat, arrivals="retime", timestamps_from=code),
    }[name]
    return build_requests(spec)


def _window(reqs: Sequence[Any], seed: int, factor: float) -> list[Any]:
    """The `seed`-th `WINDOW_S` slice, shifted to start at 0, arrival rate times `factor`."""
    from dataclasses import replace

    from engine_sim.trace import scale_load

    start = seed * WINDOW_S
    sliced = [replace(r, arrival_s=r.arrival_s - start) for r in reqs]
    sliced = [r for r in sliced if 0.0 <= r.arrival_s < WINDOW_S]
    return scale_load(sliced, factor)


def run(data_dir: Path, log: Any) -> list[Row]:
    rows: list[Row] = []
    cells: list[tuple[str, str, float]] = [(r, "-", 0.0) for r in BASELINES]
    cells += [("sal", acc, d) for d in DELAYS_S for acc in ("reset", "ticket")]
    for workload in WORKLOADS:
        trace = _workload(workload, data_dir)
        for profile, replicas in FLEETS:
            for load_x in LOADS_X:
                factor = base_load(workload, profile) * replicas * load_x
                for seed in SEEDS:
                    reqs = _window(trace, seed, factor)
                    for router, accounting, delay_s in cells:
                        summary, wall_s = _run_one(
                            reqs,
                            profile=profile,
                            replicas=replicas,
                            router=router,
                            scheduler="larry",
                            alpha=1.0,
                            seed=seed,
                            poll_interval_s=POLL_INTERVAL_S,
                            stats_delay_s=delay_s,
                            accounting="ticket" if accounting == "-" else accounting,
                        )
                        log(
                            f"{replicas}x{profile} {workload} {load_x:g}x seed {seed} {router} "
                            f"{accounting} delay {delay_s:g}s: TTFT p95 "
                            f"{summary['ttft_p95_s']:.3f}s ({wall_s:.1f}s)"
                        )
                        rows.append(
                            {
                                "fleet": f"{replicas}x{profile}",
                                "workload": workload,
                                "load_x": load_x,
                                "seed": seed,
                                "requests": len(reqs),
                                "router": router,
                                "accounting": accounting,
                                "stats_delay_s": delay_s,
                                **{m: summary[m] for m in METRICS},
                            }
                        )
    return rows


def _label(row: Row) -> str:
    if row["router"] != "sal":
        return str(row["router"])
    before_after = "before" if row["accounting"] == "reset" else "after"
    return f"sal, delay {row['stats_delay_s'] * 1e3:.0f} ms, {before_after} ({row['accounting']})"


def _mean(rows: list[Row], metric: str) -> float:
    return statistics.fmean(float(r[metric]) for r in rows)


def report(rows: list[Row], wall_s: float) -> str:
    """The markdown report: a summary of SAL against the best baseline, then every cell."""
    groups: dict[tuple[str, str, float], dict[str, list[Row]]] = {}
    for row in rows:
        key = (row["fleet"], row["workload"], row["load_x"])
        groups.setdefault(key, {}).setdefault(_label(row), []).append(row)
    out = [
        "# SAL with a non-zero stats delay, before and after the accounting fix",
        "",
        "Generated by `python -m bench.stats_delay --out docs/results/stats_delay.md` "
        f"({len(rows)} simulator runs, {wall_s:.0f} s on the shared 2-core machine). "
        "See `bench/stats_delay.py` for the setup: poll period 100 ms, the snapshot reaches "
        "the router 0 / 50 / 200 ms after it was taken; *before* = every arriving snapshot "
        "resets the between-poll accounting (`reset`), *after* = a snapshot clears only the "
        "requests routed at least 50 ms before it was taken (`ticket`, the gateway's rule "
        "now). LARRY engines; means over 3 seeds (300 s trace windows 0-300, 300-600, "
        "600-900 s). Times in seconds.",
        "",
        "## Summary: best baseline / SAL (> 1: SAL is better)",
        "",
        "| fleet | workload | load | delay | TTFT p50 before -> after | TTFT p95 before -> after "
        "| TGT p50 before -> after | TGT p95 before -> after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (fleet, workload, load_x), cells in groups.items():
        for delay_s in DELAYS_S:
            ms = f"{delay_s * 1e3:.0f} ms"
            before = cells[f"sal, delay {ms}, before (reset)"]
            after = cells[f"sal, delay {ms}, after (ticket)"]
            parts = []
            for metric in METRICS:
                best = min(_mean(cells[b], metric) for b in BASELINES)
                parts.append(
                    f"{best / _mean(before, metric):.2f} -> {best / _mean(after, metric):.2f}"
                )
            out.append(f"| {fleet} | {workload} | {load_x:g}x | {ms} | " + " | ".join(parts) + " |")
    for (fleet, workload, load_x), cells in groups.items():
        n = cells[BASELINES[0]][0]["requests"]
        out += [
            "",
            f"## {fleet}, {workload}, {load_x:g}x ({n} requests in seed 0's window)",
            "",
            "| router | TTFT p50 | TTFT p95 | TGT p50 | TGT p95 |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, runs in cells.items():
            values = " | ".join(f"{_mean(runs, m):.3f}" for m in METRICS)
            out.append(f"| {label} | {values} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_delay", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/results/stats_delay.md"))
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="(data/)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = run(args.data_dir, lambda msg: print(msg, file=sys.stderr, flush=True))
    wall_s = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, wall_s))
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out} ({wall_s:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
