"""Request body validation and the single error mapping."""

from __future__ import annotations

import json

import pytest

from sal_gateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    ModelNotFound,
    NoBackendAvailable,
    UpstreamError,
    UpstreamTimeout,
    error_body,
    error_status,
)
from sal_gateway.proxy import sse_error_event
from sal_gateway.request_body import Endpoint, parse_body


@pytest.mark.parametrize(
    ("raw", "endpoint", "message"),
    [
        (b"{not json", Endpoint.COMPLETIONS, "not valid JSON"),
        (b"\xff\xfe", Endpoint.COMPLETIONS, "not valid JSON"),
        (b"[1, 2]", Endpoint.COMPLETIONS, "must be a JSON object"),
        (b"[" * 100_000, Endpoint.COMPLETIONS, "not valid JSON"),
        (b'{"prompt": "x"}', Endpoint.COMPLETIONS, "`model` is required"),
        (b'{"model": 3, "prompt": "x"}', Endpoint.COMPLETIONS, "`model` is required"),
        (b'{"model": "m"}', Endpoint.COMPLETIONS, "`prompt` is required"),
        (b'{"model": "m", "prompt": 5}', Endpoint.COMPLETIONS, "`prompt` must be"),
        (b'{"model": "m", "prompt": []}', Endpoint.COMPLETIONS, "`prompt` must be"),
        (b'{"model": "m", "prompt": [1, "a"]}', Endpoint.COMPLETIONS, "`prompt` must be"),
        (b'{"model": "m", "prompt": [[1], []]}', Endpoint.COMPLETIONS, "`prompt` must be"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', Endpoint.COMPLETIONS, "`stream`"),
        (b'{"model": "m", "prompt": "x", "max_tokens": -1}', Endpoint.COMPLETIONS, "`max_tokens`"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "9"}', Endpoint.COMPLETIONS, "`max_tokens`"),
        (b'{"model": "m"}', Endpoint.CHAT, "`messages` must be"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', Endpoint.CHAT, "`role`"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 3}]}', Endpoint.CHAT, "content"),
    ],
)
def test_bad_bodies_are_400_naming_the_problem(
    raw: bytes, endpoint: Endpoint, message: str
) -> None:
    with pytest.raises(BadRequest, match=message) as exc:
        parse_body(raw, endpoint)
    assert error_status(exc.value) == 400


def test_unknown_fields_are_kept_for_forwarding() -> None:
    body = {
        "model": "m",
        "prompt": [[1, 2], [3]],
        "ignore_eos": True,
        "min_tokens": 4,
        "logprobs": 2,
        "stream_options": {"include_usage": True},
        "stream": True,
    }
    parsed = parse_body(json.dumps(body).encode(), Endpoint.COMPLETIONS)
    assert parsed.body == body
    assert parsed.stream is True
    assert parsed.prompts == ([1, 2], [3])


def test_chat_max_completion_tokens_wins() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": None}],
        "max_tokens": 9,
        "max_completion_tokens": 3,
    }
    assert parse_body(json.dumps(body).encode(), Endpoint.CHAT).max_tokens == 3


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (BadRequest("x"), 400, "invalid_request_error"),
        (ModelNotFound("x"), 404, "NotFoundError"),
        (BodyTooLarge("x"), 413, "invalid_request_error"),
        (NoBackendAvailable("x"), 503, "service_unavailable"),
        (UpstreamError("x"), 502, "upstream_error"),
        (UpstreamTimeout("x"), 504, "upstream_timeout"),
        (GatewayError("x"), 500, "internal_error"),
    ],
)
def test_error_mapping_is_openai_shaped(exc: GatewayError, status: int, kind: str) -> None:
    body = error_body(exc)
    assert error_status(exc) == status
    assert body == {"error": {"message": "x", "type": kind, "param": None, "code": status}}


def test_sse_error_event_ends_the_stream() -> None:
    event = sse_error_event(UpstreamError("broke"))
    first, done = event.split(b"\n\n")[:2]
    assert json.loads(first[len(b"data: ") :])["error"]["message"] == "broke"
    assert done == b"data: [DONE]"
