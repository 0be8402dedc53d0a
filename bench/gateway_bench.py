"""Gateway benchmarks: added latency, throughput, client stacks, routing and tokenization time.

``python -m bench.gateway_bench [--quick] [--no-stacks] [--json PATH]`` (also ``main(argv)``,
for ``sal-bench``). Everything runs in ONE invocation, side by side, on loopback, with bounded
request counts and time; every server and the load generator are separate processes:

1. **Added latency, saturating**: closed-loop SSE streams (8 tokens, no delays) at 1, 50 and
   200 concurrent streams, direct to the fast fake backend and through the gateway, back to
   back. At 50 and 200 streams this saturates the machine, so latency there is mostly queueing
   (concurrency / throughput).
2. **Added latency, paced**: the same concurrencies against a second fake that paces its
   tokens like a replica (first token after 50 ms, then one every 100 ms), so 200 streams are a
   load the gateway can carry; here the difference is the gateway's cost per stream.
3. **Throughput** of one gateway process: requests/s (non-streaming, small) and SSE events/s.
4. **Client stacks**: bare streaming proxies (`bench.proxy_stacks`) over plain httpx,
   httpx-aiohttp and aiohttp, at 200 concurrent streams, beside the real gateway.
5. **Routing decision** time per policy with 64 backends (pure `policies.py`).
6. **Tokenization** time per 1k-token prompt and per chat request (the gateway's tokenizer
   module with the tiny model from `engine_patch.tiny_model`).

On a shared 2-core machine the load generator, the gateway and the backend compete for the
same cores, so absolute numbers are noisy; the ratios in the same run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.decision_timing import time_all_policies, time_prefix_tracking
from bench.gateway_report import print_report
from bench.loadgen import LoadResult
from bench.processes import PortAllocator, ServerGroup, wait_http_ok
from bench.proxy_stacks import STACKS
from bench.tokenize_timing import time_tokenization
from sal_core.percentile import percentile
from sal_core.policies import POLICIES

FAST_MODEL = "tiny"
PACED_MODEL = "tiny-paced"
CONCURRENCIES = (1, 50, 200)
PACED_FIRST_BYTE_S = 0.05
PACED_CHUNK_S = 0.1
STALL_PROMPT_WORDS = 6000
STALL_LONG_CONCURRENCY = 4
STALL_SMALL_CONCURRENCY = 10


@dataclass(frozen=True)
class Sizing:
    """How long each load cell runs (bounded by time and by count, whichever comes first)."""

    duration_s: float
    paced_duration_s: float
    max_requests: int
    decision_calls: int
    tokenize_reps: int


FULL = Sizing(
    duration_s=5.0,
    paced_duration_s=8.0,
    max_requests=20_000,
    decision_calls=20_000,
    tokenize_reps=50,
)
QUICK = Sizing(
    duration_s=0.5,
    paced_duration_s=1.0,
    max_requests=500,
    decision_calls=2_000,
    tokenize_reps=5,
)


def _loadgen_args(
    url: str,
    model: str,
    concurrency: int,
    stream: bool,
    duration_s: float,
    max_requests: int,
    prompt_words: int = 0,
) -> list[str]:
    args = [
        sys.executable, "-m", "bench.loadgen", "--url", url, "--model", model,
        "--concurrency", str(concurrency), "--requests", str(max_requests),
        "--duration-s", str(duration_s), "--max-tokens", "8", "--prompt-words", str(prompt_words),
    ]  # fmt: skip
    return [*args, "--stream"] if stream else args


def _parse_loadgen(returncode: int, stdout: bytes, stderr: bytes) -> LoadResult:
    if returncode != 0:
        raise RuntimeError(f"loadgen failed: {stderr.decode(errors='replace')[-2000:]}")
    return LoadResult.from_dict(json.loads(stdout))


def run_loadgen(
    url: str, *, model: str, concurrency: int, stream: bool, duration_s: float, max_requests: int
) -> LoadResult:
    """Run `bench.loadgen` in a child process against ``url`` and return its samples."""
    args = _loadgen_args(url, model, concurrency, stream, duration_s, max_requests)
    proc = subprocess.run(args, capture_output=True, check=False, timeout=duration_s + 120.0)
    return _parse_loadgen(proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True)
class Endpoints:
    """Base URLs of the processes under test."""

    backend: str
    paced_backend: str
    gateway: str
    stacks: dict[str, str]


def _gateway_config(
    path: Path, port: int, fast: str, paced: str, tokenizer: Path, policy: str
) -> Path:
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [
            {"name": FAST_MODEL, "tokenizer": str(tokenizer), "backends": [fast]},
            {"name": PACED_MODEL, "tokenizer": str(tokenizer), "backends": [paced]},
        ],
        "routing": {"policy": policy, "poll_interval_s": 0.1},
        "log_level": "warning",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def running_servers(
    work: Path, model_dir: Path, with_stacks: bool, policy: str = "sal"
) -> Iterator[Endpoints]:
    """Start the fake backends, the gateway and (optionally) the bare proxies together, wait
    until all answer, and stop them all on exit."""
    ports = PortAllocator(19000, 20000)
    with ServerGroup() as group:

        def start(name: str, args: list[str], health: str) -> str:
            port = ports.take()
            url = f"http://127.0.0.1:{port}"
            group.start([*args, "--port", str(port)], f"{url}{health}", work / f"{name}.log")
            return url

        fake = ["-m", "bench.fake_backend_server"]
        backend = start("backend", [*fake, "--model", FAST_MODEL], "/health")
        paced_args = [
            *fake, "--model", PACED_MODEL, "--first-byte-delay-s", str(PACED_FIRST_BYTE_S),
            "--chunk-delay-s", str(PACED_CHUNK_S),
        ]  # fmt: skip
        paced = start("paced-backend", paced_args, "/health")
        gw_port = ports.take()
        config = _gateway_config(work / "gateway.yaml", gw_port, backend, paced, model_dir, policy)
        gateway = f"http://127.0.0.1:{gw_port}"
        group.start(
            ["-m", "sal_gateway.cli", "serve", "--config", str(config)],
            f"{gateway}/ready",
            work / "gateway.log",
        )
        stacks: dict[str, str] = {}
        if with_stacks:
            for name in STACKS:
                args = ["-m", "bench.proxy_stacks", "--stack", name, "--upstream", backend]
                stacks[name] = start(f"proxy-{name}", args, "/health")
        group.wait_all(timeout_s=120.0)
        yield Endpoints(backend=backend, paced_backend=paced, gateway=gateway, stacks=stacks)


def settle(gateway: str) -> None:
    """Wait until the gateway is ready again before the next cell.

    A saturating cell starves the gateway's pollers on a 2-core machine; backends whose state
    went stale are not eligible (503) until the next good poll, which would otherwise charge
    one cell's overload to the next.
    """
    wait_http_ok(f"{gateway}/ready", timeout_s=30.0)


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


def _latency_row(c: int, direct: LoadResult, via: LoadResult) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": c}
    for name, result in (("direct", direct), ("gateway", via)):
        row[f"{name}_p50_ms"] = _ms(result.latency_s, 50)
        row[f"{name}_p99_ms"] = _ms(result.latency_s, 99)
        row[f"{name}_ttft_p50_ms"] = _ms(result.ttft_s, 50)
        row[f"{name}_ttft_p99_ms"] = _ms(result.ttft_s, 99)
        row[f"{name}_req_per_s"] = result.requests_per_s
        row[f"{name}_events_per_s"] = result.events_per_s
    for stat in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
        row[f"added_{stat}"] = row[f"gateway_{stat}"] - row[f"direct_{stat}"]
    row["requests"] = len(via.latency_s)
    row["errors"] = direct.errors + via.errors
    row["error_sample"] = direct.error_sample or via.error_sample
    return row


def bench_added_latency(
    direct_base: str, gateway_base: str, model: str, duration_s: float, sizing: Sizing
) -> list[dict[str, Any]]:
    """Direct vs through-gateway SSE latency per concurrency (one row per concurrency)."""
    rows = []
    for c in CONCURRENCIES:
        settle(gateway_base)
        results = [
            run_loadgen(
                f"{base}/v1/completions",
                model=model,
                concurrency=c,
                stream=True,
                duration_s=duration_s,
                max_requests=sizing.max_requests,
            )
            for base in (direct_base, gateway_base)
        ]
        rows.append(_latency_row(c, results[0], results[1]))
    return rows


def bench_throughput(ep: Endpoints, sizing: Sizing, concurrency: int = 50) -> dict[str, Any]:
    """Non-streaming requests/s, direct and through the gateway, at ``concurrency``."""
    settle(ep.gateway)
    direct, via = (
        run_loadgen(
            f"{base}/v1/completions",
            model=FAST_MODEL,
            concurrency=concurrency,
            stream=False,
            duration_s=sizing.duration_s,
            max_requests=sizing.max_requests,
        )
        for base in (ep.backend, ep.gateway)
    )
    return {
        "concurrency": concurrency,
        "direct_req_per_s": direct.requests_per_s,
        "gateway_req_per_s": via.requests_per_s,
        "gateway_p50_ms": _ms(via.latency_s, 50),
        "gateway_p99_ms": _ms(via.latency_s, 99),
        "errors": direct.errors + via.errors,
    }


def bench_tokenize_stall(ep: Endpoints, sizing: Sizing) -> dict[str, Any]:
    """Short requests' latency through the gateway, alone and while long prompts are being
    tokenized (``STALL_LONG_CONCURRENCY`` clients sending ~``STALL_PROMPT_WORDS``-word
    prompts back to back): shows whether tokenizing long prompts stalls the event loop."""
    url = f"{ep.gateway}/v1/completions"

    def small_requests() -> LoadResult:
        return run_loadgen(
            url, model=FAST_MODEL, concurrency=STALL_SMALL_CONCURRENCY, stream=True,
            duration_s=sizing.duration_s, max_requests=sizing.max_requests,
        )  # fmt: skip

    settle(ep.gateway)
    alone = small_requests()
    settle(ep.gateway)
    background = subprocess.Popen(
        _loadgen_args(
            url, FAST_MODEL, STALL_LONG_CONCURRENCY, True, sizing.duration_s + 2.0,
            sizing.max_requests, prompt_words=STALL_PROMPT_WORDS,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # the long-prompt clients are past their warm-up
        with_long = small_requests()
        out, err = background.communicate(timeout=sizing.duration_s + 120.0)
    finally:
        if background.poll() is None:
            background.kill()
            background.communicate()
    long = _parse_loadgen(background.returncode, out, err)
    return {
        "small_concurrency": STALL_SMALL_CONCURRENCY,
        "long_concurrency": STALL_LONG_CONCURRENCY,
        "long_prompt_words": STALL_PROMPT_WORDS,
        "alone_p50_ms": _ms(alone.latency_s, 50),
        "alone_p99_ms": _ms(alone.latency_s, 99),
        "with_long_p50_ms": _ms(with_long.latency_s, 50),
        "with_long_p99_ms": _ms(with_long.latency_s, 99),
        "long_req_per_s": long.requests_per_s,
        "long_p50_ms": _ms(long.latency_s, 50),
        "errors": alone.errors + with_long.errors + long.errors,
        "error_sample": alone.error_sample or with_long.error_sample or long.error_sample,
    }


def bench_stacks(ep: Endpoints, sizing: Sizing, concurrency: int = 200) -> list[dict[str, Any]]:
    """SSE at ``concurrency`` direct, through each bare proxy, and through the gateway."""
    targets = {"backend (direct)": ep.backend, **ep.stacks, "sal-gateway": ep.gateway}
    rows = []
    for name, base in targets.items():
        settle(ep.gateway)
        result = run_loadgen(
            f"{base}/v1/completions", model=FAST_MODEL, concurrency=concurrency, stream=True,
            duration_s=sizing.duration_s, max_requests=sizing.max_requests,
        )  # fmt: skip
        rows.append(
            {
                "stack": name,
                "req_per_s": result.requests_per_s,
                "p50_ms": _ms(result.latency_s, 50),
                "p99_ms": _ms(result.latency_s, 99),
                "errors": result.errors,
            }
        )
    return rows


class _Progress:
    """One line per finished step on stderr, with the elapsed time (tables go to stdout)."""

    def __init__(self) -> None:
        self._start_s = time.monotonic()

    def step(self, what: str) -> None:
        print(f"[{time.monotonic() - self._start_s:6.1f} s] {what}", file=sys.stderr, flush=True)


def run_all(
    sizing: Sizing, with_stacks: bool, log_dir: Path | None = None, policy: str = "sal"
) -> dict[str, Any]:
    """Run every section once and return the raw report (what ``--json`` writes).

    Server logs (and the generated config and tiny model) go to ``log_dir`` when given,
    else to a temporary directory removed at the end."""
    from engine_patch import tiny_model

    progress = _Progress()
    report: dict[str, Any] = {"sizing": asdict(sizing), "policy": policy}
    with tempfile.TemporaryDirectory(prefix="sal-bench-") as tmp:
        work = Path(tmp) if log_dir is None else log_dir
        work.mkdir(parents=True, exist_ok=True)
        # 16k context so that the 10k-token tokenization input is a valid prompt.
        model_dir = tiny_model.build(work / "tiny-llama", max_model_len=16384)
        with running_servers(work, model_dir, with_stacks, policy) as ep:
            progress.step("servers up")
            report["added_latency"] = bench_added_latency(
                ep.backend, ep.gateway, FAST_MODEL, sizing.duration_s, sizing
            )
            progress.step("added latency, saturating")
            report["paced_latency"] = bench_added_latency(
                ep.paced_backend, ep.gateway, PACED_MODEL, sizing.paced_duration_s, sizing
            )
            report["paced_profile"] = {
                "first_byte_s": PACED_FIRST_BYTE_S, "chunk_s": PACED_CHUNK_S, "tokens": 8
            }  # fmt: skip
            progress.step("added latency, paced")
            report["throughput"] = bench_throughput(ep, sizing)
            progress.step("throughput")
            report["tokenize_stall"] = bench_tokenize_stall(ep, sizing)
            progress.step("tokenization stall")
            report["stacks"] = bench_stacks(ep, sizing) if ep.stacks else []
            progress.step("client stacks")
        report["decisions"] = [asdict(r) for r in time_all_policies(64, sizing.decision_calls)]
        progress.step("routing decisions")
        report["prefix_costs"] = [asdict(r) for r in time_prefix_tracking()]
        progress.step("prefix cache cost")
        report["tokenization"] = [
            asdict(r) for r in time_tokenization(model_dir, sizing.tokenize_reps)
        ]
        progress.step("tokenization")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="well under a second per cell")
    parser.add_argument("--no-stacks", action="store_true", help="skip the client-stack proxies")
    parser.add_argument("--json", type=Path, help="also write the raw report here")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs in this directory")
    parser.add_argument(
        "--policy", default="sal", choices=sorted(POLICIES), help="the gateway's routing policy"
    )
    args = parser.parse_args(argv)
    sizing = QUICK if args.quick else FULL
    report = run_all(
        sizing, with_stacks=not args.no_stacks, log_dir=args.log_dir, policy=args.policy
    )
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
