"""Every endpoint of the registry through the gateway, against fake backends (real sockets).

Two pools: ``tiny`` (runner ``generate``, two fakes) and ``tiny-embed`` (runner ``pooling``,
one fake). The real-vLLM proof of each endpoint is `test_gateway_vllm_api`; this module checks,
fast, what the gateway itself decides for every path of the registry.

What a user would notice if it broke: a vLLM endpoint that 404s through the gateway, or reaches
a replica that does not serve it; a body altered on the way; a Responses stream changed; a
request the gateway cannot count piled on one backend; the concurrency limit not applying to
the new endpoints; ``/v1/models`` not reflecting the replicas.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from engine_sim.fake_vllm import FakeBackend, ServedApp, ServedBackend
from sal_gateway.app import create_app
from sal_gateway.config import build_config
from sal_gateway.endpoints import ENDPOINTS, Family
from tests.gw_fake_support import FAST_ROUTING, metric, wait_until

GEN, EMBED = "tiny", "tiny-embed"
RELAXED = {**FAST_ROUTING, "stale_after_s": 5.0, "poll_timeout_s": 2.0, "eject_after_failures": 5}


class Fleet:
    def __init__(self, url: str, fakes: dict[str, list[FakeBackend]]) -> None:
        self.url = url
        self.fakes = fakes

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=10.0, **kw)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5.0).text


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with _fleet({}) as f:
        yield f


@contextmanager
def _fleet(limits: dict[str, Any], delay_s: float = 0.0) -> Iterator[Fleet]:
    """Fakes a, b (``tiny``) and e (``tiny-embed``, answering after `delay_s`) + a gateway."""
    with ExitStack() as stack:
        fakes: dict[str, list[FakeBackend]] = {GEN: [], EMBED: []}
        urls: dict[str, list[str]] = {GEN: [], EMBED: []}
        for name, model in (("a", GEN), ("b", GEN), ("e", EMBED)):
            fake = FakeBackend(name=name, model=model)
            if model == EMBED:  # a slow pooling replica; the generation ones answer at once
                fake.behaviour.first_byte_delay_s = delay_s
            urls[model].append(stack.enter_context(ServedBackend(fake)))
            fakes[model].append(fake)
        models = [
            {"name": GEN, "backends": urls[GEN], "models_refresh_s": 0.2},
            {"name": EMBED, "backends": urls[EMBED], "runner": "pooling"},
        ]
        config = build_config(
            {
                "models": models,
                "listen": {"host": "127.0.0.1", "port": 0},
                "routing": RELAXED,
                "limits": limits,
            }
        )
        url = stack.enter_context(ServedApp(create_app(config), lifespan=True))
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=5.0).status_code == 200, 60.0)
        yield Fleet(url, fakes)


def _model_for(family: Family) -> str:
    return EMBED if family is Family.POOLING else GEN


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.path)
def test_every_endpoint_reaches_a_replica_of_its_runner_untouched(
    fleet: Fleet, endpoint: Any
) -> None:
    model = _model_for(endpoint.family)
    body = {"model": model, "input": "hello", "prompt": "hi", "vendor_field": [1, {"x": None}]}
    if endpoint.path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": model, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    resp = fleet.post(endpoint.path, body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["backend"] in {f.name for f in fleet.fakes[model]}
    assert answer["echo"] == body  # forwarded as sent
    if endpoint.path not in ("/v1/completions", "/v1/chat/completions"):
        assert answer["path"] == endpoint.path


def test_responses_stream_is_relayed_untouched_and_its_usage_read(fleet: Fleet) -> None:
    before = metric(fleet.metrics(), "sal_output_tokens_total", model=GEN) or 0.0
    body = {"model": GEN, "input": "hello", "stream": True}
    with httpx.stream("POST", f"{fleet.url}/v1/responses", json=body, timeout=10.0) as resp:
        assert resp.status_code == 200
        text = resp.read().decode()
    assert text.startswith("event: response.created\ndata: ")
    assert "event: response.completed" in text
    sent = [f.received[-1] for fakes in fleet.fakes.values() for f in fakes if f.received]
    assert any(r == body for r in sent)  # no stream_options injected into a Responses body
    wait_until(
        lambda: (metric(fleet.metrics(), "sal_output_tokens_total", model=GEN) or 0) > before
    )


def test_uncounted_requests_are_routed_by_least_requests(fleet: Fleet) -> None:
    def decisions(policy: str) -> float:
        return (
            metric(fleet.metrics(), "sal_routing_decisions_total", model=EMBED, policy=policy) or 0
        )

    rerank, embed = decisions("least_requests"), decisions("sal")
    assert fleet.post("/v1/rerank", {"model": EMBED, "query": "q", "documents": ["d"]}).is_success
    assert fleet.post("/v1/embeddings", {"model": EMBED, "input": "some text"}).is_success
    assert decisions("least_requests") == rerank + 1
    assert decisions("sal") == embed + 1


def test_a_request_for_the_wrong_runner_names_the_model(fleet: Fleet) -> None:
    for path, model in (
        ("/v1/embeddings", GEN),
        ("/v1/responses", EMBED),
        ("/v1/completions", EMBED),
    ):
        resp = fleet.post(path, {"model": model, "input": "x", "prompt": "x"})
        assert resp.status_code == 400, path
        assert resp.json()["error"]["param"] == "model"
        assert path in resp.json()["error"]["message"]
    assert fleet.post("/tokenize", {"model": EMBED, "prompt": "x"}).is_success  # any runner


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": EMBED, "input": {"a": 1}}, "input"),
        ("/v1/responses", {"model": GEN, "input": 5}, "input"),
        ("/v1/responses", {"model": GEN, "input": "x", "stream": "yes"}, "stream"),
        ("/tokenize", {"prompt": "x"}, "model"),  # two models configured: which one?
        ("/v1/rerank", {"model": 7}, "model"),
    ],
)
def test_malformed_bodies_are_a_400_naming_the_field(
    fleet: Fleet, path: str, body: dict[str, Any], param: str
) -> None:
    resp = fleet.post(path, body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_bad_json_unknown_paths_and_oversized_bodies(fleet: Fleet) -> None:
    raw = httpx.post(f"{fleet.url}/v1/embeddings", content=b"{nope", timeout=5.0)
    assert raw.status_code == 400
    unknown = fleet.post("/v1/files", {"model": GEN})
    assert unknown.status_code == 404
    assert "/v1/files" in unknown.json()["error"]["message"]
    assert httpx.get(f"{fleet.url}/v1/embeddings", timeout=5.0).status_code == 405
    huge = fleet.post("/tokenize", {"model": GEN, "prompt": "x" * (11 << 20)})
    assert huge.status_code == 413


def test_models_list_reflects_the_replicas(fleet: Fleet) -> None:
    def listing() -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = httpx.get(f"{fleet.url}/v1/models", timeout=5.0).json()["data"]
        return data

    wait_until(lambda: all("sal_replicas" in m for m in listing()))
    data = listing()
    assert [(m["id"], m["sal_replicas"]) for m in data] == [(GEN, 2), (EMBED, 1)]
    before = sum(f.generation_requests for fs in fleet.fakes.values() for f in fs)
    for _ in range(5):
        listing()
    after = sum(f.generation_requests for fs in fleet.fakes.values() for f in fs)
    assert after == before  # a client's /v1/models never calls upstream


def test_the_concurrency_limit_covers_every_endpoint() -> None:
    with _fleet({"max_concurrent_requests": 1, "retry_after_s": 3}, delay_s=1.5) as slow:
        results: list[int] = []

        def first() -> None:
            results.append(slow.post("/v1/embeddings", {"model": EMBED, "input": "x"}).status_code)

        thread = threading.Thread(target=first)
        thread.start()
        time.sleep(0.3)  # the first request is in progress (its replica answers after 1.5 s)
        deadline = time.monotonic() + 5.0
        second = slow.post("/tokenize", {"model": GEN, "prompt": "x"})
        while second.status_code != 429 and time.monotonic() < deadline:
            second = slow.post("/tokenize", {"model": GEN, "prompt": "x"})
        thread.join(10.0)
        assert second.status_code == 429
        assert second.headers["Retry-After"] == "3"
        assert json.loads(second.text)["error"]["type"] == "rate_limit_error"
        assert results == [200]
