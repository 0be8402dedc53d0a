"""The gateway in front of real vLLM-on-CPU replicas of the tiny model, the OpenAI SDK as client.

Two patched replicas (LARRY + ``/stats``) are started once for the module's first class, then
stopped; one stock replica (no patch, no ``/stats``) for the second class exercises the
``/metrics`` fallback. The gateway runs as a CLI child process with a generated config.

What a user would notice if it broke: completions and chat answer through the gateway
(streaming and not); the gateway's prompt-token count (``sal_prompt_tokens_total``) equals
vLLM's own ``usage.prompt_tokens`` for text, token-ID, batched and chat prompts and with the
request options that change the count; a prompt over the context is refused by the gateway as
vLLM refuses it; vLLM's own 400s pass through; a burst of requests spreads over both
replicas; ``/ready`` says ready; a stock replica is usable and reported as such.

Three vLLM starts in all (the two patched ones in parallel), at most two replicas at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_sim.fake_vllm import FakeBackend, ServedBackend
from sal_gateway.relay import BUFFERED_BODY_BYTES
from tests.gateway_support import free_port, gateway_config, metric, run_gateway, scrape_metrics
from tests.vllm_support import DEFAULT_ARGS, run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
# Forced output lengths keep generation short and deterministic in size.
MAX_TOKENS = 4
# What tests/vllm_support.py starts the replicas with (`--max-model-len`); the gateway is told
# the same, as an operator would configure it.
MAX_MODEL_LEN = int(DEFAULT_ARGS[DEFAULT_ARGS.index("--max-model-len") + 1])
IGNORE_EOS = {"ignore_eos": True}
BURST_TOKENS = 200
"""Output tokens per request of the burst test: seconds of decoding, so the burst overlaps."""


def _start_replicas(model_dir: Path, schedulers: list[str], stack: ExitStack) -> list[str]:
    """Start one replica per scheduler in parallel (their ~40 s start-ups overlap)."""
    ports = []
    next_port = 19400
    for _ in schedulers:
        port = free_port(next_port, 19500)
        ports.append(port)
        next_port = port + 1
    managers = [
        run_replica(model_dir, port, scheduler=s, extra_args=("--served-model-name", MODEL))
        for port, s in zip(ports, schedulers, strict=True)
    ]
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        urls = []
        errors = []
        for manager, future in zip(managers, futures, strict=True):
            try:
                urls.append(future.result())
                stack.push(manager.__exit__)
            except Exception as exc:
                errors.append(exc)
    if errors:
        stack.close()
        raise errors[0]
    return urls


def _prompt_tokens_total(gateway: str) -> float:
    return metric(scrape_metrics(gateway), "sal_prompt_tokens_total", model=MODEL)


def _replica_requests(replica: str) -> float:
    """vLLM's own count of finished requests on one replica (ground truth of where they ran)."""
    text = httpx.get(f"{replica}/metrics", timeout=5.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# Class-scoped: each class's replicas are stopped before the next class starts its own, so
# at most two vLLM replicas run at once (~3 GB each).
@pytest.fixture(scope="class")
def replicas(tiny_model_dir: Path) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield _start_replicas(tiny_model_dir, ["larry", "larry"], stack)


@pytest.fixture(scope="class")
def gateway(replicas: list[str], tiny_model_dir: Path) -> Iterator[str]:
    port = free_port(19500, 19600)
    config = gateway_config(
        port, replicas, tokenizer=tiny_model_dir, policy="sal", max_model_len=MAX_MODEL_LEN
    )
    with run_gateway(config) as url:
        yield url


@pytest.fixture(scope="class")
def stock_replica(tiny_model_dir: Path) -> Iterator[str]:
    with ExitStack() as stack:
        yield _start_replicas(tiny_model_dir, ["stock"], stack)[0]


@pytest.fixture(scope="class")
def stock_gateway(stock_replica: str, tiny_model_dir: Path) -> Iterator[str]:
    port = free_port(19600, 19700)
    config = gateway_config(port, [stock_replica], tokenizer=tiny_model_dir, policy="sal")
    with run_gateway(config) as url:
        yield url


@pytest.fixture
def client(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as c:
        yield c


class TestPatchedPair:
    """Two replicas with the engine patch behind the gateway's SAL policy."""

    def test_ready_and_models(self, gateway: str) -> None:
        ready = httpx.get(f"{gateway}/ready", timeout=5.0)
        assert ready.status_code == 200
        models = httpx.get(f"{gateway}/v1/models", timeout=5.0).json()
        assert [m["id"] for m in models["data"]] == [MODEL]

    def test_replicas_report_stats_source(self, gateway: str, replicas: list[str]) -> None:
        samples = scrape_metrics(gateway)
        for replica in replicas:
            assert (
                metric(samples, "sal_backend_stats_source", backend=replica, source="stats") == 1.0
            )
            assert metric(samples, "sal_backend_healthy", backend=replica) == 1.0

    @pytest.mark.parametrize(
        "prompt",
        [
            pytest.param("hello world, the token cache of a gpu", id="text"),
            pytest.param([5, 17, 99, 300, 42, 7, 7, 8], id="token-ids"),
            pytest.param(
                ["hello world", "a much longer prompt about the request cache"], id="batched-text"
            ),
            pytest.param([[5, 6, 7], [8, 9, 10, 11, 12]], id="batched-token-ids"),
        ],
    )
    def test_completion_prompt_tokens_match_vllm(
        self, client: openai.OpenAI, gateway: str, prompt: str | list[int] | list[str]
    ) -> None:
        before = _prompt_tokens_total(gateway)
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS
        )
        assert resp.usage is not None
        assert resp.choices
        assert all(c.text is not None for c in resp.choices)
        assert _prompt_tokens_total(gateway) - before == resp.usage.prompt_tokens

    @pytest.mark.parametrize(
        "messages",
        [
            pytest.param([{"role": "user", "content": "hello world"}], id="one-user"),
            pytest.param(
                [
                    {"role": "system", "content": "you are a cache"},
                    {"role": "user", "content": "the token request of a gpu"},
                    {"role": "assistant", "content": "kalo minesa"},
                    {"role": "user", "content": "again, hello"},
                ],
                id="multi-turn",
            ),
            pytest.param(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hello"},
                            {"type": "text", "text": "world prompt"},
                        ],
                    }
                ],
                id="content-parts",
            ),
        ],
    )
    def test_chat_prompt_tokens_match_vllm(
        self, client: openai.OpenAI, gateway: str, messages: list[ChatCompletionMessageParam]
    ) -> None:
        before = _prompt_tokens_total(gateway)
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS
        )
        assert resp.usage is not None
        assert resp.choices[0].message.role == "assistant"
        assert _prompt_tokens_total(gateway) - before == resp.usage.prompt_tokens

    @pytest.mark.parametrize(
        ("endpoint", "options"),
        [
            pytest.param("completions", {"add_special_tokens": False}, id="no-bos"),
            pytest.param("chat", {"add_generation_prompt": False}, id="no-generation-prompt"),
            pytest.param("chat", {"add_special_tokens": True}, id="chat-with-special-tokens"),
            pytest.param(
                "chat",
                {"add_generation_prompt": False, "continue_final_message": True},
                id="continue-final-message",
            ),
        ],
    )
    def test_request_options_that_change_the_count(
        self, client: openai.OpenAI, gateway: str, endpoint: str, options: dict[str, bool]
    ) -> None:
        before = _prompt_tokens_total(gateway)
        extra = {**IGNORE_EOS, **options}
        if endpoint == "completions":
            usage = client.completions.create(
                model=MODEL, prompt="hello world", max_tokens=MAX_TOKENS, extra_body=extra
            ).usage
        else:
            usage = client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": "hello world"},
                    {"role": "assistant", "content": "the cache"},
                ],
                max_tokens=MAX_TOKENS,
                extra_body=extra,
            ).usage
        assert usage is not None
        assert _prompt_tokens_total(gateway) - before == usage.prompt_tokens

    def test_streaming_completion(self, client: openai.OpenAI, gateway: str) -> None:
        before = _prompt_tokens_total(gateway)
        stream = client.completions.create(
            model=MODEL,
            prompt="stream me the hello world tokens",
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=MAX_TOKENS,
            extra_body=IGNORE_EOS,
        )
        texts: list[str] = []
        usage = None
        for chunk in stream:
            texts.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert usage is not None
        assert usage.completion_tokens == 4
        assert len(texts) >= 1
        assert _prompt_tokens_total(gateway) - before == usage.prompt_tokens

    def test_streaming_chat(self, client: openai.OpenAI, gateway: str) -> None:
        before = _prompt_tokens_total(gateway)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream a chat answer"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=MAX_TOKENS,
            extra_body=IGNORE_EOS,
        )
        usage = None
        finish = None
        for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length"
        assert usage is not None
        assert usage.completion_tokens == 4
        assert _prompt_tokens_total(gateway) - before == usage.prompt_tokens

    def test_burst_reaches_both_replicas(self, gateway: str, replicas: list[str]) -> None:
        # Long enough outputs that the 16 requests are in flight together however slowly a busy
        # machine routes them: then the replica serving earlier ones looks busier, and SAL must
        # send later ones to the other. (With 4-token outputs each request could end before
        # the next is routed, and an idle pair ties every time.)
        before = [_replica_requests(r) for r in replicas]

        async def burst() -> None:
            async with openai.AsyncOpenAI(
                base_url=f"{gateway}/v1", api_key="unused", max_retries=0
            ) as aclient:
                await asyncio.gather(
                    *(
                        aclient.completions.create(
                            model=MODEL,
                            prompt=f"burst request {i} " * 20,
                            max_tokens=BURST_TOKENS,
                            extra_body=IGNORE_EOS,
                        )
                        for i in range(16)
                    )
                )

        asyncio.run(burst())
        # vLLM counts a success when it records the step's stats, which may follow the answer.
        deadline = time.monotonic() + 60.0
        while True:
            served = [_replica_requests(r) - b for r, b in zip(replicas, before, strict=True)]
            if sum(served) >= 16 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert sum(served) == 16
        assert all(n > 0 for n in served), served

    def test_overlong_prompt_rejected_like_vllm(
        self, client: openai.OpenAI, gateway: str, replicas: list[str]
    ) -> None:
        prompt = [5] * (MAX_MODEL_LEN + 1)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        direct = httpx.post(f"{replicas[0]}/v1/completions", json=body, timeout=30.0)
        assert direct.status_code == 400  # what vLLM itself answers
        before = metric(scrape_metrics(gateway), "sal_requests_total", backend="none", status="400")
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert str(MAX_MODEL_LEN) in str(info.value)
        after = metric(scrape_metrics(gateway), "sal_requests_total", backend="none", status="400")
        assert after - before == 1  # answered by the gateway, never sent to a replica

    def test_vllm_rejection_passes_through(self, client: openai.OpenAI) -> None:
        # vLLM answers 400 for a negative temperature; the gateway relays status and body.
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", temperature=-1.0, max_tokens=2)

    def test_a_large_answer_is_passed_through_whole_and_its_usage_counted(
        self, gateway: str
    ) -> None:
        """Three choices of 1,800 tokens with 20 top logprobs each: a non-streamed answer of
        several MB, over what the gateway reads whole (`BUFFERED_BODY_BYTES`), so it is
        relayed as vLLM sends it and its usage read from its last bytes."""
        tokens, n = 1800, 3
        before = metric(scrape_metrics(gateway), "sal_output_tokens_total", model=MODEL)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": tokens,
            "n": n,
            "logprobs": True,
            "top_logprobs": 20,
            **IGNORE_EOS,
        }
        resp = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=600.0)
        assert resp.status_code == 200, resp.text[:500]
        print(f"\nlarge answer through the gateway: {len(resp.content) / 1e6:.1f} MB")
        assert len(resp.content) > BUFFERED_BODY_BYTES
        answer = resp.json()  # whole and well-formed
        assert [len(c["logprobs"]["content"]) for c in answer["choices"]] == [tokens] * n
        assert answer["usage"]["completion_tokens"] == tokens * n
        after = metric(scrape_metrics(gateway), "sal_output_tokens_total", model=MODEL)
        assert after - before == tokens * n

    def test_a_backend_that_serves_another_model_gets_no_request(
        self, replicas: list[str], tiny_model_dir: Path
    ) -> None:
        """A wrong address in the config: model ``tiny``'s pool holds a real replica and one
        serving ``other`` (vLLM's 404 for every request); model ``ghost``'s pool holds a real
        replica serving ``tiny`` only. The gateway reads each backend's ``/v1/models``: tiny's
        requests all reach the real replica, ghost's get a 503 that says why."""
        with ExitStack() as stack:
            wrong = FakeBackend(name="wrong", model="other")
            wrong_url = stack.enter_context(ServedBackend(wrong))
            port = free_port(19700, 19800)
            config = gateway_config(port, [replicas[0], wrong_url], tokenizer=tiny_model_dir)
            config["models"].append({"name": "ghost", "backends": [replicas[1]]})
            url = stack.enter_context(run_gateway(config, wait_ready=False))

            def serves(model: str, backend: str) -> float:
                samples = scrape_metrics(url)
                return metric(samples, "sal_backend_serves_model", model=model, backend=backend)

            deadline = time.monotonic() + 30.0
            while serves("tiny", wrong_url) or serves("ghost", replicas[1]):
                assert time.monotonic() < deadline, "the wrong backends were never noticed"
                time.sleep(0.1)
            assert serves("tiny", replicas[0]) == 1.0
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
                for _ in range(8):
                    answer = c.completions.create(
                        model=MODEL, prompt="hello", max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS
                    )
                    assert answer.choices[0].text is not None
                with pytest.raises(openai.InternalServerError) as refused:
                    c.completions.create(model="ghost", prompt="hello", max_tokens=MAX_TOKENS)
            assert not wrong.received  # nothing was sent to the wrong replica
            assert refused.value.status_code == 503
            assert "1 of its 1 backends do not serve it" in str(refused.value)
            listed = httpx.get(f"{url}/v1/models", timeout=5.0).json()["data"]
            assert [m["id"] for m in listed] == [MODEL]


class TestStockReplica:
    """One stock vLLM replica (no patch): routed through the `/metrics` fallback."""

    def test_stock_replica_served_via_metrics_fallback(
        self, stock_gateway: str, stock_replica: str
    ) -> None:
        gateway, stock = stock_gateway, stock_replica
        assert httpx.get(f"{stock}/stats", timeout=5.0).status_code == 404
        with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
            before = _prompt_tokens_total(gateway)
            resp = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello stock"}],
                max_tokens=MAX_TOKENS,
                extra_body=IGNORE_EOS,
            )
        assert resp.usage is not None
        assert _prompt_tokens_total(gateway) - before == resp.usage.prompt_tokens
        samples = scrape_metrics(gateway)
        assert metric(samples, "sal_backend_stats_source", backend=stock, source="metrics") == 1.0
        assert metric(samples, "sal_backend_healthy", backend=stock) == 1.0
