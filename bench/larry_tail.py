"""``sal-bench larry-tail``: LARRY without the tail penalty, on every workload, load and window.

    sal-bench larry-tail [--out docs/results] [--jobs 2] [--loads 0.5,1,...] [--windows 0,1,2,3,4]
    sal-bench larry-tail --report-only        # re-render the report from larry_tail.json
    sal-bench larry-tail --schedulers larry_tail --merge   # rerun one variant, keep the rest

One replica of Llama-3-8B on A100 (the single-replica experiment's engine), workloads chat /
chat-bursty / code, loads 0.5x..3x, five 600-s trace windows (`bench.larry_tail_runs`:
windows 0-2 tuned on, 3-4 held out), every scheduler of `VARIANTS` on the same requests.
Writes ``larry_tail.json`` (every run), ``larry_tail.md`` (ratios against FCFS and against
FCFS with the same headroom, median and min-max over windows, the issue's aims per
workload and load, met or not) and ``larry_tail.png`` (p50 / p99 TTFT against load).
CPU-bound: about 2 s per run on a free core; ``--jobs`` runs that many in parallel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.larry_tail_runs import (
    HELD_OUT_WINDOWS,
    LOADS,
    TUNING_WINDOWS,
    VARIANTS,
    WORKLOADS,
    build_for,
    load_requests,
    run_variant,
    variant,
)
from engine_sim.data import AZURE_CHAT, AZURE_CODE, data_dir, missing_message

HELP = "LARRY variants without the tail penalty vs FCFS, TGI: every workload, load and window"

Row = dict[str, Any]
_KEYS = (
    "requests",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "ttft_max_s",
    "norm_ttft_p50_ms_per_token",
    "norm_ttft_p95_ms_per_token",
    "preemption_rate",
    "tgt_p50_s",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="the traces' folder")
    parser.add_argument("--jobs", type=int, default=1, help="simulations in parallel (1)")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    parser.add_argument(
        "--windows", default=",".join(str(w) for w in TUNING_WINDOWS + HELD_OUT_WINDOWS)
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--schedulers",
        default=",".join(v.label for v in VARIANTS),
        help="variant labels to run (default: all)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other schedulers' rows of an existing larry_tail.json",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="re-render from the folder's larry_tail.json"
    )


def _job(spec: tuple[str, int, float, str, str]) -> Row:
    workload, window, load_x, label, folder = spec
    reqs = load_requests(workload, window, load_x, Path(folder))
    summary = run_variant(reqs, build_for(variant(label), reqs))
    return {
        "workload": workload,
        "window": window,
        "held_out": window in HELD_OUT_WINDOWS,
        "load_x": load_x,
        "scheduler": label,
        **{k: summary[k] for k in _KEYS},
    }


def run_sweep(
    workloads: Sequence[str],
    windows: Sequence[int],
    loads: Sequence[float],
    labels: Sequence[str],
    folder: Path,
    jobs: int,
) -> list[Row]:
    """Every (workload, window, load, variant) run, in a stable order."""
    specs = [
        (w, k, x, label, str(folder))
        for w in workloads
        for k in windows
        for x in loads
        for label in labels
    ]
    rows: list[Row] = []
    started = time.perf_counter()
    if jobs <= 1:
        results = map(_job, specs)
        for n, row in enumerate(results, 1):
            rows.append(row)
            _progress(n, len(specs), started)
    else:
        with ProcessPoolExecutor(jobs) as pool:
            for n, row in enumerate(pool.map(_job, specs), 1):
                rows.append(row)
                _progress(n, len(specs), started)
    return rows


def _progress(n: int, total: int, started: float) -> None:
    if n % 20 == 0 or n == total:
        elapsed = time.perf_counter() - started
        print(f"larry-tail: {n}/{total} runs, {elapsed:.0f} s", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    raw = out / "larry_tail.json"
    if args.report_only:
        from bench.larry_tail_report import write_report

        if not raw.is_file():
            print(f"sal-bench larry-tail: error: {raw} not found", file=sys.stderr)
            return 2
        data = json.loads(raw.read_text())
        write_report(data["rows"], data["meta"], out)
        return 0
    for name in (AZURE_CHAT, AZURE_CODE):
        if not (args.data_dir / name).is_file():
            missing = missing_message(args.data_dir / name, "--data-dir")
            print(f"sal-bench larry-tail: error: {missing}", file=sys.stderr)
            return 2
    try:
        loads = [float(x) for x in args.loads.split(",")]
        windows = [int(x) for x in args.windows.split(",")]
        workloads = [w for w in args.workloads.split(",") if w]
    except ValueError as exc:
        print(f"sal-bench larry-tail: error: bad --loads/--windows: {exc}", file=sys.stderr)
        return 2
    labels = [s for s in args.schedulers.split(",") if s]
    known = {v.label for v in VARIANTS}
    if not labels or any(s not in known for s in labels):
        print(
            f"sal-bench larry-tail: error: --schedulers must be among {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or any(not 0 <= k <= 4 for k in windows):
        print(
            f"sal-bench larry-tail: error: workloads must be among {', '.join(WORKLOADS)} "
            "and windows among 0-4",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    rows = run_sweep(workloads, windows, loads, labels, args.data_dir, max(1, args.jobs))
    kept: dict[str, Any] = {}
    wall_before = 0.0
    invocation = f"--schedulers {','.join(labels)!r} --jobs {max(1, args.jobs)}"
    if args.merge and raw.is_file():
        previous = json.loads(raw.read_text())
        rows = [r for r in previous["rows"] if r["scheduler"] not in labels] + rows
        # The other schedulers' rows stay, and so does what the report says about them.
        kept = {k: previous["meta"][k] for k in ("tuned_on", "note") if k in previous["meta"]}
        wall_before = float(previous["meta"].get("wall_s", 0.0))
        invocation += " --merge"
        if "note" in kept:
            kept["note"] = f"{kept['note']}, then {invocation}"
    order = {v.label: i for i, v in enumerate(VARIANTS)}
    rows = [r for r in rows if r["scheduler"] in order]
    rows.sort(key=lambda r: (r["workload"], r["window"], r["load_x"], order[r["scheduler"]]))
    meta = {
        "loads": sorted({float(r["load_x"]) for r in rows}),
        "windows": sorted({int(r["window"]) for r in rows}),
        "tuning_windows": list(TUNING_WINDOWS),
        "held_out_windows": list(HELD_OUT_WINDOWS),
        "workloads": [w for w in WORKLOADS if any(r["workload"] == w for r in rows)],
        "variants": {v.label: v.description for v in VARIANTS},
        "wall_s": round(wall_before + time.perf_counter() - started, 1),
        "note": f"one invocation on a shared 2-core machine: {invocation}",
        **kept,
    }
    out.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    from bench.larry_tail_report import write_report

    write_report(rows, meta, out)
    print(f"wrote {out}/larry_tail.md, larry_tail.json, larry_tail.png", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.larry_tail [options]`` (= ``sal-bench larry-tail``)."""
    parser = argparse.ArgumentParser(prog="sal-bench larry-tail", description=HELP)
    configure(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
