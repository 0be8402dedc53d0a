"""Cache-aware SAL on real vLLM-on-CPU replicas: a conversation's turns land where its prefix is,
and vLLM's own prefix-cache counters show the reuse.

Two patched replicas (LARRY + ``/stats``) with prefix caching on, prompt-token details and
KV-cache events, the gateway in this process (``routing.policy: sal``, once per cache source:
``approximate`` and ``kv_events``), token-id prompts. The state is forced, never assumed: one
phantom request in flight in the gateway's table makes one replica look busier, so that a
cache-blind SAL (ties between idle replicas broken by fewer requests in flight) would send
each follow-up turn to the *other* replica; the cache-aware one must send it back to the
replica that holds its prefix, in both directions. A gateway started after a replica served
a turn learns of it only through the replicas' replay sockets. Last, the gateway as the CLI
runs it with two workers: a turn through the worker that did not route the turn before it
finds its prefix only when the workers share their index; and as two gateways (on separate
hosts as far as they know) telling each other over ``peers``: the same, only when they tell
the blocks.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.prefix_real import free_udp_ports
from engine_sim.fake_vllm import ServedApp
from sal_core.prefix import chain_hashes
from sal_gateway.app import Runtime, create_app
from sal_gateway.config import build_config
from sal_gateway.state import BackendState
from tests.gateway_support import free_port, gateway_config, run_gateway
from tests.vllm_support import run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
BLOCK = 128
"""vLLM's KV block on CPU."""
DEADLINE_S = 60.0


def _replay_endpoint(endpoint: str) -> str:
    """The replay socket beside a replica's event publisher at `endpoint` (same folder)."""
    folder, name = endpoint.rsplit("/", 1)
    return f"{folder}/replay-{name}"


def _replica_args(endpoint: str) -> tuple[str, ...]:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": _replay_endpoint(endpoint),
    }
    return (
        "--served-model-name",
        MODEL,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(events),
    )


def _replica_urls(model_dir: Path, endpoints: list[str], stack: ExitStack) -> list[str]:
    ports = [free_port(19600, 19700)]
    ports.append(free_port(ports[0] + 1, 19700))
    managers = [
        run_replica(model_dir, port, extra_args=_replica_args(endpoint))
        for port, endpoint in zip(ports, endpoints, strict=True)
    ]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        urls = []
        for manager, future in zip(managers, futures, strict=True):
            urls.append(future.result())
            stack.push(manager.__exit__)
    return urls


@pytest.fixture(scope="module")
def replicas(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[str], list[str]]]:
    sockets = tmp_path_factory.mktemp("kv-events")
    endpoints = [f"ipc://{sockets}/kv-{i}.sock" for i in range(2)]
    with ExitStack() as stack:
        yield _replica_urls(tiny_model_dir, endpoints, stack), endpoints


@contextlib.contextmanager
def _gateway(
    urls: list[str], endpoints: list[str], prefix_cache: str, *, replay: bool = False
) -> Iterator[tuple[str, Runtime]]:
    """A gateway in this process in front of the replicas (its URL and runtime), once it
    tracks every replica's prefix cache; `replay`: with the replicas' replay endpoints."""
    model: dict[str, object] = {
        "name": MODEL,
        "backends": urls,
        "kv_events_endpoints": dict(zip(urls, endpoints, strict=True)),
    }
    if replay:
        model["kv_events_replay_endpoints"] = {
            u: _replay_endpoint(e) for u, e in zip(urls, endpoints, strict=True)
        }
    config = build_config(
        {
            "models": [model],
            "listen": {"host": "127.0.0.1", "port": 0},
            "routing": {
                "policy": "sal",
                "prefix_cache": prefix_cache,
                # Every hit counts: these conversations are a few blocks long (the
                # default ignores matches under 1,024 tokens).
                "prefix_min_match_tokens": 0,
                "poll_timeout_s": 1.0,
                "stale_after_s": 3.0,  # 2 busy cores: a late poll must not eject
            },
            "log_level": "warning",
        }
    )
    app = create_app(config)
    with ServedApp(app, lifespan=True) as gateway:
        runtime: Runtime = app.state.runtime
        deadline = time.monotonic() + DEADLINE_S
        # Every replica tracked, not just the model's block size learnt (that is the first
        # replica's): a request routed to a replica not polled yet is not indexed.
        while (
            runtime.prefix is None
            or runtime.prefix.block_size(MODEL) != BLOCK
            or not all(runtime.prefix.tracking(MODEL, b.url) for b in runtime.table.backends(MODEL))
        ):
            assert time.monotonic() < deadline, "the gateway never tracked every replica's cache"
            time.sleep(0.1)
        yield gateway, runtime


@pytest.fixture(params=["approximate", "kv_events"])
def fleet(
    request: pytest.FixtureRequest, replicas: tuple[list[str], list[str]]
) -> Iterator[tuple[list[str], str, Runtime]]:
    urls, endpoints = replicas
    with _gateway(urls, endpoints, request.param) as (gateway, runtime):
        if request.param == "kv_events":
            _subscribed(urls, gateway)
        yield urls, gateway, runtime


def _stored_blocks(gateway: str) -> dict[str, float]:
    """The gateway's ``stored_blocks`` KV events so far, per backend."""
    text = httpx.get(f"{gateway}/metrics", timeout=10.0).text
    found = re.findall(
        r'^sal_kv_events_total\{([^}]*kind="stored_blocks"[^}]*)\} ([0-9.e+]+)$', text, re.M
    )
    out: dict[str, float] = {}
    for labels, value in found:
        backend = re.search(r'backend="([^"]*)"', labels)
        if backend is not None:
            out[backend.group(1)] = out.get(backend.group(1), 0.0) + float(value)
    return out


def _subscribed(urls: list[str], gateway: str) -> None:
    """Until the gateway receives each replica's KV events. ZMQ drops what a publisher sends
    before a subscriber's connection is up (its "slow joiner"), so a request served before
    then is never told; a clean-clone run on a busy machine lost one replica's events that
    way. One prompt of two full blocks straight to each replica, until its events arrive."""
    deadline = time.monotonic() + DEADLINE_S
    rng = random.Random("subscribed")
    while True:
        stored = _stored_blocks(gateway)
        missing = [u for u in urls if stored.get(u, 0.0) <= 0]
        if not missing:
            return
        assert time.monotonic() < deadline, f"no KV events from {missing}"
        for url in missing:
            prompt = [rng.randrange(10, 1900) for _ in range(2 * BLOCK + 1)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60.0).status_code == 200
        time.sleep(0.5)


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out = {}
    for key in ("hits", "queries"):
        found = re.findall(
            rf"^vllm:prefix_cache_{key}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M
        )
        out[key] = sum(float(v) for v in found)
    return out


def _complete(gateway: str, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(f"{gateway}/v1/completions", json=body, timeout=120.0)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def _served_by(urls: list[str], before: list[dict[str, float]], prompt: list[int]) -> int:
    """Which replica served a request: the one whose prefix-cache queries grew by its prompt
    (vLLM counts every admitted prompt's tokens there)."""
    grown = [_counters(u)["queries"] - b["queries"] for u, b in zip(urls, before, strict=True)]
    served = [i for i, g in enumerate(grown) if g >= len(prompt)]
    assert len(served) == 1, grown
    return served[0]


def _all_eligible(runtime: Runtime) -> None:
    """Wait until the gateway sees every replica eligible and every routed request in its
    replica's numbers: on 2 busy cores a late poll can make one look stale, and a decision
    made then would test the starvation, not the cache (README, known weak spots)."""
    deadline = time.monotonic() + DEADLINE_S
    table = runtime.table
    while not all(
        b.is_eligible(runtime.clock(), table.stale_after_s) and b.routed_tokens_since_poll == 0
        for b in table.backends(MODEL)
    ):
        assert time.monotonic() < deadline, "the replicas never looked eligible together"
        time.sleep(0.05)


@contextlib.contextmanager
def _busier(backend: BackendState) -> Iterator[None]:
    """The gateway believes one more request is in flight on `backend` (a phantom: a real
    long request ends whenever the CPU lets it, and the state must not depend on that).
    Ties between idle replicas go to the one with fewer requests in flight."""
    backend.in_flight += 1
    try:
        yield
    finally:
        backend.in_flight -= 1


def _state(runtime: Runtime) -> str:
    """What the gateway believed about each replica (for assertion messages)."""
    now = runtime.clock()
    rows = []
    for b in runtime.table.backends(MODEL):
        stats = b.stats
        rows.append(
            f"{b.url}: eligible={b.is_eligible(now, runtime.table.stale_after_s)} "
            f"in_flight={b.in_flight} queued={b.queued_prefill_tokens()} "
            f"free={b.free_kv_tokens()} waiting={stats.num_waiting if stats else None} "
            f"running={stats.num_running if stats else None} age={b.age_s(now)} "
            f"progress_age={b.progress_age_s(now)} suspect={b.suspect}"
        )
    return "; ".join(rows)


def _turn(
    urls: list[str], gateway: str, prompt: list[int], runtime: Runtime, why: list[str]
) -> tuple[int, int, list[int]]:
    """Send one turn: (replica index, vLLM's cached_tokens for it, the reply's token ids).
    Appends the gateway's state just before the request to `why`."""
    before = [_counters(u) for u in urls]
    _all_eligible(runtime)
    why.append(_state(runtime))
    answer = _complete(gateway, prompt)
    choice = answer["choices"][0]
    cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return _served_by(urls, before, prompt), cached, list(choice.get("token_ids") or [])


def test_turns_follow_their_prefix_and_vllm_reuses_it(
    fleet: tuple[list[str], str, Runtime],
) -> None:
    urls, gateway, runtime = fleet
    stored_before = _stored_blocks(gateway)
    # Each source's run has conversations of its own (the replicas outlive one gateway).
    rng = random.Random(runtime.config.routing.prefix_cache)
    conv_a = [rng.randrange(10, 1900) for _ in range(5 * BLOCK + 20)]  # 5 full blocks and a bit
    conv_b = [rng.randrange(10, 1900) for _ in range(5 * BLOCK + 20)]
    why: list[str] = []
    backends = runtime.table.backends(MODEL)
    # Turn 1 of A, both replicas idle: the tie goes to replica 0.
    a1, _, reply_a = _turn(urls, gateway, conv_a, runtime, why)
    assert a1 == 0, why
    hits_before = [_counters(u)["hits"] for u in urls]
    with _busier(backends[0]):
        # Turn 1 of B is cold: the less busy replica 1 takes it.
        b1, _, reply_b = _turn(urls, gateway, conv_b, runtime, why)
        assert b1 == 1, why
        # A's follow-up goes back to replica 0, which holds its prefix, although a
        # cache-blind SAL would send it to the less busy replica 1 ...
        a2, a2_cached, _ = _turn(urls, gateway, [*conv_a, *reply_a, *range(40, 80)], runtime, why)
    with _busier(backends[1]):
        # ... and B's to replica 1, although a cache-blind SAL would now pick replica 0.
        b2, b2_cached, _ = _turn(urls, gateway, [*conv_b, *reply_b, *range(40, 80)], runtime, why)
    assert (a2, b2) == (0, 1), why
    # vLLM's own counters show the reuse: at least the first turn's full blocks.
    assert a2_cached >= 5 * BLOCK
    assert b2_cached >= 5 * BLOCK
    hits = [_counters(u)["hits"] - h for u, h in zip(urls, hits_before, strict=True)]
    assert hits[0] >= 5 * BLOCK
    assert hits[1] >= 5 * BLOCK
    metrics = httpx.get(f"{gateway}/metrics", timeout=10.0).text
    predicted = re.findall(
        r"^sal_prefix_predicted_hit_tokens_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M
    )
    assert sum(float(v) for v in predicted) >= 2 * 5 * BLOCK
    if runtime.config.routing.prefix_cache == "kv_events":
        # Events travel on their own ZMQ stream: the last turn's may trail its answer a little.
        # Each replica stored at least its conversation's 5 full blocks.
        deadline = time.monotonic() + 10.0
        while True:
            after = _stored_blocks(gateway)
            grown = [after.get(u, 0.0) - stored_before.get(u, 0.0) for u in urls]
            if min(grown) >= 5 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert min(grown) >= 5, ("too few KV events reached the gateway", grown)


def _metric_total(gateway: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    text = httpx.get(f"{gateway}/metrics", timeout=10.0).text
    total = 0.0
    for label_text, value in re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M):
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def test_a_gateway_started_after_its_replicas_replays_what_they_cached(
    replicas: tuple[list[str], list[str]],
) -> None:
    # A conversation's first turn is served by replica 1 while no gateway runs (a gateway
    # pod restarted, or rolled out after the replicas). ZMQ gives a new subscriber only what
    # is published after it joins: a gateway reading live events alone never learns that
    # replica 1 holds the turn. With the replicas' replay endpoints it asks each publisher
    # for what it still buffers, and the next turn goes to replica 1 though the gateway
    # believes it busier; vLLM's own cached_tokens confirm the reuse.
    urls, endpoints = replicas
    rng = random.Random("replay")
    first = [rng.randrange(10, 1900) for _ in range(5 * BLOCK + 20)]
    assert _complete(urls[1], first)["usage"]["prompt_tokens"] == len(first)
    with _gateway(urls, endpoints, "kv_events") as (gateway, runtime):
        # Without replay: live events only (each replica's proven flowing), nothing predicted.
        _subscribed(urls, gateway)
        why: list[str] = []
        second = [*first, *range(40, 80)]
        with _busier(runtime.table.backends(MODEL)[1]):
            served, _, _ = _turn(urls, gateway, second, runtime, why)
        assert served == 0, why  # the cache-blind choice: replica 0 looks less busy
        assert _metric_total(gateway, "sal_prefix_predicted_hit_tokens_total") == 0
        assert _metric_total(gateway, "sal_kv_events_total", kind="replayed_messages") == 0
    third = [rng.randrange(10, 1900) for _ in range(5 * BLOCK + 20)]
    assert _complete(urls[1], third)["usage"]["prompt_tokens"] == len(third)
    with _gateway(urls, endpoints, "kv_events", replay=True) as (gateway, runtime):
        # Each replica's catch-up replay has run, and its messages are all applied (their
        # count no longer grows: the replay ended; the main loop applies them at once).
        deadline = time.monotonic() + DEADLINE_S
        replayed = [0.0, 0.0]
        while True:
            now = [
                _metric_total(gateway, "sal_kv_events_total", kind="replayed_messages", backend=u)
                for u in urls
            ]
            if min(now) > 0 and now == replayed:
                break
            assert time.monotonic() < deadline, f"replicas' buffers not replayed: {now}"
            replayed = now
            time.sleep(0.5)
        why = []
        with _busier(runtime.table.backends(MODEL)[1]):
            served, cached, _ = _turn(urls, gateway, [*third, *range(40, 80)], runtime, why)
        assert served == 1, why
        assert cached >= 5 * BLOCK
        assert _metric_total(gateway, "sal_prefix_predicted_hit_tokens_total") >= 5 * BLOCK
        assert _metric_total(gateway, "sal_kv_events_dropped_total", reason="replay_timeout") == 0


def test_stats_reports_vllms_own_prefix_cache_counters(
    fleet: tuple[list[str], str, Runtime],
) -> None:
    """``/stats`` (sal-stats/1.1) says caching is on with its hash, carries the same hit and
    query counters as vLLM's ``/metrics``, and the gateway turns them into its achieved-hit
    counters."""
    urls, gateway, _ = fleet
    prompt = list(range(300, 300 + 3 * BLOCK + 7))
    _complete(gateway, prompt)
    _complete(gateway, [*prompt, 5, 6, 7])  # a hit, wherever it lands

    def agree() -> bool:
        for url in urls:
            stats = httpx.get(f"{url}/stats", timeout=10.0).json()
            counters = _counters(url)
            if (stats["prefix_cache_hit_tokens"], stats["prefix_cache_query_tokens"]) != (
                counters["hits"],
                counters["queries"],
            ):
                return False
        return True

    deadline = time.monotonic() + DEADLINE_S
    while not agree():
        assert time.monotonic() < deadline, "/stats and /metrics never agreed"
        time.sleep(0.25)
    for url in urls:
        stats = httpx.get(f"{url}/stats", timeout=10.0).json()
        assert stats["schema"] == "sal-stats/1.2"
        assert (stats["prefix_caching"], stats["prefix_hash_algo"]) == (True, "sha256")
        assert stats["block_size"] == BLOCK
    engine_hits = sum(_counters(u)["hits"] for u in urls)
    assert engine_hits >= 3 * BLOCK

    def gateway_hits() -> float:
        text = httpx.get(f"{gateway}/metrics", timeout=10.0).text
        found = re.findall(r"^sal_prefix_engine_hit_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return sum(float(v) for v in found)

    # The gateway's counter starts from the engine's total at its first poll, then follows
    # its growth: at least the hit of the second request above.
    deadline = time.monotonic() + DEADLINE_S
    while gateway_hits() < 3 * BLOCK:
        assert time.monotonic() < deadline, "the gateway never counted the engine's hits"
        time.sleep(0.25)


def _reuse_metric(text: str, name: str, scale: str | None = None) -> float:
    labels = rf'[^}}]*kv_scale="{scale}"[^}}]*' if scale else r"[^}]*"
    found = re.findall(rf"^sal_prefix_fleet_reuse_{name}\{{{labels}\}} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_the_fleet_reuse_estimate_is_sized_by_vllms_kv_and_finds_a_repeated_prompt(
    fleet: tuple[list[str], str, Runtime],
) -> None:
    """The gateway's estimate of what a cache of the whole fleet's KV would hold: sized by the
    replicas' own ``kv_blocks_total``, it finds every sampled block (each standing for the
    blocks it samples) of a prompt sent twice, at x1, x2 and x4, and sees each prompt once."""
    urls, gateway, runtime = fleet
    total = sum(httpx.get(f"{u}/stats", timeout=10.0).json()["kv_blocks_total"] for u in urls)
    assert total > 0
    deadline = time.monotonic() + DEADLINE_S
    while _reuse_metric(httpx.get(f"{gateway}/metrics", timeout=10.0).text, "kv_blocks") != total:
        assert time.monotonic() < deadline, "the estimate never learnt the replicas' KV"
        time.sleep(0.2)
    assert runtime.prefix is not None
    shift = runtime.prefix.fleet_sample_shift(MODEL)
    assert shift is not None
    mask = (1 << shift) - 1
    rng = random.Random(f"reuse-{runtime.config.routing.prefix_cache}")
    while True:  # 4 full blocks (all reusable: 7 tokens follow), some of them sampled
        prompt = [rng.randrange(10, 1900) for _ in range(4 * BLOCK + 7)]
        sampled = sum(1 for k in chain_hashes(prompt, BLOCK) if not k & mask)
        if sampled:
            break
    before = httpx.get(f"{gateway}/metrics", timeout=10.0).text
    _complete(gateway, prompt)
    _complete(gateway, prompt)
    after = httpx.get(f"{gateway}/metrics", timeout=10.0).text
    grown = _reuse_metric(after, "prompt_tokens_total") - _reuse_metric(
        before, "prompt_tokens_total"
    )
    assert grown == 2 * len(prompt)
    for scale in ("1", "2", "4"):
        hits = _reuse_metric(after, "hit_tokens_total", scale) - _reuse_metric(
            before, "hit_tokens_total", scale
        )
        assert hits == (sampled << shift) * BLOCK, scale


def _three_free_ports(start: int, stop: int) -> int:
    """A port p in [start, stop) with p, p + 1 and p + 2 free: a gateway and its two
    workers' own ports (``listen.port`` + 1 + i)."""
    port = start
    while port + 2 < stop:
        port = free_port(port, stop)
        if free_port(port + 1, stop) == port + 1 and free_port(port + 2, stop) == port + 2:
            return port
        port += 1
    raise RuntimeError(f"no three consecutive free ports in [{start}, {stop})")


@pytest.mark.parametrize("share", [True, False])
def test_a_turn_through_another_worker_finds_its_prefix_when_the_workers_share(
    replicas: tuple[list[str], list[str]], share: bool
) -> None:
    """Two gateway workers (the CLI, ``listen.workers: 2``) in front of the two real
    replicas. Turn 1 of a conversation goes through worker 0, turn 2 through worker 1, as
    when a client's pooled connections reach different workers. Worker 1 never routed turn
    1: told by worker 0 (``listen.share_prefix_index``, the default) it predicts turn 1's
    blocks on the replica that ran it, sends turn 2 there, and vLLM serves those blocks
    from its cache (its own ``cached_tokens``); on its own it predicts nothing."""
    urls, _ = replicas
    port = _three_free_ports(19760, 19800)
    config = gateway_config(
        port,
        urls,
        tokenizer=None,
        extra={
            "listen": {
                "host": "127.0.0.1",
                "port": port,
                "workers": 2,
                "share_prefix_index": share,
            },
            "limits": {"body_workers": 1},
            "log_level": "warning",
        },
    )
    config["routing"].update(
        {"prefix_min_match_tokens": 0, "poll_timeout_s": 1.0, "stale_after_s": 3.0}
    )
    rng = random.Random(f"workers-{share}")
    conv = [rng.randrange(10, 1900) for _ in range(5 * BLOCK + 20)]
    worker0, worker1 = (f"http://127.0.0.1:{port + 1 + i}" for i in range(2))
    with run_gateway(config):
        _wait_tracked(worker0, urls)
        _wait_tracked(worker1, urls)
        before = [_counters(u) for u in urls]
        first = _complete(worker0, conv)
        ran = _served_by(urls, before, conv)
        turn2 = [*conv, *first["choices"][0]["token_ids"], *range(40, 80)]
        before = [_counters(u) for u in urls]
        second = _complete(worker1, turn2)
        served = _served_by(urls, before, turn2)
        predicted_tokens = _predicted_hit_tokens(worker1)
    cached = _cached_tokens(second)
    if share:
        assert predicted_tokens >= 5 * BLOCK  # turn 1's blocks, learnt from worker 0
        assert served == ran
        assert cached >= 5 * BLOCK  # vLLM's own word: they were reused
    else:
        assert predicted_tokens == 0


def _predicted_hit_tokens(gateway: str) -> float:
    """The prompt tokens `gateway` predicted cached where it routed, over every model and
    backend (``sal_prefix_predicted_hit_tokens_total``)."""
    found = re.findall(
        r"^sal_prefix_predicted_hit_tokens_total\{[^}]*\} ([0-9.e+]+)$",
        httpx.get(f"{gateway}/metrics", timeout=10.0).text,
        re.M,
    )
    return sum(float(v) for v in found)


def _cached_tokens(response: dict[str, Any]) -> int:
    """vLLM's own count of the prompt tokens it served from its prefix cache."""
    return int((response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("share", [True, False], ids=["blocks", "counts only"])
def test_a_turn_through_another_gateway_finds_its_prefix_when_peers_tell_blocks(
    replicas: tuple[list[str], list[str]], share: bool
) -> None:
    """Two gateways (the CLI, each its own process) in front of the two real replicas, told
    of each other over ``peers`` (UDP on loopback), as two gateway pods behind one Service.
    Turn 1 of a conversation goes through gateway A, turn 2 through gateway B. B never
    routed turn 1: told its blocks by A (``peers.share_prefix_blocks``, the default) it
    predicts them on the replica that ran turn 1, sends turn 2 there, and vLLM serves them
    from its cache (its own ``cached_tokens``); told only A's counts it predicts nothing."""
    urls, _ = replicas
    first = free_port(19800, 19850)
    ports = [first, free_port(first + 1, 19850)]
    udp = free_udp_ports(2)
    configs = []
    for i in range(2):
        config = gateway_config(
            ports[i],
            urls,
            tokenizer=None,
            extra={
                "peers": {
                    "listen": f"127.0.0.1:{udp[i]}",
                    "addresses": [f"127.0.0.1:{udp[1 - i]}"],
                    "expire_s": 5.0,
                    "share_prefix_blocks": share,
                },
                "log_level": "warning",
            },
        )
        config["routing"].update(
            {"prefix_min_match_tokens": 0, "poll_timeout_s": 1.0, "stale_after_s": 3.0}
        )
        configs.append(config)
    rng = random.Random(f"peers-{share}")
    conv = [rng.randrange(10, 1900) for _ in range(5 * BLOCK + 20)]
    env = {"SAL_GATEWAY_PEERS_SECRET": "a shared secret for the tests"}
    with run_gateway(configs[0], env=env) as gateway_a, run_gateway(configs[1], env=env) as b:
        _wait_tracked(gateway_a, urls)
        _wait_tracked(b, urls)
        before = [_counters(u) for u in urls]
        turn1 = _complete(gateway_a, conv)
        ran = _served_by(urls, before, conv)
        turn2 = [*conv, *turn1["choices"][0]["token_ids"], *range(40, 80)]
        if share:  # A's blocks datagram is on its way over UDP: wait for it, not a fixed time
            deadline = time.monotonic() + DEADLINE_S
            while not re.search(
                r'^sal_peer_datagrams_total\{result="blocks"\} [1-9]',
                httpx.get(f"{b}/metrics", timeout=10.0).text,
                re.M,
            ):
                assert time.monotonic() < deadline, "gateway B never indexed A's blocks"
                time.sleep(0.1)
        before = [_counters(u) for u in urls]
        second = _complete(b, turn2)
        served = _served_by(urls, before, turn2)
        predicted_tokens = _predicted_hit_tokens(b)
    cached = _cached_tokens(second)
    if share:
        assert predicted_tokens >= 5 * BLOCK  # turn 1's blocks, learnt from gateway A
        assert served == ran
        assert cached >= 5 * BLOCK  # vLLM's own word: they were reused
    else:
        assert predicted_tokens == 0


def _wait_tracked(worker: str, urls: list[str]) -> None:
    """Until `worker` is up (its own port: the shared one answered for one worker) and has
    polled both replicas' prefix caches."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            text = httpx.get(f"{worker}/metrics", timeout=10.0).text
        except httpx.HTTPError:
            text = ""
        if all(f'backend="{u}"' in text and "sal_prefix_engine_query_tokens" in text for u in urls):
            polled = re.findall(r"^sal_prefix_engine_query_tokens_total\{[^}]*\}", text, re.M)
            if len(polled) >= len(urls):
                return
        assert time.monotonic() < deadline, f"{worker} never polled every replica's cache"
        time.sleep(0.2)
