"""Real vLLM-on-CPU replicas started by ``sal-engine serve``: `/stats` and LARRY's ordering.

Four replica starts for the whole module (each ~1-2 min and ~3 GB on a shared CPU box):

* LARRY with two API servers, under memory pressure on purpose (``--max-num-seqs 1``: one
  request runs, the rest queue): `/stats` schema and values against vLLM's own `/metrics` at
  rest and under load, from both API servers.
* LARRY with one API server, same pressure: a burst of long and short prompts.
* stats-only FCFS, same pressure: the same burst, for the contrast.
* LARRY with ``--data-parallel-size 2``: `/stats` aggregates both engines and lists them.

Ordering is asserted as an order of first tokens, never as a duration.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sal_gateway.stats import parse_stats
from tests.vllm_support import run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
LARRY_PORT = 20010
FCFS_PORT = 20011
DP_PORT = 20012
LARRY_ONE_API_PORT = 20013
PRESSURE_ARGS = ("--served-model-name", MODEL, "--max-num-seqs", "1")

_METRIC = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$")


@pytest.fixture(scope="class")
def larry_url(tiny_model_dir: Path) -> Iterator[str]:
    extra = (*PRESSURE_ARGS, "--api-server-count", "2")
    with run_replica(tiny_model_dir, LARRY_PORT, scheduler="larry", extra_args=extra) as url:
        yield url


@pytest.fixture
def larry_one_api_url(tiny_model_dir: Path) -> Iterator[str]:
    # One API server for the ordering test: with two, requests are spread over both
    # processes, and one that is busy relaying a stream on these 2 shared cores delays the
    # requests that landed on it, scrambling their arrival order at the engine (seen in CI:
    # short3 reached the engine before short0-2).
    with run_replica(
        tiny_model_dir, LARRY_ONE_API_PORT, scheduler="larry", extra_args=PRESSURE_ARGS
    ) as url:
        yield url


@pytest.fixture
def fcfs_url(tiny_model_dir: Path) -> Iterator[str]:
    with run_replica(tiny_model_dir, FCFS_PORT, scheduler="fcfs", extra_args=PRESSURE_ARGS) as url:
        yield url


@pytest.fixture
def dp_url(tiny_model_dir: Path) -> Iterator[str]:
    extra = ("--served-model-name", MODEL, "--data-parallel-size", "2")
    with run_replica(tiny_model_dir, DP_PORT, scheduler="larry", extra_args=extra) as url:
        yield url


def vllm_gauges(metrics_text: str, engine: str = "0") -> dict[str, float]:
    """vLLM's gauges for one engine (label ``engine``) from a `/metrics` body."""
    gauges: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _METRIC.match(line)
        if (
            m
            and f'engine="{engine}"' in m.group(2)
            and m.group(1)
            in (
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
            )
        ):
            gauges[m.group(1)] = float(m.group(3))
    return gauges


def agree(stats_body: object, gauges: dict[str, float]) -> bool:
    stats = parse_stats(stats_body)
    usage = 1.0 - stats.kv_blocks_free / stats.kv_blocks_total
    return (
        gauges.get("vllm:num_requests_waiting") == stats.num_waiting
        and gauges.get("vllm:num_requests_running") == stats.num_running
        and abs(gauges.get("vllm:kv_cache_usage_perc", -1.0) - usage) < 1e-6
    )


def token_prompt(n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n_tokens)]


async def first_token_order(
    url: str, requests: list[tuple[str, int, float, int]], *, into: list[str] | None = None
) -> list[str]:
    """Send streaming completions ``(name, prompt_tokens, send_at_s, max_tokens)``; return
    the names in the order their first token arrived (appended to `into` if given)."""
    order: list[str] = [] if into is None else into

    async def one(
        client: httpx.AsyncClient, name: str, n_tokens: int, delay_s: float, max_tokens: int
    ) -> None:
        await asyncio.sleep(delay_s)
        body = {
            "model": MODEL,
            "prompt": token_prompt(n_tokens, seed=sum(map(ord, name))),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                # Keep reading to the end, so the request runs to completion.
                is_chunk = line.startswith("data: ") and line != "data: [DONE]"
                if is_chunk and name not in order:
                    order.append(name)

    timeout = httpx.Timeout(300.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client, asyncio.TaskGroup() as tg:
        for name, n_tokens, delay_s, max_tokens in requests:
            tg.create_task(one(client, name, n_tokens, delay_s, max_tokens))
    return order


# A blocker decodes for seconds (``--max-num-seqs 1``: nothing else runs meanwhile); three
# long and four short prompts are sent behind it, longs first, and decode 100 tokens each.
# The engine's admission order is read from its own `/stats` (the waiting count and the
# queued prefill tokens after each admission), not from when first tokens reach the client:
# on 2 busy cores the API server relays streams in bursts, which scrambles client-side order.
LONG_TOKENS, SHORT_TOKENS = 1200, 16
BURST = [
    ("blocker", 64, 0.0, 1500),
    *((f"long{i}", LONG_TOKENS, 0.2 + 0.05 * i, 100) for i in range(3)),
    *((f"short{i}", SHORT_TOKENS, 0.4 + 0.05 * i, 100) for i in range(4)),
]
QUEUED = len(BURST) - 1
BURST_ATTEMPTS = 4


def queued_after(admitted: list[int]) -> int:
    """Queued prefill tokens once the prompts in `admitted` (in that order) have run their
    prefill: every other queued prompt is still waiting, uncomputed."""
    waiting = [LONG_TOKENS] * 3 + [SHORT_TOKENS] * 4
    for n in admitted:
        waiting.remove(n)
    return sum(waiting)


async def admission_samples(url: str) -> list[tuple[int, int]]:
    """Run `BURST`; return the (num_waiting, queued_prefill_tokens) states `/stats` showed
    after all seven were queued behind the running blocker (empty if they never were)."""
    task = asyncio.create_task(first_token_order(url, BURST))
    seen: list[tuple[int, int]] = []
    all_queued = False
    async with httpx.AsyncClient(timeout=10.0) as client:
        while not task.done():
            try:
                stats = parse_stats((await client.get(f"{url}/stats")).json())
            except httpx.TransportError:  # a poll lost to the busy server; the next one counts
                continue
            if stats.num_running == 1 and stats.num_waiting == QUEUED:
                all_queued = True
            if all_queued and stats.num_running == 1:
                seen.append((stats.num_waiting, stats.queued_prefill_tokens))
            await asyncio.sleep(0.01)
    await task
    return seen


def admission_states(url: str) -> dict[int, int]:
    """num_waiting -> queued prefill tokens after at least one admission of one burst (any
    single state tells the two orders apart: their queued tokens differ at every count)."""
    for _ in range(BURST_ATTEMPTS):
        states = dict(asyncio.run(admission_samples(url)))
        if any(0 < w < QUEUED for w in states):
            return states
    raise AssertionError(
        f"in {BURST_ATTEMPTS} bursts /stats never showed the seven requests queued behind the "
        "blocker and then an admission; the ordering could not be observed"
    )


# /stats --------------------------------------------------------------------------------------


class TestTwoApiServers:
    """One LARRY replica with ``--api-server-count 2``, stopped after these tests: on 2 cores
    an idle vLLM engine still polls, so replicas must not outlive the tests that use them."""

    def test_stats_at_rest_follows_the_contract_and_agrees_with_metrics(
        self, larry_url: str
    ) -> None:
        with httpx.Client(timeout=60.0) as client:
            # One finished request, so vLLM's engine gauges exist in /metrics (with several API
            # servers they appear with the first stats update).
            done = client.post(
                f"{larry_url}/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
            )
            assert done.status_code == 200
            body: dict[str, object] = {}
            for _ in range(40):
                body = client.get(f"{larry_url}/stats").json()
                if agree(body, vllm_gauges(client.get(f"{larry_url}/metrics").text)):
                    break
                time.sleep(0.25)
            assert agree(body, vllm_gauges(client.get(f"{larry_url}/metrics").text)), body
            stats = parse_stats(body)
            assert body["schema"] == "sal-stats/1"
            assert stats.model == MODEL
            assert stats.scheduler == "larry"
            assert stats.alpha == 1.0
            assert stats.max_num_seqs == 1
            assert (
                stats.kv_blocks_total == 511
            )  # --num-gpu-blocks-override 512, minus the null block
            assert stats.free_kv_tokens == stats.kv_blocks_free * stats.block_size
            assert (stats.num_waiting, stats.num_running, stats.queued_prefill_tokens) == (0, 0, 0)
            # An idle engine keeps its snapshot fresh, so the gateway does not take it for stale.
            time.sleep(1.0)
            later = parse_stats(client.get(f"{larry_url}/stats").json())
            assert later.time > stats.time

    def test_stats_under_load_agrees_with_metrics_on_both_api_servers(self, larry_url: str) -> None:
        # One request runs at a time (--max-num-seqs 1), so these queue for several seconds.
        load = [(f"load{i}", 600, 0.02 * i, 160) for i in range(8)]
        samples: list[dict[str, object]] = []
        agreed_busy = 0

        async def poll_while_loaded() -> None:
            nonlocal agreed_busy
            task = asyncio.create_task(first_token_order(larry_url, load))
            stats_url, fresh = f"{larry_url}/stats", {"connection": "close"}
            async with httpx.AsyncClient(timeout=10.0) as client:
                while not task.done():
                    # Fresh connections: SO_REUSEPORT spreads them over both API servers.
                    before = (await client.get(stats_url, headers=fresh)).json()
                    metrics = (await client.get(f"{larry_url}/metrics")).text
                    after = (await client.get(stats_url, headers=fresh)).json()
                    samples.append(before)
                    stable = {
                        k: before[k] for k in ("num_waiting", "num_running", "kv_blocks_free")
                    }
                    if stable == {k: after[k] for k in stable} and before["num_waiting"] > 0:
                        agreed_busy += agree(before, vllm_gauges(metrics))
                    await asyncio.sleep(0.05)
            await task

        asyncio.run(poll_while_loaded())
        parsed = [parse_stats(s) for s in samples]
        assert max(s.num_waiting for s in parsed) >= 3  # the queue really built up
        assert max(s.queued_prefill_tokens for s in parsed) >= 3 * 600
        assert all(s.num_running <= 1 for s in parsed)
        assert agreed_busy >= 1
        # Steps only move forward across both API servers' answers.
        steps = [s.step for s in parsed]
        assert steps == sorted(steps)


# Ordering under memory pressure --------------------------------------------------------------


def test_larry_admits_queued_short_prompts_before_long_ones(larry_one_api_url: str) -> None:
    states = admission_states(larry_one_api_url)
    # score = alpha * wait - queue_len * blocks: a 1-block short beats a 10-block long that
    # waited 0.2 s longer, so the four shorts go first, then the longs.
    larry = [SHORT_TOKENS] * 4 + [LONG_TOKENS] * 3
    for waiting, queued in states.items():
        assert queued == queued_after(larry[: QUEUED - waiting]), states


def test_fcfs_admits_queued_prompts_in_arrival_order(fcfs_url: str) -> None:
    states = admission_states(fcfs_url)
    fcfs = [LONG_TOKENS] * 3 + [SHORT_TOKENS] * 4
    for waiting, queued in states.items():
        assert queued == queued_after(fcfs[: QUEUED - waiting]), states
    with httpx.Client(timeout=10.0) as client:
        stats = parse_stats(client.get(f"{fcfs_url}/stats").json())
    assert stats.scheduler == "fcfs"
    assert stats.alpha is None


# Data parallelism ----------------------------------------------------------------------------


def test_data_parallel_stats_aggregate_both_engines(dp_url: str) -> None:
    load = [(f"dp{i}", 300, 0.0, 400) for i in range(6)]

    async def sample_under_load() -> list[dict[str, Any]]:
        task = asyncio.create_task(first_token_order(dp_url, load))
        seen: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=10.0) as client:
            while not task.done():
                seen.append((await client.get(f"{dp_url}/stats")).json())
                await asyncio.sleep(0.05)
        await task
        return seen

    samples = asyncio.run(sample_under_load())
    for body in samples:
        total = parse_stats(body)
        ranks = body["dp_ranks"]
        per_rank = [parse_stats(r) for r in ranks]
        assert [r["dp_rank"] for r in ranks] == [0, 1]
        assert total.num_running == sum(r.num_running for r in per_rank)
        assert total.kv_blocks_free == sum(r.kv_blocks_free for r in per_rank)
        assert total.kv_blocks_total == 2 * per_rank[0].kv_blocks_total
        assert total.time == min(r.time for r in per_rank)
    # vLLM spread the requests over both engines, and /stats saw both busy.
    busiest = max(samples, key=lambda b: parse_stats(b).num_running)
    assert all(parse_stats(r).num_running > 0 for r in busiest["dp_ranks"])
    with httpx.Client(timeout=10.0) as client:
        body = client.get(f"{dp_url}/stats").json()
        metrics = client.get(f"{dp_url}/metrics").text
    for rank in body["dp_ranks"]:
        assert agree(rank, vllm_gauges(metrics, engine=str(rank["dp_rank"])))
