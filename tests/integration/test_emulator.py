"""The emulator over real sockets: the OpenAI SDK, `/stats`, `/metrics`, disconnects."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine_sim.emulator import EmulatorConfig, build_parser, config_from_args, run_emulators
from sal_core.stats import parse_stats
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import load_model_tokenizer
from sal_gateway.vllm_metrics import parse_vllm_metrics


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


DEADLINE_S = 60.0
"""How long a state a test waits for may take (generous: a busy machine is slow, not wrong)."""


async def wait_idle(http: httpx.AsyncClient, url: str) -> dict[str, object]:
    """Poll `/stats` until nothing is waiting or running (at most `DEADLINE_S`)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        body = (await http.get(f"{url}/stats")).json()
        if body["num_running"] == 0 and body["num_waiting"] == 0:
            return dict(body)
        if time.monotonic() > deadline:
            raise AssertionError(f"replica never went idle: {body}")
        await asyncio.sleep(0.01)


async def test_completions_through_the_openai_sdk_non_streaming() -> None:
    async with run_emulators(1) as (url,), client_for(url) as client:
        result = await client.completions.create(
            model="tiny", prompt=[5, 6, 7, 8], max_tokens=7, extra_body={"ignore_eos": True}
        )
    assert result.usage is not None
    assert result.usage.prompt_tokens == 4
    assert result.usage.completion_tokens == 7
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].text.count("tok") == 7


async def test_chat_streaming_delivers_every_token_and_usage() -> None:
    async with run_emulators(1) as (url,), client_for(url) as client:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "How long is a piece of string?"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        contents: list[str] = []
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                contents.append(choice.delta.content or "")
    assert "".join(contents).count("tok") == 12
    assert usage is not None
    assert usage.completion_tokens == 12
    # No tokenizer configured: the gateway's documented estimate, ceil(30 / 4) + 4 + 3.
    assert usage.prompt_tokens == 15


async def test_stats_and_metrics_follow_the_contracts_under_load() -> None:
    emulators = run_emulators(1, num_kv_blocks=64, time_scale=2.0)
    async with emulators as (url,), client_for(url) as client:
        jobs = [
            asyncio.create_task(
                # Distinct prompts: the prefix cache must not let them share blocks.
                client.completions.create(model="tiny", prompt=[i + 1] * 300, max_tokens=40)
            )
            for i in range(6)
        ]
        async with httpx.AsyncClient() as http:
            busy = None
            deadline = time.monotonic() + DEADLINE_S
            # Until the queue shows (or every job ended without it: the product is wrong).
            while not all(job.done() for job in jobs) and time.monotonic() < deadline:
                stats = parse_stats((await http.get(f"{url}/stats")).json())
                if stats.num_waiting and stats.num_running:
                    busy = stats
                    break
                await asyncio.sleep(0.005)
            metrics = parse_vllm_metrics((await http.get(f"{url}/metrics")).text, "tiny", 0.0)
            results = await asyncio.gather(*jobs)
            idle = parse_stats(await wait_idle(http, url))
    # 6 x 300-token prompts (19 blocks each) cannot all fit 64 blocks: some wait.
    assert busy is not None
    assert busy.kv_blocks_free < busy.kv_blocks_total == 64
    assert busy.queued_prefill_tokens >= 300
    assert metrics.kv_blocks_total == 64
    assert metrics.block_size == 16
    assert all(r.usage is not None and r.usage.completion_tokens == 40 for r in results)
    assert idle.kv_blocks_free == 64
    assert idle.queued_prefill_tokens == 0
    assert idle.step > busy.step


async def test_client_disconnect_aborts_the_request_in_the_engine() -> None:
    # time_scale 5: this 10,000-token generation would take ~150 s of wall time.
    async with run_emulators(1, time_scale=5.0) as (url,), httpx.AsyncClient() as http:
        body = {"model": "tiny", "prompt": [1] * 10, "max_tokens": 10_000, "stream": True}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        # The stream is closed; the engine must forget the request and free its blocks.
        idle = parse_stats(await wait_idle(http, url))
        assert idle.kv_blocks_free == idle.kv_blocks_total
        # Non-streaming: the client gives up (timeout) and disconnects.
        body["stream"] = False
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{url}/v1/completions", json=body, timeout=0.3)
        idle = parse_stats(await wait_idle(http, url))
        assert idle.kv_blocks_free == idle.kv_blocks_total


async def test_several_replicas_in_one_process_are_independent() -> None:
    async with run_emulators(3, scheduler="larry", alpha=5.0) as urls, httpx.AsyncClient() as http:
        assert len(set(urls)) == 3
        async with client_for(urls[1]) as client:
            await client.completions.create(model="tiny", prompt=[3] * 50, max_tokens=5)
        steps = []
        for url in urls:
            assert (await http.get(f"{url}/health")).status_code == 200
            stats = parse_stats((await http.get(f"{url}/stats")).json())
            assert stats.scheduler == "larry"
            assert stats.alpha == 5.0
            steps.append(stats.step)
    assert steps[0] == steps[2] == 0
    assert steps[1] > 0


async def test_errors_are_openai_shaped() -> None:
    async with run_emulators(1, num_kv_blocks=8) as (url,), httpx.AsyncClient() as http:
        wrong_model = await http.post(f"{url}/v1/completions", json={"model": "x", "prompt": "a"})
        too_big = await http.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": [1] * 100, "max_tokens": 100}
        )
    assert wrong_model.status_code == 404
    assert wrong_model.json()["error"]["param"] == "model"
    # 8 blocks hold 128 tokens: prompt (100) + max_tokens clamped to the context.
    assert too_big.status_code == 200
    assert too_big.json()["usage"]["completion_tokens"] == 28


@pytest.mark.parametrize("repeat", [1, 300], ids=["short", "long-prompt-in-thread"])
async def test_prompt_counts_match_the_gateway_with_a_tokenizer(
    tiny_model_dir: Path, repeat: int
) -> None:
    text = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox. " * repeat
    raw = httpx.Request(
        "POST", "http://x", json={"model": "tiny", "prompt": text, "max_tokens": 2}
    ).content
    expected = load_model_tokenizer(str(tiny_model_dir), None).count_sync(
        parse_body(raw, Endpoint.COMPLETIONS)
    )
    # 2,048 blocks and a 32k context: the long prompt is ~19k tokens of the byte-level BPE.
    async with (
        run_emulators(
            1, tokenizer=str(tiny_model_dir), num_kv_blocks=2048, max_model_len=32768
        ) as (url,),
        client_for(url) as client,
    ):
        result = await client.completions.create(model="tiny", prompt=text, max_tokens=2)
    assert result.usage is not None
    assert result.usage.prompt_tokens == expected.total
    assert expected.estimated is False


async def test_batched_prompts_on_a_gpu_profile_faster_than_real_time() -> None:
    # The 8B/A100 profile at time_scale 0.05: a 2,000-token prefill (~0.17 s modelled)
    # takes ~9 ms of wall time.
    emulators = run_emulators(1, profile="llama3-8b-a100", time_scale=0.05)
    async with emulators as (url,), client_for(url) as client:
        result = await client.completions.create(
            model="tiny", prompt=[[1] * 2000, [2] * 30], max_tokens=4
        )
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.text.count("tok") == 4 for c in result.choices)
    assert result.usage is not None
    assert result.usage.prompt_tokens == 2030
    assert result.usage.completion_tokens == 8


async def test_a_repeated_prompt_is_served_from_the_prefix_cache() -> None:
    prompt = list(range(100, 700))  # 600 tokens: 37 full blocks, all but the last token
    text = "Once upon a time, " * 40
    async with run_emulators(1) as (url,), client_for(url) as client, httpx.AsyncClient() as http:
        for _ in range(2):
            await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        hits = _counter((await http.get(f"{url}/metrics")).text, "vllm:prefix_cache_hits_total")
        queries = _counter((await http.get(f"{url}/metrics")).text, "vllm:prefix_cache_queries")
        await client.completions.create(model="tiny", prompt=text, max_tokens=2)
        await client.completions.create(model="tiny", prompt=text + "The end.", max_tokens=2)
        text_hits = _counter((await http.get(f"{url}/metrics")).text, "vllm:prefix_cache_hits")
    assert (hits, queries) == (37 * 16, 1200)
    # A text prompt without a tokenizer: blocks of 4-byte pseudo-tokens; the longer one
    # reuses all 11 full blocks of the shorter (720 bytes = 180 tokens).
    assert text_hits - hits == 11 * 16


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_command_line_flags_map_onto_the_config() -> None:
    args = build_parser().parse_args(
        [
            "--replicas", "4", "--base-port", "21500", "--profile", "llama3-70b-fp8-h100x2",
            "--scheduler", "trail_plus", "--trail-c", "0", "--time-scale", "0.1",
            "--model", "llama", "--no-scheduler-reserve-full-isl", "--num-kv-blocks", "500",
            "--no-enable-prefix-caching", "--lora-modules", "sql", "chat", "--max-loras", "2",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert (args.replicas, args.base_port) == (4, 21500)
    assert config.model_name == "llama"
    assert config.profile == "llama3-70b-fp8-h100x2"
    engine = config.engine_config()
    assert engine.scheduler == "trail_plus"
    assert engine.trail_c == 0.0
    assert engine.num_kv_blocks == 500
    assert engine.reserve_full_prompt is False
    assert engine.enable_prefix_caching is False
    assert config.lora_modules == ("sql", "chat")
    assert engine.max_loras == 2
    assert config_from_args(build_parser().parse_args([])).engine_config().max_loras == 0
    assert config.time_scale == 0.1


async def test_lora_adapters_are_listed_served_and_wait_for_a_slot() -> None:
    """Two adapters and one slot: the second adapter's request waits until the first
    adapter's request ends, as vLLM's scheduler makes it; /stats names the slot's holder,
    and an adapter's prompt does not hit the base model's cached blocks."""
    config = EmulatorConfig(lora_modules=("sql", "chat"), max_loras=1, time_scale=1.0)
    prompt = list(range(100, 300))  # 200 tokens: 12 full blocks
    async with (
        run_emulators(1, config=config) as (url,),
        client_for(url) as client,
        httpx.AsyncClient() as http,
    ):
        cards = (await http.get(f"{url}/v1/models")).json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [
            ("tiny", None), ("sql", "tiny"), ("chat", "tiny")
        ]  # fmt: skip
        long_sql = asyncio.ensure_future(
            client.completions.create(model="sql", prompt=[1, 2, 3], max_tokens=400)
        )
        deadline = time.monotonic() + DEADLINE_S
        while (await http.get(f"{url}/stats")).json()["lora_running"] != ["sql"]:
            assert time.monotonic() < deadline, "sql never ran"
            await asyncio.sleep(0.005)
        # A stock-vLLM reader (the gateway's /metrics fallback) sees the same slot taken.
        stock = parse_vllm_metrics((await http.get(f"{url}/metrics")).text, "tiny", 0.0)
        assert (stock.max_loras, stock.lora_running) == (1, ("sql",))
        chat = await client.completions.create(model="chat", prompt=[4, 5, 6], max_tokens=1)
        assert long_sql.done()  # chat's request started only once sql's had ended
        assert chat.model == "chat"
        stats = (await http.get(f"{url}/stats")).json()
        assert (stats["max_loras"], stats["lora_running"]) == (1, [])
        stock = parse_vllm_metrics((await http.get(f"{url}/metrics")).text, "tiny", 0.0)
        assert (stock.max_loras, stock.lora_running) == (1, ())
        await client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        before = _counter((await http.get(f"{url}/metrics")).text, "vllm:prefix_cache_hits")
        await client.completions.create(model="sql", prompt=prompt, max_tokens=1)
        after = _counter((await http.get(f"{url}/metrics")).text, "vllm:prefix_cache_hits")
        assert after == before  # the adapter's blocks are its own
        missing = await http.post(
            f"{url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}
        )
        assert missing.status_code == 404
