"""Validation of an OpenAI completions / chat-completions request body (pure).

The app calls `parse_body()` once per request with the raw bytes; it returns an
`InboundRequest` holding the decoded body (forwarded upstream untouched, every unknown field
included) plus the few fields the gateway itself needs, or raises `BadRequest` naming the
field. Only what the gateway reads is validated; everything else is the backend's business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sal_gateway.errors import BadRequest


class Endpoint(Enum):
    """The two generation endpoints the gateway proxies."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


PromptInput = str | list[int]
"""One prompt: text, or token IDs."""


@dataclass(frozen=True, slots=True)
class InboundRequest:
    """A validated request body."""

    endpoint: Endpoint
    body: dict[str, Any]
    """The decoded JSON body, forwarded as is."""
    model: str
    stream: bool
    max_tokens: int | None
    """``max_tokens`` (or ``max_completion_tokens`` for chat), None when absent."""
    prompts: tuple[PromptInput, ...] = ()
    """Completions: the prompt(s), batched prompts as several entries."""
    messages: tuple[dict[str, Any], ...] = ()
    """Chat: the messages."""


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(value: object) -> tuple[PromptInput, ...]:
    """Accept every prompt form vLLM accepts: str, [str], [int], [[int]]."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if _is_token_ids(value):
            return (list(value),)
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(_is_token_ids(p) and p for p in value):
            return tuple(list(p) for p in value)
    raise BadRequest(
        "`prompt` must be a string, a list of strings, a list of token IDs or a list of "
        "lists of token IDs (non-empty)",
        param="prompt",
    )


def _messages(value: object) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise BadRequest("`messages` must be a non-empty list", param="messages")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(
                f"`messages[{i}]` must be an object with a string `role`", param="messages"
            )
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"`messages[{i}].content` must be a string, a list of parts or null",
                param="messages",
            )
    return tuple(value)


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"`{name}` must be a non-negative integer, got {value!r}", param=name)
    return value


def parse_body(raw: bytes, endpoint: Endpoint) -> InboundRequest:
    """Decode and validate one request body; `BadRequest` names the first bad field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"`stream` must be a boolean, got {stream!r}", param="stream")
    if endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("`prompt` is required", param="prompt")
        return InboundRequest(
            endpoint=endpoint,
            body=body,
            model=model,
            stream=stream,
            max_tokens=_optional_int(body, "max_tokens"),
            prompts=_prompts(body["prompt"]),
        )
    max_tokens = _optional_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens")
    return InboundRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        messages=_messages(body.get("messages")),
    )
