"""PNG plots of the experiments (matplotlib, Agg backend: no display needed).

Called by `bench.experiments` once per figure with the result rows it collected; each row is
a flat dict with the run's configuration (``workload``, ``scheduler``, ``router``, ``load_x``,
...) and its `engine_sim.results.Summary` fields.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

Row = dict[str, Any]

_SWEEP_PANELS: tuple[tuple[str, str], ...] = (
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("ttft_p95_s", "TTFT p95 (s)"),
    ("norm_ttft_p95_ms_per_token", "normalized TTFT p95 (ms/token)"),
    ("tgt_p50_s", "total generation time p50 (s)"),
)


def plot_load_sweep(rows: Sequence[Row], title: str, path: Path) -> None:
    """Latency vs load factor, one line per engine scheduler (log y), 2x2 panels."""
    schedulers = list(dict.fromkeys(r["scheduler"] for r in rows))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (key, label) in zip(axes.flat, _SWEEP_PANELS, strict=True):
        for name in schedulers:
            points = sorted((r["load_x"], r[key]) for r in rows if r["scheduler"] == name)
            xs = [x for x, y in points if math.isfinite(y) and y > 0]
            ys = [y for x, y in points if math.isfinite(y) and y > 0]
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("load (x of 1x)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)


_FLEET_PANELS: tuple[tuple[str, str], ...] = (
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("tgt_p50_s", "total generation time p50 (s)"),
    ("ttft_p95_s", "TTFT p95 (s)"),
    ("tgt_p95_s", "total generation time p95 (s)"),
)


def plot_fleet(rows: Sequence[Row], title: str, path: Path) -> None:
    """Grouped bars: engine schedulers on x, one bar per router, 2x2 metric panels.

    Linear y axes from 0, so bar heights compare honestly."""
    schedulers = list(dict.fromkeys(r["scheduler"] for r in rows))
    routers = list(dict.fromkeys(r["router"] for r in rows))
    width = 0.8 / max(1, len(routers))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (key, label) in zip(axes.flat, _FLEET_PANELS, strict=True):
        for j, router in enumerate(routers):
            values = []
            for name in schedulers:
                match = [r[key] for r in rows if r["router"] == router and r["scheduler"] == name]
                values.append(match[0] if match and math.isfinite(match[0]) else 0.0)
            xs = [i + (j - (len(routers) - 1) / 2) * width for i in range(len(schedulers))]
            ax.bar(xs, values, width=width, label=router)
        ax.set_xticks(range(len(schedulers)), schedulers)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(routers), fontsize=9)
    fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)
