"""``sal-bench fuzz``: the gateway under a stream of hostile requests, next to normal clients.

Starts a fake backend and ``sal-gateway serve`` (child processes, so the gateway's process
metrics are its own), measures well-formed request latency on the quiet gateway, then sends
`--requests` hostile requests (`bench.hostile`, deterministic per `--seed`) with
`--concurrency` connections while one normal client keeps sending well-formed requests.
Reports: 5xx count (must be 0), requests without an answer, well-formed failures, well-formed
p50/p99 latency quiet vs during the fuzz and their ratio (aim: within 2x), the event loop's lag
p99 during the fuzz (``sal_event_loop_lag_seconds``) and the gateway's RSS and open
descriptors before and after. The fuzz tier (tests/integration/test_gw_fuzz.py) runs
`run_fuzz()` and asserts on the same numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.hostile import (
    MAX_BODY_BYTES,
    NESTED_LOOP,
    Hostile,
    Models,
    hostile_requests,
    http,
    send_raw,
)
from bench.processes import PortAllocator, ServerGroup
from sal_core.percentile import percentile

HELP = "hostile-request fuzz: 5xx, loop lag, memory and well-formed latency quiet vs fuzzed"
TEMPLATE_TIMEOUT_S = 0.5
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class FuzzResult:
    """What one fuzz run measured (times in seconds, sizes in bytes)."""

    sent: int = 0
    by_status: collections.Counter[str] = field(default_factory=collections.Counter)
    server_errors: list[tuple[str, int]] = field(default_factory=list)
    """(kind, status) of every 5xx."""
    unanswered: collections.Counter[str] = field(default_factory=collections.Counter)
    """Hostile requests whose connection closed without a status line, by kind."""
    well_formed_failures: list[tuple[str, int | None]] = field(default_factory=list)
    quiet_latency_s: list[float] = field(default_factory=list)
    fuzz_latency_s: list[float] = field(default_factory=list)
    lag_p99_s: float = 0.0
    lag_max_bucket_s: float = 0.0
    rss_before: float = 0.0
    rss_after: float = 0.0
    fds_before: float = 0.0
    fds_after: float = 0.0
    duration_s: float = 0.0
    alive: bool = True
    client_cpu_s: float = 0.0
    """CPU the fuzzing client itself used during the fuzz (it shares the machine)."""
    gateway_cpu_s: float = 0.0
    """CPU the gateway process used during the fuzz (its worker processes not included)."""
    rate_per_s: float = 0.0
    """The flood's pace (0: as fast as its connections go)."""
    benign: bool = False
    """The control flood (well-formed requests) instead of hostile ones."""


def _scrape(url: str) -> Samples:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10.0) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _lag_buckets(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> dict[float, float]:
    return {
        float(dict(labels)["le"]): v
        for (name, labels), v in samples.items()
        if name == "sal_event_loop_lag_seconds_bucket"
    }


def lag_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile `q` of the observations made
    between two scrapes (cumulative ``le`` buckets)."""
    bounds = sorted(after)
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    if total <= 0:
        return 0.0
    for le in bounds:
        if after[le] - before.get(le, 0.0) >= q * total:
            return le
    return float("inf")


async def _well_formed(
    host: str, port: int, n: int | None, stop: Callable[[], bool]
) -> list[float]:
    """Sequential well-formed requests (n of them, or until `stop()`); latency of each, or -1
    for a failure."""
    out: list[float] = []
    i = 0
    while (n is None and not stop()) or (n is not None and i < n):
        body = json.dumps({"model": "tiny", "prompt": f"hello {i}", "max_tokens": 2}).encode()
        data = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        start = time.perf_counter()
        status = await send_raw(host, port, data)
        out.append(time.perf_counter() - start if status == 200 else -1.0)
        i += 1
        await asyncio.sleep(0.02)
    return out


def _probe_main(host: str, port: int, n: int | None, stop: Any, out: Any) -> None:
    """Entry of the normal client's own process (`_probe`): `_well_formed` until `stop` (a
    multiprocessing event) is set, the latencies put on `out`."""
    out.put(asyncio.run(_well_formed(host, port, n, stop.is_set)))


async def _probe(host: str, port: int, n: int | None, stop: Any) -> list[float]:
    """The normal client in a process of its own, as a real client is: sharing the flood's
    event loop, its latency included the loop's own delays building and sending the flood
    (10 MiB bodies), not the gateway's. Returns its latencies once it stopped."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_probe_main, args=(host, port, n, stop, out), daemon=True)
    proc.start()
    try:
        latencies: list[float] = await asyncio.to_thread(out.get, True, 600.0)
    finally:
        await asyncio.to_thread(proc.join, 10.0)
        if proc.is_alive():
            proc.kill()
    return latencies


def benign_requests(n: int, models: Models) -> Iterator[Hostile]:
    """The control flood (``--benign``): `n` well-formed completions, the same load shape as
    the hostile flood (same count, same connections) with nothing hostile in it, so that
    what a flood costs well-formed latency can be told apart from what hostile content does."""
    for i in range(n):
        body = {"model": models.plain, "prompt": f"benign {i} " * (1 + i % 64), "max_tokens": 2}
        yield Hostile("benign", http("POST", "/v1/completions", json.dumps(body).encode()), True)


async def _fuzz(
    host: str,
    port: int,
    n: int,
    seed: int,
    concurrency: int,
    r: FuzzResult,
    benign: bool,
    rate_per_s: float = 0.0,
) -> None:
    """Send the flood over `concurrency` connections: as fast as they go (`rate_per_s` 0),
    or paced to `rate_per_s` requests a second (open loop, still at most `concurrency` in
    flight)."""
    queue: asyncio.Queue[Hostile | None] = asyncio.Queue(maxsize=concurrency * 2)

    async def worker() -> None:
        while (item := await queue.get()) is not None:
            status = await send_raw(host, port, item.data)
            r.sent += 1
            r.by_status[str(status)] += 1
            if status is None:
                r.unanswered[item.kind] += 1
            elif status >= 500:
                r.server_errors.append((item.kind, status))
            if item.well_formed and status != 200:
                r.well_formed_failures.append((item.kind, status))

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    flood = benign_requests(n, Models()) if benign else hostile_requests(seed, n, Models())
    started = time.monotonic()
    for i, item in enumerate(flood):
        if rate_per_s > 0:
            await asyncio.sleep(max(0.0, started + i / rate_per_s - time.monotonic()))
        await queue.put(item)
    for _ in workers:
        await queue.put(None)
    await asyncio.gather(*workers)


async def _run(
    url: str, n: int, seed: int, concurrency: int, quiet: int, benign: bool, rate_per_s: float
) -> FuzzResult:
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    r = FuzzResult()
    ctx = multiprocessing.get_context("spawn")
    r.quiet_latency_s = await _probe(host, port, quiet, ctx.Event())
    before = await asyncio.to_thread(_scrape, url)
    r.rss_before = before[("process_resident_memory_bytes", ())]
    r.fds_before = before[("process_open_fds", ())]
    stop = ctx.Event()
    start = time.monotonic()
    cpu_start = time.process_time()
    normal = asyncio.create_task(_probe(host, port, None, stop))
    await _fuzz(host, port, n, seed, concurrency, r, benign, rate_per_s)
    stop.set()
    r.fuzz_latency_s = await normal
    r.duration_s = time.monotonic() - start
    r.client_cpu_s = time.process_time() - cpu_start
    r.well_formed_failures.extend(("normal client", None) for x in r.fuzz_latency_s if x < 0)
    r.fuzz_latency_s = [x for x in r.fuzz_latency_s if x >= 0]
    after = await asyncio.to_thread(_scrape, url)
    r.rss_after = after[("process_resident_memory_bytes", ())]
    r.fds_after = after[("process_open_fds", ())]
    cpu = ("process_cpu_seconds_total", ())
    r.gateway_cpu_s = after[cpu] - before[cpu]
    lag_before, lag_after = _lag_buckets(before), _lag_buckets(after)
    r.lag_p99_s = lag_quantile(lag_before, lag_after, 0.99)
    r.lag_max_bucket_s = lag_quantile(lag_before, lag_after, 1.0)
    return r


def single_request_lags(url: str) -> dict[str, float]:
    """The largest event loop lag (histogram bucket bound) while one hostile request of each
    heavy kind is served alone: a 10 MiB body, a ~100k-token prompt, a runaway template."""
    models = Models()
    ids = json.dumps({"model": models.plain, "prompt": [7] * (MAX_BODY_BYTES // 3 - 100)})
    words = " ".join(f"w{i % 977}x" for i in range(50_000))  # ~100k tokens (tiny tokenizer)
    long_prompt = json.dumps({"model": models.plain, "prompt": words, "max_tokens": 1})
    runaway = json.dumps(
        {"model": models.trusted, "messages": [{"role": "user", "content": "x"}],
         "chat_template": NESTED_LOOP}
    )  # fmt: skip
    cases = {
        "10 MiB token-ID body": http("POST", "/v1/completions", ids.encode()),
        "~100k-token prompt": http("POST", "/v1/completions", long_prompt.encode()),
        "runaway trusted template": http("POST", "/v1/chat/completions", runaway.encode()),
    }
    port = int(url.rsplit(":", 1)[1])
    out = {}
    for name, data in cases.items():
        time.sleep(1.0)  # the template workers start in the background
        before = _lag_buckets(_scrape(url))
        asyncio.run(send_raw("127.0.0.1", port, data))
        time.sleep(0.2)
        out[name] = lag_quantile(before, _lag_buckets(_scrape(url)), 1.0)
    return out


def run_fuzz(
    url: str,
    n: int,
    seed: int = 1,
    concurrency: int = 16,
    quiet: int = 200,
    benign: bool = False,
    rate_per_s: float = 0.0,
) -> FuzzResult:
    """Fuzz the gateway at `url` (see the module docstring); it must serve `Models()`.
    `benign`: flood with well-formed requests instead (`benign_requests`, the control).
    `rate_per_s`: pace the flood (0: as fast as the connections go)."""
    r = asyncio.run(_run(url, n, seed, concurrency, quiet, benign, rate_per_s))
    r.rate_per_s, r.benign = rate_per_s, benign
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10.0) as resp:
            r.alive = resp.status == 200
    except OSError:
        r.alive = False
    return r


def gateway_config(port: int, backends: list[str], model_dir: Path) -> dict[str, object]:
    """Two models on the fake backends: request templates refused / trusted."""
    models = Models()
    return {
        "listen": {
            "host": "127.0.0.1",
            "port": port,
            "header_timeout_s": 5.0,
            "body_timeout_s": 5.0,
        },
        "models": [
            {"name": models.plain, "tokenizer": str(model_dir), "backends": backends},
            {
                "name": models.trusted,
                "tokenizer": str(model_dir),
                "backends": backends,
                "trust_request_chat_template": True,
            },
        ],
        "routing": {"poll_interval_s": 0.1, "stale_after_s": 5.0, "poll_timeout_s": 2.0},
        "limits": {"template_timeout_s": TEMPLATE_TIMEOUT_S},
        "log_level": "warning",
    }


@contextmanager
def running_gateway(work: Path, model_dir: Path) -> Iterator[str]:
    """Two fake backends and ``sal-gateway serve`` in child processes (as in a fleet: a
    failed upstream connection is retried on the other); yields the gateway URL."""
    # A start that differs per process: parallel runs (CI, other benchmarks) rarely collide.
    start = 20000 + (os.getpid() * 7) % 8000
    ports = PortAllocator(start, start + 2000)
    with ServerGroup() as group:
        backends = []
        for name in ("a", "b"):
            fake_port = ports.take()
            backends.append(f"http://127.0.0.1:{fake_port}")
            group.start(
                [
                    "-m",
                    "bench.fake_backend_server",
                    "--port",
                    str(fake_port),
                    # Both configured names, as vLLM's `--served-model-name tiny tiny-trusted`.
                    "--also-serves",
                    Models().trusted,
                ],
                f"{backends[-1]}/health",
                work / f"backend-{name}.log",
            )
        gw_port = ports.take()
        config = work / "gateway.yaml"
        config.write_text(yaml.safe_dump(gateway_config(gw_port, backends, model_dir)))
        url = f"http://127.0.0.1:{gw_port}"
        group.start(
            ["-m", "sal_gateway.cli", "serve", "--config", str(config)],
            f"{url}/ready",
            work / "gateway.log",
        )
        group.wait_all(timeout_s=120.0)
        yield url


def table(results: list[FuzzResult]) -> str:
    """The benchmark table, one row per run."""
    head = (
        "| run | flood | rate /s (achieved) | 5xx | unanswered | well-formed failed | "
        "quiet p50/p99 ms | fuzz p50/p99 ms | p99 ratio | loop lag p99 | "
        "RSS MiB before/after | fds before/after | "
        "CPU s client/gateway | s |"
    )
    rows = [head, "|" + "---|" * 14]
    for i, r in enumerate(results, 1):
        q50, q99 = percentile(r.quiet_latency_s, 50), percentile(r.quiet_latency_s, 99)
        f50, f99 = percentile(r.fuzz_latency_s, 50), percentile(r.fuzz_latency_s, 99)
        achieved = r.sent / r.duration_s if r.duration_s > 0 else 0.0
        pace = f"{achieved:.0f}" if r.rate_per_s <= 0 else f"{r.rate_per_s:g} ({achieved:.0f})"
        rows.append(
            f"| {i} | {r.sent} {'benign' if r.benign else 'hostile'} | {pace} | "
            f"{len(r.server_errors)} | {sum(r.unanswered.values())} | "
            f"{len(r.well_formed_failures)} | {q50 * 1e3:.1f} / {q99 * 1e3:.1f} | "
            f"{f50 * 1e3:.1f} / {f99 * 1e3:.1f} | {f99 / q99:.2f} | <= {r.lag_p99_s * 1e3:g} ms | "
            f"{r.rss_before / 2**20:.0f} / {r.rss_after / 2**20:.0f} | "
            f"{r.fds_before:.0f} / {r.fds_after:.0f} | "
            f"{r.client_cpu_s:.0f} / {r.gateway_cpu_s:.0f} | {r.duration_s:.0f} |"
        )
    return "\n".join(rows)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=10_000, help="hostile requests per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1, help="seed of the first run (+1 per run)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--quiet", type=int, default=200, help="quiet well-formed requests")
    parser.add_argument(
        "--benign",
        action="store_true",
        help="control run: flood with well-formed requests (same count and connections)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="after each hostile run, the same run with the benign flood (side by side)",
    )
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.0],
        help="flood paces to run, requests/s (0: as fast as the connections go)",
    )


def run(args: argparse.Namespace) -> int:
    from engine_patch import tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="sal-fuzz-") as tmp:
        work = Path(tmp)
        model_dir = tiny_model.build(work / "tiny-llama")
        kinds = [True, False] if args.control else [args.benign]
        cells = [(rate, i, b) for rate in args.rates for i in range(args.runs) for b in kinds]
        for rate, i, benign in cells:
            with running_gateway(work, model_dir) as url:
                singles = single_request_lags(url)
                print(
                    "largest loop lag (bucket bound) per single hostile request: "
                    + ", ".join(f"{k}: <= {v * 1e3:g} ms" for k, v in singles.items()),
                    flush=True,
                )
                r = run_fuzz(
                    url, args.requests, args.seed + i, args.concurrency, args.quiet, benign, rate
                )
            results.append(r)
            if r.server_errors:
                print(f"5xx: {r.server_errors[:20]}")
                log = (work / "gateway.log").read_text(errors="replace")
                print("\n".join(x for x in log.splitlines() if "ERROR" in x or "Error" in x))
            print(
                f"run {i + 1}: load average (1/5/15 min) at its end "
                f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())}; "
                f"{r.sent} hostile in {r.duration_s:.0f} s, statuses "
                f"{dict(sorted(r.by_status.items()))}, unanswered {dict(r.unanswered)}",
                flush=True,
            )
    print(table(results))
    return 0 if all(not r.server_errors and r.alive for r in results) else 1
