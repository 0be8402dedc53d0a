"""SIGTERM to the gateway process: the drain sequence (`sal_gateway.drain`), end to end.

A rolling update stops each old gateway with SIGTERM. Before the drain, uvicorn cut every
request still running 5 s after the signal as a broken connection (measured: a 10 s stream
started 2 s before the signal died at 7.2 s with "incomplete chunked read", no error event).

Fake replicas (processes of their own) behind the gateway (a process): model ``tiny`` streams
a token every 0.25 s, model ``slow`` never answers (until its client goes away). What a user
would notice if it broke: streams of a rolling update cut although they would have finished
within the grace, ``/ready`` still 200 while draining (the load balancer keeps sending),
requests refused during the delay, a stream that outlasts the grace ending as a broken
connection instead of an error event, a waiting request getting no answer, vLLM generating on
for requests nobody will read, or the process not exiting.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.processes import PortAllocator
from tests.fault_support import FakeProc, fake_procs, wait_for
from tests.gateway_support import gateway_config, metric, run_gateway_process, scrape_metrics

pytestmark = pytest.mark.slow

TOKEN_S = 0.25
"""Seconds between two tokens of a ``tiny`` stream."""


@dataclass
class Stream:
    """One streamed completion read in a thread: its data lines and how it ended."""

    gateway: str
    tokens: int
    user: str
    lines: list[str] = field(default_factory=list)
    error: str | None = None
    ended_s: float | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": self.tokens,
            "stream": True,
            "user": self.user,
        }
        try:
            with httpx.stream(
                "POST", f"{self.gateway}/v1/completions", json=body, timeout=90.0
            ) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended_s = time.monotonic()

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(timeout=90.0)
        assert not self.thread.is_alive()

    def tokens_received(self) -> int:
        return sum(1 for line in self.lines if '"text"' in line)


@dataclass
class Fleet:
    url: str
    proc: subprocess.Popen[bytes]
    tiny: FakeProc
    slow: FakeProc


def _fleet(
    tmp: Path,
    stack: ExitStack,
    listen: dict[str, float],
    limits: dict[str, int] | None = None,
) -> Fleet:
    ports = PortAllocator(22800, 22900)
    for sub in ("tiny", "slow"):
        (tmp / sub).mkdir()
    (tiny,) = stack.enter_context(fake_procs(tmp / "tiny", [ports.take()]))
    (slow,) = stack.enter_context(fake_procs(tmp / "slow", [ports.take()], "--model", "slow"))
    tiny.fault(chunk_delay_s=TOKEN_S)
    slow.fault(hang=True)  # answers nothing until its client goes away
    config = gateway_config(ports.take(), [tiny.url], tokenizer=None)
    config["models"].append({"name": "slow", "backends": [slow.url]})
    config["listen"].update(listen)
    if limits:
        config.setdefault("limits", {}).update(limits)
    url, proc = stack.enter_context(run_gateway_process(config))
    return Fleet(url, proc, tiny, slow)


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the gateway's log is copied when it stops."""
    keep = tmp_path / "logs"
    monkeypatch.setenv("SAL_TEST_KEEP_LOGS", str(keep))
    return keep


def test_drain_serves_during_the_delay_and_ends_what_outlasts_the_grace_cleanly(
    tmp_path: Path, logs: Path
) -> None:
    # A delay of 3 s: on a loaded CI machine the request sent once /ready says 503 must
    # still arrive within it.
    delay_s, grace_s = 3.0, 3.0
    with ExitStack() as stack:
        fleet = _fleet(tmp_path, stack, {"shutdown_delay_s": delay_s, "shutdown_grace_s": grace_s})
        fake_slow = fleet.slow
        long = Stream(fleet.url, 200, "long").start()  # 50 s of tokens: outlasts the grace
        short = Stream(fleet.url, 10, "short").start()  # 2.5 s: ends within the grace
        waiting: dict[str, httpx.Response] = {}

        def non_streamed() -> None:
            body = {"model": "slow", "prompt": "hi", "max_tokens": 2, "user": "waiting"}
            waiting["resp"] = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60.0)

        waiter = threading.Thread(target=non_streamed, daemon=True)
        waiter.start()
        wait_for(lambda: long.tokens_received() >= 2 and short.tokens_received() >= 1)
        signalled_s = time.monotonic()
        fleet.proc.send_signal(signal.SIGTERM)

        # The delay: not ready any more, but still serving. Waited for, not slept for: the
        # gateway may run its signal handler late on a loaded machine.
        def draining() -> bool:
            ready = httpx.get(f"{fleet.url}/ready", timeout=5.0)
            return ready.status_code == 503 and ready.json()["draining"] is True

        wait_for(draining, 10.0, "/ready 503 draining after SIGTERM")
        during = httpx.post(
            f"{fleet.url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            timeout=10.0,
        )
        assert during.status_code == 200
        short.join()
        long.join()
        waiter.join(timeout=60.0)
        exit_code = fleet.proc.wait(timeout=30.0)
        exited_s = time.monotonic() - signalled_s
        print(
            f"\ndrain: long stream ended {long.ended_s - signalled_s:.1f} s after SIGTERM "
            f"(delay {delay_s} + grace {grace_s}), process exited at {exited_s:.1f} s"
        )
        # Ended within the grace: whole, no error.
        assert short.error is None
        assert short.tokens_received() == 10
        assert short.lines[-1] == "[DONE]"
        # Outlasted it: an error event the client can read, then [DONE]; no broken connection.
        assert long.error is None, long.error
        assert long.lines[-1] == "[DONE]"
        error = json.loads(long.lines[-2])["error"]
        assert error["code"] == "gateway_shutdown"
        assert 0 < long.tokens_received() < 200
        # Unanswered: a 503 saying why.
        resp = waiting["resp"]
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "gateway_shutdown"
        assert exit_code in (0, -signal.SIGTERM)
        # vLLM (here the fakes) stopped generating for both.
        wait_for(lambda: fleet.tiny.records()[("abort", "long")] == 1, 10.0, "long aborted")
        wait_for(lambda: fake_slow.records()[("abort", "waiting")] == 1, 10.0, "waiting aborted")
    log = "\n".join(p.read_text(errors="replace") for p in logs.iterdir())
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log


def test_with_the_defaults_a_stream_running_at_sigterm_finishes_whole(tmp_path: Path) -> None:
    with ExitStack() as stack:
        fleet = _fleet(tmp_path, stack, {})
        stream = Stream(fleet.url, 32, "whole").start()  # 8 s of tokens
        wait_for(lambda: stream.tokens_received() >= 2)
        fleet.proc.send_signal(signal.SIGTERM)
        stream.join()
        assert fleet.proc.wait(timeout=30.0) in (0, -signal.SIGTERM)
    assert stream.error is None, stream.error
    assert stream.tokens_received() == 32
    assert stream.lines[-1] == "[DONE]"


def test_with_two_workers_sigterm_lets_both_workers_finish_their_streams(tmp_path: Path) -> None:
    """``listen.workers``: the supervisor forwards SIGTERM and every worker drains its own
    streams. Streams are opened (one connection each) until both workers carry one, as each
    worker's own ``/metrics`` port shows; all must end whole after the signal."""
    ports = PortAllocator(22950, 22999)
    first = ports.take()
    own = [first, ports.take()]
    assert own[1] == first + 1, "need two consecutive free ports"
    with ExitStack() as stack:
        fleet = _fleet(
            tmp_path,
            stack,
            {"workers": 2, "worker_ports_from": first},
            limits={"body_workers": 1},
        )
        workers = [f"http://127.0.0.1:{port}" for port in own]
        for worker in workers:  # each worker ready on its own port (it polled the fakes)
            wait_for(lambda w=worker: httpx.get(f"{w}/ready", timeout=2.0).status_code == 200)
        streams: list[Stream] = []

        def carrying() -> list[float]:
            return [metric(scrape_metrics(w), "sal_backend_in_flight") for w in workers]

        while min(carrying()) < 1:
            assert len(streams) < 16, f"16 connections, all on one worker: {carrying()}"
            stream = Stream(fleet.url, 32, f"w{len(streams)}").start()  # 8 s of tokens
            streams.append(stream)
            wait_for(lambda s=stream: s.tokens_received() >= 1 or s.ended_s is not None)
        fleet.proc.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.join()
        assert fleet.proc.wait(timeout=30.0) in (0, -signal.SIGTERM)
    print(f"\nworkers drain: {len(streams)} streams over 2 workers, all ended")
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.tokens_received() == 32, (stream.user, stream.lines[-3:])
        assert stream.lines[-1] == "[DONE]"
