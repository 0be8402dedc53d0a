"""Validation of an OpenAI completions / chat-completions request body (pure).

The app calls `parse_body()` once per request with the raw bytes; it returns an
`InboundRequest` holding the decoded body (forwarded upstream untouched, every unknown field
included) plus the few fields the gateway itself needs, or raises `BadRequest` naming the
field. What the gateway reads, and what reaches the chat template the gateway renders
(`chat_fields`), is validated; everything else is the backend's business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sal_gateway.chat_fields import (
    check_bool_fields,
    check_chat_fields,
    check_messages,
    request_chat_template,
)
from sal_gateway.errors import BadRequest

DEFAULT_MAX_N = 16


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
    fan_out: int = 1
    """Engine requests vLLM makes of this one: ``max(n, best_of)``."""
    chat_template: str | None = None
    """Chat: the client-supplied chat template (None: the model's own)."""
    # --- E: the endpoints beyond completions and chat (`api_body`, `endpoints`) ---
    path: str = ""
    """The upstream path when it is not `endpoint`'s (set by `api_body.parse_api_body`)."""
    count_options: dict[str, Any] | None = None
    """The options that drive counting (``add_special_tokens``, ``add_generation_prompt``,
    ``continue_final_message``, ``tools``, ...) with the request's endpoint's defaults made
    explicit; None: the body's own, with completions' and chat's defaults."""
    counted: bool = True
    """False: the gateway cannot count this request's tokens (routed by the fallback)."""
    ask_stream_usage: bool = True
    """Ask a stream for usage on the client's behalf (completions and chat only: other
    endpoints report usage in their own events, or take no ``stream_options``)."""
    truncate_to: int | None = None
    """``truncate_prompt_tokens``: vLLM cuts each prompt to this many tokens (-1: the
    context length), so longer prompts are not refused."""
    served_model: str | None = None
    """The name the client asked for when it is not a configured model but one its replicas
    serve besides it (a LoRA adapter, another served name; `admission.resolve_served`):
    `model` is then the configured model whose pool, tokenizer and limits apply, and the
    body, forwarded as is, still names this one."""

    @property
    def upstream_path(self) -> str:
        """The path the request is forwarded to."""
        return self.path or self.endpoint.value

    @property
    def count_body(self) -> dict[str, Any]:
        """Where counting reads its options (`count_options`, else the body)."""
        return self.body if self.count_options is None else self.count_options


def shown(value: object) -> str:
    """`value` for an error message, bounded: clients can send megabytes in any field."""
    if isinstance(value, str):
        return repr(value[:40] + "..." if len(value) > 40 else value)
    if value is None or isinstance(value, bool | int | float):
        return repr(value)[:40]
    return f"a JSON {'object' if isinstance(value, dict) else 'array'}"


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


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"`{name}` must be a non-negative integer, got {shown(value)}", param=name)
    return value


def _fan_out(body: dict[str, Any], max_n: int) -> int:
    """``max(n, best_of)``, each an integer in ``1..max_n`` and ``best_of >= n``."""
    values = {}
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_n:
            raise BadRequest(
                f"`{name}` must be an integer from 1 to {max_n}, got {shown(value)}", param=name
            )
        values[name] = value
    n = values.get("n", 1)
    if values.get("best_of", n) < n:
        raise BadRequest(f"`best_of` ({values['best_of']}) must be >= `n` ({n})", param="best_of")
    return max(n, values.get("best_of", 1))


def _common(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object", param="stream_options")


def decode_json(raw: bytes) -> object:
    """`raw` decoded as JSON; `BadRequest` for anything else (bad UTF-8, too deep, ...)."""
    try:
        return json.loads(raw)
    # ValueError also covers integers over Python's 4300-digit conversion limit.
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {str(exc)[:200]}") from None


def parse_body(raw: bytes, endpoint: Endpoint, *, max_n: int = DEFAULT_MAX_N) -> InboundRequest:
    """Decode and validate one request body; `BadRequest` names the first bad field.
    Costs time linear in ``len(raw)``: the app calls it in a body worker process for large
    bodies (`admission`)."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"`stream` must be a boolean, got {shown(stream)}", param="stream")
    _common(body)
    fan_out = _fan_out(body, max_n)
    if endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("`prompt` is required", param="prompt")
        check_bool_fields(body, ("add_special_tokens", "echo"))
        return InboundRequest(
            endpoint=endpoint,
            body=body,
            model=model,
            stream=stream,
            max_tokens=_optional_int(body, "max_tokens"),
            prompts=_prompts(body["prompt"]),
            fan_out=fan_out,
        )
    messages = check_messages(body.get("messages"))
    check_chat_fields(body)
    max_tokens = _optional_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens")
    return InboundRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        messages=messages,
        fan_out=fan_out,
        chat_template=request_chat_template(body),
    )
