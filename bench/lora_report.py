"""The markdown report of ``sal-bench lora`` (`bench.lora_bench`).

Per workload, load and ``--max-loras``: every router blind to LoRA slots, with the free-slot
filter only, with the filter and affinity, and with the gateway's whole rule (TTFT p50 / p95
/ p99 and TGT p50, median [min-max] over the windows); then SAL with the gateway's rule
against the best baseline blind to slots, the best baseline with the same rule, and SAL
itself with each lesser rule and blind, paired per window (best baseline: the best of round
robin, p2c and least requests per window and metric; > 1: ours better; a spread reaching
within 2 % of 1 is a tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.spread import compare, spread

Row = dict[str, Any]
Scenario = tuple[str, float, int]

BASELINES = ("round_robin", "p2c", "least_requests")
LORA_LABELS = {
    "blind": "blind to LoRA slots",
    "slots": "+ free-slot filter",
    "no_full": "+ free slot, then affinity",
    "affinity": "+ gateway rule (free slot, then affinity; all full: fewest in flight)",
}
METRICS = (
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p95_s", "TTFT p95"),
    ("ttft_p99_s", "TTFT p99"),
    ("tgt_p50_s", "TGT p50"),
)


def _runs(
    rows: Sequence[Row], scenario: Scenario, router: str, lora: str, setup: str = "one"
) -> list[Row]:
    workload, fraction, max_loras = scenario
    runs = [
        r
        for r in rows
        if (r["workload"], r["load_fraction"], r["max_loras"]) == (workload, fraction, max_loras)
        and r["router"] == router
        and r["lora"] == lora
        and r.get("setup", "one") == setup
    ]
    return sorted(runs, key=lambda r: r["window"])


def _values(
    rows: Sequence[Row],
    scenario: Scenario,
    router: str,
    lora: str,
    metric: str,
    setup: str = "one",
) -> list[float]:
    return [float(r[metric]) for r in _runs(rows, scenario, router, lora, setup)]


SETUP_LABELS = {
    "one": "one gateway",
    "workers": "{k} workers, adapters shared",
    "workers_apart": "{k} workers, adapters not shared",
    "peers": "{k} gateways on separate hosts (peers), adapters shared",
    "peers_apart": "{k} gateways on separate hosts (peers), adapters not shared",
}
WORKER_COMPARISONS = (
    ("{k} workers not sharing adapters", "workers_apart"),
    ("one gateway", "one"),
    ("{k} gateways with peers", "peers"),
)


def workers_headline(rows: Sequence[Row], scenario: Scenario, router: str) -> dict[str, str]:
    """`router`'s workers sharing their pending adapters (gateway's rule) against the same
    workers not sharing them, one gateway, and as many gateways on separate hosts with
    ``peers``, TTFT p95 and p99 paired per window: ``{"against / metric": "1.31x [1.20–1.45]
    win"}`` ("—" for a setup not run; empty without workers' runs)."""
    ours = {m: _values(rows, scenario, router, "affinity", m, "workers") for m, _ in METRICS}
    if not ours["ttft_p95_s"]:
        return {}
    out = {}
    for name, setup in WORKER_COMPARISONS:
        for metric, label in METRICS[1:3]:
            base = _values(rows, scenario, router, "affinity", metric, setup)
            out[f"{name} / {label}"] = compare(base, ours[metric]).format() if base else "—"
    return out


def peers_headline(rows: Sequence[Row], scenario: Scenario, router: str) -> dict[str, str]:
    """`router`'s gateways with ``peers`` telling each other their pending adapters against
    the same gateways telling only their counts, TTFT p95 and p99 paired per window (empty
    without those runs)."""
    out = {}
    for metric, label in METRICS[1:3]:
        ours = _values(rows, scenario, router, "affinity", metric, "peers")
        base = _values(rows, scenario, router, "affinity", metric, "peers_apart")
        if ours and base:
            out[label] = compare(base, ours).format()
    return out


def _best(rows: Sequence[Row], scenario: Scenario, lora: str, metric: str) -> list[float]:
    """Per window, the best baseline's `metric` (lower is better)."""
    per_router = [_values(rows, scenario, b, lora, metric) for b in BASELINES]
    return [min(values) for values in zip(*(v for v in per_router if v), strict=True)]


def scenarios(rows: Sequence[Row]) -> list[Scenario]:
    """(workload, load fraction, max_loras) of every measured scenario, in run order."""
    seen: dict[Scenario, None] = {}
    for r in rows:
        seen[(r["workload"], r["load_fraction"], r["max_loras"])] = None
    return list(seen)


COMPARISONS = (
    ("best baseline blind to LoRA slots", "best", "blind"),
    ("best baseline with the same rule", "best", "affinity"),
    ("SAL with the free-slot filter only", "sal", "slots"),
    ("SAL without the all-full step (fewest in flight)", "sal", "no_full"),
    ("SAL blind to LoRA slots", "sal", "blind"),
)


def headline(rows: Sequence[Row], scenario: Scenario) -> dict[str, dict[str, str]]:
    """SAL with the gateway's rule against each of `COMPARISONS`:
    ``{comparison: {metric label: "1.31x [1.20–1.45] win"}}``."""
    out: dict[str, dict[str, str]] = {}
    for name, who, lora in COMPARISONS:
        cells = {}
        for metric, label in METRICS[:3]:
            ours = _values(rows, scenario, "sal", "affinity", metric)
            if who == "best":
                base = _best(rows, scenario, lora, metric)
            else:
                base = _values(rows, scenario, who, lora, metric)
            cells[label] = compare(base, ours).format() if base else "—"  # not run
        out[name] = cells
    return out


def render(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """The whole ``lora.md``."""
    plan = meta["plan"]
    lines = [
        "# LoRA fleets: routing with and without the LoRA slot rules",
        "",
        f"Generated by `{meta['command']}` ({meta['wall_s']} s). Simulator: "
        f"{plan['replicas']} x {plan['profile']}, stock vLLM FCFS with `--max-loras` as "
        f"given, {plan['windows']} trace windows of {plan['window_s']:g} s per workload; "
        f"every request names one of {meta['adapters']} adapters (Zipf exponent "
        f"{meta['zipf_s']:g}, seeded per window). Load: a fraction of the load at which "
        "p2c+fcfs nears its capacity without adapters ("
        + ", ".join(f"{w} {x:g}x" for w, x in meta["loads"].items())
        + " the recorded rate per replica). Values: median [min–max] over the windows, "
        "seconds. Ratios: paired per window, theirs / SAL with the gateway's rule (> 1: SAL "
        "better), the best baseline chosen per window and metric among round robin, p2c and "
        "least requests; within 2 % of 1 or a spread across 1 is a tie. LoRA's kernel cost "
        "and adapter loading are not modelled.",
        "",
    ]
    for scenario in scenarios(rows):
        workload, fraction, max_loras = scenario
        lines += [
            f"## {workload}, load {fraction:g} x, --max-loras {max_loras}",
            "",
            "| router | LoRA slots | " + " | ".join(label for _, label in METRICS) + " |",
            "|---|---|" + "---|" * len(METRICS),
        ]
        for router in (*BASELINES, "sal"):
            for lora, label in LORA_LABELS.items():
                runs = _runs(rows, scenario, router, lora)
                if not runs:
                    continue  # a router the run left out
                cells = [spread([float(r[m]) for r in runs]).format(3) for m, _ in METRICS]
                lines.append(f"| {router} | {label} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| SAL with the gateway's rule against | TTFT p50 | TTFT p95 | TTFT p99 |",
            "|---|---|---|---|",
        ]
        for name, cells_by_metric in headline(rows, scenario).items():
            lines.append(f"| {name} | " + " | ".join(cells_by_metric.values()) + " |")
        lines.append("")
        lines += _workers_section(rows, scenario, int(meta.get("workers", 0)))
    return "\n".join(lines)


def _workers_section(rows: Sequence[Row], scenario: Scenario, k: int) -> list[str]:
    """Several workers of one host (gateway's rule): with and without shared adapters."""
    if not k or not any(r.get("setup", "one") != "one" for r in rows):
        return []
    lines = [
        f"Several gateways, arrivals split round robin, gateway's rule: `listen.workers` {k} "
        f"(shared accounting, with or without the pending adapters) or {k} gateways on "
        "separate hosts telling each other every change 1 ms later (`peers`):",
        "",
        "| router | who routes | " + " | ".join(label for _, label in METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for router in (*BASELINES, "sal"):
        for setup, label in SETUP_LABELS.items():
            runs = _runs(rows, scenario, router, "affinity", setup)
            if runs:
                cells = [spread([float(r[m]) for r in runs]).format(3) for m, _ in METRICS]
                lines.append(f"| {router} | {label.format(k=k)} | " + " | ".join(cells) + " |")
    columns = [
        f"{name.format(k=k)} / {label}"
        for name, _ in WORKER_COMPARISONS
        for _, label in METRICS[1:3]
    ]
    lines += [
        "",
        f"| {k} workers sharing adapters against | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for router in (*BASELINES, "sal"):
        ratios = workers_headline(rows, scenario, router)
        if ratios:
            lines.append(f"| {router} | " + " | ".join(ratios.values()) + " |")
    peers = {router: peers_headline(rows, scenario, router) for router in (*BASELINES, "sal")}
    if any(peers.values()):
        lines += [
            "",
            f"| {k} gateways with peers sharing adapters against the same not sharing them "
            "| TTFT p95 | TTFT p99 |",
            "|---|---|---|",
        ]
        for router, ratios in peers.items():
            if ratios:
                lines.append(f"| {router} | " + " | ".join(ratios.values()) + " |")
    lines.append("")
    return lines


def write_report(rows: Sequence[Row], meta: dict[str, Any], out: Path) -> str:
    """Write ``lora.md`` into `out`; return its text."""
    text = render(rows, meta)
    (out / "lora.md").write_text(text)
    return text
