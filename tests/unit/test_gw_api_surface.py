"""The endpoint registry, the new endpoints' body validation and counting, the models union.

What a user would notice if it broke: an endpoint vLLM serves that the gateway neither relays
nor explains; a Responses or embeddings request counted differently from chat (so SAL would
route it on a wrong size); a malformed body reaching vLLM instead of a 400 naming the field;
``/v1/models`` listing names no replica serves.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import vllm

from sal_gateway import model_catalog
from sal_gateway.api_body import parse_api_body
from sal_gateway.endpoints import (
    BY_PATH,
    ENDPOINTS,
    FALLBACK_POLICY,
    GATEWAY_OWN,
    NOT_RELAYED,
    Counting,
    markdown_table,
    route_policy,
    serves,
)
from sal_gateway.errors import BadRequest
from sal_gateway.model_catalog import Card, ModelCatalog, parse_cards, refresh_models
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import load_model_tokenizer
from sal_gateway.usage import usage_from_json, usage_from_sse_tail

REPO = Path(__file__).resolve().parents[2]
_ROUTE = re.compile(
    r'(?:router\.(?:post|get|api_route|websocket)|add_api_route)\(\s*"([^"]+)"', re.DOTALL
)


def _vllm_routes() -> set[str]:
    """Every path the installed vLLM's API server can mount, read from its router sources."""
    root = Path(vllm.__file__).parent / "entrypoints"
    paths: set[str] = set()
    for source in root.rglob("*.py"):
        paths.update(_ROUTE.findall(source.read_text()))
    return paths


def _parse(path: str, body: dict[str, Any], default: str | None = "tiny") -> Any:
    return parse_api_body(json.dumps(body).encode(), BY_PATH[path], default_model=default)


# --- the registry ---------------------------------------------------------------------------


def test_every_vllm_route_is_relayed_or_explained() -> None:
    routes = _vllm_routes()
    assert "/v1/responses" in routes
    assert "/v1/rerank" in routes
    unexplained = routes - set(BY_PATH) - set(NOT_RELAYED) - GATEWAY_OWN
    assert not unexplained, f"vLLM routes neither relayed nor explained: {sorted(unexplained)}"
    assert not set(BY_PATH) & set(NOT_RELAYED)
    # The registry covers every supported release (`since`): this one serves exactly the
    # entries its release has (CI runs this file on 0.32.0 and on 0.33.0).
    release = tuple(int(part) for part in vllm.__version__.split("+")[0].split(".")[:3])
    available = {e.path for e in ENDPOINTS if e.since <= release}
    assert available <= routes, "the registry names a path this vLLM does not serve"
    assert not (set(BY_PATH) - available) & routes, "an endpoint's `since` is too late"


def test_docs_table_is_the_registry() -> None:
    docs = (REPO / "docs" / "gateway.md").read_text()
    assert markdown_table() in docs


def test_uncounted_requests_fall_back_only_under_a_token_aware_policy() -> None:
    assert route_policy(False, "sal") == FALLBACK_POLICY
    assert route_policy(True, "sal") is None
    assert route_policy(False, "round_robin") is None
    pooling = [e for e in ENDPOINTS if e.path in ("/v1/embeddings", "/v1/rerank", "/pooling")]
    assert all(serves(e, "pooling") and not serves(e, "generate") for e in pooling)
    assert serves(BY_PATH["/tokenize"], "pooling")
    assert serves(BY_PATH["/tokenize"], "generate")
    assert not serves(BY_PATH["/v1/responses"], "pooling")


# --- Responses API bodies ----------------------------------------------------------------------


def test_responses_text_input_is_a_user_message_after_the_instructions() -> None:
    req = _parse(
        "/v1/responses",
        {"model": "tiny", "input": "hi", "instructions": "be brief", "max_output_tokens": 5},
    )
    assert req.counted
    assert req.upstream_path == "/v1/responses"
    assert req.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    )
    assert req.max_tokens == 5
    assert req.count_body["add_generation_prompt"] is True
    assert not req.ask_stream_usage  # Responses streams carry usage in their last event


def test_responses_message_items_and_function_tools_are_counted_like_chat() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    req = _parse(
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"role": "assistant", "content": "b", "status": "incomplete"},
            ],
            "tools": [tool],
            "stream": True,
        },
    )
    assert req.model == "tiny"
    assert req.stream
    assert req.counted
    assert req.messages[0] == {"role": "user", "content": [{"type": "text", "text": "a"}]}
    assert req.count_body["continue_final_message"] is True
    assert req.count_body["add_generation_prompt"] is False
    assert req.count_body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        {"input": "x", "tools": [{"type": "web_search_preview"}]},
        {"input": "x", "previous_response_id": "resp_1"},
    ],
)
def test_responses_forms_the_gateway_cannot_count_are_routed_uncounted(
    body: dict[str, Any],
) -> None:
    assert not _parse("/v1/responses", body).counted


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": ["x"]}, "input"),
        ({"input": "x", "instructions": 1}, "instructions"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "tools": {"a": 1}}, "tools"),
        ({"input": "x", "model": ""}, "model"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input"),
    ],
)
def test_malformed_responses_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        _parse("/v1/responses", body)
    assert info.value.param == param


def test_a_missing_model_needs_a_single_configured_model() -> None:
    assert _parse("/tokenize", {"prompt": "x"}).model == "tiny"
    with pytest.raises(BadRequest) as info:
        _parse("/tokenize", {"prompt": "x"}, default=None)
    assert info.value.param == "model"
    with pytest.raises(BadRequest):
        parse_api_body(b"[1]", BY_PATH["/tokenize"], default_model="tiny")


# --- pooling bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "prompts"),
    [
        ("hello", ("hello",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ([1, 2, 3],)),
        ([[1], [2, 3]], ([1], [2, 3])),
    ],
)
def test_embedding_inputs_are_counted_as_prompts(value: object, prompts: tuple[Any, ...]) -> None:
    req = _parse("/v1/embeddings", {"model": "e", "input": value})
    assert req.counted
    assert req.prompts == prompts
    assert req.endpoint is Endpoint.COMPLETIONS
    assert req.count_body == {"add_special_tokens": True}
    assert not req.stream


def test_embedding_messages_are_counted_as_a_chat_without_generation_prompt() -> None:
    for body in (
        {"input": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}]},
    ):
        req = _parse("/v1/embeddings", body)
        assert req.counted
        assert req.endpoint is Endpoint.CHAT
        assert req.count_body["add_generation_prompt"] is False
    batch = {"input": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]]}
    assert not _parse("/v1/embeddings", batch).counted
    assert not _parse("/pooling", {"data": {"plugin": 1}}).counted


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": {"a": 1}}, "input"),
        ({"input": []}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [{"role": "user", "content": 5}]}, "input"),
        ({"messages": []}, "messages"),
        ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ],
)
def test_malformed_pooling_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        _parse("/v1/embeddings", body)
    assert info.value.param == param


def test_uncounted_endpoints_check_model_and_stream_only() -> None:
    req = _parse("/v1/rerank", {"model": "e", "query": "q", "documents": ["d"]})
    assert not req.counted
    assert req.upstream_path == "/v1/rerank"
    assert req.prompts == ()
    assert BY_PATH["/v1/rerank"].counting is Counting.NONE
    with pytest.raises(BadRequest) as info:
        _parse("/v1/messages", {"model": "m", "stream": 1})
    assert info.value.param == "stream"


def test_responses_count_equals_the_equivalent_chat_count(tiny_model_dir: Path) -> None:
    """The same conversation counts the same through /v1/responses as through chat, but
    for the special tokens vLLM's Responses API adds (``add_special_tokens`` default true)."""
    counter = load_model_tokenizer(str(tiny_model_dir), None)
    responses = _parse("/v1/responses", {"input": "hello there", "instructions": "sys"})
    chat_body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hello there"},
        ],
        "add_special_tokens": True,
    }
    chat = parse_body(json.dumps(chat_body).encode(), Endpoint.CHAT)
    assert counter.count_sync(responses).total == counter.count_sync(chat).total > 0
    embed = _parse("/v1/embeddings", {"input": ["hello", "hello there"]})
    expected = tuple(len(counter.hf_tokenizer(t).input_ids) for t in ("hello", "hello there"))
    assert counter.count_sync(embed).per_prompt == expected


# --- usage of the other endpoints -----------------------------------------------------------


def test_usage_is_read_from_responses_answers_and_named_sse_events() -> None:
    body = {"object": "response", "usage": {"input_tokens": 7, "output_tokens": 3}}
    assert usage_from_json(json.dumps(body).encode()) == (7, 3)
    event = {"type": "response.completed", "response": {"usage": body["usage"]}}
    tail = b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n"
    assert usage_from_sse_tail(b"event: x\ndata: {}\n\n" + tail) == (7, 3)
    pooled = {"usage": {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0}}
    assert usage_from_json(json.dumps(pooled).encode()) == (4, 0)


# --- /v1/models ---------------------------------------------------------------------------------


def test_models_listing_is_the_union_of_what_replicas_serve() -> None:
    catalog = ModelCatalog()
    pools = {"tiny": ["http://a", "http://b"], "embed": ["http://c"], "odd": ["http://d"]}
    # Before any replica answered: the configured names.
    assert [m["id"] for m in catalog.listing(pools, 1)] == ["tiny", "embed", "odd"]
    card = {"id": "tiny", "object": "model", "owned_by": "vllm", "max_model_len": 2048}
    catalog.update("tiny", "http://a", (card, {"id": "tiny-lora", "parent": "tiny"}))
    catalog.update("tiny", "http://b", (card,))
    catalog.update("odd", "http://d", ({"id": "other-name"},))
    data = catalog.listing(pools, 1)
    # "odd": its replica serves another name (not routable, so not listed); tiny's adapter
    # follows tiny.
    assert [m["id"] for m in data] == ["tiny", "tiny-lora", "embed"]
    assert data[1]["sal_replicas"] == 1
    assert data[0]["owned_by"] == "vllm"
    assert data[0]["sal_replicas"] == 2
    assert data[0]["max_model_len"] == 2048
    catalog.retain("tiny", ["http://b"])  # a left the pool
    assert catalog.listing(pools, 1)[0]["sal_replicas"] == 1


@pytest.mark.parametrize(
    "raw", [b"nope", b"[]", b'{"data": 3}', b'{"data": [' + b"{}," * 2000 + b"{}]}"]
)
def test_a_malformed_models_answer_is_ignored(raw: bytes) -> None:
    assert parse_cards(raw) in (None, ())


def test_refresh_reports_what_each_replica_serves_and_rereads_a_wrong_one_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_catalog, "RETRY_S", 0.05)
    serving = {"http://a": "tiny", "http://b": "other"}  # b: started with another name
    reads: dict[str, int] = {"http://a": 0, "http://b": 0}
    told: list[tuple[str, tuple[str, ...]]] = []

    async def fetch(url: str) -> tuple[Card, ...] | None:
        reads[url] += 1
        return ({"id": serving[url], "object": "model"},)

    async def scenario() -> None:
        task = asyncio.create_task(
            refresh_models(
                "tiny",
                lambda: list(serving),
                fetch,
                ModelCatalog(),
                interval_s=60.0,
                on_served=lambda url, names: told.append((url, names)),
            )
        )
        await asyncio.sleep(0.3)
        # b is re-read every RETRY_S, not every 60 s: fixed, it is seen at once.
        assert reads["http://b"] >= 3
        serving["http://b"] = "tiny"
        await asyncio.sleep(0.2)
        settled = reads["http://b"]
        await asyncio.sleep(0.3)
        assert reads["http://b"] == settled  # serves it now: back to the normal interval
        task.cancel()

    asyncio.run(scenario())
    assert told[0] == ("http://a", ("tiny",))
    assert told[1] == ("http://b", ("other",))
    assert told[-1] == ("http://b", ("tiny",))
