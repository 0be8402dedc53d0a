"""FCFS vs LARRY vs the tail-guarded LARRY on one real vLLM-on-CPU replica (Azure chat trace).

Starts one replica per scheduler (``sal-engine serve``, identical settings except the
scheduler) and replays ``--runs`` slices of the trace on each (run ``i``: rows
``start_row + i * requests`` on) with the trace's own inter-arrival times divided by
``--load-factor``, one replay at a time, waiting for the replica to be idle first. By default
(``--order interleaved``) every replica runs from the start and each slice is replayed on
every scheduler in turn, the order rotated from slice to slice, so the runs a ratio pairs are
seconds apart instead of one scheduler's whole share of the benchmark (``--order grouped``:
one replica at a time, all its slices, then the next). Idle replicas wait on their queues and
cost the running one little CPU. ``--pin`` puts the replicas' engine processes on the last
CPU and their API servers and this client on the others (`bench.cpu_pinning`), so that the
engine's share of the machine does not swing with the load of streaming 150 responses.
Prints per
scheduler the median (min-max over the runs) of TTFT (p50/p95/p99/max), normalized TTFT
(TTFT per prompt token), total generation time, preemptions (vLLM's own
``vllm:num_preemptions`` counter), engine steps (the count of vLLM's
``vllm:iteration_tokens_total``) and the latency of ``GET /stats`` polled at 10 Hz, plus
every scheduler's per-run ratios to FCFS on the same slice. Prompts are random token IDs
whose lengths are the trace's, scaled so the longest fits the tiny model's context; outputs
are forced to the trace's length (capped) with ``ignore_eos`` + ``max_tokens``.

Schedulers: ``fcfs`` (vLLM's order + /stats), ``fcfs+headroom`` (the same with vLLM's
``--watermark`` set to ``--headroom``), ``larry`` (the paper's, ``--alpha``), ``larry_tail``
(the tail guard, its ``headroom`` set to ``--headroom``), ``larry_tail+marginM`` (the same
with ``margin_s`` M, e.g. ``larry_tail+margin2``), ``fcfs+noprefix`` and ``larry+noprefix``
(vLLM's prefix caching off: no cache lookups in LARRY's memory term), ``stock``.

    python -m bench.larry_vllm_bench [--trace PATH] [--requests 80] [--runs 3] [--load-factor 1.0]

A replay of 150 requests takes ~10 s; starting the replicas takes most of the time (a few
minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from bench.cpu_pinning import pin_replica, pin_self, split_cpus
from engine_patch import tiny_model
from engine_patch.replica import LocalReplica, replica_command
from engine_sim.data import AZURE_CHAT, data_dir, missing_message
from sal_core.percentile import percentile

DEFAULT_TRACE = data_dir() / AZURE_CHAT
"""The chat trace in the repository's ``data/`` (``engine_sim.data``)."""
SERVED_NAME = "tiny"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One replayed request: when to send it (relative to the start) and its forced sizes."""

    send_at_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class RunResult:
    """Raw per-request samples of one scheduler's run over one slice."""

    scheduler: str
    run: int = 0
    ttft_s: list[float] = field(default_factory=list)
    norm_ttft_s_per_token: list[float] = field(default_factory=list)
    generation_s: list[float] = field(default_factory=list)
    stats_latency_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    engine_steps: int = 0
    errors: int = 0
    wall_s: float = 0.0


def load_trace_slice(
    path: Path,
    *,
    start_row: int,
    count: int,
    load_factor: float,
    max_prompt_tokens: int,
    max_output_tokens: int,
) -> list[TraceRequest]:
    """Read `count` rows from `start_row`, rescale time by `load_factor` and prompt lengths so
    the slice's longest prompt becomes `max_prompt_tokens`; cap outputs (pure apart from the
    file read)."""
    rows: list[tuple[datetime, int, int]] = []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start_row:
                continue
            if len(rows) >= count:
                break
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"no rows in {path} from row {start_row}")
    t0 = rows[0][0]
    longest = max(p for _, p, _ in rows)
    scale = min(1.0, max_prompt_tokens / longest)
    return [
        TraceRequest(
            send_at_s=(stamp - t0).total_seconds() / load_factor,
            prompt_tokens=max(1, round(prompt * scale)),
            output_tokens=max(1, min(output, max_output_tokens)),
        )
        for stamp, prompt, output in rows
    ]


async def _one_request(
    client: httpx.AsyncClient, url: str, req: TraceRequest, seed: int, result: RunResult
) -> None:
    rng = random.Random(seed)
    body = {
        "model": SERVED_NAME,
        "prompt": [rng.randrange(10, 2000) for _ in range(req.prompt_tokens)],
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    first: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.errors += 1
                return
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: ") and line != "data: [DONE]":
                    first = time.monotonic()
    except httpx.HTTPError:
        result.errors += 1
        return
    end = time.monotonic()
    if first is None:
        result.errors += 1
        return
    result.ttft_s.append(first - start)
    result.norm_ttft_s_per_token.append((first - start) / req.prompt_tokens)
    result.generation_s.append(end - start)


async def _poll_stats(
    client: httpx.AsyncClient, url: str, stop: asyncio.Event, out: RunResult
) -> None:
    while not stop.is_set():
        t = time.monotonic()
        try:
            response = await client.get(f"{url}/stats")
            if response.status_code == 200:
                out.stats_latency_s.append(time.monotonic() - t)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)


def parse_counters(metrics_text: str) -> tuple[int, int]:
    """vLLM's preemptions and engine steps (``vllm:iteration_tokens_total``'s count) so far,
    from its ``/metrics`` text (summed over engines; 0 where absent)."""
    return (
        _metric_sum(metrics_text, "vllm:num_preemptions_total"),
        _metric_sum(metrics_text, "vllm:iteration_tokens_total_count"),
    )


def _metric_sum(text: str, name: str) -> int:
    """The sum of every sample of `name` (any labels) in Prometheus text."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return int(sum(float(v) for v in values))


async def _counters(client: httpx.AsyncClient, url: str) -> tuple[int, int]:
    return parse_counters((await client.get(f"{url}/metrics")).text)


async def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the replica's `/stats` shows nothing waiting or running (between slices)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                body = (await client.get(f"{url}/stats")).json()
                if body.get("num_waiting") == 0 and body.get("num_running") == 0:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} still busy after {timeout_s} s")


async def replay(
    url: str, requests: Sequence[TraceRequest], scheduler: str, run: int = 0
) -> RunResult:
    """Send every request at its time (open loop) and collect the samples."""
    result = RunResult(scheduler, run)
    limits = httpx.Limits(max_connections=len(requests) + 4)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        before = await _counters(client, url)
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_stats(client, url, stop, result))
        start = time.monotonic()

        async def at(req: TraceRequest, seed: int) -> None:
            await asyncio.sleep(max(0.0, start + req.send_at_s - time.monotonic()))
            await _one_request(client, url, req, seed, result)

        async with asyncio.TaskGroup() as tg:
            for i, req in enumerate(requests):
                tg.create_task(at(req, seed=i))
        result.wall_s = time.monotonic() - start
        stop.set()
        await poller
        # Counters reach /metrics with the engine's next stats update.
        await asyncio.sleep(1.0)
        after = await _counters(client, url)
        result.preemptions = after[0] - before[0]
        result.engine_steps = after[1] - before[1]
    return result


def _metrics(r: RunResult) -> dict[str, float]:
    """One run's headline numbers (seconds, ms per token for normalized TTFT)."""
    out: dict[str, float] = {}
    for q in (50, 95, 99, 100):
        name = "max" if q == 100 else f"p{q}"
        out[f"TTFT {name} (s)"] = percentile(r.ttft_s, q)
    for q in (50, 95):
        out[f"normalized TTFT p{q} (ms/token)"] = 1000 * percentile(r.norm_ttft_s_per_token, q)
    for q in (50, 99):
        out[f"generation time p{q} (s)"] = percentile(r.generation_s, q)
    out["preemptions"] = float(r.preemptions)
    out["engine steps"] = float(r.engine_steps)
    out["errors"] = float(r.errors)
    out["replay wall time (s)"] = r.wall_s
    for q in (50, 99):
        out[f"/stats latency p{q} (ms)"] = 1000 * percentile(r.stats_latency_s, q)
    return out


def _spread(values: Sequence[float]) -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "n/a"
    med = percentile(vals, 50)
    if len(vals) == 1:
        return f"{med:.3g}"
    return f"{med:.3g} ({min(vals):.3g}-{max(vals):.3g})"


def summary_rows(results: Sequence[RunResult], schedulers: Sequence[str]) -> list[tuple[str, ...]]:
    """Table rows: metric, then per scheduler the median (min-max) over its runs."""
    per = {s: [_metrics(r) for r in results if r.scheduler == s] for s in schedulers}
    names = list(_metrics(RunResult("x")).keys())
    return [(name, *(_spread([m[name] for m in per[s]]) for s in schedulers)) for name in names]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ratio_rows(results: Sequence[RunResult], schedulers: Sequence[str]) -> list[tuple[str, ...]]:
    """Per metric, per non-FCFS scheduler: scheduler / FCFS on the same slice, median
    (min-max) over the runs and on how many runs it is below 1 (better than FCFS)."""
    fcfs = {r.run: _metrics(r) for r in results if r.scheduler == "fcfs"}
    others = [s for s in schedulers if s != "fcfs"]
    if not fcfs or not others:
        return []
    rows = []
    for name in ("TTFT p50 (s)", "TTFT p95 (s)", "TTFT p99 (s)", "TTFT max (s)"):
        cells = []
        for s in others:
            vals = []
            for r in results:
                if r.scheduler == s and r.run in fcfs and fcfs[r.run][name] > 0:
                    vals.append(_metrics(r)[name] / fcfs[r.run][name])
            below = sum(v < 1 for v in vals)
            cells.append(f"{_spread(vals)}, {below}/{len(vals)} < 1" if vals else "n/a")
        rows.append((name.replace(" (s)", ""), *cells))
    return rows


def stats_handler_cost_s(iterations: int = 20000) -> list[float]:
    """Per-call cost of building one `/stats` answer from a snapshot (in this process): what
    the middleware adds to an API server, without HTTP or event-loop queueing."""
    from engine_patch.snapshot import SnapshotRecord, SnapshotWriter, snapshot_path
    from engine_patch.stats_route import SnapshotSource
    from sal_core.stats import ReplicaStats

    with tempfile.TemporaryDirectory(prefix="stats-cost-") as tmp:
        prefix = str(Path(tmp) / "s")
        writer = SnapshotWriter(snapshot_path(prefix, 0))
        stats = ReplicaStats(
            time=time.time(),
            step=1,
            model=SERVED_NAME,
            scheduler="larry",
            alpha=1.0,
            block_size=128,
            kv_blocks_total=47,
            kv_blocks_free=40,
            free_kv_tokens=5120,
            queued_prefill_tokens=300,
            num_waiting=2,
            num_running=8,
            max_num_batched_tokens=2048,
            max_num_seqs=8,
        )
        writer.publish(SnapshotRecord(stats, 0, 1))
        source = SnapshotSource(prefix)
        samples = []
        for _ in range(iterations):
            t = time.perf_counter()
            source.body()
            samples.append(time.perf_counter() - t)
        writer.close()
    return samples


BENCH_SCHEDULERS = {
    "fcfs": "fcfs",
    "fcfs+headroom": "fcfs",
    "larry": "larry",
    "larry_tail": "larry_tail",
    "stock": "stock",
    "larry+noprefix": "larry",
    "fcfs+noprefix": "fcfs",
}
"""Benchmark scheduler names -> the launcher's ``--sal-scheduler``."""


_MARGIN_VARIANT = re.compile(r"^larry_tail\+margin(\d+(?:\.\d+)?)$")
"""``larry_tail+margin2``: the tail guard with ``margin_s`` 2."""


def launcher_scheduler(name: str) -> str | None:
    """The launcher's ``--sal-scheduler`` of a benchmark scheduler name (None: unknown)."""
    if name in BENCH_SCHEDULERS:
        return BENCH_SCHEDULERS[name]
    return "larry_tail" if _MARGIN_VARIANT.match(name) else None


def _scheduler_args(name: str, headroom: float) -> list[str]:
    """Extra replica arguments of one benchmark scheduler (headroom and margin settings)."""
    if name == "fcfs+headroom":
        return ["--watermark", repr(headroom)]
    if name.endswith("+noprefix"):  # no prefix-cache lookups in LARRY's memory term either
        return ["--no-enable-prefix-caching"]
    margin = _MARGIN_VARIANT.match(name)
    if name == "larry_tail" or margin:
        config: dict[str, float] = {"headroom": headroom}
        if margin:
            config["margin_s"] = float(margin.group(1))
        return ["--additional-config", json.dumps({"larry_tail": config})]
    return []


def replay_order(schedulers: Sequence[str], runs: int, order: str) -> list[tuple[int, str]]:
    """(slice, scheduler) pairs in the order they are replayed: ``grouped`` runs every slice
    of one scheduler before the next; ``interleaved`` runs each slice on every scheduler,
    starting slice ``i`` at scheduler ``i mod n`` so no scheduler always goes first."""
    if order == "grouped":
        return [(run, s) for s in schedulers for run in range(runs)]
    n = len(schedulers)
    return [(run, schedulers[(run + k) % n]) for run in range(runs) for k in range(n)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start-row", type=int, default=0)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument(
        "--load-factor",
        type=float,
        default=1.0,
        help="divide the trace's inter-arrival times by this (2 = twice the rate)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3, help="trace slices per scheduler (3)")
    parser.add_argument(
        "--schedulers",
        default="fcfs,fcfs+headroom,larry,larry_tail",
        help="comma-separated, among " + ", ".join(BENCH_SCHEDULERS) + ", larry_tail+marginM",
    )
    parser.add_argument(
        "--order",
        choices=("interleaved", "grouped"),
        default="interleaved",
        help="interleaved (default): every replica up at once, each slice on every scheduler "
        "in turn; grouped: one replica at a time",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="engines (EngineCore, workers) on the last CPU, the replicas' API servers and "
        "this client on the others, so the engine's CPU share does not depend on the load "
        "the client and the API server put on the machine (Linux, >= 2 CPUs)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.05,
        help="KV headroom of fcfs+headroom (--watermark) and larry_tail (0.05: 2 of the 49 "
        "blocks; vLLM rounds down, so the default 0.02 would keep none here)",
    )
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=20100)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=48,
        help="KV blocks (128 tokens each on CPU): small, for memory pressure",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json-out", type=Path, default=None)
    return parser.parse_args(argv)


def _remove_log_unless_failed(replica: LocalReplica) -> Callable[..., None]:
    def exit_(exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            replica.remove_log()

    return exit_


def _start(stack: contextlib.ExitStack, replicas: list[LocalReplica], names: list[str]) -> None:
    """Start `replicas` together; `stack` stops them when it closes and removes their logs
    unless it closes on an exception (a failed start's log tail is in its error)."""
    print(f"starting {', '.join(names)} replica(s) ...", file=sys.stderr, flush=True)
    for replica in replicas:
        stack.push(_remove_log_unless_failed(replica))
        stack.callback(replica.stop)
    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        for future in [pool.submit(r.start, 600.0) for r in replicas]:
            future.result()


def _pin(replicas: list[LocalReplica], front: frozenset[int], engine: frozenset[int]) -> None:
    """Each replica's API server and this client on `front`, its engine processes on
    `engine` (`bench.cpu_pinning`)."""
    engines = 0
    for replica in replicas:
        assert replica.proc is not None
        engines += len(pin_replica(replica.proc.pid, front, engine))
    pin_self(front)
    print(
        f"pinned: API servers and this client on CPUs {sorted(front)}, {engines} engine "
        f"processes on {sorted(engine)}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.trace.is_file():
        print(f"larry_vllm_bench: error: {missing_message(args.trace, '--trace')}", file=sys.stderr)
        return 2
    replica_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--num-gpu-blocks-override",
        str(args.num_gpu_blocks),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    bad = [s for s in schedulers if launcher_scheduler(s) is None]
    if bad or args.runs < 1 or len(set(schedulers)) != len(schedulers):
        print(
            f"larry_vllm_bench: error: --schedulers among {', '.join(BENCH_SCHEDULERS)}, "
            "larry_tail+marginM, each once, "
            f"--runs >= 1 (got {args.schedulers!r}, {args.runs})",
            file=sys.stderr,
        )
        return 2
    slices = [
        load_trace_slice(
            args.trace,
            start_row=args.start_row + i * args.requests,
            count=args.requests,
            load_factor=args.load_factor,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
        )
        for i in range(args.runs)
    ]
    pinning: tuple[frozenset[int], frozenset[int]] | None = None
    if args.pin:
        try:
            pinning = split_cpus(os.sched_getaffinity(0))
        except ValueError as exc:
            print(f"larry_vllm_bench: error: --pin: {exc}", file=sys.stderr)
            return 2
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="larry-bench-") as tmp:
        model_dir = args.model_dir or tiny_model.build(Path(tmp) / "tiny")
        replicas = {
            scheduler: LocalReplica(
                replica_command(
                    model_dir,
                    args.port + i,
                    scheduler=launcher_scheduler(scheduler) or scheduler,
                    alpha=args.alpha,
                    extra_args=[*replica_args, *_scheduler_args(scheduler, args.headroom)],
                ),
                args.port + i,
            )
            for i, scheduler in enumerate(schedulers)
        }
        with contextlib.ExitStack() as running:
            current: list[str] = []
            for run, scheduler in replay_order(schedulers, args.runs, args.order):
                if scheduler not in current:
                    # Grouped: the previous scheduler is done; interleaved: start them all.
                    wanted = schedulers if args.order == "interleaved" else [scheduler]
                    if args.order == "grouped":
                        running.close()
                    _start(running, [replicas[s] for s in wanted], wanted)
                    if pinning is not None:
                        _pin([replicas[s] for s in wanted], *pinning)
                    current = list(wanted)
                url = replicas[scheduler].base_url
                asyncio.run(wait_idle(url))
                results.append(asyncio.run(replay(url, slices[run], scheduler, run)))
                print(f"{scheduler} run {run}: done", file=sys.stderr, flush=True)
    prompts = [r.prompt_tokens for sl in slices for r in sl]
    print(
        f"\n{args.runs} x {args.requests} requests from {args.trace.name} rows "
        f"{args.start_row}..{args.start_row + args.runs * args.requests - 1}, load factor "
        f"{args.load_factor}, prompts {min(prompts)}-{max(prompts)} tokens (mean "
        f"{statistics.fmean(prompts):.0f}), outputs <= {args.max_output_tokens}; replica: "
        f"{' '.join(replica_args[2:])}; headroom {args.headroom:g}; order {args.order}"
        f"{'; engines pinned to their own CPU' if pinning else ''}\n"
    )
    print("Median (min-max) over the runs:\n")
    print(format_table(["metric", *schedulers], summary_rows(results, schedulers)))
    ratios = ratio_rows(results, schedulers)
    if ratios:
        print("\nScheduler / FCFS on the same slice, median (min-max) over the runs:\n")
        others = [s for s in schedulers if s != "fcfs"]
        print(format_table(["ratio (< 1: better than FCFS)", *others], ratios))
    cost = stats_handler_cost_s()
    print(
        f"\n/stats handler cost (snapshot read + JSON, no HTTP): p50 "
        f"{percentile(cost, 50) * 1e6:.1f} us, p99 {percentile(cost, 99) * 1e6:.1f} us"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
