"""The markdown report and plot of ``sal-bench capacity`` (`bench.capacity`), from its rows.

One row per (workload, fleet, window, stack) with the stack's capacity on that window and
its latency at the baseline's capacity. Every headline number is a median over the windows
with its [min-max] (`bench.spread`); stacks are compared with the baseline window by window
(paired ratios) and a spread that reaches within 2 % of 1 is reported as a tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.spread import TIE_TOLERANCE, Comparison, compare, spread

Row = dict[str, Any]

AIM_RATIO = 1.3
AIM_WORKLOADS = ("chat-bursty", "code")
DEFAULT_STACK = "sal+larry_tail"
"""SAL in front of the engine patch's default scheduler (`sal-engine serve`)."""


def _groups(rows: Sequence[Row]) -> dict[tuple[str, str, int], dict[str, list[Row]]]:
    """(workload, profile, replicas) -> stack -> its rows sorted by window (table order)."""
    out: dict[tuple[str, str, int], dict[str, list[Row]]] = {}
    for row in rows:
        key = (row["workload"], row["profile"], row["replicas"])
        out.setdefault(key, {}).setdefault(row["stack"], []).append(row)
    for stacks in out.values():
        for runs in stacks.values():
            runs.sort(key=lambda r: r["window"])
    return out


def _capacity(runs: Sequence[Row]) -> list[float]:
    return [float(r["capacity_x"]) for r in runs]


def capacity_vs(baseline: Sequence[Row], runs: Sequence[Row]) -> Comparison:
    """Paired per-window capacity ratio ``stack / baseline`` (> 1: the stack serves more).

    A tie unless every window's ratio is beyond the bisection's resolution (each capacity is
    only known to within ``1 + rel_tol``), or beyond 2 % when that is finer.
    """
    tolerance = max(TIE_TOLERANCE, float(baseline[0].get("rel_tol", 0.0)) if baseline else 0.0)
    return compare(_capacity(baseline), _capacity(runs), higher_is_better=True, tolerance=tolerance)


def replicas_needed(baseline: Sequence[Row], runs: Sequence[Row]) -> list[float]:
    """Per window: replicas the stack needs for the traffic the baseline serves with one."""
    out = []
    for b, r in zip(_capacity(baseline), _capacity(runs), strict=True):
        out.append(b / r if r > 0 else math.inf)
    return out


def _binding(runs: Sequence[Row]) -> str:
    """Which objective the first failed probe above capacity missed, over the windows (a
    probe stopped early missed TTFT; its TPOT covers the requests finished by then)."""
    seen: dict[str, int] = {}
    for run in runs:
        above = [p for p in run["probes"] if not p["ok"] and p["load_x"] > run["capacity_x"]]
        if not above:
            continue
        first = min(above, key=lambda p: p["load_x"])
        slo = run["slo"]
        parts = []
        if first["ttft_p95_s"] > slo["ttft_p95_s"] or first.get("aborted"):
            parts.append("TTFT")
        if first["tpot_p95_s"] > slo["tpot_p95_s"]:
            parts.append("TPOT")
        if first["unfinished"] and not first.get("aborted"):  # an early stop leaves some
            parts.append("unfinished")
        label = "+".join(parts) or "?"
        seen[label] = seen.get(label, 0) + 1
    return ", ".join(f"{k} ({v})" if len(seen) > 1 else k for k, v in sorted(seen.items()))


def _baseline_name(stacks: dict[str, list[Row]]) -> str:
    from bench.stacks import BASELINE

    return BASELINE if BASELINE in stacks else next(iter(stacks))


def _headline(groups: dict[tuple[str, str, int], dict[str, list[Row]]]) -> list[str]:
    keys = list(groups)
    names = list(dict.fromkeys(name for stacks in groups.values() for name in stacks))
    head = " | ".join(f"{w}, {n} x {p}" for w, p, n in keys)
    out = [
        "| stack | " + head + " |",
        "|---|" + "---|" * len(keys),
    ]
    for name in names:
        cells = []
        for key in keys:
            stacks = groups[key]
            base = stacks[_baseline_name(stacks)]
            if name not in stacks:
                cells.append("—")
                continue
            if name == _baseline_name(stacks):
                cells.append("1 (baseline)")
                continue
            needed = spread(replicas_needed(base, stacks[name]))
            verdict = capacity_vs(base, stacks[name]).verdict
            cells.append(f"{needed.format(3)} ({verdict})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _aim(groups: dict[tuple[str, str, int], dict[str, list[Row]]]) -> list[str]:
    out = [
        f"| workload | fleet | best stack | capacity vs p2c+fcfs | aim >= {AIM_RATIO}x | "
        f"{DEFAULT_STACK} (the engine patch's default) |",
        "|---|---|---|---|---|---|",
    ]
    for (workload, profile, replicas), stacks in groups.items():
        if workload not in AIM_WORKLOADS:
            continue
        base_name = _baseline_name(stacks)
        base = stacks[base_name]
        best_name, best = max(
            ((n, capacity_vs(base, r)) for n, r in stacks.items() if n != base_name),
            key=lambda item: item[1].ratio.median,
        )
        if best.ratio.low >= AIM_RATIO:
            met = "**met** (every window)"
        elif best.ratio.median >= AIM_RATIO:
            met = "met on the median, not on every window"
        else:
            met = "**not met**"
        default = (
            capacity_vs(base, stacks[DEFAULT_STACK]).format(3) if DEFAULT_STACK in stacks else "—"
        )
        out.append(
            f"| {workload} | {replicas} x {profile} | {best_name} | {best.format(3)} | {met} | "
            f"{default} |"
        )
    return out


def _cell_table(stacks: dict[str, list[Row]], reuse: bool) -> list[str]:
    base_name = _baseline_name(stacks)
    base = stacks[base_name]
    out = [
        "| stack | capacity (x of 1x) | req/s per replica | capacity vs "
        f"{base_name} | replicas for the same traffic | TTFT p95 at {base_name}'s capacity "
        f"| TTFT p99 at {base_name}'s capacity | TPOT p95 there | "
        + ("prefix-cache hit rate there | " if reuse else "")
        + "SLO that binds |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if reuse else ""),
    ]
    for name, runs in stacks.items():
        cap = spread(_capacity(runs))
        rps = spread([float(r["capacity_rps_per_replica"]) for r in runs])
        vs = capacity_vs(base, runs)
        needed = spread(replicas_needed(base, runs))
        p95 = spread([float(r["at_baseline"]["ttft_p95_s"]) for r in runs])
        p99 = spread([float(r["at_baseline"]["ttft_p99_s"]) for r in runs])
        tpot = spread([float(r["at_baseline"]["tpot_p95_s"]) for r in runs])
        hits = spread([100.0 * float(r["at_baseline"].get("hit_rate", 0.0)) for r in runs])
        out.append(
            f"| {name} | {cap.format(3)} | {rps.format(3)} | "
            f"{'—' if name == base_name else vs.format(3)} | {needed.format(2)} | "
            f"{p95.format(3, ' s')} | {p99.format(3, ' s')} | {tpot.format(2, ' s')} | "
            + (f"{hits.format(2, ' %')} | " if reuse else "")
            + f"{_binding(runs)} |"
        )
    return out


REUSE_PAIRS = (
    ("sal+fcfs", "sal_paper+fcfs", "cache-aware SAL vs the paper's Eq. 2"),
    ("sal+fcfs", "llm_d+fcfs", "cache-aware SAL vs llm-d's scorers"),
    ("sal+fcfs", "cache_aware+fcfs", "cache-aware SAL vs SGLang's cache_aware"),
)
"""Head-to-head capacity comparisons on the workloads with prefix reuse."""


def _reuse(groups: dict[tuple[str, str, int], dict[str, list[Row]]], reuse: set[str]) -> list[str]:
    out = [
        "| workload | fleet | comparison | capacity ratio (paired) |",
        "|---|---|---|---|",
    ]
    for (workload, profile, replicas), stacks in groups.items():
        if workload not in reuse:
            continue
        for mine, theirs, what in REUSE_PAIRS:
            if mine in stacks and theirs in stacks:
                vs = capacity_vs(stacks[theirs], stacks[mine])
                out.append(f"| {workload} | {replicas} x {profile} | {what} | {vs.format(3)} |")
    return out


def render(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """The whole ``capacity.md``."""
    from bench.windows import REUSE_WORKLOADS

    reuse = {r["workload"] for r in rows if r["workload"] in REUSE_WORKLOADS}
    # Older rows lack their SLO and tolerance: the run's own (copies: the caller's rows stay).
    rows = [
        {"slo": meta["slos"][r["workload"]], "rel_tol": meta["plan"]["rel_tol"], **r} for r in rows
    ]
    groups = _groups(rows)
    plan = meta["plan"]
    probes = sum(len(r["probes"]) for r in rows)
    out = [
        "# Capacity at SLO: replicas needed for the same traffic",
        "",
        f"Generated by `{meta['command']}` ({probes} simulator runs plus one per stack and "
        f"window at the baseline's capacity, {meta['wall_s']:.0f} s on the shared 2-core "
        "machine). Setup and definitions: `bench/capacity.py`. Each cell replays "
        f"{plan['windows']} windows of {plan['window_s']:.0f} trace seconds (window k = "
        "seconds [k*w, (k+1)*w) of the trace) through the simulator; a stack **sustains** a "
        "load on a window when every request finishes with p95 TTFT and p95 TPOT (time per "
        "output token after the first) within the workload's SLO; its capacity on the window "
        "is the highest such load by geometric bisection (to within "
        f"{plan['rel_tol'] * 100:.0f} %), in multiples of the fleet's nominal 1x (docs/"
        'simulator.md, "Workloads and 1x"). Numbers are medians over the windows with '
        "[min–max]; comparisons are paired per window, and a spread that reaches within "
        f"{max(plan['rel_tol'], 0.02) * 100:.0f} % of 1 (the bisection's resolution) is a "
        "**tie**.",
        "",
        "The workloads with prefix reuse (here: "
        + (", ".join(sorted(reuse)) or "none")
        + ") have no trace to slice: window k is seed k of the multi-turn generator "
        "(conversations starting during the window, each prompt the conversation so far), its "
        "load is the rate of new conversations (think times unchanged), every replica runs "
        "vLLM's prefix caching, and the prefix-aware routers (sal, llm_d, cache_aware) read "
        "the router's approximate index of the blocks it routed (`bench/windows.py`).",
        "",
        "## SLOs",
        "",
        "| workload | p95 TTFT | p95 TPOT | why |",
        "|---|---|---|---|",
    ]
    for workload, slo in meta["slos"].items():
        out.append(
            f"| {workload} | {slo['ttft_p95_s']:g} s | {slo['tpot_p95_s']:g} s | {slo['why']} |"
        )
    out += [
        "",
        "## Headline: replicas needed for the same traffic, relative to p2c+fcfs",
        "",
        "Per window: p2c+fcfs's capacity / the stack's (below 1: fewer replicas). Median "
        "[min–max] over the windows, then the paired verdict on capacity.",
        "",
        *_headline(groups),
        "",
        f"## The issue's aim: >= {AIM_RATIO}x p2c+fcfs's capacity on chat-bursty and code",
        "",
        *_aim(groups),
        "",
    ]
    if reuse:
        out += [
            "## With prefix reuse: cache-aware SAL against the other cache-aware routers",
            "",
            "Per window: the first stack's capacity / the second's (> 1: cache-aware SAL "
            "serves more).",
            "",
            *_reuse(groups, reuse),
            "",
        ]
    out += [
        "![replicas needed relative to p2c+fcfs](capacity.png)",
    ]
    for (workload, profile, replicas), stacks in groups.items():
        slo = meta["slos"][workload]
        n = next(iter(stacks.values()))[0]["requests"]
        out += [
            "",
            f"## {workload}, {replicas} x {profile} (p95 TTFT <= {slo['ttft_p95_s']:g} s, "
            f"p95 TPOT <= {slo['tpot_p95_s']:g} s; {n} requests in window 0)",
            "",
            *_cell_table(stacks, workload in reuse),
        ]
    out += [
        "",
        '"SLO that binds": the objective missed at the lowest failed load above capacity '
        "(over the windows; counts in parentheses when they differ).",
        "",
    ]
    return "\n".join(out)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Grouped bars: replicas needed relative to p2c+fcfs per stack, error bars min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    keys = list(groups)
    names = list(dict.fromkeys(name for stacks in groups.values() for name in stacks))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(keys)), 4.2), constrained_layout=True)
    for j, name in enumerate(names):
        xs, meds, lows, highs = [], [], [], []
        for i, key in enumerate(keys):
            stacks = groups[key]
            if name not in stacks:
                continue
            s = spread(replicas_needed(stacks[_baseline_name(stacks)], stacks[name]))
            if s.n == 0 or not math.isfinite(s.high):
                continue
            xs.append(i + (j - (len(names) - 1) / 2) * width)
            meds.append(s.median)
            lows.append(s.median - s.low)
            highs.append(s.high - s.median)
        ax.bar(xs, meds, width, yerr=[lows, highs], capsize=2, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{w}\n{n} x {p}" for w, p, n in keys], fontsize=8)
    ax.set_ylabel("replicas needed vs p2c+fcfs (lower is better)")
    ax.set_title("Replicas for the same traffic within the SLOs (median, min-max over windows)")
    ax.legend(fontsize=7, ncol=3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(rows: Sequence[Row], meta: dict[str, Any], out: Path) -> None:
    """``capacity.md`` and ``capacity.png`` in `out`."""
    (out / "capacity.md").write_text(render(rows, meta))
    plot(rows, out / "capacity.png")
