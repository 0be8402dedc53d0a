"""Fault injection against real processes: the gateway (CLI child process) in front of two fake
vLLM backends, each a process of its own (``bench.fake_backend_server``), under steady
streaming load.

Faults: SIGKILL mid-stream, a replica that dies (or ends the stream empty) after a stream's
headers but before its first byte, SIGSTOP of the whole replica (then SIGCONT), a frozen
engine heartbeat, slow ``/stats``, malformed ``/stats`` (deeply nested JSON, NaN, wrong
schema, a NaN in stock ``/metrics``, an error status), a flapping replica and a replica
restarted on the same port. For each the test asserts what a user would notice:

* every request gets exactly one answer or one explicit error (an SSE error event then
  ``[DONE]`` for a stream that broke, an OpenAI-shaped error otherwise), never a hang;
* nothing is generated twice: each backend's own record (``start/done/abort ID`` lines, kept
  across kills) has every request id completed at most once, on the backend the client saw;
* new requests stop going to the broken replica within a generous bound (the target is 2 s;
  the measured value is printed, run with ``-s``), and it is used again once it recovers.

Real vLLM replicas (engine frozen on its own, upstream aborts) are in ``test_faults_vllm.py``.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.faultload import (
    MetricsTimeline,
    Outcome,
    TrackedLoad,
    metric_sum,
    parse_metrics,
    tracked_stream,
)
from bench.processes import PortAllocator
from tests.fault_support import FakeProc, LoadRun, background_load, fake_procs, measured, wait_for
from tests.gateway_support import gateway_config, run_gateway_process

pytestmark = pytest.mark.slow

MODEL = "tiny"
ROUTING: dict[str, Any] = {
    "policy": "round_robin",
    "poll_interval_s": 0.1,
    "poll_timeout_s": 0.5,
    "stale_after_s": 1.0,
    "eject_after_failures": 3,
}
HEADER_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 2.0
PROXY: dict[str, Any] = {
    "connect_timeout_s": 1.0,
    "stream_header_timeout_s": HEADER_TIMEOUT_S,
    "stream_idle_timeout_s": IDLE_TIMEOUT_S,
    "total_timeout_s": 30.0,
}
# 16 tokens at 50 ms: streams last ~0.8 s, so several are open on each backend at any time.
FAKE_ARGS = ("--chunk-delay-s", "0.05")
MAX_TOKENS = 16
AVOID_BOUND_S = 5.0
"""Generous "does not keep routing there" bound; the target (2 s) is what gets reported."""


@dataclass
class Fleet:
    gateway: str
    fakes: list[FakeProc]

    def metrics(self) -> dict[Any, float]:
        return parse_metrics(httpx.get(f"{self.gateway}/metrics", timeout=5.0).text)

    def healthy(self, fake: FakeProc) -> bool:
        return metric_sum(self.metrics(), "sal_backend_healthy", backend=fake.url) == 1.0


def _start(
    stack: ExitStack, tmp_path: Path, routing: dict[str, Any]
) -> tuple[Fleet, subprocess.Popen[bytes]]:
    """Two fake backends and the gateway (its process too), stopped when `stack` closes."""
    ports = PortAllocator(21000, 21999)
    fake_ports = [ports.take(), ports.take()]
    gw_port = ports.take()
    fakes = stack.enter_context(fake_procs(tmp_path, fake_ports, *FAKE_ARGS))
    config = gateway_config(
        gw_port,
        [f.url for f in fakes],
        tokenizer=None,
        extra={"routing": routing, "proxy": PROXY, "log_level": "warning"},
    )
    url, proc = stack.enter_context(run_gateway_process(config))
    return Fleet(url, fakes), proc


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with ExitStack() as stack:
        yield _start(stack, tmp_path, ROUTING)[0]


def _load(fleet: Fleet, prefix: str) -> tuple[TrackedLoad, MetricsTimeline]:
    load = TrackedLoad(
        fleet.gateway,
        model=MODEL,
        rate_per_s=10.0,
        concurrency=32,
        max_tokens=MAX_TOKENS,
        hang_s=20.0,
        id_prefix=prefix,
    )
    return load, MetricsTimeline(fleet.gateway, interval_s=0.1)


def assert_accounted(run: LoadRun, fakes: list[FakeProc]) -> collections.Counter[str]:
    """Every request got exactly one answer or explicit error, and nothing ran twice: a good
    answer was generated to the end on the backend that sent it and nowhere else."""
    outcomes = run.outcomes
    kinds = collections.Counter(o.kind for o in outcomes)
    assert len(outcomes) == run.load.sent, "a request got no outcome"
    assert len({o.request_id for o in outcomes}) == len(outcomes)
    bad = [o for o in outcomes if o.kind in ("lost", "duplicated")]
    assert not bad, f"lost or duplicated: {bad[:5]}"
    done_at: dict[str, list[str]] = collections.defaultdict(list)
    for fake in fakes:
        for (event, request_id), n in fake.records().items():
            if event == "done":
                done_at[request_id] += [fake.name] * n
    twice = {rid: names for rid, names in done_at.items() if len(names) > 1}
    assert not twice, f"generated to the end more than once: {twice}"
    for o in outcomes:
        if o.kind == "ok":
            assert done_at.get(o.request_id) == [o.backend], (o, done_at.get(o.request_id))
        else:
            # A stream cut mid-way may still have been finished into the void by the backend
            # it came from (a stopped process resumed); never by another one.
            assert set(done_at.get(o.request_id, [])) <= {o.backend}, (o, done_at[o.request_id])
    return kinds


def _after(outcomes: list[Outcome], t: float) -> list[Outcome]:
    return [o for o in outcomes if o.sent_s >= t]


def test_sigkill_mid_stream(fleet: Fleet) -> None:
    a, _b = fleet.fakes
    with background_load(*_load(fleet, "kill-")) as run:
        time.sleep(1.5)
        killed_at = time.monotonic()
        a.kill()
        time.sleep(3.0)
    kinds = assert_accounted(run, fleet.fakes)
    broken = [o for o in run.outcomes if o.kind == "error_event"]
    # The streams open on a when it died end with an error event, at once (no timeout).
    assert broken, kinds
    assert all(o.backend == "a" and o.sent_s < killed_at for o in broken), broken
    assert all(o.sent_s + o.latency_s < killed_at + 1.0 for o in broken), broken
    # Requests sent after the kill are answered by b (a connect failure is retried).
    later = _after(run.outcomes, killed_at)
    assert later
    assert all(o.kind == "ok" and o.backend == "b" for o in later), later
    avoid_s = run.timeline.avoid_time_s(a.url, killed_at)
    assert avoid_s <= AVOID_BOUND_S
    measured("SIGKILL mid-stream (fake)", avoid_s=avoid_s, error_events=len(broken), **kinds)


async def _streams_one_by_one(gateway: str, prefix: str, n: int) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=20.0) as client:
        return [
            await tracked_stream(
                client, gateway, model=MODEL, request_id=f"{prefix}{i}", max_tokens=MAX_TOKENS
            )
            for i in range(n)
        ]


@pytest.mark.parametrize(("mode", "reason"), [("exit", "closed"), ("empty", "empty")])
def test_stream_failing_before_its_first_byte_is_rerouted(
    fleet: Fleet, mode: str, reason: str
) -> None:
    """The replica sends a stream's headers, then dies (``exit``: the process is gone) or
    ends the stream without content (``empty``). The client has seen nothing (the gateway
    holds its headers until the first body byte), so the request goes to the other replica:
    one whole answer, generated once, no error."""
    a, b = fleet.fakes
    a.fault(fail_after_headers=mode)
    outcomes = asyncio.run(_streams_one_by_one(fleet.gateway, f"{mode}-", 6))
    samples = fleet.metrics()
    kinds = collections.Counter(o.kind for o in outcomes)
    assert all(o.kind == "ok" and o.backend == "b" for o in outcomes), outcomes
    records = a.records()
    started_on_a = {rid for (event, rid) in records if event == "start"}
    assert started_on_a, "round robin never tried a"
    assert not any(event == "done" for (event, _rid) in records)
    done_on_b = collections.Counter(
        {rid: n for (event, rid), n in b.records().items() if event == "done"}
    )
    assert done_on_b == collections.Counter(o.request_id for o in outcomes)  # each once
    failures = metric_sum(samples, "sal_first_byte_failures_total", backend=a.url, reason=reason)
    assert failures == len(started_on_a)
    assert metric_sum(samples, "sal_retries_total", backend=a.url) >= len(started_on_a)
    assert metric_sum(samples, "sal_stream_errors_total") == 0
    if mode == "exit":
        assert a.proc is not None
        assert a.proc.wait(timeout=5) == 17
    rerouted = [o for o in outcomes if o.request_id in started_on_a]
    measured(
        f"dies before first byte, {mode} (fake)",
        rerouted=len(rerouted),
        rerouted_latency_max_s=max(o.latency_s for o in rerouted),
        **kinds,
    )


def test_replica_restarted_on_same_port_is_used_again(fleet: Fleet) -> None:
    a, _b = fleet.fakes
    with background_load(*_load(fleet, "restart-")) as run:
        time.sleep(0.5)
        a.kill()
        wait_for(lambda: not fleet.healthy(a), what="a ejected")
        restarted_at = time.monotonic()
        a.start()  # same port, fresh process
        readmit_s = wait_for(lambda: fleet.healthy(a), what="a readmitted")
        time.sleep(2.0)
    kinds = assert_accounted(run, fleet.fakes)
    served_by_new_a = [o for o in _after(run.outcomes, restarted_at) if o.backend == "a"]
    assert served_by_new_a
    assert all(o.kind == "ok" for o in served_by_new_a)
    measured("restart on same port (fake)", readmit_s=readmit_s, **kinds)


def test_sigstop_whole_replica_then_sigcont(fleet: Fleet) -> None:
    a, _b = fleet.fakes
    with background_load(*_load(fleet, "stop-")) as run:
        time.sleep(1.5)
        stopped_at = time.monotonic()
        a.signal(signal.SIGSTOP)
        try:
            time.sleep(4.0)
        finally:
            a.signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        readmit_s = wait_for(lambda: fleet.healthy(a), what="a readmitted")
        time.sleep(2.0)
    kinds = assert_accounted(run, fleet.fakes)
    # Streams open on a when it froze end with an error event after the idle timeout.
    broken = [o for o in run.outcomes if o.kind == "error_event"]
    assert broken
    assert all(o.backend == "a" and o.sent_s < stopped_at for o in broken), broken
    assert all(o.latency_s < IDLE_TIMEOUT_S + 2.0 for o in broken), broken
    # New requests never hang: those routed to a before it was avoided are retried after the
    # header timeout and answered by b.
    frozen = [o for o in run.outcomes if stopped_at <= o.sent_s < resumed_at]
    assert frozen
    # Only the offenders in the message (the whole list is truncated in a failure report).
    wrong = [o for o in frozen if not (o.kind == "ok" and o.backend == "b")]
    assert not wrong, (stopped_at, resumed_at, wrong)
    assert max(o.latency_s for o in frozen) < HEADER_TIMEOUT_S + 3.0
    avoid_s = run.timeline.avoid_time_s(a.url, stopped_at, resumed_at)
    assert avoid_s <= AVOID_BOUND_S
    retried = sum(1 for o in frozen if o.latency_s > HEADER_TIMEOUT_S)
    assert any(o.backend == "a" for o in _after(run.outcomes, resumed_at + readmit_s))
    measured(
        "SIGSTOP whole replica (fake)",
        avoid_s=avoid_s,
        error_events=len(broken),
        retried_after_header_timeout=retried,
        readmit_after_sigcont_s=readmit_s,
        **kinds,
    )


def test_frozen_engine_heartbeat_is_avoided(fleet: Fleet) -> None:
    """As vLLM with its engine stopped: the API server keeps serving the last snapshot on
    ``/stats``, accepts requests and sends their headers, then nothing. The gateway must not
    take the replica for an idle one."""
    a, _b = fleet.fakes
    with background_load(*_load(fleet, "frozen-")) as run:
        time.sleep(1.0)
        frozen_at = time.monotonic()
        a.fault(engine_frozen=True, stall_after_chunks=0)
        time.sleep(IDLE_TIMEOUT_S + 2.0)
        samples = fleet.metrics()
        thawed_at = time.monotonic()
        a.fault(engine_frozen=False, stall_after_chunks=None)
        readmit_s = wait_for(lambda: fleet.healthy(a), what="a readmitted")
        time.sleep(1.0)
    kinds = assert_accounted(run, fleet.fakes)
    assert metric_sum(samples, "sal_backend_healthy", backend=a.url) == 0.0
    assert metric_sum(samples, "sal_backend_progress_age_seconds", backend=a.url) > 1.0
    avoid_s = run.timeline.avoid_time_s(a.url, frozen_at, thawed_at)
    assert avoid_s <= AVOID_BOUND_S
    # Streams on a (open, or sent before it was avoided) end with an error event after the
    # idle timeout; everything sent later is answered by b.
    broken = [o for o in run.outcomes if o.kind != "ok"]
    assert all(o.kind == "error_event" for o in broken), broken
    assert all(o.sent_s < frozen_at + avoid_s + 0.2 for o in broken), broken
    assert all(o.latency_s < IDLE_TIMEOUT_S + 2.0 for o in broken), broken
    late = [o for o in run.outcomes if frozen_at + avoid_s + 0.2 < o.sent_s]
    assert late
    assert all(o.kind == "ok" for o in late)
    # Read after the load: a stream sent just before a was avoided is cut an idle bound
    # later, possibly after `samples` was taken.
    idle_cuts = metric_sum(fleet.metrics(), "sal_stream_timeouts_total", backend=a.url, kind="idle")
    assert idle_cuts == len(broken)
    measured(
        "frozen engine heartbeat (fake)",
        avoid_s=avoid_s,
        readmit_s=readmit_s,
        idle_timeouts=int(idle_cuts),
        **kinds,
    )


def test_slow_stats(fleet: Fleet) -> None:
    a, _b = fleet.fakes
    # Slower than usual but inside the poll timeout: still a healthy replica.
    a.fault(stats_delay_s=0.2)
    time.sleep(1.5)
    # Waited for: a loaded CI machine can starve a past stale_after_s (1 s) at any one read.
    wait_for(lambda: fleet.healthy(a), what="a healthy with 0.2 s /stats")
    with background_load(*_load(fleet, "slow-")) as run:
        time.sleep(0.5)
        slowed_at = time.monotonic()
        a.fault(stats_delay_s=2.0)  # beyond poll_timeout_s
        time.sleep(3.0)
        samples = fleet.metrics()
        fast_at = time.monotonic()
        a.fault(stats_delay_s=0.0)
        readmit_s = wait_for(lambda: fleet.healthy(a), what="a readmitted")
    kinds = assert_accounted(run, fleet.fakes)
    assert kinds["ok"] == len(run.outcomes), kinds
    assert metric_sum(samples, "sal_backend_healthy", backend=a.url) == 0.0
    assert metric_sum(samples, "sal_poll_errors_total", backend=a.url, reason="timeout") >= 1
    avoid_s = run.timeline.avoid_time_s(a.url, slowed_at, fast_at)
    assert avoid_s <= AVOID_BOUND_S
    measured("slow /stats (fake)", avoid_s=avoid_s, readmit_s=readmit_s, **kinds)


@pytest.mark.parametrize(
    ("mode", "reasons"),
    [
        ("nested", {"bad_body"}),
        ("nan", {"bad_body", "schema"}),
        ("schema", {"schema"}),
        ("status_503", {"http_status"}),
        ("stock_nan", {"bad_body", "schema"}),
    ],
)
def test_malformed_stats(fleet: Fleet, mode: str, reasons: set[str]) -> None:
    a, _b = fleet.fakes
    with background_load(*_load(fleet, f"{mode}-")) as run:
        time.sleep(0.5)
        broken_at = time.monotonic()
        a.fault(stats_mode=mode)
        wait_for(lambda: not fleet.healthy(a), timeout_s=AVOID_BOUND_S, what="a ineligible")
        # The gateway stays responsive while its poller chews on the body.
        health_s = []
        for _ in range(10):
            started = time.monotonic()
            assert httpx.get(f"{fleet.gateway}/health", timeout=5.0).status_code == 200
            health_s.append(time.monotonic() - started)
            time.sleep(0.1)
        samples = fleet.metrics()
        fixed_at = time.monotonic()
        a.fault(stats_mode="ok")
        # The poll loop survived: the replica comes back.
        readmit_s = wait_for(lambda: fleet.healthy(a), what="a readmitted")
        time.sleep(1.0)
    kinds = assert_accounted(run, fleet.fakes)
    assert kinds["ok"] == len(run.outcomes), kinds
    assert max(health_s) < 1.0
    by_reason = {
        r: metric_sum(samples, "sal_poll_errors_total", backend=a.url, reason=r)
        for r in ("timeout", "connect", "http_status", "bad_body", "schema", "internal")
    }
    assert sum(by_reason[r] for r in reasons) >= 1, by_reason
    assert by_reason["internal"] == 0, by_reason
    avoid_s = run.timeline.avoid_time_s(a.url, broken_at, fixed_at)
    assert avoid_s <= AVOID_BOUND_S
    measured(
        f"malformed /stats {mode} (fake)",
        avoid_s=avoid_s,
        readmit_s=readmit_s,
        poll_errors=",".join(f"{r}:{int(v)}" for r, v in by_reason.items() if v),
        **kinds,
    )


def test_flapping_replica(fleet: Fleet) -> None:
    a, _b = fleet.fakes
    with background_load(*_load(fleet, "flap-")) as run:
        for _ in range(3):
            time.sleep(1.0)
            a.kill()
            time.sleep(0.7)
            a.start()
        readmit_s = wait_for(lambda: fleet.healthy(a), what="a readmitted")
        time.sleep(2.0)
    kinds = assert_accounted(run, fleet.fakes)
    broken = [o for o in run.outcomes if o.kind != "ok"]
    assert all(o.kind == "error_event" and o.backend == "a" for o in broken), broken
    # Waited for: a loaded CI machine can starve a past stale_after_s (1 s) at any one read.
    wait_for(lambda: fleet.healthy(a), what="a healthy after the flapping")
    measured("flapping replica (fake)", readmit_s=readmit_s, **kinds)


def _served(fleet: Fleet, fake: FakeProc) -> float:
    return metric_sum(fleet.metrics(), "sal_requests_total", backend=fake.url, status="200")


@pytest.mark.parametrize("peer", ["healthy", "frozen"])
def test_requests_that_arrive_while_the_gateway_is_stalled_are_served(
    tmp_path: Path, peer: str
) -> None:
    """The gateway's own process is not scheduled for 3 s (SIGSTOP: as a CPU-throttled
    container or a paused VM) while clients keep sending. When it runs again every backend
    looks stale (its pollers did not run either: `stale_after_s` 1 s, degraded routing off),
    so the requests that queued meanwhile would get 503s; the gateway waits at most one poll
    round for its pollers and serves them. With the other backend frozen (SIGSTOP, ejected
    before the stall), its poll that timed out during the stall is booked first, on time: the
    live backend alone being overdue is enough to wait (a CI run lost a request so, with a
    frozen vLLM API server beside a healthy one). The live backend's own poll in flight when
    the stall began is answered during it, and is a good poll, not a timeout (a timeout had
    left it stale with its poller on time: 3 of 8 got a 503 in a CI run)."""
    with ExitStack() as stack:
        # A frozen backend's polls back off at most one interval: one is nearly always in
        # flight, so it times out (and is booked, on time) as soon as the gateway runs again.
        routing = {**ROUTING, "degraded_max_progress_age_s": 0.0, "poll_backoff_max_s": 0.1}
        stalled, proc = _start(stack, tmp_path, routing)
        url = stalled.gateway
        frozen, live = stalled.fakes
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10.0).status_code == 200
        if peer == "frozen":
            frozen.signal(signal.SIGSTOP)
            wait_for(lambda: not stalled.healthy(frozen), what="the frozen backend ejected")
            time.sleep(1.0)  # its failing polls on their backoff
        live_before = _served(stalled, live)
        answers: list[httpx.Response] = []

        def client() -> None:
            answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30.0))

        proc.send_signal(signal.SIGSTOP)
        try:
            senders = [threading.Thread(target=client) for _ in range(8)]
            for sender in senders:
                sender.start()
                time.sleep(0.2)
            time.sleep(1.5)  # 3 s stalled in all, the requests waiting in its socket queue
        finally:
            proc.send_signal(signal.SIGCONT)
        for sender in senders:
            sender.join(timeout=30.0)
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
        served = parse_metrics(httpx.get(f"{url}/metrics", timeout=5.0).text)
        assert metric_sum(served, "sal_requests_total", status="503") == 0
        if peer == "frozen":  # all by the live backend
            assert _served(stalled, live) - live_before == 8


def test_streams_that_flow_across_a_gateway_stall_are_not_cut(tmp_path: Path) -> None:
    """The gateway's process is not scheduled for 3 s, longer than the idle bound (2 s),
    while 4 streams run (3 s each: 60 tokens at 50 ms) and 4 more are sent. The backends
    keep writing meanwhile; when the gateway runs again their bytes are in its sockets
    beside the expired idle timers. Every stream ends normally with all its tokens, none is
    cut (`stall_guard`: before it, the streams open during the stall ended with error
    events at its end), and the ones sent during the stall are served."""
    tokens = 60
    with ExitStack() as stack:
        stalled, proc = _start(stack, tmp_path, ROUTING)

        async def scenario() -> list[Outcome]:
            async with httpx.AsyncClient(timeout=30.0) as client:

                def stream(n: int) -> Awaitable[Outcome]:
                    return tracked_stream(
                        client,
                        stalled.gateway,
                        model=MODEL,
                        request_id=f"s{n}",
                        max_tokens=tokens,
                        hang_s=30.0,
                    )

                running = [asyncio.ensure_future(stream(n)) for n in range(4)]
                await asyncio.sleep(0.5)  # well inside the streams
                proc.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(0.5)
                    sent_during = [asyncio.ensure_future(stream(n)) for n in range(4, 8)]
                    await asyncio.sleep(2.5)
                finally:
                    proc.send_signal(signal.SIGCONT)
                return list(await asyncio.gather(*running, *sent_during))

        outcomes = asyncio.run(scenario())
        assert [o.kind for o in outcomes] == ["ok"] * 8, outcomes
        served = stalled.metrics()
        assert metric_sum(served, "sal_stream_timeouts_total") == 0
        assert metric_sum(served, "sal_retries_total") == 0
