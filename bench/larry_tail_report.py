"""``larry_tail.md`` + ``larry_tail.png`` from the rows `bench.larry_tail` collected (pure
apart from writing the two files).

Every ratio is *variant / FCFS* on the same requests (same workload, window and load), so
below 1 is better than FCFS; each cell is the median over the windows with its min-max.
The issue's aims are checked per workload and load, window by window, and reported as the
number of windows that met them, tuning and held-out windows apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sal_core.percentile import percentile

Row = dict[str, Any]
Key = tuple[str, int, float]

P99_AIM = 1.02
MAX_AIM = 1.10
P50_AIM = 2.0
LIGHT_SHARE_AIM = 0.70
HEAVY_P50_S = 1.0
CANDIDATES = (
    "larry_tail", "larry_tail margin 0.25 s", "larry_tail margin 1.5 s", "larry_tail margin 2 s",
    "larry", "fcfs+headroom",
    "tgi", "hindsight deadline (what-if)",
)  # fmt: skip
"""Schedulers whose aims are tabled (in this order, when present)."""

_RATIO_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p95_s", "TTFT p95"),
    ("ttft_p99_s", "TTFT p99"),
    ("ttft_max_s", "TTFT max"),
    ("norm_ttft_p50_ms_per_token", "normalized TTFT p50"),
    ("norm_ttft_p95_ms_per_token", "normalized TTFT p95"),
)


def _index(rows: Sequence[Row]) -> dict[Key, dict[str, Row]]:
    out: dict[Key, dict[str, Row]] = {}
    for r in rows:
        out.setdefault((r["workload"], int(r["window"]), float(r["load_x"])), {})[
            r["scheduler"]
        ] = r
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "n/a"
    med = percentile(vals, 50)
    if len(vals) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def aims_met(run: Row, fcfs: Row, larry: Row | None) -> dict[str, bool | None]:
    """The issue's four aims for one run against FCFS on the same requests (None: n/a)."""
    f50 = float(fcfs["ttft_p50_s"])
    heavy = f50 >= HEAVY_P50_S
    light: bool | None = None
    if not heavy and larry is not None:
        gain_larry = f50 - float(larry["ttft_p50_s"])
        gain = f50 - float(run["ttft_p50_s"])
        light = gain_larry <= 0.005 * f50 or gain >= LIGHT_SHARE_AIM * gain_larry
    return {
        "p99": float(run["ttft_p99_s"]) <= P99_AIM * float(fcfs["ttft_p99_s"]),
        "max": float(run["ttft_max_s"]) <= MAX_AIM * float(fcfs["ttft_max_s"]),
        "p50": (f50 / float(run["ttft_p50_s"]) >= P50_AIM) if heavy else None,
        "light": light,
    }


def _aims_cell(results: Sequence[dict[str, bool | None]], aim: str) -> str:
    vals = [r[aim] for r in results if r[aim] is not None]
    if not vals:
        return "-"
    ok = sum(1 for v in vals if v)
    return f"{ok}/{len(vals)}" if ok == len(vals) else f"**{ok}/{len(vals)}**"


def aims_table(rows: Sequence[Row], meta: dict[str, Any], scheduler: str) -> list[str]:
    """Markdown lines: per workload and load, windows meeting each aim (tuning | held out)."""
    index = _index(rows)
    held = set(meta.get("held_out_windows", []))
    lines = [
        f"#### {scheduler}",
        "",
        "| workload | load | p99 <= 1.02x | max <= 1.1x | p50 >= 2x lower (FCFS p50 >= 1 s) "
        "| >= 70% of LARRY's p50 gain (lighter loads) |",
        "|---|---:|---|---|---|---|",
    ]
    totals = {"p99": [0, 0], "max": [0, 0], "p50": [0, 0], "light": [0, 0]}
    for workload in meta["workloads"]:
        for load in meta["loads"]:
            parts: dict[bool, list[dict[str, bool | None]]] = {False: [], True: []}
            for (w, k, x), by in sorted(index.items()):
                if w != workload or x != load or scheduler not in by or "fcfs" not in by:
                    continue
                parts[k in held].append(aims_met(by[scheduler], by["fcfs"], by.get("larry")))
            if not parts[False] and not parts[True]:
                continue
            cells = []
            for aim, tot in totals.items():
                cells.append(f"{_aims_cell(parts[False], aim)} · {_aims_cell(parts[True], aim)}")
                for r in parts[False] + parts[True]:
                    if r[aim] is not None:
                        tot[1] += 1
                        tot[0] += bool(r[aim])
            lines.append(f"| {workload} | {load:g}x | " + " | ".join(cells) + " |")
    summary = ", ".join(f"{aim} {ok}/{n}" for aim, (ok, n) in totals.items() if n)
    lines += ["", f"All windows together, runs meeting each aim: {summary}.", ""]
    return lines


def ratio_table(
    rows: Sequence[Row],
    meta: dict[str, Any],
    workload: str,
    key: str,
    baseline: str,
    windows: Callable[[int], bool],
) -> list[str]:
    """Markdown lines: variant / `baseline` for `key`, schedulers x loads, median (min-max)."""
    index = _index(rows)
    labels = [s for s in meta["variants"] if s != baseline]
    head = "| scheduler | " + " | ".join(f"{x:g}x" for x in meta["loads"]) + " |"
    lines = [head, "|---|" + "---:|" * len(meta["loads"])]
    for label in labels:
        cells = []
        for load in meta["loads"]:
            vals = [
                _ratio(float(by[label][key]), float(by[baseline][key]))
                for (w, k, x), by in index.items()
                if w == workload and x == load and windows(k) and label in by and baseline in by
            ]
            cells.append(_spread(vals))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def absolute_table(rows: Sequence[Row], meta: dict[str, Any], workload: str, key: str) -> list[str]:
    """Markdown lines: the median value of `key` (min-max over windows), schedulers x loads."""
    index = _index(rows)
    head = "| scheduler | " + " | ".join(f"{x:g}x" for x in meta["loads"]) + " |"
    lines = [head, "|---|" + "---:|" * len(meta["loads"])]
    scale = 100.0 if key == "preemption_rate" else 1.0
    for label in meta["variants"]:
        cells = []
        for load in meta["loads"]:
            vals = [
                scale * float(by[label][key])
                for (w, k, x), by in index.items()
                if w == workload and x == load and label in by
            ]
            cells.append(_spread(vals, "{:.3g}"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def aims_summary(rows: Sequence[Row], meta: dict[str, Any], baseline: str) -> list[str]:
    """Markdown lines: per scheduler, runs (all windows, loads, workloads) meeting each aim
    against `baseline` (``fcfs`` or ``fcfs+headroom``) on the same requests."""
    index = _index(rows)
    held = set(meta.get("held_out_windows", []))
    lines = [
        "| scheduler | p99 <= 1.02x | max <= 1.1x | p50 >= 2x lower | >= 70% of LARRY's gain "
        "| p99 <= 1.02x, held-out windows only | busy runs meeting p50, p99 and max at once |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in meta["variants"]:
        if label == baseline:
            continue
        counts = {
            "p99": [0, 0], "max": [0, 0], "p50": [0, 0], "light": [0, 0], "held": [0, 0],
            "busy": [0, 0],
        }  # fmt: skip
        for (_, k, _), by in index.items():
            if label not in by or baseline not in by:
                continue
            met = aims_met(by[label], by[baseline], by.get("larry"))
            for aim in ("p99", "max", "p50", "light"):
                if met[aim] is not None:
                    counts[aim][1] += 1
                    counts[aim][0] += bool(met[aim])
            if k in held:
                counts["held"][1] += 1
                counts["held"][0] += bool(met["p99"])
            if met["p50"] is not None:
                counts["busy"][1] += 1
                counts["busy"][0] += bool(met["p50"] and met["p99"] and met["max"])
        cells = [f"{ok}/{n}" if n else "-" for ok, n in counts.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def render(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """The whole ``larry_tail.md``."""
    held = set(meta["held_out_windows"])
    out = [
        "# LARRY without the tail penalty: variants vs FCFS, one replica",
        "",
        "Generated by `sal-bench larry-tail --out docs/results` "
        f"(loads {', '.join(f'{x:g}x' for x in meta['loads'])}; windows "
        f"{', '.join(str(w) for w in meta['windows'])}). One replica of Llama-3-8B on A100 "
        "(engine model), 600-s trace windows `[600 k, 600 (k+1))` of each workload; windows "
        f"{', '.join(str(w) for w in meta['tuning_windows'])} form the tuning set, windows "
        f"{', '.join(str(w) for w in meta['held_out_windows'])} the held-out set, never "
        "looked at while choosing the defaults."
        " 1x is the single-replica experiment's 1x (`docs/results/results.md`). Every "
        "request runs to completion.",
        "",
    ]
    if meta.get("tuned_on"):
        out += [str(meta["tuned_on"]), ""]
    if meta.get("note"):
        out += [f"Runs: {meta['note']} ({meta.get('wall_s')} s of wall time in all).", ""]
    out += ["Schedulers:", ""]
    out += [f"* `{label}`: {desc}" for label, desc in meta["variants"].items()]
    out += [
        "",
        "## Summary: runs meeting each aim",
        "",
        "Every (workload, load, window) run counts once: 3 workloads x "
        f"{len(meta['loads'])} loads x {len(meta['windows'])} windows. The p50 aim counts "
        "only runs where the baseline's p50 >= 1 s; the lighter-load aim the others "
        "(against LARRY's own gain on the same requests).",
        "",
        "Against plain FCFS (the issue's aims):",
        "",
    ]
    out += aims_summary(rows, meta, "fcfs")
    out += [
        "",
        "Against FCFS with the same headroom (what the ordering adds on top of the headroom):",
        "",
    ]
    out += aims_summary(rows, meta, "fcfs+headroom")
    out += [
        "",
        "## The issue's aims, window by window",
        "",
        "Each cell: windows meeting the aim, tuning windows · held-out windows; **bold** = "
        "not met in every window. Against plain FCFS on the same requests. `-`: the aim "
        "does not apply at that load (the p50 aim needs FCFS p50 >= 1 s, the lighter-load "
        "aim applies below it).",
        "",
    ]
    for label in CANDIDATES:
        if label in meta["variants"]:
            out += aims_table(rows, meta, label)
    for workload in meta["workloads"]:
        out += [f"## {workload}", ""]
        for key, title in _RATIO_METRICS:
            out += [
                f"{title}, variant / FCFS (below 1: better than FCFS), median (min-max) over "
                "all windows:",
                "",
            ]
            out += ratio_table(rows, meta, workload, key, "fcfs", lambda k: True)
            out += [""]
        for key, title in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
            out += [f"{title}, variant / FCFS, held-out windows only:", ""]
            out += ratio_table(rows, meta, workload, key, "fcfs", lambda k: k in held)
            out += [""]
        for key, title in (
            ("ttft_p50_s", "TTFT p50"),
            ("ttft_p99_s", "TTFT p99"),
            ("ttft_max_s", "TTFT max"),
        ):
            out += [
                f"{title}, variant / FCFS with the same headroom (the headroom's own share "
                "taken out):",
                "",
            ]
            out += ratio_table(rows, meta, workload, key, "fcfs+headroom", lambda k: True)
            out += [""]
        for key, title in (
            ("ttft_p50_s", "TTFT p50 (s)"),
            ("ttft_p99_s", "TTFT p99 (s)"),
            ("preemption_rate", "preemptions per 100 requests"),
        ):
            out += [f"{title}, median (min-max) over windows:", ""]
            out += absolute_table(rows, meta, workload, key)
            out += [""]
        out += [f"![{workload}](larry_tail.png)", ""] if workload == meta["workloads"][0] else []
    return "\n".join(out) + "\n"


def plot(rows: Sequence[Row], meta: dict[str, Any], path: Path) -> None:
    """p50 and p99 TTFT vs load, one column per workload, median over windows + min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = _index(rows)
    workloads = meta["workloads"]
    fig, axes = plt.subplots(
        2, len(workloads), figsize=(4.5 * len(workloads), 7), constrained_layout=True
    )
    for col, workload in enumerate(workloads):
        for row_i, (key, label) in enumerate(
            (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"))
        ):
            ax = axes[row_i][col] if len(workloads) > 1 else axes[row_i]
            for name in meta["variants"]:
                xs, meds, los, his = [], [], [], []
                for load in meta["loads"]:
                    vals = [
                        float(by[name][key])
                        for (w, k, x), by in index.items()
                        if w == workload and x == load and name in by
                    ]
                    if vals:
                        xs.append(load)
                        meds.append(percentile(vals, 50))
                        los.append(min(vals))
                        his.append(max(vals))
                if xs:
                    (line,) = ax.plot(xs, meds, marker="o", markersize=3, label=name)
                    ax.fill_between(xs, los, his, alpha=0.12, color=line.get_color())
            ax.set_yscale("log")
            ax.set_xlabel("load (x of 1x)")
            ax.set_ylabel(label)
            ax.set_title(workload)
            ax.grid(True, which="both", alpha=0.3)
    first = axes[0][0] if len(workloads) > 1 else axes[0]
    first.legend(fontsize=7)
    fig.suptitle("LARRY variants, one replica: median over trace windows (band: min-max)")
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(rows: Sequence[Row], meta: dict[str, Any], out: Path) -> None:
    """Write ``larry_tail.md`` and ``larry_tail.png`` into `out`."""
    (out / "larry_tail.md").write_text(render(rows, meta))
    plot(rows, meta, out / "larry_tail.png")
