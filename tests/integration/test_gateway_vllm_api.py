"""The whole vLLM API surface through the gateway, against real vLLM-on-CPU replicas.

First class: one generation replica (``tiny``, the engine patch) and one pooling replica of the
same tiny model (``tiny-embed``: ``--runner pooling --convert embed``, stock vLLM) behind one
gateway (the CLI, a child process). Second class: one classification replica
(``tiny-cls``: ``--convert classify``) for ``/classify``. At most two replicas at a time.

What a user would notice if it broke: the OpenAI SDK's ``responses.create`` (streaming and
not), ``embeddings.create`` and ``models.list`` work unmodified through the gateway; so do
``/tokenize``, ``/detokenize``, ``/v1/score``, ``/v1/rerank`` (and vLLM's aliases),
``/pooling`` and ``/classify`` over plain HTTP; the gateway's prompt-token count of a
Responses or embeddings request equals vLLM's own ``usage``; requests it cannot count are
routed by the least-requests fallback; an endpoint sent to a model of the wrong runner, or an
unknown ``/v1/`` path, gets an OpenAI-shaped error naming what is wrong.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_support import free_port, metric, run_gateway, scrape_metrics
from tests.vllm_support import DEFAULT_ARGS, run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GEN, EMBED, CLS = "tiny", "tiny-embed", "tiny-cls"
MAX_MODEL_LEN = int(DEFAULT_ARGS[DEFAULT_ARGS.index("--max-model-len") + 1])
POOLING_ARGS = ("--runner", "pooling")


def _config(port: int, models: list[tuple[str, str, str]], tokenizer: Path) -> dict[str, Any]:
    """(name, runner, backend URL) per model, in the documented config shape."""
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [
            {
                "name": name,
                "runner": runner,
                "backends": [url],
                "tokenizer": str(tokenizer),
                "max_model_len": MAX_MODEL_LEN,
                "models_refresh_s": 1.0,
            }
            for name, runner, url in models
        ],
        "routing": {"policy": "sal", "poll_interval_s": 0.1},
        "log_level": "info",
    }


def _prompt_tokens(gateway: str, model: str) -> float:
    return metric(scrape_metrics(gateway), "sal_prompt_tokens_total", model=model)


def _decisions(gateway: str, model: str, policy: str) -> float:
    samples = scrape_metrics(gateway)
    return metric(samples, "sal_routing_decisions_total", model=model, policy=policy)


def _post(gateway: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway}{path}", json=body, timeout=60.0)


@pytest.fixture(scope="class")
def pair(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    gen_port = free_port(19700, 19750)
    embed_port = free_port(gen_port + 1, 19750)
    with ExitStack() as stack:
        gen = stack.enter_context(
            run_replica(tiny_model_dir, gen_port, extra_args=("--served-model-name", GEN))
        )
        embed = stack.enter_context(
            run_replica(
                tiny_model_dir,
                embed_port,
                scheduler="stock",
                extra_args=("--served-model-name", EMBED, *POOLING_ARGS, "--convert", "embed"),
            )
        )
        yield gen, embed


@pytest.fixture(scope="class")
def gateway(pair: tuple[str, str], tiny_model_dir: Path) -> Iterator[str]:
    gen, embed = pair
    models = [(GEN, "generate", gen), (EMBED, "pooling", embed)]
    with run_gateway(_config(free_port(19750, 19800), models, tiny_model_dir)) as url:
        yield url


@pytest.fixture
def client(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as c:
        yield c


class TestGenerateAndEmbed:
    """A generation replica and an embedding replica behind one gateway."""

    def test_models_list_is_what_the_replicas_serve(self, client: openai.OpenAI) -> None:
        deadline = time.monotonic() + 30.0  # the first refresh follows the start by ~1 s
        models = client.models.list().data
        while any(m.owned_by != "vllm" for m in models) and time.monotonic() < deadline:
            time.sleep(0.2)
            models = client.models.list().data
        assert [m.id for m in models] == [GEN, EMBED]
        assert all(m.owned_by == "vllm" for m in models)  # the replicas' own cards
        assert all((m.model_extra or {}).get("max_model_len") == MAX_MODEL_LEN for m in models)

    @pytest.mark.parametrize(
        "kwargs",
        [
            pytest.param({"input": "hello world, the cache"}, id="text"),
            pytest.param(
                {
                    "instructions": "you are a cache",
                    "input": [
                        {"role": "user", "content": "the token request"},
                        {"role": "assistant", "content": "kalo minesa"},
                        {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
                    ],
                },
                id="messages",
            ),
        ],
    )
    def test_responses_prompt_tokens_match_vllm(
        self, client: openai.OpenAI, gateway: str, kwargs: dict[str, Any]
    ) -> None:
        before = _prompt_tokens(gateway, GEN)
        resp = client.responses.create(model=GEN, max_output_tokens=4, **kwargs)
        assert resp.status in ("completed", "incomplete")
        assert resp.usage is not None
        assert resp.usage.input_tokens > 0
        assert _prompt_tokens(gateway, GEN) - before == resp.usage.input_tokens

    def test_responses_stream(self, client: openai.OpenAI, gateway: str) -> None:
        before = _prompt_tokens(gateway, GEN)
        events = list(
            client.responses.create(model=GEN, input="stream me", max_output_tokens=4, stream=True)
        )
        assert events[0].type == "response.created"
        last = events[-1]
        assert last.type in ("response.completed", "response.incomplete")
        usage = last.response.usage
        assert usage is not None
        assert _prompt_tokens(gateway, GEN) - before == usage.input_tokens

    @pytest.mark.parametrize(
        "value",
        [
            pytest.param("hello world, the token cache", id="text"),
            pytest.param(["hello world", "a longer text about caches"], id="texts"),
            pytest.param([5, 17, 99, 300], id="token-ids"),
        ],
    )
    def test_embeddings_prompt_tokens_match_vllm(
        self, client: openai.OpenAI, gateway: str, value: Any
    ) -> None:
        before = _prompt_tokens(gateway, EMBED)
        resp = client.embeddings.create(model=EMBED, input=value)
        assert resp.data
        assert len(resp.data[0].embedding) > 0
        assert _prompt_tokens(gateway, EMBED) - before == resp.usage.prompt_tokens

    def test_embeddings_of_messages_match_vllm(self, gateway: str) -> None:
        before = _prompt_tokens(gateway, EMBED)
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
        resp = _post(gateway, "/v1/embeddings", {"model": EMBED, "messages": messages})
        assert resp.status_code == 200, resp.text
        assert _prompt_tokens(gateway, EMBED) - before == resp.json()["usage"]["prompt_tokens"]

    def test_tokenize_and_detokenize(self, gateway: str) -> None:
        out = _post(gateway, "/tokenize", {"model": GEN, "prompt": "hello world"})
        assert out.status_code == 200, out.text
        tokens = out.json()["tokens"]
        assert out.json()["count"] == len(tokens) > 0
        back = _post(gateway, "/detokenize", {"model": GEN, "tokens": tokens})
        assert back.status_code == 200, back.text
        assert "hello world" in back.json()["prompt"]
        chat = _post(
            gateway, "/tokenize", {"model": EMBED, "messages": [{"role": "user", "content": "x"}]}
        )
        assert chat.status_code == 200
        assert chat.json()["count"] > 0

    @pytest.mark.parametrize(
        ("path", "body"),
        [
            ("/v1/score", {"text_1": "hello", "text_2": ["world", "cache"]}),
            ("/score", {"queries": "hello", "documents": ["world", "cache"]}),
            ("/v1/rerank", {"query": "hello", "documents": ["world", "cache"]}),
            ("/rerank", {"query": "hello", "documents": ["world", "cache"]}),
            ("/v2/rerank", {"query": "hello", "documents": ["world", "cache"]}),
        ],
    )
    def test_score_and_rerank_route_by_the_fallback(
        self, gateway: str, path: str, body: dict[str, Any]
    ) -> None:
        before = _decisions(gateway, EMBED, "least_requests")
        resp = _post(gateway, path, {"model": EMBED, **body})
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        results = answer.get("data") or answer.get("results")
        assert len(results) == 2
        assert _decisions(gateway, EMBED, "least_requests") - before == 1

    def test_pooling(self, gateway: str) -> None:
        before = _prompt_tokens(gateway, EMBED)
        resp = _post(gateway, "/pooling", {"model": EMBED, "input": "hello world"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"][0]["data"]
        assert _prompt_tokens(gateway, EMBED) - before == resp.json()["usage"]["prompt_tokens"]

    def test_wrong_runner_is_refused_naming_the_model(self, gateway: str) -> None:
        for path, model in (("/v1/embeddings", GEN), ("/v1/chat/completions", EMBED)):
            body = {"model": model, "input": "x", "messages": [{"role": "user", "content": "x"}]}
            resp = _post(gateway, path, body)
            assert resp.status_code == 400
            assert resp.json()["error"]["param"] == "model"

    def test_unknown_v1_path_is_an_openai_404_naming_it(self, gateway: str) -> None:
        resp = _post(gateway, "/v1/no-such-thing", {"model": GEN})
        assert resp.status_code == 404
        assert "/v1/no-such-thing" in resp.json()["error"]["message"]

    def test_anthropic_messages_relay(self, gateway: str) -> None:
        body = {"model": GEN, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        resp = _post(gateway, "/v1/messages", body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["type"] == "message"


@pytest.fixture(scope="class")
def classifier(tiny_model_dir: Path) -> Iterator[str]:
    port = free_port(19800, 19850)
    args = ("--served-model-name", CLS, *POOLING_ARGS, "--convert", "classify")
    with run_replica(tiny_model_dir, port, scheduler="stock", extra_args=args) as url:
        yield url


@pytest.fixture(scope="class")
def cls_gateway(classifier: str, tiny_model_dir: Path) -> Iterator[str]:
    config = _config(free_port(19850, 19900), [(CLS, "pooling", classifier)], tiny_model_dir)
    with run_gateway(config) as url:
        yield url


class TestClassify:
    """A classification replica (``--convert classify``) behind the gateway."""

    def test_classify_prompt_tokens_match_vllm(self, cls_gateway: str) -> None:
        before = _prompt_tokens(cls_gateway, CLS)
        resp = _post(cls_gateway, "/classify", {"input": ["hello world", "cache"]})  # no model
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["data"]) == 2
        assert resp.json()["data"][0]["num_classes"] == 2
        assert _prompt_tokens(cls_gateway, CLS) - before == resp.json()["usage"]["prompt_tokens"]
