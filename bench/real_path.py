"""``sal-bench real-path``: the same workload through the real gateway and through the simulator.

For each routing policy, one small run of a trace window goes

* **real path**: an HTTP client replays the requests on the wall clock (streaming
  ``/v1/completions`` with token-ID prompts of the recorded length, ``max_tokens`` = the
  recorded output, ``ignore_eos``) into the real gateway (`sal_gateway.app.create_app`,
  served by uvicorn on 127.0.0.1) in front of N emulated replicas
  (`engine_sim.emulator.run_emulators`: the engine model on the wall clock);
* **simulated path**: `engine_sim.simulator.simulate` on the same requests, profile, engine
  scheduler and routing policy.

The emulators run `time_scale` wall seconds per modelled second, so a laptop can keep up with
a GPU's token rate; wall-clock measurements are divided by it and the gateway polls every
``0.1 * time_scale`` wall seconds, i.e. every 0.1 modelled seconds like the simulator. The
report puts both side by side with each path's ranking of the policies.
Everything runs in this one process and only talks to 127.0.0.1 on ports the OS picks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine_sim.data import AZURE_CHAT, data_dir, missing_message
from sal_core.percentile import percentile

HELP = "run one workload through the real gateway + emulators and the simulator; compare"

MODEL_NAME = "sim"


@dataclass(frozen=True, slots=True)
class PathResult:
    """One policy's numbers on one path (modelled seconds)."""

    ttft_p50_s: float
    ttft_p95_s: float
    tgt_p50_s: float
    tgt_p95_s: float
    failed: int
    failure_reasons: str = ""
    """``reason x count`` of failed requests (HTTP status or exception type)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        type=Path,
        default=data_dir() / AZURE_CHAT,
        help="Azure trace CSV (chat; the repository's data/)",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--profile", default="llama3-8b-a100")
    parser.add_argument("--scheduler", default="larry")
    parser.add_argument("--load-factor", type=float, default=4.0, help="trace load factor")
    parser.add_argument("--duration-s", type=float, default=120.0, help="trace window (s)")
    parser.add_argument("--max-output", type=int, default=64, help="clip output lengths")
    parser.add_argument("--time-scale", type=float, default=4.0, help="wall s per modelled s")
    parser.add_argument(
        "--routers", default="sal,p2c,random,round_robin,least_requests", help="comma list"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write real_path.md here")
    parser.add_argument(
        "--gateways",
        default=None,
        help="comma list of K: run K gateway processes (listen.workers) per router instead "
        "(bench.real_gateways; writes real_gateways.md)",
    )


def distinct_prompt(index: int, tokens: int) -> list[int]:
    """Token ids for request `index` that share no prefix block with another request of the
    run: its first two ids are its own (up to 810,000 requests), so its first block's hash
    differs and so does every chained block after it. The emulated replicas cache prompt
    blocks as vLLM does, and the simulated requests of these traces share nothing; with one
    repeated id every prompt after the first was a cache hit (real TTFT 4x below the sim)."""
    head = [10 + index % 900, 10 + (index // 900) % 900]
    return (head + [10 + (index + j) % 900 for j in range(tokens)])[: max(1, tokens)]


async def _one_request(
    client: Any, url: str, req: Any, start_wall: float, time_scale: float, index: int
) -> tuple[float, float] | str:
    """Send request `index` as one streaming completion at its arrival time
    (`distinct_prompt`).

    Returns (TTFT, TGT) in modelled seconds, or why it failed (HTTP status, exception type).
    """
    await asyncio.sleep(max(0.0, start_wall + req.arrival_s * time_scale - time.monotonic()))
    body = {
        "model": MODEL_NAME,
        "prompt": distinct_prompt(index, req.prompt_tokens),
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.monotonic()
    first: float | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"HTTP {resp.status_code}"
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: {") and '"text"' in line:
                    first = time.monotonic()
                elif line.startswith("data: {") and '"error"' in line:
                    return "stream error event"
    except Exception as exc:  # any transport failure counts as a failed request
        return type(exc).__name__
    done = time.monotonic()
    if first is None:
        return "no content"
    return (first - sent) / time_scale, (done - sent) / time_scale


async def _real_run(requests: Sequence[Any], args: argparse.Namespace, router: str) -> PathResult:
    import httpx
    import uvicorn

    from engine_sim.emulator import run_emulators
    from sal_gateway.app import create_app
    from sal_gateway.config import GatewayConfig, ModelConfig, RoutingConfig

    poll_s = 0.1 * args.time_scale
    async with run_emulators(
        args.replicas,
        profile=args.profile,
        scheduler=args.scheduler,
        time_scale=args.time_scale,
        model_name=MODEL_NAME,
    ) as urls:
        config = GatewayConfig(
            models=(ModelConfig(name=MODEL_NAME, backends=tuple(urls)),),
            routing=RoutingConfig(
                policy=router,
                poll_interval_s=poll_s,
                stale_after_s=max(1.0, 10 * poll_s),
                seed=args.seed,
            ),
            log_level="warning",
        )
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=0,
                log_level="warning",
                access_log=False,
                lifespan="on",
                timeout_keep_alive=max(1, round(config.listen.keep_alive_s)),
            )
        )
        task = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            url = f"http://127.0.0.1:{port}/v1/completions"
            await asyncio.sleep(3 * poll_s)  # let the pollers see every replica once
            limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
            async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
                start_wall = time.monotonic() + 0.2
                results = await asyncio.gather(
                    *(
                        _one_request(client, url, r, start_wall, args.time_scale, i)
                        for i, r in enumerate(requests)
                    )
                )
        finally:
            server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(task, timeout=10.0)
    ok = [r for r in results if not isinstance(r, str)]
    failures = Counter(r for r in results if isinstance(r, str))
    ttft = [r[0] for r in ok]
    tgt = [r[1] for r in ok]
    reasons = ", ".join(f"{reason} x{count}" for reason, count in sorted(failures.items()))
    return PathResult(
        percentile(ttft, 50),
        percentile(ttft, 95),
        percentile(tgt, 50),
        percentile(tgt, 95),
        len(results) - len(ok),
        reasons,
    )


def _sim_run(requests: Sequence[Any], args: argparse.Namespace, router: str) -> PathResult:
    from engine_sim.simulator import RouterConfig, simulate

    s = simulate(
        requests,
        replicas=args.replicas,
        scheduler=args.scheduler,
        profile=args.profile,
        router=RouterConfig(policy=router, seed=args.seed),
    ).summary
    return PathResult(s.ttft_p50_s, s.ttft_p95_s, s.tgt_p50_s, s.tgt_p95_s, s.unfinished)


def _ranking(results: dict[str, PathResult], key: str) -> list[str]:
    return sorted(results, key=lambda name: (getattr(results[name], key), name))


def _ranked(results: dict[str, PathResult], order: Sequence[str], key: str) -> str:
    best = getattr(results[order[0]], key)
    parts = []
    for name in order:
        value = getattr(results[name], key)
        parts.append(f"{name} {value / best:.2f}" if best > 0 else name)
    return ", ".join(parts)


def _spearman(a: Sequence[str], b: Sequence[str]) -> float:
    n = len(a)
    if n < 2:
        return math.nan
    pos_b = {name: i for i, name in enumerate(b)}
    d2 = sum((i - pos_b[name]) ** 2 for i, name in enumerate(a))
    return 1.0 - 6.0 * d2 / (n * (n * n - 1))


def render(
    real: dict[str, PathResult], sim: dict[str, PathResult], args: argparse.Namespace, n: int
) -> str:
    """The side-by-side markdown report."""
    lines = [
        "# Real path vs simulator: the same workload, the same ranking?\n",
        f"`sal-bench real-path`: {n} requests (chat trace, first {args.duration_s:g} s, load "
        f"factor {args.load_factor:g}, outputs clipped to {args.max_output} tokens) on "
        f"{args.replicas} x {args.profile} replicas with the `{args.scheduler}` engine "
        f"scheduler. Real path: HTTP client -> real gateway -> emulated replicas at time "
        f"scale {args.time_scale:g} (numbers divided by it). Times in modelled seconds.\n",
        "| router | real TTFT p50 | sim TTFT p50 | real TTFT p95 | sim TTFT p95 | "
        "real TGT p50 | sim TGT p50 | real TGT p95 | sim TGT p95 | real failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in real:
        r, s = real[name], sim[name]
        lines.append(
            f"| {name} | {r.ttft_p50_s:.3f} | {s.ttft_p50_s:.3f} | {r.ttft_p95_s:.3f} | "
            f"{s.ttft_p95_s:.3f} | {r.tgt_p50_s:.3f} | {s.tgt_p50_s:.3f} | "
            f"{r.tgt_p95_s:.3f} | {s.tgt_p95_s:.3f} | {r.failed} |"
        )
    failed = [f"{name}: {r.failure_reasons}" for name, r in real.items() if r.failed]
    if failed:
        lines.append("\nFailed requests on the real path: " + "; ".join(failed) + ".")
    lines.append("")
    lines.append(
        "Rankings, best first, each policy with its value relative to the best of that path:\n"
    )
    lines.append("| metric | real path | simulator | Spearman rho |")
    lines.append("|---|---|---|---:|")
    for key in ("ttft_p50_s", "ttft_p95_s", "tgt_p50_s", "tgt_p95_s"):
        rr, sr = _ranking(real, key), _ranking(sim, key)
        lines.append(
            f"| {key} | {_ranked(real, rr, key)} | {_ranked(sim, sr, key)} | "
            f"{_spearman(rr, sr):.2f} |"
        )
    lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from engine_sim.trace import load_azure_csv, scale_load

    if not args.trace.is_file():
        missing = missing_message(args.trace, "--trace")
        print(f"sal-bench real-path: error: {missing}", file=sys.stderr)
        return 2
    try:
        reqs = load_azure_csv(args.trace, context_limit_tokens=8192, duration_s=args.duration_s)
    except (OSError, ValueError) as exc:
        print(f"sal-bench real-path: error: {exc}", file=sys.stderr)
        return 2
    reqs = [replace(r, output_tokens=min(r.output_tokens, args.max_output)) for r in reqs]
    reqs = scale_load(reqs, args.load_factor)
    if args.gateways:
        from bench import real_gateways

        return real_gateways.run(args, reqs)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    real: dict[str, PathResult] = {}
    sim: dict[str, PathResult] = {}
    for router in routers:
        sim[router] = _sim_run(reqs, args, router)
        started = time.monotonic()
        real[router] = asyncio.run(_real_run(reqs, args, router))
        wall_s = time.monotonic() - started
        line = f"{router}: real {_as_dict(real[router])} sim {_as_dict(sim[router])}"
        print(f"{line} ({wall_s:.0f} s)", file=sys.stderr, flush=True)
    report = render(real, sim, args, len(reqs))
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "real_path.md").write_text(report)
    return 0


def _as_dict(result: PathResult) -> dict[str, float]:
    return {
        "ttft_p50_s": round(result.ttft_p50_s, 4),
        "tgt_p50_s": round(result.tgt_p50_s, 4),
        "failed": result.failed,
    }
