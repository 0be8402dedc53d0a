"""``sal-gateway demo``: the gateway in front of N emulated vLLM replicas, in one process.

The embedded default of the README's quick start. No GPU and no vLLM are needed: each
replica is `engine_sim`'s engine model (continuous batching, KV blocks, chunked prefill,
LARRY or FCFS, a Llama-3-8B-on-A100 cost model) behind the real OpenAI API and ``/stats``,
driven by the wall clock. The gateway is the real one (`create_app`), with the tiny model's
tokenizer built locally for exact prompt counts.

With ``--requests N`` the demo also sends N requests with chat-like lengths through the
gateway, prints a summary table (TTFT, total generation time, routing share per replica) and
keeps serving; ``--exit-after-load`` stops once the table is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from engine_patch import tiny_model
from engine_sim.cost_model import PROFILES
from engine_sim.emulator import run_emulators
from engine_sim.schedulers import ENGINE_SCHEDULERS
from sal_core.percentile import percentile
from sal_core.policies import POLICIES
from sal_gateway.app import create_app, load_counters
from sal_gateway.config import GatewayConfig, build_config

MODEL_NAME = "demo-llama"


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What the demo runs (every field has a CLI flag of the same name)."""

    replicas: int = 4
    host: str = "127.0.0.1"
    port: int = 8080
    replica_base_port: int = 0
    """Port of the first emulated replica (0: free ports)."""
    policy: str = "sal"
    scheduler: str = "larry_tail"
    """The engine order the patch ships by default (`--sal-scheduler larry_tail`)."""
    profile: str = "llama3-8b-a100"
    time_scale: float = 1.0
    """Wall seconds per modelled second (0.5: twice as fast as the modelled GPU)."""
    requests: int = 0
    """Requests of the built-in load (0: none, just serve)."""
    rate_per_s: float = 8.0
    """Poisson arrival rate of the built-in load."""
    exit_after_load: bool = False
    seed: int = 0
    model_dir: Path | None = None
    """Tokenizer/model directory; None: built once under ~/.cache/sal-gateway."""


def demo_model_dir(explicit: Path | None = None) -> Path:
    """The tiny model directory whose tokenizer the gateway and the replicas share."""
    path = explicit or Path.home() / ".cache" / "sal-gateway" / "demo-model"
    if not (path / "tokenizer.json").is_file() or not (path / "config.json").is_file():
        tiny_model.build(path)
    return path


def gateway_config(options: DemoOptions, backends: Sequence[str], model_dir: Path) -> GatewayConfig:
    """The gateway config the demo serves (validated like a config.yaml)."""
    return build_config(
        {
            "listen": {"host": options.host, "port": options.port},
            "models": [
                {"name": MODEL_NAME, "tokenizer": str(model_dir), "backends": list(backends)}
            ],
            "routing": {"policy": options.policy, "seed": options.seed},
            "log_level": "warning",
        }
    )


@dataclass(frozen=True, slots=True)
class _Result:
    ttft_s: float
    total_s: float
    prompt_tokens: int
    ok: bool


def _lengths(rng: random.Random) -> tuple[int, int]:
    """Chat-like prompt/output lengths (log-normal, medians ~ the Azure 2023 chat trace)."""
    prompt = int(min(3500, max(8, rng.lognormvariate(math.log(900), 0.9))))
    output = int(min(400, max(4, rng.lognormvariate(math.log(150), 0.7))))
    return prompt, output


async def _one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> _Result:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft_s = math.nan
    ok = False
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if math.isnan(ttft_s):
                ttft_s = time.perf_counter() - start
            if line == "data: [DONE]":
                ok = response.status_code == 200
            elif '"error"' in line:
                ok = False
                break
    return _Result(ttft_s, time.perf_counter() - start, len(prompt), ok)


_FOLLOW_UP_SHARE = 0.5
"""Share of built-in requests that continue an earlier conversation (its prompt + more)."""
_MAX_CONVERSATION_TOKENS = 3_500
"""A follow-up never grows a prompt past the longest fresh one (the demo model's context is
4,096 tokens, outputs up to 400)."""


def _next_prompt(rng: random.Random, conversations: list[list[int]], prompt_len: int) -> list[int]:
    """A new conversation, or (half the time) an earlier prompt extended by `prompt_len`
    tokens, so the replicas' prefix caches have something to hit."""
    fresh = [rng.randrange(10, 1000) for _ in range(prompt_len)]
    if conversations and rng.random() < _FOLLOW_UP_SHARE:
        i = rng.randrange(len(conversations))
        prompt = conversations[i] + fresh
        if len(prompt) <= _MAX_CONVERSATION_TOKENS:
            conversations[i] = prompt
            return prompt
    conversations.append(fresh)
    return fresh


async def run_load(base_url: str, options: DemoOptions) -> list[_Result]:
    """Send `options.requests` streaming completions at a Poisson rate; return their timings."""
    rng = random.Random(options.seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    timeout = httpx.Timeout(600.0)
    conversations: list[list[int]] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks: list[asyncio.Task[_Result]] = []
        for _ in range(options.requests):
            prompt_len, output_len = _lengths(rng)
            prompt = _next_prompt(rng, conversations, prompt_len)
            url = f"{base_url}/v1/completions"
            tasks.append(asyncio.create_task(_one_request(client, url, prompt, output_len)))
            await asyncio.sleep(rng.expovariate(options.rate_per_s))
        return list(await asyncio.gather(*tasks))


def _routing_share(metrics_text: str) -> dict[str, float]:
    share: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("sal_routing_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            backend = labels.split('backend="', 1)[1].split('"', 1)[0]
            share[backend] = share.get(backend, 0.0) + float(value)
    return share


def prefix_cache_hit_rate(metrics_texts: Sequence[str]) -> float:
    """Prompt tokens the replicas served from their prefix caches / tokens they looked up
    (vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries``, summed over replicas)."""
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for text in metrics_texts:
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    queries = totals["vllm:prefix_cache_queries_total"]
    return totals["vllm:prefix_cache_hits_total"] / queries if queries else 0.0


def fleet_reuse_rates(metrics_text: str) -> dict[str, float]:
    """The gateway's fleet-reuse estimate per ``kv_scale`` label: prompt tokens a cache of
    that many times the fleet's KV would have held / prompt tokens it saw (empty: none seen)."""
    prompt = 0.0
    hits: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("sal_prefix_fleet_reuse_prompt_tokens_total{"):
            prompt += float(line.rsplit(" ", 1)[1])
        elif line.startswith("sal_prefix_fleet_reuse_hit_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            scale = labels.split('kv_scale="', 1)[1].split('"', 1)[0]
            hits[scale] = hits.get(scale, 0.0) + float(value)
    if not prompt:
        return {}
    return {scale: hit / prompt for scale, hit in sorted(hits.items(), key=lambda kv: float(kv[0]))}


def format_summary(
    results: list[_Result],
    share: dict[str, float],
    options: DemoOptions,
    hit_rate: float = 0.0,
    fleet_reuse: dict[str, float] | None = None,
) -> str:
    """The table printed after the built-in load."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    total = [r.total_s for r in ok]
    ttft_ms = [1000 * t for t in ttft]
    lines = [
        f"built-in load: {len(results)} requests at {options.rate_per_s}/s, policy "
        f"{options.policy}, engine {options.scheduler}, profile {options.profile}",
        f"  succeeded            {len(ok)}/{len(results)}",
        f"  TTFT p50 / p95       {percentile(ttft_ms, 50):8.1f} ms / "
        f"{percentile(ttft_ms, 95):8.1f} ms",
        f"  total p50 / p95      {percentile(total, 50):8.2f} s  / {percentile(total, 95):8.2f} s",
    ]
    if ttft:
        lines.append(f"  mean TTFT            {statistics.fmean(ttft) * 1000:8.1f} ms")
    lines.append(f"  prefix-cache hits    {hit_rate:8.1%} of prompt tokens (replicas' /metrics)")
    if fleet_reuse:
        could = " / ".join(f"x{scale} {rate:.0%}" for scale, rate in fleet_reuse.items())
        lines.append(
            f"  fleet could keep     {could} (gateway's estimate with 1, 2, 4x the fleet's KV)"
        )
    n = sum(share.values()) or 1.0
    for backend, count in sorted(share.items()):
        lines.append(f"  routed to {backend:<24} {count / n:6.1%}")
    return "\n".join(lines)


async def run_demo(options: DemoOptions) -> None:
    """Start replicas and the gateway; optionally drive the built-in load; serve until stopped."""
    model_dir = demo_model_dir(options.model_dir)
    async with run_emulators(
        options.replicas,
        "127.0.0.1",
        options.replica_base_port,
        options.profile,
        model_name=MODEL_NAME,
        scheduler=options.scheduler,
        time_scale=options.time_scale,
        tokenizer=str(model_dir),
    ) as urls:
        config = gateway_config(options, urls, model_dir)
        app = create_app(config, counters=load_counters(config))
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=options.host,
                port=options.port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=2,
                timeout_keep_alive=max(1, round(config.listen.keep_alive_s)),
            )
        )
        serve_task = asyncio.create_task(server.serve())
        while not server.started:
            if serve_task.done():
                serve_task.result()
                return
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        base_url = f"http://{options.host}:{port}"
        print(_banner(options, urls, base_url), flush=True)
        if options.requests:
            await asyncio.sleep(0.5)  # let the pollers see every replica once
            results = await run_load(base_url, options)
            async with httpx.AsyncClient() as client:
                metrics = (await client.get(f"{base_url}/metrics")).text
                replica_metrics = [(await client.get(f"{u}/metrics")).text for u in urls]
            hits = prefix_cache_hit_rate(replica_metrics)
            summary = format_summary(
                results, _routing_share(metrics), options, hits, fleet_reuse_rates(metrics)
            )
            print(summary, flush=True)
            if options.exit_after_load:
                server.should_exit = True
        await serve_task


def _banner(options: DemoOptions, urls: Sequence[str], base_url: str) -> str:
    example = json.dumps(
        {"model": MODEL_NAME, "prompt": "hello gateway", "max_tokens": 8, "ignore_eos": True}
    )
    return "\n".join(
        [
            f"SAL gateway ({options.policy}) on {base_url} in front of {len(urls)} emulated "
            f"vLLM replicas ({options.profile}, {options.scheduler}): {', '.join(urls)}",
            "These replicas are emulated (engine_sim): timings follow the cost model, the text",
            "is filler. Try:",
            f"  curl -s {base_url}/v1/completions -H 'content-type: application/json' "
            f"-d '{example}'",
            f"  curl -s {base_url}/metrics | grep '^sal_'",
            "Ctrl-C stops everything.",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's flags."""
    d = DemoOptions()
    parser.add_argument("--replicas", type=int, default=d.replicas)
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--replica-base-port", type=int, default=d.replica_base_port)
    parser.add_argument("--policy", default=d.policy, choices=sorted(POLICIES))
    parser.add_argument("--scheduler", default=d.scheduler, choices=sorted(ENGINE_SCHEDULERS))
    parser.add_argument("--profile", default=d.profile, choices=sorted(PROFILES))
    parser.add_argument("--time-scale", type=float, default=d.time_scale)
    parser.add_argument("--requests", type=int, default=d.requests, help="built-in load size")
    parser.add_argument("--rate-per-s", type=float, default=d.rate_per_s)
    parser.add_argument("--exit-after-load", action="store_true")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--model-dir", type=Path, default=None)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Map parsed flags to `DemoOptions`, rejecting impossible values."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.requests < 0 or args.rate_per_s <= 0 or args.time_scale <= 0:
        raise ValueError("--requests must be >= 0, --rate-per-s and --time-scale > 0")
    return DemoOptions(
        replicas=args.replicas,
        host=args.host,
        port=args.port,
        replica_base_port=args.replica_base_port,
        policy=args.policy,
        scheduler=args.scheduler,
        profile=args.profile,
        time_scale=args.time_scale,
        requests=args.requests,
        rate_per_s=args.rate_per_s,
        exit_after_load=args.exit_after_load,
        seed=args.seed,
        model_dir=args.model_dir,
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed CLI flags; exit status 2 on bad flags."""
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"sal-gateway demo: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_demo(options))
    return 0


@dataclass(frozen=True, slots=True)
class DemoCommand:
    """``sal-gateway demo``, registered in the ``sal_gateway.commands`` entry-point group
    (pyproject.toml) so the gateway's CLI reaches it without importing the simulator."""

    help: str = "run the gateway in front of N emulated vLLM replicas (no GPU needed)"
    description: str = (
        "The gateway in front of emulated vLLM replicas in one process; "
        "optionally drives a built-in load and prints a summary."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The demo's flags."""
        add_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        """Run the demo."""
        return run(args)


COMMAND = DemoCommand()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine_sim.demo [flags]``: the demo without the gateway's CLI."""
    parser = argparse.ArgumentParser(
        prog="python -m engine_sim.demo", description=COMMAND.description
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
