"""The gateway as a user runs it: ``sal-gateway serve --config config.yaml``, then ``curl`` and
the ``openai`` SDK against it.

The backends are two typed fakes (`engine_sim.fake_vllm.FakeBackend`) served on loopback in
this test process; they speak the OpenAI API with ``usage`` and ``/stats`` like patched vLLM
replicas (real vLLM is covered by ``tests/integration/test_gateway_vllm.py``). The gateway is
the installed console script in a child process, with the tiny model's tokenizer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from engine_sim.fake_vllm import FakeBackend, ServedBackend
from tests.gateway_support import (
    SAL_GATEWAY_SCRIPT,
    free_port,
    gateway_config,
    metric,
    run_gateway,
    scrape_metrics,
    wait_ok,
)

MODEL = "tiny"


@dataclass
class Fakes:
    """The two fake backends and their base URLs."""

    backends: list[FakeBackend]
    urls: list[str]


@pytest.fixture(scope="module")
def fakes() -> Iterator[Fakes]:
    backends = [FakeBackend(name="a"), FakeBackend(name="b")]
    served = [ServedBackend(b) for b in backends]
    try:
        urls = [s.start() for s in served]
        yield Fakes(backends, urls)
    finally:
        for s in served:
            s.stop()


@pytest.fixture(scope="module")
def gateway(fakes: Fakes, tiny_model_dir: Path) -> Iterator[str]:
    port = free_port(19800, 19900)
    config = gateway_config(port, fakes.urls, tokenizer=tiny_model_dir, policy="round_robin")
    with run_gateway(config, command=(str(SAL_GATEWAY_SCRIPT),)) as url:
        yield url


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    """Run curl (silent, errors shown, bounded in time) and return its result."""
    return subprocess.run(
        ["curl", "-sS", "--max-time", "30", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_curl_completion(gateway: str) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5}
    result = curl(
        "-X", "POST", f"{gateway}/v1/completions",
        "-H", "Content-Type: application/json", "-d", json.dumps(body),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5


def test_curl_streaming_chat_relays_sse(gateway: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "stream": True,
    }
    result = curl(
        "-N", "-X", "POST", f"{gateway}/v1/chat/completions",
        "-H", "Content-Type: application/json", "-d", json.dumps(body),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = [e for e in result.stdout.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert len(chunks) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_curl_service_endpoints(gateway: str) -> None:
    models = json.loads(curl(f"{gateway}/v1/models").stdout)
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert curl("-f", f"{gateway}/health").returncode == 0
    ready = curl("-f", f"{gateway}/ready")
    assert ready.returncode == 0, ready.stdout
    metrics_text = curl(f"{gateway}/metrics").stdout
    assert "sal_build_info" in metrics_text
    assert "sal_backend_healthy" in metrics_text


def test_curl_malformed_json_gets_openai_error(gateway: str) -> None:
    result = curl(
        "-X", "POST", f"{gateway}/v1/completions", "-H", "Content-Type: application/json",
        "-d", "{not json", "-w", "\n%{http_code}",
    )  # fmt: skip
    body, status = result.stdout.rsplit("\n", 1)
    assert status == "400"
    error = json.loads(body)["error"]
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    # ...and the gateway keeps serving.
    assert curl("-f", f"{gateway}/health").returncode == 0


@pytest.fixture
def client(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_openai_sdk_completion_and_chat(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length"


def test_openai_sdk_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    usage = None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text.count("tok") == 6
    assert usage is not None
    assert usage.completion_tokens == 6


def test_openai_sdk_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert "no-such-model" in str(info.value)


def test_extra_fields_reach_the_backend_untouched(client: openai.OpenAI, fakes: Fakes) -> None:
    extra = {"ignore_eos": True, "min_tokens": 2, "repetition_penalty": 1.1, "priority": 0}
    client.completions.create(
        model=MODEL, prompt="forward me", max_tokens=3, logprobs=2, extra_body=extra
    )
    seen = [r for b in fakes.backends for r in b.received if r.get("prompt") == "forward me"]
    assert len(seen) == 1, "exactly one backend must have received the request"
    body = seen[0]
    for key, value in extra.items():
        assert body[key] == value
    assert body["logprobs"] == 2


def test_requests_spread_over_both_backends(
    client: openai.OpenAI, gateway: str, fakes: Fakes
) -> None:
    before = [b.generation_requests for b in fakes.backends]
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="spread", max_tokens=1)
    served = [b.generation_requests - n for b, n in zip(fakes.backends, before, strict=True)]
    assert served == [2, 2]  # round_robin in this config
    samples = scrape_metrics(gateway)
    assert metric(samples, "sal_requests_total", model=MODEL, status="200") >= 4


def test_port_flag_overrides_config_and_sigterm_stops_cleanly(tmp_path: Path, fakes: Fakes) -> None:
    config_port = free_port(19900, 19950)
    port = free_port(19950, 20000)
    config = gateway_config(config_port, fakes.urls, tokenizer=None)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(SAL_GATEWAY_SCRIPT), "serve", "--config", str(config_path), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ),
        )
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", proc, log_path, 60.0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{config_port}/health", timeout=2.0)
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the process reports
        # how it ended (exit status -SIGTERM); either way it must be gone promptly.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
