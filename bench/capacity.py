"""``sal-bench capacity``: the highest load each serving stack sustains within latency SLOs.

    sal-bench capacity [--quick] [--out docs/results] [--jobs N] [--stacks a,b] [--data-dir DIR]
    sal-bench capacity --report-only --out docs/results     # re-render from capacity.json

What a platform team buys is capacity: how many replicas it needs to serve its traffic
within its latency objectives. For each workload (`bench.windows`) and fleet, and for each
stack of `bench.stacks.STACKS`, this finds by bisection on the load factor the highest load
at which the stack meets both objectives of `SLOS` (p95 TTFT and p95 time per output
token), on each of several trace windows (the seeds), then reports:

* capacity per stack: median [min-max] over the windows, in units of the fleet's nominal 1x
  (`bench.experiments.base_load` per replica) and in requests/s per replica;
* capacity relative to ``p2c+fcfs`` as paired per-window ratios (`bench.spread.compare`;
  a spread that reaches within the bisection's resolution of 1 is a tie), and its inverse,
  the replicas needed for the same traffic;
* p95 / p99 TTFT of every stack at ``p2c+fcfs``'s capacity (same window, same load).

**Sustains**: a stack sustains load x on a window when every request finishes, the p95
TTFT is at most the SLO's and the p95 TPOT is at most the SLO's. Its capacity on the window is
the bisection's highest sustained load (relative tolerance `Plan.rel_tol`); its capacity is
the median over the windows, so a load at which the stack sustains at least two of three
windows when attainment is monotone in load. The search starts at p2c's capacity on the
same window (bracketed by factors of `BRACKET`), so probes cluster where the answers lie.

Writes ``capacity.md``, ``capacity.json`` (every probe) and ``capacity.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.cells import log, run_cells
from engine_sim.data import AZURE_CHAT, AZURE_CODE, SHAREGPT_STATS, data_dir, missing_message

HELP = "highest load each stack sustains within p95 TTFT/TPOT SLOs (bisection, 3 windows)"

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives of one workload (both must hold)."""

    ttft_p95_s: float
    tpot_p95_s: float
    why: str


SLOS: dict[str, Slo] = {
    "chat": Slo(
        1.0,
        0.10,
        "chatbot: TPOT as DistServe's chatbot SLO (0.1 s, OPT-13B) and Sarathi-Serve's strict "
        "P99 TBT for a 7B model (0.1 s); TTFT between DistServe's chatbot SLOs for 13B and 66B "
        "(0.25-2.5 s) and within Sarathi-Serve's 2 s median scheduling-delay bound, about 3x "
        "the unloaded p95 of this trace's long prompts (0.35 s)",
    ),
    "code": Slo(
        1.5,
        0.20,
        "code completion: TPOT as DistServe's code-completion SLO (0.2 s); TTFT its 0.125 s "
        "for HumanEval's 171-token prompts scaled to this trace's 2,048-token mean prompt "
        "(12x: 1.5 s), about 2.2x the unloaded p95 (0.67 s)",
    ),
}
SLOS["chat-bursty"] = Slo(
    SLOS["chat"].ttft_p95_s,
    SLOS["chat"].tpot_p95_s,
    "as chat: the same requests and users, only the arrivals are bursty",
)
SLOS["multiturn"] = Slo(
    5.0,
    SLOS["chat"].tpot_p95_s,
    "chatbot TPOT as chat (0.1 s); TTFT scaled to these prompts as code's is: each turn resends "
    "the conversation so far (median 8-9k tokens, p95 22k), so a replica that has none of it "
    "cached prefills for seconds even when idle: 5 s is about 2.2x the unloaded p95 of "
    "cache-blind routing (2.3 s on 8 x llama31-8b-a100-80gb at 0.05x)",
)
"""Per workload (chat-bursty and multiturn keep chat's objectives: chatbot users)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How much to run (full or ``--quick``)."""

    workloads: tuple[str, ...]
    fleets: tuple[tuple[str, int], ...]
    """(profile, replicas)."""
    window_s: float
    """Trace seconds per window (before load scaling)."""
    windows: int
    """Windows per cell (the seeds)."""
    rel_tol: float
    """Bisection stops when the bracket's hi / lo is at most 1 + this."""
    reuse_fleets: tuple[tuple[str, int], ...] = ()
    """(profile, replicas) for the workloads with prefix reuse (`bench.windows.REUSE_WORKLOADS`;
    long-context profiles: their prompts grow with the conversation); `fleets` for the rest."""

    def fleets_for(self, workload: str) -> tuple[tuple[str, int], ...]:
        from bench.windows import REUSE_WORKLOADS

        return self.reuse_fleets if workload in REUSE_WORKLOADS else self.fleets


FULL = Plan(
    workloads=("chat", "chat-bursty", "code", "multiturn"),
    fleets=(("llama3-8b-a100", 8), ("llama3-70b-fp8-h100x2", 4)),
    window_s=300.0,
    windows=3,
    rel_tol=0.03,
    reuse_fleets=(("llama31-8b-a100-80gb", 8), ("llama31-8b-a100", 8)),
)
QUICK = Plan(
    workloads=("chat-bursty", "code"),
    fleets=(("llama3-8b-a100", 4),),
    window_s=120.0,
    windows=3,
    rel_tol=0.08,
)
BRACKET = 1.25
"""Factor by which the search steps out from its first guess until it brackets capacity."""
LOAD_LIMITS = (1.0 / 64, 64.0)
"""Loads (x) below / above which the search gives up (capacity reported as 0 / the limit)."""


@dataclass(frozen=True, slots=True)
class Probe:
    """One simulator run at one load."""

    load_x: float
    ttft_p95_s: float
    ttft_p99_s: float
    tpot_p95_s: float
    unfinished: int
    ok: bool
    hit_rate: float = 0.0
    """Share of prompt tokens served from the replicas' prefix caches (0 without reuse)."""
    aborted: bool = False
    """Stopped once more than 5 % of requests were certainly over the TTFT objective (a
    failed probe; its latencies cover the requests finished by then)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="(data/)")
    parser.add_argument("--quick", action="store_true", help="small fleet, short windows")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (1)")
    parser.add_argument("--stacks", default=None, help="comma list (default: every stack)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other stacks' rows of the --out folder's capacity.json (with --stacks)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite capacity.md and capacity.png from the capacity.json in --out",
    )


@dataclass(frozen=True, slots=True)
class Cell:
    """One (workload, fleet, window): the requests every stack replays there."""

    workload: str
    profile: str
    replicas: int
    window: int
    requests: Sequence[Any]
    """The window's requests at the fleet's 1x (trace workloads: unscaled)."""
    window_s: float = 0.0
    """Generated workloads: seconds during which conversations start."""
    lengths: Sequence[tuple[int, int]] = ()
    """Generated workloads: the ShareGPT lengths they draw from (`bench.windows`)."""

    @property
    def slo(self) -> Slo:
        return SLOS[self.workload]

    @property
    def has_reuse(self) -> bool:
        from bench.windows import REUSE_WORKLOADS

        return self.workload in REUSE_WORKLOADS

    def trace_factor(self, load_x: float) -> float:
        """The trace load factor of `load_x` times the fleet's nominal 1x."""
        from bench.experiments import base_load

        return load_x * base_load(self.workload, self.profile) * self.replicas

    def requests_at(self, load_x: float) -> Sequence[Any]:
        """The cell's requests at `load_x` times the fleet's 1x: a trace window on a faster
        clock; ``multiturn``: more conversations, each with the same think times."""
        from bench.windows import MULTITURN_RATE_1X, multiturn_window
        from engine_sim.trace import scale_load

        if self.workload == "multiturn":
            rate = load_x * MULTITURN_RATE_1X[self.profile] * self.replicas
            return multiturn_window(self.lengths, self.window, self.window_s, rate)
        return scale_load(self.requests, self.trace_factor(load_x))

    def rate_1x_per_replica(self) -> float:
        """Requests/s per replica at 1x (arrivals over the window's span)."""
        reqs = self.requests_at(1.0)
        span = float(reqs[-1].arrival_s - reqs[0].arrival_s) or 1.0
        return len(reqs) / span / self.replicas


def probe(cell: Cell, stack: Any, load_x: float, *, early_stop: bool = True) -> Probe:
    """Run `stack` on `cell` at `load_x` times the fleet's 1x and judge it by the cell's SLO.

    With `early_stop` the run ends as soon as more than 5 % of its requests are certainly
    over the TTFT objective (the verdict is then known; past saturation the rest would cost
    the most simulator time of all); without it every request runs to its end.
    """
    from bench.stacks import run_stack, tpots_s
    from engine_sim.simulator import LateAbort, RouterConfig
    from sal_core.percentile import percentile

    requests = cell.requests_at(load_x)
    # p95 is certainly above the objective once more than ceil(5 % of n) requests are.
    abort = LateAbort(cell.slo.ttft_p95_s, math.ceil(0.05 * len(requests)))
    result = run_stack(
        requests,
        stack,
        profile=cell.profile,
        replicas=cell.replicas,
        router=RouterConfig(seed=cell.window),
        prefix_caching=cell.has_reuse,
        abort=abort if early_stop else None,
    )
    ttft = [o.ttft_s for o in result.outcomes]
    ttft_p95 = percentile(ttft, 95)
    tpot_p95 = percentile(tpots_s(result.outcomes), 95)
    ok = (
        result.unfinished == 0
        and ttft_p95 <= cell.slo.ttft_p95_s
        and not tpot_p95 > cell.slo.tpot_p95_s  # NaN (no decode at all) meets it
    )
    return Probe(
        load_x,
        ttft_p95,
        percentile(ttft, 99),
        tpot_p95,
        result.unfinished,
        ok,
        result.summary.hit_rate,
        result.aborted,
    )


def find_capacity(
    sustains: Callable[[float], bool],
    guess: float,
    rel_tol: float,
    bracket: float = BRACKET,
    limits: tuple[float, float] = LOAD_LIMITS,
) -> float:
    """The highest load `sustains` accepts, to within ``1 + rel_tol`` (geometric bisection).

    Steps out from `guess` by factors of `bracket` until one load is sustained and the next
    is not, then bisects. Returns 0.0 when even ``limits[0]`` is not sustained and
    ``limits[1]`` when that is. Assumes sustaining is monotone in load (else: one crossing).
    """
    lo_limit, hi_limit = limits
    x = min(max(guess, lo_limit), hi_limit)
    if sustains(x):
        lo = x
        hi = lo * bracket
        while sustains(hi):
            lo = hi
            if lo >= hi_limit:
                return hi_limit
            hi = min(lo * bracket, hi_limit)
    else:
        hi = x
        lo = hi / bracket
        while not sustains(lo):
            hi = lo
            if hi <= lo_limit:
                return 0.0
            lo = max(hi / bracket, lo_limit)
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        if sustains(mid):
            lo = mid
        else:
            hi = mid
    return lo


def capacity_rows(cell: Cell, stacks: Sequence[Any], rel_tol: float) -> list[Row]:
    """Each stack's capacity on `cell`, and its latency at the first stack's capacity.

    The first stack is the baseline: its capacity is every other stack's first guess and the
    load of the "at the baseline's capacity" columns.
    """
    rows: list[Row] = []
    baseline_x: float | None = None
    rate_1x_per_replica = cell.rate_1x_per_replica()
    for stack in stacks:
        probes: dict[float, Probe] = {}

        def sustains(x: float, stack: Any = stack, probes: dict[float, Probe] = probes) -> bool:
            if x not in probes:
                probes[x] = probe(cell, stack, x)
            return probes[x].ok

        started = time.perf_counter()
        capacity_x = find_capacity(sustains, baseline_x or 1.0, rel_tol)
        if baseline_x is None:
            baseline_x = max(capacity_x, LOAD_LIMITS[0])
        at_base = probes.get(baseline_x)
        if at_base is None or at_base.aborted:  # its latencies are reported: run it whole
            at_base = probe(cell, stack, baseline_x, early_stop=False)
        wall_s = time.perf_counter() - started
        log(
            f"{cell.workload} {cell.replicas}x{cell.profile} window {cell.window} "
            f"{stack.name}: capacity {capacity_x:.3f}x ({len(probes)} probes, {wall_s:.1f} s)"
        )
        rows.append(
            {
                "workload": cell.workload,
                "profile": cell.profile,
                "replicas": cell.replicas,
                "window": cell.window,
                "requests": len(cell.requests),
                "stack": stack.name,
                "router": stack.router,
                "engine": dict(stack.engine),
                "capacity_x": capacity_x,
                "capacity_rps_per_replica": capacity_x * rate_1x_per_replica,
                "baseline_capacity_x": baseline_x,
                "at_baseline": asdict(at_base),
                "probes": [asdict(p) for _, p in sorted(probes.items())],
                "wall_s": round(wall_s, 2),
            }
        )
    return rows


def _cell(task: tuple[str, str, int, int, Plan, list[str], Path]) -> list[Row]:
    """Worker entry: build one cell from the traces and measure every stack on it."""
    from bench.stacks import BASELINE, for_workload, stacks_by_name
    from bench.windows import GENERATED_WORKLOADS, multiturn_lengths, window, workload_trace

    workload, profile, replicas, index, plan, names, folder = task
    if workload in GENERATED_WORKLOADS:
        lengths = multiturn_lengths(folder)
        cell = Cell(workload, profile, replicas, index, (), plan.window_s, lengths)
        cell = replace(cell, requests=cell.requests_at(1.0))
    else:
        reqs = window(workload_trace(workload, folder), index, plan.window_s)
        if len(reqs) < 2:
            log(f"{workload} window {index}: fewer than 2 requests in the window, left out")
            return []
        cell = Cell(workload, profile, replicas, index, reqs)
    stacks = for_workload(stacks_by_name(names), has_reuse=cell.has_reuse)
    stacks.sort(key=lambda s: s.name != BASELINE)  # stable: the baseline first, then in order
    return capacity_rows(cell, stacks, plan.rel_tol)


def measure(
    plan: Plan, folder: Path, names: list[str] | None, jobs: int, partial: Path | None = None
) -> list[Row]:
    """Every (workload, fleet, window) cell; `jobs` > 1 runs cells in worker processes.

    With `partial`, the rows measured so far are rewritten there after every cell, so a run
    cut short keeps what it measured.
    """
    from bench.stacks import BASELINE, STACKS

    chosen = names or [s.name for s in STACKS]
    if BASELINE not in chosen:
        chosen = [BASELINE, *chosen]
    tasks = [
        (workload, profile, replicas, index, plan, chosen, folder)
        for workload in plan.workloads
        for profile, replicas in plan.fleets_for(workload)
        for index in range(plan.windows)
    ]
    rows: list[Row] = []

    def keep(cell_rows: list[Row]) -> None:
        rows.extend(cell_rows)
        if partial is not None:
            partial.write_text(json.dumps(rows, indent=1))

    return run_cells(_cell, tasks, jobs, keep)


def run(args: argparse.Namespace) -> int:
    from bench.capacity_report import write_report
    from bench.stacks import stacks_by_name

    if args.report_only:
        try:
            data = json.loads((args.out / "capacity.json").read_text())
            write_report(data["rows"], data["meta"], args.out)
        except (OSError, ValueError, KeyError) as exc:
            print(f"sal-bench capacity: error: cannot re-render: {exc!r}", file=sys.stderr)
            return 2
        return 0
    for name in (AZURE_CHAT, AZURE_CODE, SHAREGPT_STATS):
        if not (args.data_dir / name).is_file():
            missing = missing_message(args.data_dir / name, "--data-dir")
            print(f"sal-bench capacity: error: {missing}", file=sys.stderr)
            return 2
    names = None
    if args.stacks:
        names = [n.strip() for n in args.stacks.split(",") if n.strip()]
        try:
            stacks_by_name(names)
        except KeyError as exc:
            print(f"sal-bench capacity: error: {exc.args[0]}", file=sys.stderr)
            return 2
    if args.jobs < 1:
        print("sal-bench capacity: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    previous_path = args.out / "capacity.json"
    previous: dict[str, Any] | None = None
    if args.merge and previous_path.is_file():
        previous = json.loads(previous_path.read_text())
        if bool(previous["meta"].get("quick")) != bool(args.quick):
            print("sal-bench capacity: error: cannot --merge quick and full runs", file=sys.stderr)
            return 2
    rows = measure(plan, args.data_dir, names, args.jobs, args.out / "capacity.partial.json")
    wall_before = 0.0
    if previous is not None:
        measured = {r["stack"] for r in rows}
        rows = [r for r in previous["rows"] if r["stack"] not in measured] + rows
        wall_before = float(previous["meta"].get("wall_s", 0.0))
        from bench.stacks import BASELINE, STACKS

        # As `measure` orders a cell: the baseline first, then the stacks in table order
        # (stable: the cells keep theirs).
        order = {s.name: i for i, s in enumerate(STACKS)}
        order[BASELINE] = -1
        rows.sort(key=lambda r: order.get(r["stack"], len(order)))
    meta = {
        "quick": bool(args.quick),
        "plan": asdict(plan),
        "slos": {w: asdict(s) for w, s in SLOS.items()},
        "bracket": BRACKET,
        "wall_s": round(wall_before + time.perf_counter() - started, 1),
        "command": "sal-bench capacity" + (" --quick" if args.quick else ""),
    }
    (args.out / "capacity.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(rows, meta, args.out)
    (args.out / "capacity.partial.json").unlink(missing_ok=True)
    log(f"wrote {args.out}/capacity.md, capacity.json, capacity.png in {meta['wall_s']} s")
    return 0
