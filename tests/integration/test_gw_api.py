"""The gateway over real sockets in front of our fake backends, the OpenAI SDK as client.

What a user would notice if it broke: completions and chat (streaming and not) answer through
the gateway; every field it does not need reaches the backend untouched; SAL sends work to the
less-loaded backend; bad input gets a clear 4xx JSON error and the gateway keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_sim.fake_vllm import default_stats
from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:
    # Generous staleness and poll timeouts: on a loaded CI box a slow poll must not make a
    # backend ineligible in the middle of a routing assertion (the fault tests cover that).
    relaxed = {"stale_after_s": 5.0, "poll_timeout_s": 2.0, "eject_after_failures": 5}
    with gateway_rig(2, tokenizer=tiny_model_dir, max_model_len=256, routing=relaxed) as r:
        yield r


@pytest.fixture
def client(rig: Rig) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_health_ready(rig: Rig) -> None:
    assert httpx.get(f"{rig.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{rig.url}/ready")
    assert ready.status_code == 200
    assert ready.json()["eligible_backends"] == {MODEL: 2}
    models = httpx.get(f"{rig.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_completion_non_streaming(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3)
    assert out.choices[0].text == " tok tok tok"
    assert out.usage is not None
    assert out.usage.completion_tokens == 3


def test_completion_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == " tok" * 5


def test_chat_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert out.choices[0].message.content == " tok tok"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 4
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_stream_usage_counted_without_the_client_seeing_it(rig: Rig) -> None:
    before = metric(rig.metrics(), "sal_output_tokens_total", model=MODEL) or 0.0
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{rig.url}/v1/completions", json=body) as resp:
        relayed = resp.read()
    events = [e for e in relayed.split(b"\n\n") if e]
    assert len(events) == 7  # six token chunks and [DONE]: no usage event
    assert b'"usage"' not in relayed
    assert events[-1] == b"data: [DONE]"
    assert metric(rig.metrics(), "sal_output_tokens_total", model=MODEL) == before + 6
    answered = [r for f in rig.fakes for r in f.received if r.get("max_tokens") == 6]
    assert answered[-1]["stream_options"]["include_usage"] is True  # asked on its behalf


def test_unknown_fields_reach_the_backend_untouched(rig: Rig, client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    extra = {"ignore_eos": True, "min_tokens": 2, "my_vendor_field": {"a": [1, 2]}}
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
        tools=tools,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    ).close()
    client.completions.create(
        model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=1, logprobs=1, extra_body=extra
    )
    received = [r for f in rig.fakes for r in f.received]
    chat = next(r for r in received if r.get("tools") == tools)
    assert chat["logprobs"] is True
    assert chat["top_logprobs"] == 2
    assert chat["stream_options"] == {"include_usage": True}
    for key, value in extra.items():
        assert chat[key] == value
    completion = next(r for r in received if r.get("prompt") == [[1, 2, 3], [4, 5]])
    assert completion["logprobs"] == 1
    assert completion["ignore_eos"] is True


def test_headers_forwarded_and_body_labelled_json(rig: Rig) -> None:
    resp = httpx.post(
        f"{rig.url}/v1/completions",
        content=b'{"model": "tiny", "prompt": "x", "max_tokens": 1}',
        headers={"authorization": "Bearer k", "x-request-id": "r1", "content-type": "text/plain"},
    )
    assert resp.status_code == 200
    assert len(resp.headers.get_list("date")) == 1
    assert resp.headers["x-request-id"] == "r1"
    answered = next(f for f in rig.fakes if f.name == resp.json()["backend"])
    # The client's credentials are its own: never forwarded (issue 8); its request id is.
    assert "authorization" not in answered.last_headers
    assert answered.last_headers["x-request-id"] == "r1"
    assert answered.last_headers["content-type"] == "application/json"


def test_sal_routes_to_the_less_loaded_backend(rig: Rig, client: openai.OpenAI) -> None:
    a, b = rig.fakes
    idle = default_stats()
    busy = dataclasses.replace(
        idle, free_kv_tokens=0, kv_blocks_free=0, queued_prefill_tokens=200_000, num_waiting=50
    )
    try:
        for loaded, free in ((a, b), (b, a)):
            loaded.stats, free.stats = busy, idle

            # Both polls must have landed (the pollers run independently of each other).
            def both_polled(busy: str = loaded.name, idle: str = free.name) -> bool:
                return _polled_queue(rig, busy) >= 200_000 and _polled_queue(rig, idle) == 0

            wait_until(both_polled)
            before = free.generation_requests
            for _ in range(5):
                client.completions.create(model=MODEL, prompt="route me", max_tokens=1)
            assert free.generation_requests == before + 5
    finally:
        a.stats = b.stats = idle


def _polled_queue(rig: Rig, name: str) -> int:
    for served in rig.served:
        if served.backend.name == name:
            state = rig.runtime.table.get(MODEL, served.url)
            assert state is not None
            return state.stats.queued_prefill_tokens if state.stats else 0
    raise KeyError(name)


def test_metrics_exported(rig: Rig, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    text = rig.metrics()
    for name in (
        "sal_requests_total",
        "sal_ttft_seconds_count",
        "sal_generation_seconds_count",
        "sal_prompt_tokens_total",
        "sal_output_tokens_total",
        "sal_routing_decisions_total",
        "sal_routing_decision_seconds_count",
        "sal_backend_healthy",
        "sal_backend_free_kv_tokens",
        "sal_backend_queued_prefill_tokens",
        "sal_backend_num_waiting",
        "sal_backend_num_running",
        "sal_backend_in_flight",
        "sal_backend_state_age_seconds",
        "sal_beta",
        "sal_build_info",
    ):
        assert metric(text, name) is not None, name
    assert metric(text, "sal_requests_total", model=MODEL, status="200") is not None
    assert metric(text, "sal_backend_stats_source", source="stats") == 1.0
    assert (metric(text, "sal_output_tokens_total", model=MODEL) or 0) >= 2


def test_prompt_tokens_counted_with_the_tokenizer(rig: Rig, client: openai.OpenAI) -> None:
    before = metric(rig.metrics(), "sal_prompt_tokens_total", model=MODEL) or 0.0
    client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=1)
    after = metric(rig.metrics(), "sal_prompt_tokens_total", model=MODEL)
    assert after == before + 5


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{oops", 400, "not valid JSON"),
        (b'{"model": "tiny", "prompt": 12}', 400, "`prompt` must be"),
        (b'{"model": "tiny", "prompt": "x", "stream": "no"}', 400, "`stream`"),
        (b'{"prompt": "x"}', 400, "`model` is required"),
        (b'{"model": "gpt-9", "prompt": "x"}', 404, "does not exist"),
        (
            json.dumps({"model": "tiny", "prompt": "hello " * 400}).encode(),
            400,
            "maximum context length is 256",
        ),
        (
            json.dumps({"model": "tiny", "prompt": list(range(300))}).encode(),
            400,
            "maximum context length is 256",
        ),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1000}', 400, "max_tokens=1000"),
        (
            b'{"model": "tiny", "prompt": "bad \\ud800 surrogate"}',
            400,
            "not valid Unicode (a lone surrogate, U+D800, at character 4)",
        ),
    ],
)
def test_bad_input_gets_openai_error_and_gateway_keeps_serving(
    rig: Rig, client: openai.OpenAI, body: bytes, status: int, needle: str
) -> None:
    resp = httpx.post(
        f"{rig.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert needle in error["message"]
    assert error["code"] == status
    assert isinstance(error["type"], str)
    assert client.completions.create(model=MODEL, prompt="still ok", max_tokens=1).choices


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 400}], max_tokens=1
        )


def test_body_over_limit_is_413_by_header_and_by_stream() -> None:
    with gateway_rig(1, proxy={"max_body_bytes": 1000}) as rig:
        big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
        resp = httpx.post(f"{rig.url}/v1/completions", content=big)
        assert resp.status_code == 413
        assert "exceeds the limit of 1000 bytes" in resp.json()["error"]["message"]

        def chunked() -> Iterator[bytes]:  # no Content-Length: the size is found while reading
            yield big[:600]
            yield big[600:]

        resp = httpx.post(f"{rig.url}/v1/completions", content=chunked())
        assert resp.status_code == 413
        assert rig.fakes[0].generation_requests == 0


def test_without_tokenizer_prompts_are_estimated_and_flagged() -> None:
    with gateway_rig(1) as rig:
        httpx.post(
            f"{rig.url}/v1/completions", json={"model": MODEL, "prompt": "x" * 40, "max_tokens": 1}
        ).raise_for_status()
        text = rig.metrics()
        assert metric(text, "sal_prompt_tokens_estimated_total", model=MODEL) == 1.0
        assert metric(text, "sal_prompt_tokens_total", model=MODEL) == 10.0
