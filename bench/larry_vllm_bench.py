"""LARRY vs FCFS on one real vLLM-on-CPU replica, replaying a slice of the Azure chat trace.

For each scheduler in turn, starts one replica (``sal-engine serve``, identical settings
except ``--sal-scheduler``), replays the same requests with the trace's own inter-arrival
times divided by ``--load-factor``, and prints TTFT (p50/p95/p99), normalized TTFT (TTFT per
prompt token), total generation time, preemptions (vLLM's own ``vllm:num_preemptions``
counter) and the latency of ``GET /stats`` polled at 10 Hz during the run. Prompts are random
token IDs whose lengths are the trace's, scaled so the longest fits the tiny model's context;
outputs are forced to the trace's length (capped) with ``ignore_eos`` + ``max_tokens``.

    python -m bench.larry_vllm_bench [--trace PATH] [--requests 80] [--load-factor 1.0]

Takes ~4-5 minutes on 2 CPU cores (most of it starting the two replicas).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from engine_patch import tiny_model
from engine_patch.replica import LocalReplica, replica_command

DEFAULT_TRACE = Path("../shared/data/AzureLLMInferenceTrace_conv.csv")
SERVED_NAME = "tiny"
_PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.eE+-]+)$", re.M)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One replayed request: when to send it (relative to the start) and its forced sizes."""

    send_at_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class RunResult:
    """Raw per-request samples of one scheduler's run."""

    scheduler: str
    ttft_s: list[float] = field(default_factory=list)
    norm_ttft_s_per_token: list[float] = field(default_factory=list)
    generation_s: list[float] = field(default_factory=list)
    stats_latency_s: list[float] = field(default_factory=list)
    preemptions: int = 0
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


def percentile(samples: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100), linear interpolation; NaN for no samples."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


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


async def _preemptions(client: httpx.AsyncClient, url: str) -> int:
    text = (await client.get(f"{url}/metrics")).text
    return int(sum(float(v) for v in _PREEMPTIONS.findall(text)))


async def replay(url: str, requests: Sequence[TraceRequest], scheduler: str) -> RunResult:
    """Send every request at its time (open loop) and collect the samples."""
    result = RunResult(scheduler)
    limits = httpx.Limits(max_connections=len(requests) + 4)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        before = await _preemptions(client, url)
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
        result.preemptions = await _preemptions(client, url) - before
    return result


def summary_rows(results: Sequence[RunResult]) -> list[tuple[str, ...]]:
    """Table rows (metric, one column per scheduler) for `format_table`."""
    rows: list[tuple[str, ...]] = []

    def add(label: str, values: list[float], fmt: str) -> None:
        rows.append((label, *(fmt.format(v) for v in values)))

    for q in (50, 95, 99):
        add(f"TTFT p{q} (s)", [percentile(r.ttft_s, q) for r in results], "{:.3f}")
    for q in (50, 95, 99):
        add(
            f"normalized TTFT p{q} (ms/token)",
            [1000 * percentile(r.norm_ttft_s_per_token, q) for r in results],
            "{:.3f}",
        )
    for q in (50, 95, 99):
        add(f"generation time p{q} (s)", [percentile(r.generation_s, q) for r in results], "{:.3f}")
    add(
        "mean generation time (s)",
        [statistics.fmean(r.generation_s or [0]) for r in results],
        "{:.3f}",
    )
    add("preemptions", [float(r.preemptions) for r in results], "{:.0f}")
    add("errors", [float(r.errors) for r in results], "{:.0f}")
    add("replay wall time (s)", [r.wall_s for r in results], "{:.1f}")
    for q in (50, 99):
        add(
            f"/stats latency p{q} (ms)",
            [1000 * percentile(r.stats_latency_s, q) for r in results],
            "{:.2f}",
        )
    return rows


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _ratio_rows(results: Sequence[RunResult]) -> list[tuple[str, str]]:
    by = {r.scheduler: r for r in results}
    if not {"larry", "fcfs"} <= set(by):
        return []
    larry, fcfs = by["larry"], by["fcfs"]
    rows = []
    for label, attr in (
        ("TTFT", "ttft_s"),
        ("normalized TTFT", "norm_ttft_s_per_token"),
        ("generation time", "generation_s"),
    ):
        for q in (50, 95, 99):
            lv = percentile(getattr(larry, attr), q)
            fv = percentile(getattr(fcfs, attr), q)
            rows.append((f"FCFS / LARRY {label} p{q}", f"{fv / lv:.2f}x" if lv else "n/a"))
    return rows


def stats_handler_cost_s(iterations: int = 20000) -> list[float]:
    """Per-call cost of building one `/stats` answer from a snapshot (in this process): what
    the middleware adds to an API server, without HTTP or event-loop queueing."""
    from engine_patch.snapshot import SnapshotRecord, SnapshotWriter, snapshot_path
    from engine_patch.stats_route import SnapshotSource
    from sal_gateway.stats import ReplicaStats

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
    parser.add_argument("--schedulers", default="larry,fcfs")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests = load_trace_slice(
        args.trace,
        start_row=args.start_row,
        count=args.requests,
        load_factor=args.load_factor,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
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
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="larry-bench-") as tmp:
        model_dir = args.model_dir or tiny_model.build(Path(tmp) / "tiny")
        for i, scheduler in enumerate(schedulers):
            command = replica_command(
                model_dir,
                args.port + i,
                scheduler=scheduler,
                alpha=args.alpha,
                extra_args=replica_args,
            )
            print(f"starting {scheduler} replica ...", file=sys.stderr, flush=True)
            with LocalReplica(command, args.port + i) as replica:
                results.append(asyncio.run(replay(replica.base_url, requests, scheduler)))
            print(f"{scheduler}: done", file=sys.stderr, flush=True)
    prompts = [r.prompt_tokens for r in requests]
    print(
        f"\n{len(requests)} requests from {args.trace.name} rows {args.start_row}.."
        f"{args.start_row + len(requests) - 1}, load factor {args.load_factor}, prompts "
        f"{min(prompts)}-{max(prompts)} tokens (mean {statistics.fmean(prompts):.0f}), outputs "
        f"<= {args.max_output_tokens}; replica: {' '.join(replica_args[2:])}\n"
    )
    print(format_table(["metric", *schedulers], summary_rows(results)))
    ratios = _ratio_rows(results)
    if ratios:
        print()
        print(format_table(["ratio (>1: LARRY better)", "value"], ratios))
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
