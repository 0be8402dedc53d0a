"""Real processes to break, and load to watch them break under, for the fault-injection tests.

* `FakeProc` — one fake vLLM backend (``python -m bench.fake_backend_server``) as a process of
  its own, so it can be SIGKILLed, SIGSTOPped and restarted on the same port; its request
  record file (``start/done/abort ID`` lines) survives a kill.
* `background_load()` — `bench.faultload.TrackedLoad` and `MetricsTimeline` in a thread of
  their own while the test injects faults from the main thread.
* `engine_core_pid()` — vLLM's EngineCore child of a replica's API server.
* `engine_busy()` — what a replica's engine last published, read from its snapshot file.
* `FAULT_MEASUREMENTS` / `measured()` — numbers a test measured (printed with ``-s`` and at the
  end of the session), for the failure table in docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.faultload import MetricsTimeline, Outcome, TrackedLoad
from engine_patch.snapshot import SnapshotError, SnapshotReader, snapshot_path
from tests.gateway_support import wait_ok

FAULT_MEASUREMENTS: list[str] = []


def measured(scenario: str, **values: float | int | str) -> None:
    """Record (and print) what a fault test measured."""
    parts = " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
    line = f"[fault] {scenario}: {parts}"
    FAULT_MEASUREMENTS.append(line)
    print(line)


def wait_for(check: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> float:
    """Poll `check` every 50 ms; return the seconds it took, or fail the test."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{what} not true within {timeout_s} s")


@dataclass
class FakeProc:
    """A fake backend process on a fixed port (restartable there)."""

    name: str
    port: int
    record: Path
    args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        log = self.record.with_suffix(".log").open("ab")
        cmd = [sys.executable, "-m", "bench.fake_backend_server", "--port", str(self.port)]
        cmd += ["--name", self.name, "--record", str(self.record), *self.args]
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        wait_ok(f"{self.url}/health", self.proc, self.record.with_suffix(".log"), timeout_s)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (a crash: no graceful close of its connections)."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def fault(self, **knobs: object) -> None:
        """Set fault knobs (see `bench.fake_backend_server.FaultyFake`)."""
        httpx.post(f"{self.url}/_fault", json=knobs, timeout=5.0).raise_for_status()

    def records(self) -> collections.Counter[tuple[str, str]]:
        """``Counter[(start|done|abort, request id)]`` over every run of this backend."""
        lines = self.record.read_text().splitlines() if self.record.exists() else []
        return collections.Counter(tuple(line.split(" ", 1)) for line in lines if " " in line)  # type: ignore[misc]


@contextlib.contextmanager
def fake_procs(tmp: Path, ports: list[int], *args: str) -> Iterator[list[FakeProc]]:
    """Start one `FakeProc` per port (names a, b, ...); stop them all on exit."""
    fakes = [
        FakeProc(chr(ord("a") + i), p, tmp / f"{chr(ord('a') + i)}.rec", args)
        for i, p in enumerate(ports)
    ]
    try:
        for fake in fakes:
            fake.start()
        yield fakes
    finally:
        for fake in fakes:
            fake.stop()


@dataclass
class LoadRun:
    """What `background_load` yields: the load, the metrics timeline, and a stop switch."""

    load: TrackedLoad
    timeline: MetricsTimeline
    stop: Callable[[], None]
    outcomes: list[Outcome] = field(default_factory=list)

    def by_kind(self) -> collections.Counter[str]:
        return collections.Counter(o.kind for o in self.load.outcomes)


@contextlib.contextmanager
def background_load(load: TrackedLoad, timeline: MetricsTimeline) -> Iterator[LoadRun]:
    """Run `load` and `timeline` in a thread; on exit stop sending and wait for every answer."""
    loop = asyncio.new_event_loop()
    stop_event = asyncio.Event()

    async def main() -> None:
        await asyncio.gather(load.run(stop_event), timeline.run(stop_event))

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            loop.call_soon_threadsafe(stop_event.set)
            thread.join(timeout=load.hang_s + 30)
            assert not thread.is_alive(), "the load did not finish: a request hung"

    thread.start()
    run = LoadRun(load, timeline, stop)
    try:
        yield run
    finally:
        stop()
        loop.close()
        run.outcomes = list(load.outcomes)


def engine_core_pid(api_server_pid: int) -> int:
    """The PID of vLLM's EngineCore process under a replica's API server."""
    for child in psutil.Process(api_server_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child.pid
    raise AssertionError(f"no EngineCore process under PID {api_server_pid}")


def replica_counters(url: str) -> dict[str, float]:
    """vLLM's own counters from a replica's ``/metrics``: finished requests by reason
    (``success_<reason>``), ``prompt_tokens``, ``generation_tokens``, and ``finished_long``:
    requests the engine ran to their end with more than 100 generated tokens (its
    ``request_generation_tokens`` histogram, which client aborts do not enter)."""
    # Generous: a starved replica renders its /metrics late (seconds on a busy 2-core box).
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[f"success_{reason}"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prompt_tokens_total{"):
            out["prompt_tokens"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:generation_tokens_total{"):
            out["generation_tokens"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_generation_tokens_count{"):
            out["finished_long"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_generation_tokens_bucket{") and 'le="100.0"' in line:
            out["finished_long"] -= float(line.rsplit(" ", 1)[1])
    return dict(out)


def replica_busy(url: str) -> int:
    """``num_running + num_waiting`` from a replica's ``/stats``."""
    body = httpx.get(f"{url}/stats", timeout=5.0).json()
    return int(body["num_running"]) + int(body["num_waiting"])


def engine_busy(stats_prefix: str) -> int:
    """``num_running + num_waiting`` as a replica's engine (data-parallel rank 0) last
    published it, read from its snapshot file under `stats_prefix` (the replica's
    ``SAL_STATS_PREFIX``); 0 before it has published.

    The same numbers ``/stats`` serves, without the API server in the way: while it relays a
    long stream on a starved box, it answers ``/stats`` seconds late (measured up to 8.4 s),
    long enough for a 4,000-token stream to end unseen."""
    reader = SnapshotReader(snapshot_path(stats_prefix, 0))
    try:
        record = reader.read()
    except SnapshotError:
        return 0
    finally:
        reader.close()
    return 0 if record is None else record.stats.num_running + record.stats.num_waiting
