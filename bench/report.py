"""Write the experiments' results folder: ``results.md`` tables, claim checks and PNG plots.

Called once by `bench.experiments.run` with every run's row (configuration + summary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.plots import plot_fleet, plot_load_sweep

Row = dict[str, Any]

_SINGLE_METRICS: tuple[tuple[str, str, float], ...] = (
    ("ttft_p50_s", "TTFT p50 (s)", 1.0),
    ("ttft_p95_s", "TTFT p95 (s)", 1.0),
    ("ttft_p99_s", "TTFT p99 (s)", 1.0),
    ("norm_ttft_p50_ms_per_token", "normalized TTFT p50 (ms/token)", 1.0),
    ("norm_ttft_p95_ms_per_token", "normalized TTFT p95 (ms/token)", 1.0),
    ("tgt_p50_s", "total generation time p50 (s)", 1.0),
    ("tgt_p95_s", "total generation time p95 (s)", 1.0),
    ("preemption_rate", "preemptions per 100 requests", 100.0),
)
_FLEET_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p95_s", "TTFT p95"),
    ("norm_ttft_p95_ms_per_token", "norm. TTFT p95 (ms/tok)"),
    ("tgt_p50_s", "TGT p50"),
    ("tgt_p95_s", "TGT p95"),
    ("preemption_rate", "preemptions/req"),
)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def _ratio(other: float, ours: float) -> float:
    return other / ours if ours > 0 and math.isfinite(other) else math.nan


def _single_tables(rows: Sequence[Row]) -> list[str]:
    out: list[str] = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        wrows = [r for r in rows if r["workload"] == workload]
        loads = sorted(dict.fromkeys(r["load_x"] for r in wrows))
        schedulers = list(dict.fromkeys(r["scheduler"] for r in wrows))
        base = wrows[0]["trace_load_factor"] / wrows[0]["load_x"]
        out.append(f"### (a) one replica, {workload} (1x = trace load factor {base:g})\n")
        out.append(f"![{workload}](single_{workload}.png)\n")
        for key, label, scale in _SINGLE_METRICS:
            out.append(f"{label}:\n")
            out.append("| scheduler | " + " | ".join(f"{x:g}x" for x in loads) + " |")
            out.append("|---|" + "---:|" * len(loads))
            for name in schedulers:
                cells = []
                for x in loads:
                    match = [r[key] for r in wrows if r["scheduler"] == name and r["load_x"] == x]
                    cells.append(_fmt(match[0] * scale) if match else "")
                out.append(f"| {name} | " + " | ".join(cells) + " |")
            out.append("")
    return out


def _larry_claims(rows: Sequence[Row]) -> list[str]:
    """LARRY (alpha 1) vs the best other engine scheduler, per workload and load."""
    out = [
        "### LARRY vs the next-best engine scheduler (one replica)\n",
        "Ratio = next-best other scheduler's value / LARRY's (alpha = 1); > 1 means LARRY is "
        'better. "Other" = fcfs, no_preempt, trail_plus (the paper\'s baselines). The paper '
        "reports p50 TTFT 1.8-2.1x, p95 1.2-1.4x, normalized p95 3.3-5.5x.\n",
        "| workload | load | p50 TTFT | p95 TTFT | p99 TTFT | norm. p95 TTFT | "
        "LARRY preemptions per 100 req. |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    others = ("fcfs", "no_preempt", "trail_plus")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for x in sorted(dict.fromkeys(r["load_x"] for r in rows if r["workload"] == workload)):
            at = {r["scheduler"]: r for r in rows if r["workload"] == workload and r["load_x"] == x}
            larry = at.get("larry a=1")
            if larry is None:
                continue
            cells = []
            for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "norm_ttft_p95_ms_per_token"):
                best = min(at[o][key] for o in others if o in at)
                cells.append(_fmt(_ratio(best, larry[key])) + "x")
            out.append(
                f"| {workload} | {x:g}x | "
                + " | ".join(cells)
                + f" | {_fmt(100 * larry['preemption_rate'])} |"
            )
    out.append("")
    return out


def _fleet_tables(rows: Sequence[Row]) -> list[str]:
    out: list[str] = []
    groups = dict.fromkeys((r["profile"], r["replicas"], r["workload"], r["load_x"]) for r in rows)
    for profile, replicas, workload, x in groups:
        grows = [
            r
            for r in rows
            if (r["profile"], r["replicas"], r["workload"], r["load_x"])
            == (profile, replicas, workload, x)
        ]
        name = f"fleet_{replicas}x{profile}_{workload}_{x:g}x"
        out.append(
            f"### (b) {replicas} x {profile}, {workload}, {x:g}x "
            f"(trace load factor {grows[0]['trace_load_factor']:g})\n"
        )
        out.append(f"![{name}]({name}.png)\n")
        out.append("| scheduler | router | " + " | ".join(m[1] for m in _FLEET_METRICS) + " |")
        out.append("|---|---|" + "---:|" * len(_FLEET_METRICS))
        for r in grows:
            cells = [_fmt(r[key]) for key, _ in _FLEET_METRICS]
            out.append(f"| {r['scheduler']} | {r['router']} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _sal_claims(rows: Sequence[Row]) -> list[str]:
    """SAL vs the best of P2C / Random (the paper's baselines) with the same engine scheduler."""
    out = [
        "### SAL vs the next-best of P2C / Random (same engine scheduler)\n",
        "Ratio = best of p2c/random / SAL; > 1 means SAL is better. The paper reports p50 and "
        "p95 TGT 1.1-1.3x and p50 TTFT 1.0-1.5x (with LARRY). Last column: best of all four "
        "other routers (round_robin and least_requests included).\n",
        "| fleet | workload | load | scheduler | p50 TTFT | p95 TTFT | p50 TGT | p95 TGT | "
        "p50 TGT vs all others |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    keys = dict.fromkeys(
        (r["profile"], r["replicas"], r["workload"], r["load_x"], r["scheduler"]) for r in rows
    )
    for profile, replicas, workload, x, sched in keys:
        at = {
            r["router"]: r
            for r in rows
            if (r["profile"], r["replicas"], r["workload"], r["load_x"], r["scheduler"])
            == (profile, replicas, workload, x, sched)
        }
        sal = at.get("sal")
        base = [at[n] for n in ("p2c", "random") if n in at]
        if sal is None or not base:
            continue
        cells = []
        for key in ("ttft_p50_s", "ttft_p95_s", "tgt_p50_s", "tgt_p95_s"):
            cells.append(_fmt(_ratio(min(b[key] for b in base), sal[key])) + "x")
        every = [r for n, r in at.items() if n != "sal"]
        cells.append(_fmt(_ratio(min(r["tgt_p50_s"] for r in every), sal["tgt_p50_s"])) + "x")
        out.append(
            f"| {replicas}x{profile} | {workload} | {x:g}x | {sched} | " + " | ".join(cells) + " |"
        )
    out.append("")
    return out


def _ablation_table(fleet: Sequence[Row], ablation: Sequence[Row]) -> list[str]:
    """The what-if SAL variant next to SAL and the best baseline, LARRY engines."""
    if not ablation:
        return []
    out = [
        "### What-if: SAL with ties broken by position (LARRY engines)\n",
        "Not a product policy (`bench/ablations.py`): the paper-literal stable tie-break. "
        "While queues are empty every SAL load is equal, so it sends work to the first "
        "replicas; the product's SAL breaks ties by fewest in-flight requests. TGT in s.\n",
        "| fleet | workload | load | SAL p50 / p95 TGT | what-if p50 / p95 TGT | "
        "best other p50 / p95 TGT | SAL p50 TTFT | what-if p50 TTFT |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for a in ablation:
        same = [
            r
            for r in fleet
            if (r["profile"], r["workload"], r["load_x"], r["scheduler"])
            == (a["profile"], a["workload"], a["load_x"], "larry")
        ]
        sal = [r for r in same if r["router"] == "sal"]
        others = [r for r in same if r["router"] != "sal"]
        if not sal or not others:
            continue
        best = min(others, key=lambda r: r["tgt_p50_s"])
        out.append(
            f"| {a['replicas']}x{a['profile']} | {a['workload']} | {a['load_x']:g}x | "
            f"{_fmt(sal[0]['tgt_p50_s'])} / {_fmt(sal[0]['tgt_p95_s'])} | "
            f"{_fmt(a['tgt_p50_s'])} / {_fmt(a['tgt_p95_s'])} | "
            f"{_fmt(best['tgt_p50_s'])} / {_fmt(best['tgt_p95_s'])} ({best['router']}) | "
            f"{_fmt(sal[0]['ttft_p50_s'])} | {_fmt(a['ttft_p50_s'])} |"
        )
    out.append("")
    return out


def _staleness_table(rows: Sequence[Row]) -> list[str]:
    """SAL under slower or late polls."""
    if not rows:
        return []
    first = rows[0]
    out = [
        f"### SAL's sensitivity to poll staleness ({first['replicas']} x {first['profile']}, "
        f"{first['load_x']:g}x, LARRY engines)\n",
        "The gateway polls every 0.1 s; here snapshots come every `poll` seconds and reach the "
        "router `delay` seconds after they were taken. Times in s.\n",
        "| workload | poll (s) | delay (s) | TTFT p50 | TTFT p95 | TGT p50 | TGT p95 | "
        "preemptions/req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['poll_interval_s']:g} | {r['stats_delay_s']:g} | "
            f"{_fmt(r['ttft_p50_s'])} | {_fmt(r['ttft_p95_s'])} | {_fmt(r['tgt_p50_s'])} | "
            f"{_fmt(r['tgt_p95_s'])} | {_fmt(r['preemption_rate'])} |"
        )
    out.append("")
    return out


def write_report(rows: Sequence[Row], meta: dict[str, Any], out_dir: Path) -> None:
    """Write ``results.md`` and the PNGs into `out_dir` (which exists)."""
    single = [r for r in rows if r["experiment"] == "single"]
    fleet = [r for r in rows if r["experiment"] == "fleet"]
    ablation = [r for r in rows if r["experiment"] == "ablation"]
    staleness = [r for r in rows if r["experiment"] == "staleness"]
    for workload in dict.fromkeys(r["workload"] for r in single):
        wrows = [r for r in single if r["workload"] == workload]
        plot_load_sweep(
            wrows, f"one replica (llama3-8b-a100), {workload}", out_dir / f"single_{workload}.png"
        )
    groups = dict.fromkeys((r["profile"], r["replicas"], r["workload"], r["load_x"]) for r in fleet)
    for profile, replicas, workload, x in groups:
        grows = [
            r
            for r in fleet
            if (r["profile"], r["replicas"], r["workload"], r["load_x"])
            == (profile, replicas, workload, x)
        ]
        plot_fleet(
            grows,
            f"{replicas} x {profile}, {workload}, {x:g}x",
            out_dir / f"fleet_{replicas}x{profile}_{workload}_{x:g}x.png",
        )
    plan = meta["plan"]
    lines = [
        "# Simulator results: the paper's experiments\n",
        "Generated by `sal-bench experiments"
        + (" --quick" if meta["quick"] else "")
        + f" --out {out_dir}` (seed {meta['seed']}, {meta['wall_s']} s of wall time). "
        f"Single-replica runs replay the first {plan['single_window_s']:g} s of each workload, "
        f"fleet runs the first {plan['fleet_window_s']:g} s (trace time, before load scaling); "
        "every request runs to completion. Times in seconds unless stated. See "
        "`docs/simulator.md` for the method and the comparison with the paper.\n",
        "Code the numbers depend on (sha256, first 12 hex digits; rerun when they change): "
        + ", ".join(f"`{k}` {v}" for k, v in meta.get("model_sources_sha256", {}).items())
        + "\n",
        "## Claims\n",
        *_larry_claims(single),
        *_sal_claims(fleet),
        *_ablation_table(fleet, ablation),
        *_staleness_table(staleness),
        "## (a) One replica: engine schedulers\n",
        *_single_tables(single),
        "## (b) Fleets: routers x engine schedulers\n",
        *_fleet_tables(fleet),
    ]
    (out_dir / "results.md").write_text("\n".join(lines))
