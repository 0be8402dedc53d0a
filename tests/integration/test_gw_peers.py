"""``peers``: two gateway processes (as on two hosts) tell each other their accounting.

Each gateway runs as a user runs it (the CLI in a child process), in front of the same two
fake backends (processes of their own), with ``peers`` listing the other gateway's UDP
address and the secret in its environment. What a user would notice if it broke: gateways
that herd (each sends its next requests to the replica the others just filled), a gateway
that keeps counting a dead peer's requests, or one that starts without its secret.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from bench.processes import PortAllocator
from sal_gateway.peer_wire import PeerRow, encode
from tests.fault_support import fake_procs
from tests.gateway_support import (
    gateway_config,
    metric,
    run_gateway_process,
    scrape_metrics,
    serve_refused,
)
from tests.herding_support import (
    SHORT_REQUESTS,
    route_short_requests,
    short_body,
    slow_backends,
    streams_held_on_a,
    wait_until,
)

pytestmark = pytest.mark.slow

SECRET_ENV = {"SAL_GATEWAY_PEERS_SECRET": "a shared secret for the tests"}
EXPIRE_S = 4.0
"""`peers.expire_s` here: a loaded CI machine can leave a gateway unscheduled for over 1 s
(the default), and its peer would forget its streams meanwhile."""
STALE_AFTER_S = 5.0
"""`routing.stale_after_s` here: a loaded CI machine can starve a replica past 1 s (the
default): staleness is not under test here."""


def _unstale(config: dict) -> dict:
    config["routing"]["stale_after_s"] = STALE_AFTER_S
    return config


def _gateway(
    port: int, backends: list[str], peer_port: int, other: int | None, **peers: object
) -> dict:
    extra: dict[str, object] = {"log_level": "warning"}
    if other is not None:
        extra["peers"] = {
            "listen": f"127.0.0.1:{peer_port}",
            "addresses": [f"127.0.0.1:{other}"],
            "expire_s": EXPIRE_S,
            **peers,
        }
    return _unstale(gateway_config(port, backends, tokenizer=None, policy="sal", extra=extra))


@pytest.mark.parametrize("told", [True, False], ids=["peers", "alone"])
def test_a_gateway_routes_knowing_what_the_other_gateway_has_in_flight(
    tmp_path: Path, told: bool
) -> None:
    """Gateway A holds four long streams on replica a, then eight short requests go through
    gateway B while both replicas report the same idle queue (`tests.herding_support`).
    Told by A, B sends every request to b; alone, it sees none of A's streams and sends
    every one to a, the first on a tie: what independent gateways do (they herd). Then A is
    SIGKILLed: B stops counting its streams once `expire_s` has passed without a word."""
    ports = PortAllocator(22000, 22999)
    fake_ports = [ports.take(), ports.take()]
    gw = [ports.take(), ports.take()]
    udp = [ports.take(), ports.take()]
    with fake_procs(tmp_path, fake_ports) as (a, b), ExitStack() as stack:
        slow_backends(a, b)
        backends = [a.url, b.url]
        first, first_proc = stack.enter_context(
            run_gateway_process(
                _gateway(gw[0], backends, udp[0], udp[1] if told else None), env=SECRET_ENV
            )
        )
        second, _ = stack.enter_context(
            run_gateway_process(
                _gateway(gw[1], backends, udp[1], udp[0] if told else None), env=SECRET_ENV
            )
        )
        with streams_held_on_a(first, b, observer=second):
            chosen = route_short_requests(second)
            expected = "b" if told else "a"
            assert chosen == [expected] * SHORT_REQUESTS, chosen
            # Waited for: a heartbeat can come late on a loaded machine.
            wait_until(
                lambda: metric(scrape_metrics(second), "sal_peers_heard") == (1.0 if told else 0.0),
                10,
                "gateway B does not hear as many peers as it was told",
            )
            if told:
                # A dies with its streams open: B forgets them after expire_s and then sends
                # to a again (the tie's first).
                os.kill(first_proc.pid, signal.SIGKILL)
                first_proc.wait(timeout=10)
                wait_until(
                    lambda: metric(scrape_metrics(second), "sal_peers_heard") == 0.0,
                    EXPIRE_S + 10,
                    "gateway B still hears the dead gateway A",
                )
                resp = httpx.post(f"{second}/v1/completions", json=short_body(0), timeout=30.0)
                assert resp.status_code == 200, resp.text
                assert resp.headers.get("x-fake-backend") == "a"
                accepted = metric(
                    scrape_metrics(second), "sal_peer_datagrams_total", result="accepted"
                )
                assert accepted >= 1


def _consecutive(ports: PortAllocator) -> list[int]:
    first = ports.take()
    second = ports.take()
    assert second == first + 1, "need two consecutive free ports"
    return [first, second]


def _two_worker_gateway(
    ports: PortAllocator, backends: list[str], udp: list[int], other_udp: int
) -> tuple[dict, list[str]]:
    """A gateway of two workers sharing their accounting, with `peers` (worker i on UDP
    `udp[i]`), and the URLs of the workers' own ports."""
    shared = ports.take()
    own = _consecutive(ports)
    config = gateway_config(
        shared,
        backends,
        tokenizer=None,
        policy="sal",
        extra={
            "listen": {
                "host": "127.0.0.1",
                "port": shared,
                "workers": 2,
                "worker_ports_from": own[0],
            },
            "limits": {"body_workers": 1},
            "log_level": "warning",
            "peers": {
                "listen": f"127.0.0.1:{udp[0]}",
                "addresses": [f"127.0.0.1:{other_udp}"],
                "expire_s": EXPIRE_S,
            },
        },
    )
    return _unstale(config), [f"http://127.0.0.1:{p}" for p in own]


def test_workers_of_two_gateways_hear_each_other(tmp_path: Path) -> None:
    """Two gateways of two workers each (as two pods with `listen.workers: 2`): worker 1 of
    gateway A holds the streams, worker 0 of gateway B routes, and sends every request to
    b. Each worker has its own UDP port; A's worker 1 sends to both of B's."""
    ports = PortAllocator(22000, 22999)
    fake_ports = [ports.take(), ports.take()]
    udp_a, udp_b = _consecutive(ports), _consecutive(ports)
    with fake_procs(tmp_path, fake_ports) as (a, b), ExitStack() as stack:
        slow_backends(a, b)
        config_a, workers_a = _two_worker_gateway(ports, [a.url, b.url], udp_a, udp_b[0])
        config_b, workers_b = _two_worker_gateway(ports, [a.url, b.url], udp_b, udp_a[0])
        for config in (config_a, config_b):
            stack.enter_context(run_gateway_process(config, env=SECRET_ENV))
        for url in (*workers_a, *workers_b):
            wait_until(lambda url=url: _ready(url), 60, f"{url} ready")
        with streams_held_on_a(workers_a[1], b, observer=workers_b[0]):
            chosen = route_short_requests(workers_b[0])
            assert chosen == ["b"] * SHORT_REQUESTS, chosen
            # B's worker 0 hears A's two workers (B's worker 1 is its own group); waited for:
            # a heartbeat can come late on a loaded machine.
            wait_until(
                lambda: metric(scrape_metrics(workers_b[0]), "sal_peers_heard") == 2.0,
                10,
                "B's worker 0 does not hear A's two workers",
            )


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_flood_on_the_peers_port_neither_stalls_the_gateway_nor_counts(tmp_path: Path) -> None:
    """Two seconds of datagrams from someone without the secret: random bytes and forged
    messages of the right shape. The gateway keeps answering (every probe within 2 s, where
    a stalled loop would hang them), counts them all as refused, and still takes its real
    peer's counts afterwards."""
    ports = PortAllocator(22000, 22999)
    fake_ports = [ports.take(), ports.take()]
    gw = [ports.take(), ports.take()]
    udp = [ports.take(), ports.take()]
    with fake_procs(tmp_path, fake_ports) as (a, b), ExitStack() as stack:
        backends = [a.url, b.url]
        first, _ = stack.enter_context(
            run_gateway_process(_gateway(gw[0], backends, udp[0], udp[1]), env=SECRET_ENV)
        )
        second, _ = stack.enter_context(
            run_gateway_process(_gateway(gw[1], backends, udp[1], udp[0]), env=SECRET_ENV)
        )
        forged = encode(b"guessed secret, not the real one", 7, 1, [PeerRow(1, 99, 9, 9)])
        junk = [os.urandom(n) for n in (1, 40, 700, 1394, 4000)]
        probes: list[float] = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out, httpx.Client() as client:
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                for data in (forged, *junk) * 40:
                    with contextlib.suppress(OSError):  # the kernel's buffer is full
                        out.sendto(data, ("127.0.0.1", udp[1]))
                started = time.monotonic()
                assert client.get(f"{second}/health", timeout=2.0).status_code == 200
                probes.append(time.monotonic() - started)
        samples = scrape_metrics(second)
        assert metric(samples, "sal_peer_datagrams_total", result="bad_tag") > 0
        assert metric(samples, "sal_peer_datagrams_total", result="malformed") > 0
        assert metric(samples, "sal_peers_heard") <= 1.0  # nobody new was heard
        assert len(probes) > 10, probes
        # The real peer still gets through: its heartbeat keeps it heard.
        accepted = metric(samples, "sal_peer_datagrams_total", result="accepted")
        wait_until(
            lambda: (
                metric(scrape_metrics(second), "sal_peer_datagrams_total", result="accepted")
                > accepted
            ),
            5,
            "no datagram of the real peer accepted after the flood",
        )
        assert httpx.get(f"{first}/health", timeout=5.0).status_code == 200


def test_peers_without_the_secret_is_a_config_error(tmp_path: Path) -> None:
    port = PortAllocator(22000, 22999).take()
    env = {k: v for k, v in os.environ.items() if k != "SAL_GATEWAY_PEERS_SECRET"}
    done = serve_refused(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "models: [{name: tiny, backends: ['http://127.0.0.1:9']}]\n"
        "peers: {listen: '127.0.0.1:0', addresses: ['127.0.0.1:9']}\n",
        tmp_path,
        env,
    )
    assert "SAL_GATEWAY_PEERS_SECRET must hold a shared secret" in done.stderr


@pytest.mark.parametrize(
    ("told", "share_adapters"),
    [(True, True), (True, False), (False, False)],
    ids=["peers sharing adapters", "peers, counts only", "alone"],
)
def test_a_gateway_counts_the_lora_slot_the_other_gateway_just_filled(
    tmp_path: Path, told: bool, share_adapters: bool
) -> None:
    """Each replica has one LoRA slot, free in every snapshot. Gateway A streams lora-a;
    then gateway B routes lora-b by round robin, whose first pick is the replica lora-a
    took. Told lora-a by A (``peers.share_adapters``), B counts that slot as taken and
    sends lora-b to the other replica; told only A's counts, or alone, it sends lora-b into
    the full slot (where vLLM would make it wait). The fakes' snapshots never show lora-a
    running and ``routing.accounting_grace_s`` keeps it unacknowledged, so only what A
    tells B can make the difference."""
    ports = PortAllocator(22000, 22999)
    fake_ports = [ports.take(), ports.take()]
    gw = [ports.take(), ports.take()]
    udp = [ports.take(), ports.take()]
    adapters = ("--adapter", "lora-a", "--adapter", "lora-b")
    with fake_procs(tmp_path, fake_ports, *adapters) as fakes, ExitStack() as stack:
        for fake in fakes:
            fake.fault(chunk_delay_s=0.2, stats={"max_loras": 1, "lora_running": []})
        urls = []
        for me, other in ((0, 1), (1, 0)):
            config = _gateway(gw[me], [f.url for f in fakes], udp[me], udp[other] if told else None)
            config["routing"].update(policy="round_robin", accounting_grace_s=60.0)
            if told:
                config["peers"]["share_adapters"] = share_adapters
            url, _ = stack.enter_context(run_gateway_process(config, env=SECRET_ENV))
            urls.append(url)
        first, second = urls
        if told:
            wait_until(
                lambda: metric(scrape_metrics(second), "sal_peers_heard") == 1.0,
                10,
                "gateway B never heard gateway A",
            )
        body = {"model": "lora-a", "prompt": "long", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", f"{first}/v1/completions", json=body, timeout=60) as held:
            assert held.status_code == 200
            took = held.headers["x-fake-backend"]
            time.sleep(0.5)  # A's datagram crosses loopback in well under a millisecond
            short = {"model": "lora-b", "prompt": "hi", "max_tokens": 2}
            resp = httpx.post(f"{second}/v1/completions", json=short, timeout=30)
            assert resp.status_code == 200, resp.text
            chosen = resp.headers["x-fake-backend"]
    other = {"a": "b", "b": "a"}[took]
    assert chosen == (other if share_adapters else took), (took, chosen)


def _queue_seen(gateway: str, url: str, queued: float) -> None:
    """Wait until `gateway` reports `queued` prefill tokens on backend `url`."""
    wait_until(
        lambda: (
            metric(scrape_metrics(gateway), "sal_backend_queued_prefill_tokens", backend=url)
            == queued
        ),
        30,
        f"{gateway} never saw {queued} queued tokens on {url}",
    )


@pytest.mark.parametrize("share", [True, False], ids=["blocks", "counts only"])
def test_a_conversation_follows_its_prefix_whichever_gateway_its_turns_reach(
    tmp_path: Path, share: bool
) -> None:
    """Turn 1 of a conversation goes through gateway A while replica a looks busy, so it
    runs on b; then both replicas look idle and turn 2 (turn 1 plus a new message) goes
    through gateway B, on another host as far as A knows (``peers`` over UDP). B never
    routed turn 1: told its blocks by A (``peers.share_prefix_blocks``, the default) it
    sends turn 2 where they are cached, b; told only A's counts, it sees an idle tie and
    sends turn 2 to a, which would prefill the whole conversation again."""
    ports = PortAllocator(22000, 22999)
    fake_ports = [ports.take(), ports.take()]
    gw = [ports.take(), ports.take()]
    udp = [ports.take(), ports.take()]
    turn1 = list(range(1000, 1000 + 100 * 16 + 3))  # past routing.prefix_min_match_tokens
    turn2 = [*turn1, *range(50, 90)]
    with fake_procs(tmp_path, fake_ports) as (a, b), ExitStack() as stack:
        for fake in (a, b):
            fake.fault(stats={"prefix_caching": True, "prefix_hash_algo": "sha256"})
        a.fault(stats={"queued_prefill_tokens": 50_000})
        backends = [a.url, b.url]
        first, _ = stack.enter_context(
            run_gateway_process(
                _gateway(gw[0], backends, udp[0], udp[1], share_prefix_blocks=share),
                env=SECRET_ENV,
            )
        )
        second, _ = stack.enter_context(
            run_gateway_process(
                _gateway(gw[1], backends, udp[1], udp[0], share_prefix_blocks=share),
                env=SECRET_ENV,
            )
        )
        _queue_seen(first, a.url, 50_000)
        for url in backends:  # B polled both (its index tracks only polled replicas)
            _queue_seen(second, url, 50_000 if url == a.url else 0)
        body = {"model": "tiny", "prompt": turn1, "max_tokens": 2}
        b.fault(first_byte_delay_s=3.0)  # turn 1 runs a while: B holds its blocks meanwhile

        def held_for_peers() -> float | None:
            return metric(scrape_metrics(second), "sal_prefix_told_holds", source="peers")

        with ThreadPoolExecutor(1) as pool:
            turn = pool.submit(httpx.post, f"{first}/v1/completions", json=body, timeout=30)
            if share:  # the blocks datagrams are on their way: wait for them, not a fixed time
                wait_until(lambda: held_for_peers() == 1.0, 10, "B never held A's request")
            resp = turn.result()
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-fake-backend"] == "b"
        b.fault(first_byte_delay_s=0.0)
        # Ended: released (told by A's end datagram); counts only: never held.
        wait_until(lambda: held_for_peers() == 0.0, 10, "B still holds A's ended request")
        a.fault(stats={"queued_prefill_tokens": 0})
        for url in backends:
            _queue_seen(second, url, 0)
        body = {"model": "tiny", "prompt": turn2, "max_tokens": 2}
        resp = httpx.post(f"{second}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        heard = metric(scrape_metrics(second), "sal_peer_datagrams_total", result="blocks")
    assert resp.headers["x-fake-backend"] == ("b" if share else "a")
    assert (heard or 0.0) == (1.0 if share else 0.0)  # 100 blocks: one datagram
