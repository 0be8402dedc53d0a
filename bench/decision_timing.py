"""Time one routing decision per policy over a pool of backends (pure `policies.py`, no I/O).

The snapshot is random but seeded (every backend eligible except every 16th, varied free KV and
queued tokens), and one request of 1,000 prompt tokens is routed over and over. The result is
the per-call time of `Policy.select()` (the pure decision), plus, for SAL, the whole
per-request routing work the gateway does on its event loop: `StateTable.views()` (building
the 64 `BackendView` snapshots) followed by `select()`, alone, as one of 8 workers sharing
their accounting (``listen.workers``) and as one of 8 gateways telling each other theirs
(``peers``).
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sal_core.percentile import percentile
from sal_core.policies import POLICIES, BackendView, RouteRequest, make_policy
from sal_core.stats import ReplicaStats
from sal_gateway.config import PeersConfig
from sal_gateway.peer_wire import MAX_ROWS, PeerRow, encode
from sal_gateway.peers import PeerNetwork, bind_socket
from sal_gateway.shared_accounting import SharedAccounting, backend_key
from sal_gateway.state import StateTable

_MODEL = "tiny"


@dataclass(frozen=True)
class DecisionTiming:
    """Per-call statistics of one policy's `select()` (microseconds)."""

    policy: str
    backends: int
    calls: int
    mean_us: float
    p50_us: float
    p99_us: float


def make_snapshot(n_backends: int, seed: int = 0) -> list[BackendView]:
    """A seeded pool of ``n_backends`` views with varied load; every 16th one is ineligible."""
    rng = random.Random(seed)
    return [
        BackendView(
            url=f"http://10.0.{i // 256}.{i % 256}:8000",
            eligible=i % 16 != 15,
            in_flight=rng.randrange(0, 64),
            free_kv_tokens=rng.randrange(0, 200_000),
            queued_prefill_tokens=rng.randrange(0, 50_000),
            max_num_batched_tokens=8192,
            num_running=rng.randrange(0, 64),
        )
        for i in range(n_backends)
    ]


def time_policy(name: str, n_backends: int, calls: int, batch: int = 50) -> DecisionTiming:
    """Time ``calls`` decisions of policy ``name``, in batches of ``batch`` calls per sample.

    Batching keeps the timer's own cost (~50 ns) out of the per-call numbers; p50/p99 are
    over the per-batch means.
    """
    policy = make_policy(name, seed=0)
    backends = make_snapshot(n_backends)
    request = RouteRequest(prompt_tokens=1000, beta=2.0)
    for _ in range(batch):  # warm-up
        policy.select(request, backends)
    samples: list[float] = []
    for _ in range(max(1, calls // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            policy.select(request, backends)
        samples.append((time.perf_counter() - start) / batch * 1e6)
    return DecisionTiming(
        policy=name,
        backends=n_backends,
        calls=len(samples) * batch,
        mean_us=sum(samples) / len(samples),
        p50_us=percentile(samples, 50),
        p99_us=percentile(samples, 99),
    )


def _state_table(
    n_backends: int, seed: int = 0, peers: SharedAccounting | PeerNetwork | None = None
) -> StateTable:
    """A `StateTable` of one model with ``n_backends`` freshly polled backends (at t=0);
    `peers`: this worker's handle on the workers' shared accounting, or this gateway's
    exchange with gateways on other hosts."""
    rng = random.Random(seed)
    table = StateTable(
        stale_after_s=1.0, eject_after_failures=3, peers=None if peers is None else peers.slot
    )
    for view in make_snapshot(n_backends, seed):
        table.add_backend(_MODEL, view.url)
        stats = ReplicaStats(
            time=0.0, step=1, model=_MODEL, scheduler="larry", alpha=1.0, block_size=16,
            kv_blocks_total=20_000, kv_blocks_free=view.free_kv_tokens // 16,
            free_kv_tokens=view.free_kv_tokens,
            queued_prefill_tokens=view.queued_prefill_tokens,
            num_waiting=rng.randrange(0, 20), num_running=rng.randrange(0, 64),
            max_num_batched_tokens=view.max_num_batched_tokens, max_num_seqs=256,
        )  # fmt: skip
        table.record_poll_success(_MODEL, view.url, stats, "stats", now_s=0.0)
    return table


def _told_by_peers(n_backends: int, gateways: int) -> tuple[PeerNetwork, socket.socket]:
    """A `PeerNetwork` (not started: no traffic) that has heard, through its own decoder,
    from `gateways` - 1 other gateways, each with a request on every backend."""
    secret = b"decision-timing-secret"
    config = PeersConfig(listen="127.0.0.1:0", addresses=("127.0.0.1:9",))
    sock = bind_socket(config)
    network = PeerNetwork(config, secret, sock)
    keys = [backend_key(_MODEL, v.url) for v in make_snapshot(n_backends)]
    for sender in range(1, gateways):
        for start in range(0, len(keys), MAX_ROWS):
            rows = [PeerRow(k, 1, 100, 100) for k in keys[start : start + MAX_ROWS]]
            network.datagram_received(encode(secret, sender, start + 1, rows), ("", 0))
    return network, sock


def time_request_path(
    name: str, n_backends: int, calls: int, workers: int = 1, peers: int = 1
) -> DecisionTiming:
    """Time what the gateway does per request: `StateTable.views()` then `Policy.select()`.
    With `workers` > 1, as one of that many ``listen.workers`` sharing their accounting,
    every other worker having routed a request to every backend (each view then reads
    every other worker's entry); with `peers` > 1, as one of that many gateways telling
    each other (``peers``), likewise."""
    policy = make_policy(name, seed=0)
    told = _told_by_peers(n_backends, peers) if peers > 1 else None
    owner = SharedAccounting.create(workers) if workers > 1 else None
    handles = (
        [] if owner is None else [SharedAccounting.attach(owner.name, w) for w in range(workers)]
    )
    try:
        table = _state_table(
            n_backends, peers=handles[0] if handles else None if told is None else told[0]
        )
        for handle in handles[1:]:
            other = _state_table(n_backends, peers=handle)
            for backend in other.backends(_MODEL):
                other.route(_MODEL, backend.url, 100, sent_s=0.0)
        request = RouteRequest(prompt_tokens=1000, beta=2.0)
        samples: list[float] = []
        for _ in range(max(1, calls // 50)):
            start = time.perf_counter()
            for _ in range(50):
                policy.select(request, table.views(_MODEL, 0.5))
            samples.append((time.perf_counter() - start) / 50 * 1e6)
    finally:
        for handle in handles:
            handle.close()
        if owner is not None:
            owner.close()
        if told is not None:
            told[1].close()
    label = f"{name}: views() + select()"
    if workers > 1:
        label += f", {workers} workers sharing"
    if peers > 1:
        label += f", {peers} gateways telling each other"
    return DecisionTiming(
        policy=label,
        backends=n_backends,
        calls=len(samples) * 50,
        mean_us=sum(samples) / len(samples),
        p50_us=percentile(samples, 50),
        p99_us=percentile(samples, 99),
    )


def time_all_policies(n_backends: int = 64, calls: int = 20_000) -> list[DecisionTiming]:
    """`time_policy` for every registered policy, then SAL's whole per-request path."""
    rows = [time_policy(name, n_backends, calls) for name in sorted(POLICIES)]
    rows.append(time_request_path("sal", n_backends, calls))
    rows.append(time_request_path("sal", n_backends, calls, workers=8))
    rows.append(time_request_path("sal", n_backends, calls, peers=8))
    return rows


# --- prefix-cache tracking cost (issue 9) --------------------------------------------------


@dataclass(frozen=True)
class PrefixCost:
    """Per-request cost of one step of prefix-cache tracking (microseconds)."""

    step: str
    p50_us: float
    p99_us: float


def _timed(fn: Callable[[], object], reps: int, batch: int = 10) -> tuple[float, float]:
    fn()  # warm-up
    samples = []
    for _ in range(max(1, reps // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) / batch * 1e6)
    return percentile(samples, 50), percentile(samples, 99)


def time_prefix_tracking(
    n_backends: int = 64,
    prompt_tokens: int = 8192,
    block_size: int = 16,
    holders: int = 8,
    reps: int = 400,
    seed: int = 0,
) -> list[PrefixCost]:
    """What tracking prefix caches adds per request, at `n_backends` replicas and a prompt
    of `prompt_tokens`: hashing its blocks (where it is tokenized), the lookup over every
    replica (`PrefixTracker.annotate`; `holders` replicas hold the whole prompt, which makes
    their walks the longest, every other one a shared first block and other conversations),
    taking and releasing the hold on the chosen replica, and the whole routing decision
    (views, lookup, SAL) next to SAL without a lookup."""
    from sal_core.prefix import chain_hashes
    from sal_gateway.prefix_cache import PrefixTracker, PromptBlocks

    rng = random.Random(seed)
    ids = [rng.randrange(10, 32_000) for _ in range(prompt_tokens)]
    keys = tuple(chain_hashes(ids, block_size))
    blocks = PromptBlocks(keys, prompt_tokens + 50)
    table = _state_table(n_backends, seed)
    tracker = PrefixTracker("approximate")
    for b in table.backends(_MODEL):
        assert b.stats is not None
        tracker.observe(_MODEL, b.url, replace(b.stats, prefix_caching=True))
    for i, b in enumerate(table.backends(_MODEL)):
        if i < holders:
            tracker.hold(_MODEL, b.url, blocks)
        for _ in range(20):  # other conversations sharing the first block
            other = ids[:block_size] + [rng.randrange(10, 32_000) for _ in range(2048)]
            tracker.hold(_MODEL, b.url, PromptBlocks(tuple(chain_hashes(other, block_size)), 2048))
    sal = make_policy("sal")
    request = RouteRequest(prompt_tokens, beta=2.0)
    url = table.backends(_MODEL)[holders].url

    def hold_release() -> None:
        release = tracker.hold(_MODEL, url, blocks)
        assert release is not None
        release()

    def annotate() -> None:
        tracker.annotate(_MODEL, table.views(_MODEL, 0.5), blocks)

    def decide() -> None:
        views = table.views(_MODEL, 0.5)
        tracker.annotate(_MODEL, views, blocks)
        sal.select(request, views)

    steps = {
        f"hash {prompt_tokens} token ids ({len(keys)} blocks of {block_size})": lambda: (
            chain_hashes(ids, block_size)
        ),
        f"views() + lookup over {n_backends} replicas ({holders} hold the whole prompt)": annotate,
        f"views() only, {n_backends} replicas": lambda: table.views(_MODEL, 0.5),
        "hold + release on the chosen replica": hold_release,
        "fleet-reuse estimate (x1, x2, x4 caches; 1 block in 16)": lambda: tracker.fleet_reuse(
            _MODEL, blocks
        ),
        f"views() + lookup + SAL select, {n_backends} replicas": decide,
        f"views() + SAL select without a lookup, {n_backends} replicas": lambda: sal.select(
            request, table.views(_MODEL, 0.5)
        ),
    }
    costs = [PrefixCost(name, *_timed(fn, reps)) for name, fn in steps.items()]
    return (
        costs
        + _time_prefix_share(keys, url, workers=8, reps=reps)
        + _time_peer_blocks(keys, url, gateways=8, reps=reps)
    )


def _time_peer_blocks(
    keys: tuple[int, ...], url: str, gateways: int, reps: int
) -> list[PrefixCost]:
    """``peers.share_prefix_blocks`` at `gateways` gateways: telling the others a request
    was routed (sign its blocks into datagrams, one ``sendto`` each per peer, over loopback
    UDP; the receivers drain between calls, untimed), and applying another gateway's routed
    request and its end (check and decode each datagram, index its blocks as held, release
    them)."""
    import asyncio

    from sal_gateway.prefix_cache import PrefixTracker

    secret = b"a shared secret of enough bytes"
    tracker = PrefixTracker("approximate")
    polled = _state_table(1, 0).backends(_MODEL)[0].stats
    assert polled is not None
    tracker.observe(_MODEL, url, replace(polled, prefix_caching=True))

    async def samples() -> tuple[list[float], list[float], int]:
        others = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(gateways - 1)]
        for sock in others:
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
        config = PeersConfig(
            listen="127.0.0.1:0",
            addresses=tuple(f"127.0.0.1:{s.getsockname()[1]}" for s in others),
        )
        sender = PeerNetwork(config, secret, _udp_socket())
        receiver = PeerNetwork(config, secret, _udp_socket())
        receiver.slot(_MODEL, url)
        receiver.on_blocks = tracker.told
        await sender.start()
        try:
            tell, apply = [], []
            for _ in range(reps):
                start = time.perf_counter()
                ended = sender.tell_blocks(_MODEL, url, keys)
                tell.append((time.perf_counter() - start) * 1e6)
                ended()
                got = []
                for sock in others:  # untimed: the peers read them
                    while True:
                        try:
                            got.append(sock.recv(2048))
                        except BlockingIOError:
                            break
                mine = got[: len(got) // len(others)]  # what the first peer received
                start = time.perf_counter()
                for datagram in mine:
                    receiver.datagram_received(datagram, ("127.0.0.1", 9))
                apply.append((time.perf_counter() - start) * 1e6)
            return tell, apply, len(mine) - 1
        finally:
            await sender.close()
            for sock in others:
                sock.close()

    tell, apply, datagrams = asyncio.run(samples())
    return [
        PrefixCost(
            f"peers ({gateways} gateways): tell the others a request was routed "
            f"({len(keys)} blocks, {datagrams} datagrams each)",
            percentile(tell, 50),
            percentile(tell, 99),
        ),
        PrefixCost(
            f"peers: apply another gateway's routed request and its end ({datagrams} + 1 "
            "datagrams: check, decode, index as held, release)",
            percentile(apply, 50),
            percentile(apply, 99),
        ),
    ]


def _udp_socket() -> socket.socket:
    """A non-blocking UDP socket on a free loopback port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def _time_prefix_share(
    keys: tuple[int, ...], url: str, workers: int, reps: int
) -> list[PrefixCost]:
    """``listen.share_prefix_index`` at `workers` workers: telling the others a request was
    routed (encode + a write on each connection; the receivers drain between calls,
    untimed), and applying another worker's pair of messages (decode, index the routed
    blocks as held, release them when it ended)."""
    import asyncio
    import tempfile

    from sal_gateway.prefix_cache import PrefixTracker
    from sal_gateway.prefix_share import PrefixShare, ShareSpec, decode, encode

    tracker = PrefixTracker("approximate")
    polled = _state_table(1, 0).backends(_MODEL)[0].stats
    assert polled is not None
    tracker.observe(_MODEL, url, replace(polled, prefix_caching=True))
    routed = encode(_MODEL, url, keys, True, 1)
    ended = encode(_MODEL, url, (), False, 1)

    def apply_pair() -> None:
        model, at, got, _, _ = decode(routed)
        tracker.told(model, at, got, True)
        decode(ended)  # the receiver finds the routed blocks by the sequence number
        tracker.told(model, at, got, False)

    async def tell_samples(folder: str) -> list[float]:
        shares = [
            PrefixShare(ShareSpec(folder, i, workers), lambda *_: True, lambda _: None)
            for i in range(workers)
        ]
        for share in shares:
            await share.start()
        try:
            for _ in range(1000):  # each connects within its retry period
                if shares[0].connected == workers - 1:
                    break
                await asyncio.sleep(0.01)
            samples = []
            for _ in range(reps):
                start = time.perf_counter()
                ended = shares[0].tell(_MODEL, url, keys)
                samples.append((time.perf_counter() - start) * 1e6)
                ended()  # untimed: a few bytes
                await asyncio.sleep(0.001)  # the others read them
            return samples
        finally:
            for share in shares:
                await share.aclose()

    with tempfile.TemporaryDirectory() as folder:
        told = asyncio.run(tell_samples(folder))
    return [
        PrefixCost(
            f"workers ({workers}): tell the others a request was routed ({len(keys)} blocks)",
            percentile(told, 50),
            percentile(told, 99),
        ),
        PrefixCost(
            "workers: apply another worker's routed + ended messages (decode, index)",
            *_timed(apply_pair, reps),
        ),
    ]


def time_tokenize_with_keys(
    model_dir: str, prompt_tokens: int = 8192, block_size: int = 16, reps: int = 20
) -> list[PrefixCost]:
    """Counting an ~`prompt_tokens` text prompt with the tiny model's tokenizer, without and
    with its block keys (what `routing.prefix_cache` adds where the prompt is tokenized)."""
    import json

    from bench.tokenize_timing import _text_of_tokens
    from sal_gateway.request_body import Endpoint, parse_body
    from sal_gateway.tokenizer import load_model_tokenizer

    counter = load_model_tokenizer(model_dir, None)
    text = _text_of_tokens(counter, prompt_tokens, seed=7)
    req = parse_body(json.dumps({"model": "tiny", "prompt": text}).encode(), Endpoint.COMPLETIONS)
    n = counter.count_sync(req).total
    return [
        PrefixCost(
            f"tokenize {n} tokens (count only)", *_timed(lambda: counter.count_sync(req), reps, 1)
        ),
        PrefixCost(
            f"tokenize {n} tokens + block keys",
            *_timed(lambda: counter.count_sync(req, block_size), reps, 1),
        ),
    ]


def main() -> int:
    """``python -m bench.decision_timing``: print the prefix-tracking costs next to the
    tokenization of the same prompt (the tiny model's tokenizer, built in a temp dir)."""
    import tempfile
    from pathlib import Path

    from engine_patch import tiny_model

    rows = time_prefix_tracking()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model.build(Path(tmp) / "tiny", max_model_len=16384)
        rows += time_tokenize_with_keys(str(model_dir))
    for row in rows:
        print(f"{row.step:80s} p50 {row.p50_us:9.1f} us  p99 {row.p99_us:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
