"""vLLM 0.33's decisions API (``/v1/decisions``) through the gateway, on a real replica.

Two replicas of the tiny model built as a Qwen3 (one of the architectures vLLM serves the
decisions API for, with ``--logprobs-mode raw_logprobs``), each with the tail-guarded LARRY,
behind one gateway: the openai SDK's ``decisions.create`` works unmodified through it, the
request is relayed untouched and, not counted, routed by the least-requests fallback (SAL
would otherwise take it for free, `sal_gateway.endpoints.route_policy`). Hostile input gets
the gateway's own 400 (a bad ``model``) or vLLM's (a bad question), never a 5xx.

Runs in `scripts/test.sh`'s vLLM 0.33.0 pass (`scripts/vllm_overlay.py`); deselected on 0.32,
which has no such route.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_support import free_port, metric, run_gateway, scrape_metrics
from tests.vllm_support import DEFAULT_ARGS, run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.vllm033, pytest.mark.slow]

MODEL = "tiny-q3"
MAX_MODEL_LEN = int(DEFAULT_ARGS[DEFAULT_ARGS.index("--max-model-len") + 1])
QUESTIONS: list[dict[str, Any]] = [
    {"type": "predicate", "instructions": "Is the text about the sky?"},
    {
        "type": "choice",
        "instructions": "Which colour does it name?",
        "choices": [{"value": "red"}, {"value": "blue"}, {"value": "green"}],
    },
    {"type": "score", "instructions": "How sure?", "levels": [{"label": "low"}, {"label": "high"}]},
]


@pytest.fixture(scope="module")
def gateway(qwen3_model_dir: Path) -> Iterator[tuple[str, list[str]]]:
    args = ("--served-model-name", MODEL, "--logprobs-mode", "raw_logprobs")
    with ExitStack() as stack:
        first = free_port(19900, 19950)
        replicas = [
            stack.enter_context(run_replica(qwen3_model_dir, port, extra_args=args))
            for port in (first, free_port(first + 1, 19950))
        ]
        config = {
            "listen": {"host": "127.0.0.1", "port": free_port(19950, 19990)},
            "models": [
                {
                    "name": MODEL,
                    "backends": replicas,
                    "tokenizer": str(qwen3_model_dir),
                    "max_model_len": MAX_MODEL_LEN,
                }
            ],
            "routing": {"policy": "sal", "poll_interval_s": 0.1},
            "log_level": "info",
        }
        url = stack.enter_context(run_gateway(config))
        yield url, replicas


def _routed(url: str, policy: str) -> float:
    return metric(scrape_metrics(url), "sal_routing_decisions_total", model=MODEL, policy=policy)


def test_the_sdk_gets_every_answer_through_the_gateway(gateway: tuple[str, list[str]]) -> None:
    url, replicas = gateway
    before = _routed(url, "least_requests")
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        decision = client.decisions.create(
            model=MODEL, input="The sky is blue today.", questions=QUESTIONS
        )
    answers = decision.to_dict()["answers"]
    assert [a["type"] for a in answers] == ["predicate", "choice", "score"]
    assert 0.0 <= answers[0]["probability"] <= 1.0
    for answer in answers[1:]:  # a distribution over the options, as vLLM reads it
        assert sum(p["probability"] for p in answer["probabilities"]) == pytest.approx(1.0)
    assert {p["value"] for p in answers[1]["probabilities"]} == {"red", "blue", "green"}
    usage = decision.to_dict()["usage"]
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] == len(QUESTIONS)  # one label token read per question
    # Not counted (vLLM builds the prompt from the questions): least-requests routes it.
    assert _routed(url, "least_requests") == before + 1
    samples = scrape_metrics(url)
    served = sum(
        metric(samples, "sal_requests_total", model=MODEL, backend=r, status="200")
        for r in replicas
    )
    assert served >= 1


def test_hostile_decision_bodies_get_a_clear_400(gateway: tuple[str, list[str]]) -> None:
    url, _ = gateway
    post = f"{url}/v1/decisions"
    bad_model = httpx.post(post, json={"model": 7, "input": "x", "questions": QUESTIONS})
    assert bad_model.status_code == 400
    assert bad_model.json()["error"]["param"] == "model"  # the gateway's own check
    not_json = httpx.post(post, content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 400
    # What only vLLM knows how to check comes back as vLLM's 400, relayed.
    one_choice = {"type": "choice", "instructions": "pick", "choices": [{"value": "only"}]}
    body = {"model": MODEL, "input": "x", "questions": [one_choice]}
    relayed = httpx.post(post, json=body, timeout=60.0)
    assert relayed.status_code == 400, relayed.text
    assert "choices" in relayed.text
