"""``sal-bench prefix-real``: prefix-cache-aware routing on real vLLM-on-CPU replicas.

The real gateway (`sal_gateway.app.create_app`, in this process) in front of N real vLLM
replicas (``sal-engine serve``, LARRY, a small dense model with dummy weights, automatic
prefix caching on, a small KV cache so that blocks are evicted, KV-cache events on an ipc
socket each, ``--enable-prompt-tokens-details``), replaying the seeded multi-turn chat
workload of `bench.prefix_workload`. One run per (seed, configuration); configurations:

* ``sal+approximate``: cache-aware SAL, the gateway's own index of what it routed;
* ``sal+kv_events``: cache-aware SAL, the index corrected by vLLM's KV-cache events;
* ``sal_paper``: the paper's Eq. 2 taken literally (cache-blind);
* ``p2c``: power of two choices (cache-blind).

Every run starts from empty caches (``POST /reset_prefix_cache``, vLLM's dev-mode route) and
a fresh gateway. Measured: TTFT per turn; the achieved hit rate (vLLM's own counters in
``/metrics``, and each request's ``cached_tokens``); the predicted hit rate and the
per-request prediction error (the gateway's prediction on the chosen replica, captured where
it takes its hold on the blocks, against that request's ``cached_tokens``); preemptions; the
busiest replica's share; this process's CPU time per request. Ratios are paired by seed.

    flock /tmp/sal-vllm.lock nice -n 19 sal-bench prefix-real --seeds 0,1,2

Writes ``docs/results/prefix_real.md`` and ``.json`` (``--out``). About 15-25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.prefix_workload import Replay, make_workload, replay
from bench.tables import format_table
from engine_sim.demo import fleet_reuse_rates
from sal_core.percentile import percentile

HELP = "prefix-cache-aware SAL vs sal_paper vs p2c on real vLLM-on-CPU replicas (hit rate, TTFT)"
CONFIGS = (
    "sal+approximate",
    "sal+kv_events",
    "sal_paper",
    "p2c",
    "sal+approximate@2told",
    "sal+approximate@2alone",
)
"""``@2told`` / ``@2alone``: two gateways (``peers`` over loopback UDP, counts shared)
that each get every turn at random, with or without ``peers.share_prefix_blocks``."""
PEERS_SECRET = "prefix-real: a secret for the two gateways"
BLOCK_SIZE = 128
"""vLLM's KV block on CPU."""
_COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "preemptions": "vllm:num_preemptions_total",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", default="0,1,2", help="comma list; one run per config each")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS[:4]),
        help="comma list of " + "|".join(CONFIGS) + " (default: the one-gateway ones)",
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.5, help="conversations started per s")
    parser.add_argument("--think-s", type=float, default=3.0, help="mean think time (s)")
    parser.add_argument(
        "--kv-blocks", type=int, default=40, help="KV blocks per replica (128 tokens)"
    )
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--first-port", type=int, default=8310)
    parser.add_argument("--out", type=Path, default=Path("docs/results/prefix_real.md"))


@dataclass
class RunResult:
    config: str
    seed: int
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Sum of the requests' ``cached_tokens`` (vLLM)."""
    vllm_hit_rate: float = 0.0
    """vLLM's own counters over the run: hits / queries."""
    predicted_tokens: int = 0
    """Sum of the gateway's predicted hit tokens on the chosen replicas."""
    abs_error_tokens: float = 0.0
    """Mean |predicted - cached_tokens| per request."""
    exact_share: float = 0.0
    """Requests whose prediction equals vLLM's cached_tokens."""
    preemptions: int = 0
    busiest_share: float = 0.0
    fleet_reuse: dict[str, float] = field(default_factory=dict)
    """The gateway's fleet-reuse estimate per ``kv_scale`` (`sal_core.fleet_reuse`): hit
    rate of one LRU cache of that many times the replicas' KV over the prompts routed."""
    cpu_ms_per_request: float = 0.0
    wall_s: float = 0.0


def _scrape(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    found = {}
    for key, name in _COUNTERS.items():
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        found[key] = sum(float(v) for v in values)
    return found


def _reset_caches(urls: Sequence[str]) -> None:
    import httpx

    deadline = time.monotonic() + 60
    for url in urls:
        while httpx.post(f"{url}/reset_prefix_cache", timeout=10.0).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: /reset_prefix_cache kept failing")
            time.sleep(0.5)


def _gateway_config(
    urls: Sequence[str],
    endpoints: Sequence[str],
    config: str,
    seed: int,
    peers: tuple[int, int] | None = None,
) -> Any:
    """`config` (a `CONFIGS` name) as a gateway configuration; `peers`: this gateway's UDP
    port and the other gateway's (the ``@2`` configurations)."""
    from sal_gateway.config import build_config

    routing, _, gateways = config.partition("@")
    policy, _, mode = routing.partition("+")
    extra: dict[str, Any] = {}
    if peers is not None:
        extra["peers"] = {
            "listen": f"127.0.0.1:{peers[0]}",
            "addresses": [f"127.0.0.1:{peers[1]}"],
            "expire_s": 5.0,  # the two gateways share 2 busy cores with the replicas
            "share_prefix_blocks": gateways == "2told",
        }
    return build_config(
        {
            **extra,
            "models": [
                {
                    "name": "tiny",
                    "backends": list(urls),
                    "kv_events_endpoints": dict(zip(urls, endpoints, strict=True)),
                }
            ],
            "listen": {"host": "127.0.0.1", "port": 0},
            # Lenient staleness: the replicas and this process share 2 busy cores.
            "routing": {
                "policy": policy,
                "prefix_cache": mode or "approximate",
                # Every hit counts: the tiny model's conversations are a few 128-token
                # blocks long, under the default 1,024-token minimum match.
                "prefix_min_match_tokens": 0,
                "seed": seed,
                "poll_timeout_s": 1.0,
                "stale_after_s": 3.0,
            },
            "proxy": {"stream_idle_timeout_s": 120.0},
            "log_level": "warning",
        }
    )


def _capture_predictions(runtime: Any, predicted: dict[tuple[int, ...], int]) -> None:
    """Record, per prompt (its block keys), what the gateway predicted on the replica it
    chose: `PrefixTracker.hold` runs right after the decision with nothing in between, so a
    one-view lookup there is exactly the decision's prediction (benchmark instrumentation)."""
    from sal_core.policies import BackendView

    tracker = runtime.prefix
    original = tracker.hold

    def hold(model: str, url: str, blocks: Any) -> Any:
        view = BackendView(url, True, 0, 0, 0, 1)
        tracker.annotate(model, [view], blocks)
        predicted[blocks.keys] = view.cached_tokens
        return original(model, url, blocks)

    tracker.hold = hold  # an instance attribute shadows the method for this run only


def _run_once(
    urls: Sequence[str], endpoints: Sequence[str], config: str, seed: int, args: argparse.Namespace
) -> RunResult:
    import httpx

    from engine_sim.fake_vllm import ServedApp
    from sal_core.prefix import chain_hashes
    from sal_gateway.app import create_app

    conversations = make_workload(
        seed, args.conversations, rate_per_s=args.rate, think_mean_s=args.think_s
    )
    _reset_caches(urls)
    before = [_scrape(u) for u in urls]
    predicted: dict[tuple[int, ...], int] = {}
    if "@2" in config:
        os.environ.setdefault("SAL_GATEWAY_PEERS_SECRET", PEERS_SECRET)
        udp = free_udp_ports(2)
        apps = [
            create_app(_gateway_config(urls, endpoints, config, seed, (udp[i], udp[1 - i])))
            for i in range(2)
        ]
    else:
        apps = [create_app(_gateway_config(urls, endpoints, config, seed))]
    cpu0 = time.process_time()
    with contextlib.ExitStack() as stack:
        gateways = [stack.enter_context(ServedApp(app, lifespan=True)) for app in apps]
        deadline = time.monotonic() + 60
        for gateway in gateways:
            while httpx.get(f"{gateway}/ready", timeout=5.0).status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway never became ready")
                time.sleep(0.2)
        for app in apps:
            _capture_predictions(app.state.runtime, predicted)
        time.sleep(1.0)  # every replica polled: the tracker knows the block size
        outcome: Replay = asyncio.run(replay(gateways, conversations, timeout_s=180.0, seed=seed))
        gw_metrics = "\n".join(
            httpx.get(f"{gateway}/metrics", timeout=10.0).text for gateway in gateways
        )
    cpu_s = time.process_time() - cpu0
    after = [_scrape(u) for u in urls]
    return _summarize(
        config, seed, outcome, before, after, predicted, gw_metrics, cpu_s, chain_hashes
    )


def _summarize(
    config: str,
    seed: int,
    outcome: Replay,
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    predicted: dict[tuple[int, ...], int],
    gw_metrics: str,
    cpu_s: float,
    chain_hashes: Any,
) -> RunResult:
    ok = [r for r in outcome.results if not r.error and r.ttft_s is not None]
    result = RunResult(config, seed, len(outcome.results), len(outcome.results) - len(ok))
    result.errors = sorted({r.error for r in outcome.results if r.error})[:5]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    result.ttft_p50_s = percentile(ttfts, 50) if ttfts else float("nan")
    result.ttft_p95_s = percentile(ttfts, 95) if ttfts else float("nan")
    result.prompt_tokens = sum(r.prompt_tokens for r in ok)
    result.cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in _COUNTERS}
    result.vllm_hit_rate = delta["hits"] / delta["queries"] if delta["queries"] else 0.0
    result.preemptions = int(delta["preemptions"])
    errors = []
    exact = 0
    for r in ok:
        guess = predicted.get(tuple(chain_hashes(list(r.prompt), BLOCK_SIZE)), 0)
        result.predicted_tokens += guess
        errors.append(abs(guess - (r.cached_tokens or 0)))
        exact += guess == (r.cached_tokens or 0)
    result.abs_error_tokens = statistics.fmean(errors) if errors else 0.0
    result.exact_share = exact / len(ok) if ok else 0.0
    routed: dict[str, float] = {}  # per backend, every gateway's decisions summed
    for labels, value in re.findall(
        r"^sal_routing_decisions_total\{([^}]*)\} ([0-9.eE+-]+)$", gw_metrics, re.M
    ):
        backend = re.search(r'backend="([^"]*)"', labels)
        key = backend.group(1) if backend else labels
        routed[key] = routed.get(key, 0.0) + float(value)
    total = sum(routed.values())
    result.busiest_share = max(routed.values()) / total if total else 0.0
    result.fleet_reuse = fleet_reuse_rates(gw_metrics)
    result.cpu_ms_per_request = 1000 * cpu_s / max(1, len(outcome.results))
    result.wall_s = outcome.wall_s
    return result


def free_udp_ports(count: int) -> list[int]:
    """`count` UDP ports on 127.0.0.1 free a moment ago (the OS's choice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


# --- the replicas -------------------------------------------------------------------------


def _replica_args(port: int, endpoint: str, kv_blocks: int) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "",
    }
    return [
        "--served-model-name",
        "tiny",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override",
        str(kv_blocks),
        "--kv-events-config",
        json.dumps(kv_events),
    ]


def _start_replicas(args: argparse.Namespace, workdir: Path) -> tuple[list[Any], list[str]]:
    from engine_patch import tiny_model
    from engine_patch.replica import LocalReplica, replica_command

    model_dir = tiny_model.build(
        workdir / "model", max_model_len=2048, hidden_size=args.hidden_size, num_layers=args.layers
    )
    replicas, endpoints = [], []
    try:
        for i in range(args.replicas):
            port = args.first_port + i
            endpoint = f"ipc://{workdir}/kv-{i}.sock"
            cmd = replica_command(
                model_dir, port, extra_args=_replica_args(port, endpoint, args.kv_blocks)
            )
            # The dev-mode routes include /reset_prefix_cache (each run starts cold).
            replica = LocalReplica(cmd, port, env={"VLLM_SERVER_DEV_MODE": "1"})
            replicas.append(replica)
            endpoints.append(endpoint)
            print(f"starting replica {i} on port {port} ...", file=sys.stderr, flush=True)
            replica.start(timeout_s=600)
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas, endpoints


# --- the report ----------------------------------------------------------------------------


def _median_range(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "—"
    low, mid, high = (fmt.format(v) for v in (min(values), percentile(values, 50), max(values)))
    return f"{mid} ({low}–{high})"


def _command(args: argparse.Namespace) -> str:
    """The command line that regenerates this report (options that differ from defaults)."""
    defaults = vars(build_parser().parse_args([]))
    parts = ["sal-bench prefix-real"]
    for name, value in vars(args).items():
        if (name in defaults and value != defaults[name]) or name == "seeds":
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sal-bench prefix-real", description=HELP)
    configure(parser)
    return parser


def report(runs: Sequence[RunResult], args: argparse.Namespace) -> str:
    """The markdown report: one row per configuration (median over seeds, min–max), then
    TTFT ratios paired by seed against cache-aware SAL, then every run."""
    configs = [c for c in CONFIGS if any(r.config == c for r in runs)]
    by = {c: [r for r in runs if r.config == c] for c in configs}
    seeds = sorted({r.seed for r in runs})
    rows = []
    for c in configs:
        rs = by[c]
        rows.append(
            [
                c,
                _median_range([r.vllm_hit_rate for r in rs], "{:.2f}"),
                _median_range([r.predicted_tokens / max(1, r.prompt_tokens) for r in rs], "{:.2f}"),
                _median_range([r.abs_error_tokens for r in rs], "{:.0f}"),
                _median_range([r.exact_share for r in rs], "{:.2f}"),
                _median_range([r.ttft_p50_s for r in rs]),
                _median_range([r.ttft_p95_s for r in rs]),
                _median_range([float(r.preemptions) for r in rs], "{:.0f}"),
                _median_range([r.busiest_share for r in rs], "{:.2f}"),
                " / ".join(
                    _median_range([r.fleet_reuse.get(k, 0.0) for r in rs], "{:.2f}")
                    for k in ("1", "2", "4")
                )
                if any(r.fleet_reuse for r in rs)
                else "—",
                _median_range([r.cpu_ms_per_request for r in rs], "{:.1f}"),
                sum(r.failed for r in rs),
            ]
        )
    headers = [
        "config",
        "achieved hit rate (vLLM)",
        "predicted hit rate",
        "prediction error, tokens/request",
        "exact predictions",
        "TTFT p50 s",
        "TTFT p95 s",
        "preemptions",
        "busiest replica share",
        "fleet-reuse estimate x1 / x2 / x4",
        "CPU ms/request (this process)",
        "failed",
    ]
    ratio_rows = []
    base = "sal+approximate"
    for c in configs:
        if c == base or base not in by:
            continue
        pairs = {
            metric: [
                getattr(o, metric) / getattr(b, metric)
                for s in seeds
                for b in by[base]
                for o in by[c]
                if b.seed == s and o.seed == s and getattr(b, metric) > 0
            ]
            for metric in ("ttft_p50_s", "ttft_p95_s")
        }
        ratio_rows.append(
            [
                c,
                _median_range(pairs["ttft_p50_s"], "{:.2f}x"),
                _median_range(pairs["ttft_p95_s"], "{:.2f}x"),
            ]
        )
    every = [
        [
            r.config,
            r.seed,
            r.requests,
            f"{r.vllm_hit_rate:.2f}",
            f"{r.predicted_tokens / max(1, r.prompt_tokens):.2f}",
            f"{r.ttft_p50_s:.3f}",
            f"{r.ttft_p95_s:.3f}",
            r.preemptions,
            f"{r.busiest_share:.2f}",
            r.failed,
            "; ".join(r.errors)[:120],
        ]
        for r in runs
    ]
    lines = [
        "# Prefix-cache-aware routing on real vLLM-on-CPU replicas",
        "",
        f"`{_command(args)}`: the gateway in front of {args.replicas} "
        "real vLLM-on-CPU replicas (LARRY; a dummy-weight Llama with hidden size "
        f"{args.hidden_size}, {args.layers} layers; prefix caching on; {args.kv_blocks} KV blocks "
        f"of {BLOCK_SIZE} tokens each, so blocks are evicted), {args.conversations} multi-turn "
        "conversations per run "
        f"(`bench/prefix_workload.py`: a shared {BLOCK_SIZE}-token system prompt, first message "
        f"median 300 tokens, later ones 90, replies of 16-32 generated tokens fed back into the "
        f"next prompt, conversations starting at {args.rate}/s, think time mean {args.think_s} s). "
        "Every run starts with empty caches and a fresh gateway. Median over seeds (min–max).",
        "",
        format_table(headers, rows),
        "",
        "The fleet-reuse estimate is what the gateway's `sal_prefix_fleet_reuse_*` metrics "
        "read at the end of the run: the hit rate one LRU cache of 1, 2 and 4 times the "
        "replicas' KV would have had over the prompts routed (docs/gateway.md, \"Would "
        'better routing or more KV keep more?"). Achieved near x1: routing keeps what this '
        "KV can hold; well below: routing loses reuse; x2, x4 above x1: more KV would keep "
        "more.",
        "",
        "TTFT of each configuration divided by cache-aware SAL's (`sal+approximate`) in the same "
        "seed's run (> 1: cache-aware SAL is faster); median over seeds (min–max). A ratio whose "
        "range includes 1 is a tie.",
        "",
        format_table(["config", "TTFT p50 ratio", "TTFT p95 ratio"], ratio_rows),
        "",
        "Every run:",
        "",
        format_table(
            [
                "config",
                "seed",
                "requests",
                "achieved",
                "predicted",
                "TTFT p50",
                "TTFT p95",
                "preemptions",
                "busiest share",
                "failed",
                "errors",
            ],
            every,
        ),
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    seeds = [int(s) for s in args.seeds.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="prefix-real-") as tmp:
        replicas, endpoints = _start_replicas(args, Path(tmp))
        urls = [r.base_url for r in replicas]
        try:
            for i, seed in enumerate(seeds):
                # Rotate the order per seed so no configuration always runs first.
                order = configs[i % len(configs) :] + configs[: i % len(configs)]
                for config in order:
                    result = _run_once(urls, endpoints, config, seed, args)
                    runs.append(result)
                    print(
                        f"seed {seed} {config}: hit {result.vllm_hit_rate:.2f} predicted "
                        f"{result.predicted_tokens / max(1, result.prompt_tokens):.2f} TTFT p50 "
                        f"{result.ttft_p50_s:.3f} p95 {result.ttft_p95_s:.3f} "
                        f"failed {result.failed}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for replica in replicas:
                replica.stop()
    text = report(runs, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
