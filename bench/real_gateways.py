"""``sal-bench real-path --gateways 1,2,4``: K real gateway processes in front of emulators.

The many-gateway experiment of `bench.gateways` on the real path: for each K and router the
gateway runs as a user runs it, ``sal-gateway serve`` in a child process with
``listen.workers: K`` (K processes sharing one port, each with its own pollers and, with
``listen.share_accounting: false``, its own accounting: K independent gateways, as in the
simulator's rows other than ``sal_shared``; `sal_gateway.workers`; router ``sal_shared``:
the workers share their accounting; ``sal_peers``: they tell each other over UDP, ``peers``,
as gateways on separate hosts do), in front of emulated replicas
(`engine_sim.emulator.run_emulators`, in this process, on the wall clock at ``time_scale``).
The client opens a new connection per request, so the kernel's ``SO_REUSEPORT`` hash spreads
requests over the workers at random, as a Service spreads them over gateway replicas. The
same requests then run through the simulator with K gateways and a random split.

Reported per router and K: TTFT p50 / p95 on both paths, failed requests, and each worker's
share of the requests (read from every worker's own ``/metrics`` port), in
``real_gateways.md``. One run per cell on a shared machine: noisy; compare within the table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.processes import PortAllocator, stop_process, wait_http_ok
from sal_core.percentile import percentile

MODEL_NAME = "sim"


@dataclass(frozen=True, slots=True)
class Cell:
    """One router at one K on both paths (modelled seconds)."""

    router: str
    gateways: int
    real_ttft_p50_s: float
    real_ttft_p95_s: float
    sim_ttft_p50_s: float
    sim_ttft_p95_s: float
    failed: int
    failure_reasons: str
    worker_shares: tuple[float, ...]


ROUTER_MODES = {"sal_shared": "sal", "sal_peers": "sal"}
"""Rows that are `sal` with the workers telling each other: `sal_shared` through shared
memory (``listen.share_accounting``), `sal_peers` over UDP on loopback (``peers``, each
worker a peer of its own, as gateways on separate hosts are). Every other router's workers
keep their own accounting."""

PEERS_SECRET = "real-path benchmark peers secret"


def _config(
    urls: Sequence[str],
    router: str,
    k: int,
    port: int,
    first_own: int,
    args: argparse.Namespace,
    first_udp: int | None = None,
) -> dict[str, Any]:
    poll_s = 0.1 * args.time_scale
    config: dict[str, Any] = {
        "listen": {
            "host": "127.0.0.1",
            "port": port,
            "workers": k,
            "worker_ports_from": first_own,
            "share_accounting": router == "sal_shared",
        },
        "models": [{"name": MODEL_NAME, "backends": list(urls)}],
        "routing": {
            "policy": ROUTER_MODES.get(router, router),
            "poll_interval_s": poll_s,
            "stale_after_s": max(1.0, 10 * poll_s),
            "seed": args.seed,
        },
        "limits": {"body_workers": 1},
        "log_level": "warning",
    }
    if router == "sal_peers" and first_udp is not None:
        # Worker i listens on first_udp + i and sends to first_udp + 0..K-1.
        address = f"127.0.0.1:{first_udp}"
        config["peers"] = {"listen": address, "addresses": [address]}
    return config


def _requests_served(port: int) -> float:
    """``sal_requests_total`` of the gateway process listening alone on `port`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sal_requests_total"
    )


def _start_gateway(config_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m sal_gateway.cli serve --config <path>``, output in `log_path`."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "sal_gateway.cli", "serve", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "SAL_GATEWAY_PEERS_SECRET": PEERS_SECRET},
        )


async def _real(
    requests: Sequence[Any], args: argparse.Namespace, router: str, k: int, ports: PortAllocator
) -> tuple[list[tuple[float, float] | str], list[float]]:
    import httpx

    from bench.real_path import _one_request
    from engine_sim.emulator import run_emulators

    async with run_emulators(
        args.replicas,
        profile=args.profile,
        scheduler=args.scheduler,
        time_scale=args.time_scale,
        model_name=MODEL_NAME,
    ) as urls:
        port = ports.take()
        own = [ports.take() for _ in range(k)] if k > 1 else [port]
        udp = [ports.take() for _ in range(k)]
        for group in (own, udp):
            if group != list(range(group[0], group[0] + len(group))):
                raise RuntimeError(f"ports {group} are not consecutive; free some ports")
        with tempfile.TemporaryDirectory(prefix="sal-real-gw-") as tmp:
            path = Path(tmp) / "config.yaml"
            config = _config(urls, router, k, port, own[0], args, first_udp=udp[0])
            path.write_text(yaml.safe_dump(config))
            proc = _start_gateway(path, Path(tmp) / "gateway.log")
            try:
                for p in own:
                    await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{p}/ready", 120, proc)
                await asyncio.sleep(3 * 0.1 * args.time_scale)
                url = f"http://127.0.0.1:{port}/v1/completions"
                # No keep-alive: every request is a new connection, spread by the kernel.
                limits = httpx.Limits(max_connections=2000, max_keepalive_connections=0)
                async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
                    start = time.monotonic() + 0.2
                    results = await asyncio.gather(
                        *(
                            _one_request(client, url, r, start, args.time_scale, i)
                            for i, r in enumerate(requests)
                        )
                    )
                served = [await asyncio.to_thread(_requests_served, p) for p in own]
            except RuntimeError as exc:
                tail = (Path(tmp) / "gateway.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{exc}\n--- gateway log ---\n{tail}") from exc
            finally:
                await asyncio.to_thread(stop_process, proc, 15.0)
    total = sum(served) or 1.0
    return list(results), [s / total for s in served]


def _sim(requests: Sequence[Any], args: argparse.Namespace, router: str, k: int) -> Any:
    from engine_sim.simulator import RouterConfig, simulate

    config = RouterConfig(
        policy=ROUTER_MODES.get(router, router),
        seed=args.seed,
        gateways=k,
        gateway_split="random",
        shared_accounting=router == "sal_shared" and k > 1,
        gossip_interval_s=0.0 if router == "sal_peers" else None,
        gossip_delay_s=0.0002,
    )
    return simulate(
        requests,
        replicas=args.replicas,
        scheduler=args.scheduler,
        profile=args.profile,
        router=config,
    ).summary


def measure(requests: Sequence[Any], args: argparse.Namespace) -> list[Cell]:
    ks = [int(k) for k in str(args.gateways).split(",") if k.strip()]
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    ports = PortAllocator(23000, 23999)
    cells = []
    for k in ks:
        for router in routers:
            started = time.monotonic()
            results, shares = asyncio.run(_real(requests, args, router, k, ports))
            sim = _sim(requests, args, router, k)
            ok = [r for r in results if not isinstance(r, str)]
            fails = Counter(r for r in results if isinstance(r, str))
            ttft = [r[0] for r in ok]
            cell = Cell(
                router,
                k,
                percentile(ttft, 50),
                percentile(ttft, 95),
                sim.ttft_p50_s,
                sim.ttft_p95_s,
                len(results) - len(ok),
                ", ".join(f"{why} x{n}" for why, n in sorted(fails.items())),
                tuple(shares),
            )
            cells.append(cell)
            print(
                f"K={k} {router}: real TTFT p50/p95 {cell.real_ttft_p50_s:.3f}/"
                f"{cell.real_ttft_p95_s:.3f} sim {cell.sim_ttft_p50_s:.3f}/"
                f"{cell.sim_ttft_p95_s:.3f} failed {cell.failed} shares "
                f"{[round(s, 2) for s in shares]} ({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return cells


def render(cells: Sequence[Cell], args: argparse.Namespace, n: int) -> str:
    lines = [
        "# K real gateway processes in front of emulated replicas\n",
        f"`sal-bench real-path --gateways {args.gateways} --routers {args.routers}`: {n} "
        f"requests (chat trace, first {args.duration_s:g} s, load factor {args.load_factor:g}, "
        f"outputs clipped to {args.max_output} tokens) on {args.replicas} x {args.profile} "
        f"emulated replicas with the `{args.scheduler}` engine scheduler, time scale "
        f"{args.time_scale:g}. Real: `sal-gateway serve` with `listen.workers: K` (K processes "
        "on one port, each with its own pollers and accounting: `listen.share_accounting: "
        "false`; `sal_shared`: the workers share it through memory; `sal_peers`: each worker "
        "tells the others over UDP on loopback, `peers`), a new connection per request "
        "so the kernel spreads them; sim: the simulator with K gateways and a random split. "
        "One run per cell on the shared 2-core machine (every process of the run shares it): "
        "compare within a column, expect noise. Times in modelled seconds.\n",
        "| router | K | real TTFT p50 | sim TTFT p50 | real TTFT p95 | sim TTFT p95 | "
        "real failed | requests per worker |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        shares = " / ".join(f"{s:.2f}" for s in c.worker_shares)
        lines.append(
            f"| {c.router} | {c.gateways} | {c.real_ttft_p50_s:.3f} | {c.sim_ttft_p50_s:.3f} | "
            f"{c.real_ttft_p95_s:.3f} | {c.sim_ttft_p95_s:.3f} | {c.failed} | {shares} |"
        )
    failed = [f"{c.router} K={c.gateways}: {c.failure_reasons}" for c in cells if c.failed]
    if failed:
        lines.append("\nFailed requests on the real path: " + "; ".join(failed) + ".")
    lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace, requests: Sequence[Any]) -> int:
    """The ``--gateways`` mode of `bench.real_path.run`."""
    cells = measure(requests, args)
    report = render(cells, args, len(requests))
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "real_gateways.md").write_text(report)
    return 0
