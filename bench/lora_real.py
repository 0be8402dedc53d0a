"""``sal-bench lora-real``: LoRA-slot-aware routing on real vLLM-on-CPU replicas.

vLLM does not start a request whose adapter would make its batch hold more than
``--max-loras`` adapters: it waits until every running request of another adapter has ended,
however idle the replica is otherwise. The gateway passes over replicas whose slots other
adapters hold while another can start the request (``routing.lora_slots``, on by default);
routers blind to the slots do not. This benchmark measures what that changes on real vLLM.

Two real replicas (``sal-engine serve``, the tiny model with dummy weights, ``--enable-lora
--max-loras 1``, every adapter registered with ``--lora-modules`` and kept in the CPU cache,
``--max-cpu-loras``) behind the real gateway (`sal_gateway.app.create_app`, in this process).
A seeded open-loop workload: Poisson arrivals, each request a streamed completion for one of
`--adapters` adapters chosen uniformly, a 20-60-word prompt and `--max-tokens` output tokens
(``ignore_eos``). Configurations (policy, and ``+blind`` for ``routing.lora_slots: false``):

* ``sal``: SAL with the slot rule (the default);
* ``sal+blind``: SAL without it;
* ``least_requests``: the slot rule in front of another policy (it applies to every one);
* ``least_requests+blind``, ``round_robin+blind``: what a Kubernetes Service or a plain load
  balancer does.

One run per (seed, configuration), the order rotated per seed; ratios are paired by seed
(`bench.spread`). About 13 minutes on 2 cores.

    flock /tmp/sal-vllm.lock nice -n 19 sal-bench lora-real --seeds 0,1,2

Writes ``docs/results/lora_real.md`` and ``.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.spread import compare
from bench.spread import spread as spread_of
from bench.tables import format_table
from sal_core.percentile import percentile

HELP = "LoRA-slot-aware routing vs routing blind to --max-loras on real vLLM-on-CPU replicas"
CONFIGS = ("sal", "sal+blind", "least_requests", "least_requests+blind", "round_robin+blind")
WORDS = tuple(
    "alpha beta gamma delta river stone cloud paper window garden silver orange quiet "  # noqa: SIM905
    "yellow market engine signal forest letter bridge candle winter summer number".split()
)
OUTCOMES = ("affinity", "steered", "no_free_slot")
Outcome = tuple[float | None, float | None, str | None]
"""One request's (TTFT, total time, error)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", default="0,1,2", help="comma list; one run per config each")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma list of " + "|".join(CONFIGS)
    )
    parser.add_argument("--requests", type=int, default=80, help="requests per run")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    parser.add_argument("--adapters", type=int, default=4, help="adapters, chosen uniformly")
    parser.add_argument("--max-loras", type=int, default=1, help="each replica's --max-loras")
    parser.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--first-port", type=int, default=8610)
    parser.add_argument(
        "--out", type=Path, default=Path("docs/results/lora_real.md"), help="report path"
    )


@dataclass(slots=True)
class Request:
    at_s: float
    adapter: str
    prompt: str


@dataclass(slots=True)
class RunResult:
    config: str
    seed: int
    requests: int
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_p50_s: float = float("nan")
    ttft_p95_s: float = float("nan")
    ttft_p99_s: float = float("nan")
    total_p50_s: float = float("nan")
    decisions: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0


def workload(seed: int, n: int, rate: float, adapters: int) -> list[Request]:
    """`n` requests, Poisson arrivals at `rate`, adapters ``lora-0..`` uniformly."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        out.append(Request(at, f"lora-{rng.randrange(adapters)}", words))
    return out


async def _one(client: Any, url: str, req: Request, max_tokens: int, t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
    body = {
        "model": req.adapter,
        "prompt": req.prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.monotonic()
    first: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return None, None, f"{resp.status_code} {(await resp.aread())[:120]!r}"
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic() - sent
    except Exception as exc:  # a failed request is counted and shown, not raised
        return None, None, f"{type(exc).__name__}: {exc}"[:160]
    return first, time.monotonic() - sent, None


async def _replay(url: str, reqs: Sequence[Request], max_tokens: int) -> list[Outcome]:
    import httpx

    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        t0 = time.monotonic() + 0.2
        return list(await asyncio.gather(*(_one(client, url, r, max_tokens, t0) for r in reqs)))


def _decisions(metrics: str) -> dict[str, float]:
    found = {o: 0.0 for o in OUTCOMES}
    pattern = r'^sal_lora_slot_decisions_total\{[^}]*outcome="(\w+)"[^}]*\} ([0-9.eE+-]+)$'
    for outcome, value in re.findall(pattern, metrics, re.M):
        found[outcome] = found.get(outcome, 0.0) + float(value)
    return found


def _gateway_config(urls: Sequence[str], model_dir: Path, config: str, seed: int) -> Any:
    from sal_gateway.config import build_config

    policy, _, mode = config.partition("+")
    return build_config(
        {
            "models": [{"name": "tiny", "backends": list(urls), "tokenizer": str(model_dir)}],
            "listen": {"host": "127.0.0.1", "port": 0},
            # Lenient staleness: the replicas and this process share 2 busy cores.
            "routing": {
                "policy": policy,
                "lora_slots": mode != "blind",
                "seed": seed,
                "poll_timeout_s": 1.0,
                "stale_after_s": 3.0,
            },
            "proxy": {"stream_idle_timeout_s": 120.0},
            "log_level": "warning",
        }
    )


def _run_once(
    urls: Sequence[str], model_dir: Path, config: str, seed: int, args: argparse.Namespace
) -> RunResult:
    import httpx

    from engine_sim.fake_vllm import ServedApp
    from sal_gateway.app import create_app

    reqs = workload(seed, args.requests, args.rate, args.adapters)
    app = create_app(_gateway_config(urls, model_dir, config, seed))
    with ServedApp(app, lifespan=True) as gateway:
        deadline = time.monotonic() + 60
        while httpx.get(f"{gateway}/ready", timeout=5.0).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway never became ready")
            time.sleep(0.2)
        time.sleep(1.0)  # every replica polled, its slots known
        started = time.monotonic()
        outcomes = asyncio.run(_replay(gateway, reqs, args.max_tokens))
        wall = time.monotonic() - started
        metrics = httpx.get(f"{gateway}/metrics", timeout=10.0).text
    result = RunResult(config, seed, len(reqs), wall_s=wall, decisions=_decisions(metrics))
    ttfts = [t for t, _, err in outcomes if err is None and t is not None]
    totals = [d for t, d, err in outcomes if err is None and t is not None and d is not None]
    result.failed = len(reqs) - len(ttfts)
    result.errors = sorted({err for _, _, err in outcomes if err})[:5]
    if ttfts:
        result.ttft_p50_s = percentile(ttfts, 50)
        result.ttft_p95_s = percentile(ttfts, 95)
        result.ttft_p99_s = percentile(ttfts, 99)
        result.total_p50_s = percentile(totals, 50)
    return result


def _start_replicas(args: argparse.Namespace, workdir: Path) -> tuple[list[Any], Path]:
    from engine_patch import tiny_model
    from engine_patch.replica import LocalReplica, replica_command

    model_dir = tiny_model.build(workdir / "model")
    modules = [
        f"lora-{k}={tiny_model.build_lora(model_dir, workdir / f'lora-{k}', seed=k + 1)}"
        for k in range(args.adapters)
    ]
    extra = [
        "--served-model-name", "tiny", "--enable-lora", "--max-lora-rank", "8",
        "--max-loras", str(args.max_loras), "--max-cpu-loras", str(max(args.adapters, 1)),
        "--lora-modules", *modules,
    ]  # fmt: skip
    replicas: list[Any] = []
    try:
        for i in range(args.replicas):
            port = args.first_port + i
            replica = LocalReplica(replica_command(model_dir, port, extra_args=extra), port)
            replicas.append(replica)
            print(f"starting replica {i} on port {port} ...", file=sys.stderr, flush=True)
            replica.start(timeout_s=600)
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas, model_dir


def report(runs: Sequence[RunResult], args: argparse.Namespace) -> str:
    """Markdown: per configuration the medians over seeds [min–max], then SAL's TTFT
    against each other configuration paired by seed (> 1: SAL with the slot rule is
    faster), then every run."""
    configs = [c for c in CONFIGS if any(r.config == c for r in runs)]
    by = {c: sorted((r for r in runs if r.config == c), key=lambda r: r.seed) for c in configs}

    def cell(rows: Sequence[RunResult], key: str) -> str:
        return spread_of([getattr(r, key) for r in rows]).format(3, " s")

    table = [
        [
            c,
            cell(by[c], "ttft_p50_s"),
            cell(by[c], "ttft_p95_s"),
            cell(by[c], "ttft_p99_s"),
            cell(by[c], "total_p50_s"),
            " / ".join(
                f"{percentile([r.decisions.get(o, 0.0) for r in by[c]], 50):.0f}" for o in OUTCOMES
            ),
            str(sum(r.failed for r in by[c])),
        ]
        for c in configs
    ]
    lines = [
        "# LoRA slots on real vLLM-on-CPU replicas",
        "",
        f"Generated by `{_command(args)}`. {args.replicas} replicas of the tiny model (dummy "
        f"weights) with `--enable-lora --max-loras {args.max_loras}`, {args.adapters} adapters "
        f"registered on each; {args.requests} streamed completions per run at {args.rate} "
        f"per second (Poisson), each for one adapter chosen uniformly, {args.max_tokens} "
        "output tokens. `+blind`: `routing.lora_slots: false` (routing as if the slots did "
        "not exist). Cells: median over the seeds [min–max]. Setup: `bench/lora_real.py`.",
        "",
        format_table(
            [
                "configuration",
                "TTFT p50",
                "TTFT p95",
                "TTFT p99",
                "total time p50",
                "slot decisions affinity / steered / no free slot",
                "failed",
            ],
            table,
        ),
        "",
        "## SAL with the slot rule against each configuration, paired by seed",
        "",
        "Per seed: the configuration's value / SAL's (> 1: SAL with the slot rule is faster); "
        "median [min–max] and the verdict (`bench/spread.py`: a win or a loss only when every "
        "seed agrees beyond 2 %).",
        "",
    ]
    if "sal" in by:
        rows = []
        for c in configs:
            if c == "sal":
                continue
            ours, theirs = by["sal"], by[c]
            common = sorted({r.seed for r in ours} & {r.seed for r in theirs})
            mine = {r.seed: r for r in ours}
            other = {r.seed: r for r in theirs}
            cells = [c]
            for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "total_p50_s"):
                cmp = compare(
                    [getattr(other[s], key) for s in common],
                    [getattr(mine[s], key) for s in common],
                )
                cells.append(cmp.format(3))
            rows.append(cells)
        lines.append(
            format_table(["against", "TTFT p50", "TTFT p95", "TTFT p99", "total time p50"], rows)
        )
        lines.append("")
    lines += ["## Every run", ""]
    lines.append(
        format_table(
            ["configuration", "seed", "TTFT p50", "p95", "p99", "total p50", "failed", "wall s"],
            [
                [
                    r.config,
                    str(r.seed),
                    f"{r.ttft_p50_s:.3f}",
                    f"{r.ttft_p95_s:.3f}",
                    f"{r.ttft_p99_s:.3f}",
                    f"{r.total_p50_s:.3f}",
                    str(r.failed) + (f" ({'; '.join(r.errors)})" if r.errors else ""),
                    f"{r.wall_s:.0f}",
                ]
                for r in runs
            ],
        )
    )
    return "\n".join(lines) + "\n"


def _command(args: argparse.Namespace) -> str:
    """The command line that regenerates this report (options that differ from defaults)."""
    defaults = vars(build_parser().parse_args([]))
    parts = ["sal-bench lora-real"]
    for name, value in vars(args).items():
        if name in defaults and (value != defaults[name] or name == "seeds"):
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sal-bench lora-real", description=HELP)
    configure(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    seeds = [int(s) for s in args.seeds.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="lora-real-") as tmp:
        replicas, model_dir = _start_replicas(args, Path(tmp))
        urls = [r.base_url for r in replicas]
        try:
            for i, seed in enumerate(seeds):
                # Rotate the order per seed so no configuration always runs first.
                order = configs[i % len(configs) :] + configs[: i % len(configs)]
                for config in order:
                    result = _run_once(urls, model_dir, config, seed, args)
                    runs.append(result)
                    print(
                        f"seed {seed} {config}: TTFT p50 {result.ttft_p50_s:.3f} p95 "
                        f"{result.ttft_p95_s:.3f} p99 {result.ttft_p99_s:.3f} total p50 "
                        f"{result.total_p50_s:.3f} decisions {result.decisions} failed "
                        f"{result.failed} {result.errors[:1]}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for replica in replicas:
                replica.stop()
    text = report(runs, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
