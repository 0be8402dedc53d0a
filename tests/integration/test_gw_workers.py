"""``listen.workers``: several gateway processes share one port (`sal_gateway.workers`).

The gateway runs as a user runs it (the CLI in a child process) with two workers in front of
two fake backends (processes of their own). What a user would notice if it broke: requests
on the shared port are answered by both workers (the kernel spreads connections), each
worker polls the backends itself, each worker's own port serves its ``/metrics``, and the
workers' counters add up to exactly the requests sent; SIGTERM stops every worker; with
``listen.share_accounting`` (the default) a worker routes knowing what the other worker has in
flight and which LoRA slots its requests just took, and without it it does not.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from bench.processes import PortAllocator
from tests.fault_support import fake_procs
from tests.gateway_support import (
    gateway_config,
    metric,
    run_gateway,
    scrape_metrics,
    serve_refused,
)
from tests.herding_support import (
    SHORT_REQUESTS,
    route_short_requests,
    short_body,
    slow_backends,
    streams_held_on_a,
)

pytestmark = pytest.mark.slow

REQUESTS = 48


def _ports() -> tuple[list[int], int, list[int]]:
    """Two fake backends' ports, the shared port, and the two workers' own (consecutive)."""
    ports = PortAllocator(22000, 22999)
    fake_ports = [ports.take(), ports.take()]
    gw_port = ports.take()
    first_own = ports.take()
    own = [first_own, ports.take()]
    assert own[1] == first_own + 1, "need two consecutive free ports"
    return fake_ports, gw_port, own


def _two_workers(
    gw_port: int, own: list[int], backends: list[str], policy: str, **listen: object
) -> dict[str, object]:
    """A gateway config with two workers (one body worker each) in front of `backends`."""
    config = gateway_config(
        gw_port,
        backends,
        tokenizer=None,
        policy=policy,
        extra={
            "listen": {
                "host": "127.0.0.1",
                "port": gw_port,
                "workers": 2,
                "worker_ports_from": own[0],
                **listen,
            },
            "limits": {"body_workers": 1},
            "log_level": "warning",
        },
    )
    # A loaded CI machine can starve a replica past 1 s: staleness is not under test here.
    config["routing"]["stale_after_s"] = 5.0
    return config


def _ready(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"worker port {port} never became ready")


def test_two_workers_share_the_port_and_their_metrics_add_up(tmp_path: Path) -> None:
    fake_ports, gw_port, own = _ports()
    with fake_procs(tmp_path, fake_ports) as fakes:
        config = _two_workers(gw_port, own, [f.url for f in fakes], "sal_near")
        with run_gateway(config) as url:
            for port in own:  # each worker answers on its own port, once it polled a backend
                _ready(port)
            # A new connection per request, so the kernel spreads them over the workers.
            limits = httpx.Limits(max_keepalive_connections=0)
            with httpx.Client(timeout=30.0, limits=limits) as client:
                for i in range(REQUESTS):
                    resp = client.post(f"{url}/v1/completions", json=short_body(i))
                    assert resp.status_code == 200, resp.text
            per_worker = [scrape_metrics(f"http://127.0.0.1:{p}") for p in own]
            served = [metric(m, "sal_requests_total") for m in per_worker]
            assert sum(served) == REQUESTS
            assert min(served) > 0, served  # P(all 48 on one worker) = 2^-47 per run
            for samples in per_worker:  # every worker polls every backend itself
                for fake in fakes:
                    assert metric(samples, "sal_backend_healthy", backend=fake.url) == 1.0


def test_a_bad_worker_count_is_a_config_error(tmp_path: Path) -> None:
    done = serve_refused(
        "listen: {port: 8080, workers: 2, worker_ports_from: 8079}\n"
        "models: [{name: tiny, backends: ['http://127.0.0.1:9']}]\n",
        tmp_path,
    )
    assert "listen.worker_ports_from" in done.stderr


def test_a_worker_that_cannot_bind_stops_the_set_with_one_line(tmp_path: Path) -> None:
    ports = PortAllocator(22000, 22999)
    gw_port, taken_port = ports.take(), ports.take()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", taken_port))
        squatter.listen()
        done = serve_refused(
            f"listen: {{host: 127.0.0.1, port: {gw_port}, workers: 2, "
            f"worker_ports_from: {taken_port}}}\n"
            "models: [{name: tiny, backends: ['http://127.0.0.1:9']}]\n",
            tmp_path,
        )
    assert f"cannot bind 127.0.0.1:{taken_port}" in done.stderr
    assert "stopping the other workers" in done.stderr


@pytest.mark.parametrize("share", [True, False], ids=["shared", "separate"])
def test_a_worker_routes_knowing_what_the_other_worker_has_in_flight(
    tmp_path: Path, share: bool
) -> None:
    """Worker 0 holds four long streams on replica a, then eight short requests go through
    worker 1 while both replicas report the same idle queue (`tests.herding_support`).
    Sharing, worker 1 sees a's four streams and sends every request to b; on separate
    accounting it sees none and sends every one to a, the first on a tie: what K
    independent gateways do (they herd)."""
    fake_ports, gw_port, own = _ports()
    with fake_procs(tmp_path, fake_ports) as (a, b):
        slow_backends(a, b)
        config = _two_workers(gw_port, own, [a.url, b.url], "sal", share_accounting=share)
        with run_gateway(config):
            for port in own:
                _ready(port)
            worker0, worker1 = (f"http://127.0.0.1:{p}" for p in own)
            with streams_held_on_a(worker0, b, observer=worker1):
                chosen = route_short_requests(worker1)
    expected = "b" if share else "a"
    assert chosen == [expected] * SHORT_REQUESTS, chosen


@pytest.mark.parametrize("share", [True, False])
def test_a_worker_counts_the_lora_slot_the_other_worker_just_filled(
    tmp_path: Path, share: bool
) -> None:
    """Each replica has one LoRA slot, free in every snapshot. Worker 0 streams lora-a; then
    worker 1 routes lora-b by round robin, whose first pick is the replica lora-a took.
    Sharing, worker 1 counts that slot as taken and sends lora-b to the other replica
    (where vLLM can start it now); on separate accounting it sends lora-b into the full
    slot, where vLLM would make it wait for lora-a's stream to end. The fakes' snapshots
    never show lora-a running, and ``routing.accounting_grace_s`` keeps its request
    unacknowledged for the test's length, so only the workers' shared accounting can tell."""
    fake_ports, gw_port, own = _ports()
    adapters = ("--adapter", "lora-a", "--adapter", "lora-b")
    with fake_procs(tmp_path, fake_ports, *adapters) as fakes:
        for fake in fakes:
            fake.fault(chunk_delay_s=0.2, stats={"max_loras": 1, "lora_running": []})
        config = _two_workers(
            gw_port, own, [f.url for f in fakes], "round_robin", share_accounting=share
        )
        config["routing"]["accounting_grace_s"] = 60.0
        with run_gateway(config):
            for port in own:
                _ready(port)
            worker0, worker1 = (f"http://127.0.0.1:{p}" for p in own)
            body = {"model": "lora-a", "prompt": "long", "max_tokens": 1000, "stream": True}
            with httpx.stream("POST", f"{worker0}/v1/completions", json=body, timeout=60) as held:
                assert held.status_code == 200
                took = held.headers["x-fake-backend"]
                short = {"model": "lora-b", "prompt": "hi", "max_tokens": 2}
                resp = httpx.post(f"{worker1}/v1/completions", json=short, timeout=30)
                assert resp.status_code == 200, resp.text
                chosen = resp.headers["x-fake-backend"]
                steered = metric(
                    scrape_metrics(worker1), "sal_lora_slot_decisions_total", outcome="steered"
                )
    other = {"a": "b", "b": "a"}[took]
    assert chosen == (other if share else took), (took, chosen)
    assert (steered or 0.0) == (1.0 if share else 0.0)


def _queue_seen(worker: str, url: str, queued: float) -> None:
    """Wait until `worker` reports `queued` prefill tokens on backend `url`."""
    deadline = time.monotonic() + 30
    seen = None
    while time.monotonic() < deadline:
        seen = metric(scrape_metrics(worker), "sal_backend_queued_prefill_tokens", backend=url)
        if seen == queued:
            return
        time.sleep(0.1)
    pytest.fail(f"{worker} saw {seen} queued tokens on {url}, not {queued}")


@pytest.mark.parametrize("share", [True, False])
def test_a_conversation_follows_its_prefix_whichever_worker_its_turns_reach(
    tmp_path: Path, share: bool
) -> None:
    """Turn 1 of a conversation goes through worker 0 while replica a looks busy, so it runs
    on b; then both replicas look idle and turn 2 (turn 1 plus a new message) goes through
    worker 1, as when a client's connections reach different workers. Worker 1 never routed
    turn 1: told by worker 0 (``listen.share_prefix_index``, the default) it sends turn 2
    where its 100 blocks are cached, b; on its own it sees an idle tie and sends it to a,
    which would prefill the whole conversation again."""
    fake_ports, gw_port, own = _ports()
    turn1 = list(range(1000, 1000 + 100 * 16 + 3))  # past routing.prefix_min_match_tokens
    turn2 = [*turn1, *range(50, 90)]
    with fake_procs(tmp_path, fake_ports) as (a, b):
        for fake in (a, b):
            fake.fault(stats={"prefix_caching": True, "prefix_hash_algo": "sha256"})
        a.fault(stats={"queued_prefill_tokens": 50_000})
        config = _two_workers(gw_port, own, [a.url, b.url], "sal", share_prefix_index=share)
        with run_gateway(config):
            for port in own:
                _ready(port)
            worker0, worker1 = (f"http://127.0.0.1:{p}" for p in own)
            _queue_seen(worker0, a.url, 50_000)
            body = {"model": "tiny", "prompt": turn1, "max_tokens": 2}
            first = httpx.post(f"{worker0}/v1/completions", json=body, timeout=30)
            assert first.status_code == 200, first.text
            assert first.headers["x-fake-backend"] == "b"
            a.fault(stats={"queued_prefill_tokens": 0})
            for url in (a.url, b.url):
                _queue_seen(worker1, url, 0)
            body = {"model": "tiny", "prompt": turn2, "max_tokens": 2}
            second = httpx.post(f"{worker1}/v1/completions", json=body, timeout=30)
            assert second.status_code == 200, second.text
            told = metric(
                scrape_metrics(worker1), "sal_prefix_share_messages_total", outcome="received"
            )
    assert second.headers["x-fake-backend"] == ("b" if share else "a")
    assert told == (2.0 if share else 0.0)  # turn 1 routed, then ended
