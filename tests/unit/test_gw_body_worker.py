"""What a body worker answers for one large body (`body_worker.admit_job`, in process).

What a user would notice if it broke: a large request, handled in a worker process rather
than on the event loop, is counted differently (prompt tokens, hence routing load and the
context check) or validated differently from the same request handled inline, or a
streaming body in UTF-16 loses its fields on the way to the backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sal_gateway.body_worker import admit_job
from sal_gateway.errors import BadRequest
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import PromptCounter, load_model_tokenizer


@pytest.fixture(scope="module")
def counters(tiny_model_dir: Path) -> dict[str, PromptCounter]:
    return {"tiny": load_model_tokenizer(str(tiny_model_dir), None)}


LONG_TEXT = " ".join(f"word{i % 97} and more" for i in range(3000))
BODIES: dict[str, tuple[Endpoint, dict[str, Any]]] = {
    "long text": (Endpoint.COMPLETIONS, {"prompt": LONG_TEXT, "max_tokens": 3, "n": 2}),
    "batched": (Endpoint.COMPLETIONS, {"prompt": [LONG_TEXT, "short", LONG_TEXT[:999]]}),
    "token ids": (Endpoint.COMPLETIONS, {"prompt": [[5] * 30_000, [6] * 7]}),
    "many messages": (
        Endpoint.CHAT,
        {"messages": [{"role": "user", "content": f"m {i}"} for i in range(500)], "stream": True},
    ),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_worker_counts_and_reads_what_the_inline_path_does(
    name: str, counters: dict[str, PromptCounter]
) -> None:
    endpoint, fields = BODIES[name]
    raw = json.dumps({"model": "tiny", **fields}).encode()
    inline = parse_body(raw, endpoint)
    expected = counters["tiny"].count_sync(inline)
    summary, reencoded = admit_job(raw, endpoint.value, 16, counters)
    assert summary["count"] == {
        "per_prompt": list(expected.per_prompt),
        "estimated": False,
        "block_keys": [],
    }
    assert summary["model"] == "tiny"
    assert summary["stream"] == inline.stream
    assert summary["max_tokens"] == inline.max_tokens
    assert summary["fan_out"] == inline.fan_out
    assert reencoded == b""  # plain UTF-8: the client's bytes are forwarded as they are


@pytest.mark.parametrize("name", sorted(BODIES))
def test_worker_returns_the_block_keys_the_inline_path_computes(
    name: str, counters: dict[str, PromptCounter]
) -> None:
    """With the model's block size the worker sends back the prompt's block keys (not its
    token ids), the same the inline path computes; batched prompts get none."""
    endpoint, fields = BODIES[name]
    raw = json.dumps({"model": "tiny", **fields}).encode()
    expected = counters["tiny"].count_sync(parse_body(raw, endpoint), 16)
    summary, _ = admit_job(raw, endpoint.value, 16, counters, None, {"tiny": 16})
    assert summary["count"]["block_keys"] == list(expected.block_keys)
    assert summary["count"]["per_prompt"] == list(expected.per_prompt)
    single = len(expected.per_prompt) == 1
    assert bool(expected.block_keys) == single
    if single:
        assert len(expected.block_keys) == expected.per_prompt[0] // 16


def test_worker_refuses_what_the_inline_path_refuses(counters: dict[str, PromptCounter]) -> None:
    raw = json.dumps({"model": "tiny", "prompt": LONG_TEXT, "n": 99}).encode()
    with pytest.raises(BadRequest) as inline:
        parse_body(raw, Endpoint.COMPLETIONS)
    with pytest.raises(BadRequest) as worker:
        admit_job(raw, Endpoint.COMPLETIONS.value, 16, counters)
    assert (worker.value.message, worker.value.param) == (inline.value.message, "n")


def test_request_template_is_left_for_the_template_pool(
    counters: dict[str, PromptCounter],
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 50}
    raw = json.dumps({**body, "chat_template": "{{ messages|length }}"}).encode()
    summary, _ = admit_job(raw, Endpoint.CHAT.value, 16, counters)
    assert summary["chat_template"] == "{{ messages|length }}"
    assert summary["count"] is None  # rendered (if trusted) and counted later


def test_utf16_stream_is_reencoded_whole(counters: dict[str, PromptCounter]) -> None:
    body = {"model": "tiny", "prompt": LONG_TEXT, "stream": True, "user": "u-1"}
    summary, reencoded = admit_job(
        json.dumps(body).encode("utf-16"), "/v1/completions", 16, counters
    )
    assert json.loads(reencoded) == body  # every field, as UTF-8 the gateway can splice into
    assert summary["stream"] is True
