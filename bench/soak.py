"""``sal-bench soak``: the gateway under steady streaming load while replicas die and return.

    sal-bench soak --minutes N [--replicas 3] [--rate-per-s 20] [--concurrency 32]
        [--kill-every-s 20] [--down-s 3] [--json PATH]

Starts the gateway (``python -m sal_gateway.cli serve``) and ``--replicas`` emulated vLLM
replicas (``python -m engine_sim.emulator``), each a process of its own on 127.0.0.1, sends
tracked streaming completions (`bench.faultload.TrackedLoad`: every request, by id, ends as
exactly one answer or one explicit error, or counts as lost / duplicated), and every
``--kill-every-s`` SIGKILLs the next replica in turn and restarts it on the same port
``--down-s`` later. Every minute (``--row-every-s``) it prints one table row
(`bench.soak_report`): requests ok / SSE error events / HTTP errors / lost / duplicated (by
completion time), latency p50/p99 of the good answers, and the gateway's RSS, open file
descriptors, asyncio tasks and event-loop lag p99 from its ``/metrics``
(``process_resident_memory_bytes``, ``process_open_fds``, ``sal_event_loop_tasks``,
``sal_event_loop_lag_seconds``; RSS and fds from ``/proc`` when it does not export them). At
the end: totals and the RSS / fd / task slopes after the first period (a leak is a steady
slope). Exit status 1 when anything was lost or duplicated.

A benchmark, not a CI test (``tests/e2e/test_soak.py`` runs ``--minutes 1`` as a smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

HELP = "soak: steady streaming load through the gateway while replicas are killed and restarted"
MODEL = "tiny"


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """What one soak run does (every field has a CLI flag of the same name)."""

    minutes: float
    replicas: int = 3
    rate_per_s: float = 20.0
    concurrency: int = 32
    max_tokens: int = 64
    time_scale: float = 5.0
    """Emulator wall seconds per modelled second (``tiny-cpu``: ~3 ms a step before scaling)."""
    kill_every_s: float = 20.0
    """SIGKILL one replica (in turn) this often; 0: never."""
    down_s: float = 3.0
    """Seconds a killed replica stays down before it restarts on its port."""
    row_every_s: float = 60.0
    base_port: int = 23000
    """Ports base_port .. base_port + replicas (the gateway takes the last)."""
    policy: str = "sal"
    hang_s: float = 120.0
    """A request without an answer after this long is lost (a hang)."""


def configure(parser: argparse.ArgumentParser) -> None:
    d = SoakOptions(minutes=0)
    parser.add_argument("--minutes", type=float, required=True, help="how long to load")
    parser.add_argument("--replicas", type=int, default=d.replicas, help="(3)")
    parser.add_argument("--rate-per-s", type=float, default=d.rate_per_s, help="(20)")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="in flight (32)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="(64)")
    parser.add_argument("--time-scale", type=float, default=d.time_scale, help="(5)")
    parser.add_argument("--kill-every-s", type=float, default=d.kill_every_s, help="(20)")
    parser.add_argument("--down-s", type=float, default=d.down_s, help="(3)")
    parser.add_argument("--row-every-s", type=float, default=d.row_every_s, help="(60)")
    parser.add_argument("--base-port", type=int, default=d.base_port, help="(23000)")
    parser.add_argument("--policy", default=d.policy, help="routing policy (sal)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here too")


def run(args: argparse.Namespace) -> int:
    names = set(SoakOptions.__dataclass_fields__)
    options = SoakOptions(**{k: v for k, v in vars(args).items() if k in names})
    result = asyncio.run(soak(options))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    totals = result["totals"]
    return 0 if totals["lost"] == 0 and totals["duplicated"] == 0 else 1


@dataclass
class Child:
    """One child server on a fixed port: `kill()` SIGKILLs it, `start()` brings it back there."""

    args: list[str]
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline and self.proc and self.proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(0.1)
        tail = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(self.args[:2])} on port {self.port} is not up:\n{tail}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def proc_rss_fds(pid: int) -> tuple[float, float]:
    """(RSS bytes, open fds) of `pid` read from ``/proc`` (NaN where unreadable)."""
    rss = fds = float("nan")
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = float(line.split()[1]) * 1024
        fds = float(len(os.listdir(f"/proc/{pid}/fd")))
    return rss, fds


@contextlib.asynccontextmanager
async def fleet(options: SoakOptions, workdir: Path) -> AsyncIterator[tuple[Child, list[Child]]]:
    """Start the replicas and the gateway; stop every child by PID on exit."""
    replicas = [
        Child(
            [
                "-m",
                "engine_sim.emulator",
                "--replicas",
                "1",
                "--base-port",
                str(port),
                "--profile",
                "tiny-cpu",
                "--model",
                MODEL,
                "--time-scale",
                str(options.time_scale),
            ],
            port,
            workdir / f"replica-{port}.log",
        )
        for port in range(options.base_port, options.base_port + options.replicas)
    ]
    gw_port = options.base_port + options.replicas
    config = {
        "listen": {"host": "127.0.0.1", "port": gw_port},
        "models": [{"name": MODEL, "backends": [r.url for r in replicas]}],
        "routing": {"policy": options.policy, "poll_interval_s": 0.1},
        "log_level": "warning",
    }
    config_path = workdir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    gateway = Child(
        ["-m", "sal_gateway.cli", "serve", "--config", str(config_path)],
        gw_port,
        workdir / "gateway.log",
    )
    children = [*replicas, gateway]
    try:
        for child in children:
            child.start()
        await asyncio.gather(*(r.wait_healthy() for r in children))
        yield gateway, replicas
    finally:
        for child in reversed(children):
            child.stop()


@dataclass
class Chaos:
    """Kills the next replica every `every_s` and restarts it `down_s` later, on its port."""

    replicas: list[Child]
    every_s: float
    down_s: float
    kills: int = 0
    failures: list[str] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        if self.every_s <= 0:
            return
        for n in range(10**9):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.every_s)
            if stop.is_set():
                return
            victim = self.replicas[n % len(self.replicas)]
            victim.kill()
            self.kills += 1
            await asyncio.sleep(self.down_s)
            victim.start()
            try:
                await victim.wait_healthy()
            except RuntimeError as exc:
                self.failures.append(str(exc))


async def soak(options: SoakOptions, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the soak; print the live table with `out`; return the summary (`soak_report`)."""
    from bench.faultload import TrackedLoad, parse_metrics
    from bench.soak_report import Row, format_summary, header_lines, period_row, row_line, summary

    workdir = Path(tempfile.mkdtemp(prefix="sal-soak-"))
    async with fleet(options, workdir) as (gateway, replicas):
        assert gateway.proc is not None
        pid = gateway.proc.pid
        load = TrackedLoad(
            gateway.url,
            model=MODEL,
            rate_per_s=options.rate_per_s,
            concurrency=options.concurrency,
            max_tokens=options.max_tokens,
            hang_s=options.hang_s,
        )
        chaos = Chaos(replicas, options.kill_every_s, options.down_s)
        stop = asyncio.Event()
        workers = [asyncio.create_task(load.run(stop)), asyncio.create_task(chaos.run(stop))]
        out(
            f"soak: gateway PID {pid} at {gateway.url}, {options.replicas} emulated replicas, "
            f"{options.rate_per_s:g} req/s (<= {options.concurrency} in flight), a kill every "
            f"{options.kill_every_s:g} s, {options.minutes:g} min"
        )
        out(header_lines())
        rows: list[Row] = []
        started = time.monotonic()
        end_at = started + options.minutes * 60
        async with httpx.AsyncClient(timeout=5.0) as client:
            scrape = parse_metrics((await client.get(f"{gateway.url}/metrics")).text)
            seen = kills = 0
            while True:
                period_end = min(end_at, started + (len(rows) + 1) * options.row_every_s)
                final = period_end >= end_at
                await asyncio.sleep(max(0.0, period_end - time.monotonic()))
                if final:  # stop sending; what is in flight still ends in this period
                    stop.set()
                    await asyncio.gather(*workers)
                now_scrape = parse_metrics((await client.get(f"{gateway.url}/metrics")).text)
                rss, fds = proc_rss_fds(pid)
                row = period_row(
                    (time.monotonic() - started) / 60,
                    load.outcomes[seen:],  # appended as they end: this period's
                    scrape,
                    now_scrape,
                    proc_rss_bytes=rss,
                    proc_fds=fds,
                    kills=chaos.kills - kills,
                )
                seen, kills, scrape = len(load.outcomes), chaos.kills, now_scrape
                rows.append(row)
                out(row_line(row))
                if final:
                    break
        result = summary(rows, sent=load.sent, unanswered=load.sent - len(load.outcomes))
        result["restart_failures"] = chaos.failures
        out(format_summary(result))
    if result["totals"]["lost"] or result["totals"]["duplicated"] or chaos.failures:
        out(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return result
