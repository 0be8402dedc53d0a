"""Fewer LoRA slots than adapters: SAL with the gateway's slot rule against SAL blind to it.

    python -m bench.lora_few_slots LOAD MAX_LORAS ADAPTERS [--windows N]

The simulator counterpart of ``sal-bench lora-real``'s setup: 2 Llama-3-8B/A100 replicas
running vLLM's FCFS with ``--max-loras MAX_LORAS``, Azure chat windows 0..N-1 (300 s each)
at LOAD times the single-replica 1x per replica, each request for one of ADAPTERS adapters
chosen uniformly. SAL blind to the slots, with the free-slot filter only, with the filter
and the all-full step, and with the gateway's whole rule (`sal_core.lora_slots`). Prints the
median p50/p95/p99 TTFT of each and "blind / this" per window (> 1: better than blind).

Why it exists: on two real CPU replicas with one slot each and four adapters, SAL with the
rule had a worse p99 than SAL blind to the slots on every seed. vLLM skips a waiting
request whose adapter finds every slot held and goes on admitting the running adapter's
requests, so an adapter can wait for as long as another one keeps arriving; a router that
sends each adapter only where it runs feeds that adapter's stream to one replica and keeps
its slot from ever draining. The numbers are in the README ("LoRA fleets").
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from sal_core.percentile import percentile

PROFILE = "llama3-8b-a100"
REPLICAS = 2
VARIANTS: dict[str, dict[str, Any]] = {
    "blind": {"lora_slots": False},
    "filter": {"lora_slots": True},
    "filter+full": {"lora_slots": True, "lora_when_full": True},
    "rule": {"lora_slots": True, "lora_affinity": True, "lora_when_full": True},
}


Ttft = tuple[float, float, float]
"""(TTFT p50, p95, p99) of one run, seconds."""


def run(load: float, max_loras: int, adapters: int, windows: int) -> dict[str, list[Ttft]]:
    """Per variant, per window: (TTFT p50, p95, p99) in seconds."""
    from bench.experiments import base_load
    from bench.stacks import Stack, run_stack
    from bench.windows import window, workload_trace
    from engine_sim.adapters import with_adapters
    from engine_sim.data import data_dir
    from engine_sim.simulator import RouterConfig
    from engine_sim.trace import scale_load

    out: dict[str, list[Ttft]] = {v: [] for v in VARIANTS}
    trace = workload_trace("chat", data_dir())
    for index in range(windows):
        factor = load * base_load("chat", PROFILE) * REPLICAS
        reqs = with_adapters(
            scale_load(window(trace, index, 300.0), factor),
            adapters=adapters,
            zipf_s=0.0,
            seed=index,
        )
        for name, switches in VARIANTS.items():
            result = run_stack(
                reqs,
                Stack("sal", "sal", {"scheduler": "fcfs", "max_loras": max_loras}),
                profile=PROFILE,
                replicas=REPLICAS,
                router=RouterConfig(seed=index, **switches),
            )
            s = result.summary
            out[name].append((s.ttft_p50_s, s.ttft_p95_s, s.ttft_p99_s))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_few_slots", description=__doc__)
    parser.add_argument("load", type=float)
    parser.add_argument("max_loras", type=int)
    parser.add_argument("adapters", type=int)
    parser.add_argument("--windows", type=int, default=6)
    args = parser.parse_args(argv)
    res = run(args.load, args.max_loras, args.adapters, args.windows)
    print(
        f"load {args.load}, --max-loras {args.max_loras}, {args.adapters} adapters, "
        f"{args.windows} windows (medians; blind / this per window, median [min-max])"
    )
    for name, rows in res.items():
        cells = [
            f"p{q} {percentile([r[k] for r in rows], 50):.3f}" for k, q in enumerate((50, 95, 99))
        ]
        ratios = []
        for k, q in ((1, 95), (2, 99)):
            per = [b[k] / r[k] for b, r in zip(res["blind"], rows, strict=True)]
            ratios.append(f"p{q} {percentile(per, 50):.2f} [{min(per):.2f}-{max(per):.2f}]")
        print(f"{name:12s} {' '.join(cells)} | {'; '.join(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
