"""OpenAI-shaped response bodies and SSE chunks of the emulator (pure, vLLM 0.32's shapes).

Output text is a placeholder: every generated token is the text `TOKEN_TEXT`, so a
client that counts tokens by text sees exactly ``usage.completion_tokens`` of them.
Every generation stops by length (``finish_reason: "length"``), as the engine model
forces each output to ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

TOKEN_TEXT = " tok"
FINISH_REASON = "length"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    response_id: str,
    created: int,
    model: str,
    outputs: list[int],
    prompt_tokens: int,
    *,
    chat: bool,
) -> dict[str, Any]:
    """The non-streaming response; `outputs` holds each choice's generated token count."""
    if chat:
        choices: list[dict[str, Any]] = [
            {
                "index": i,
                "message": {"role": "assistant", "content": TOKEN_TEXT * n},
                "logprobs": None,
                "finish_reason": FINISH_REASON,
                "stop_reason": None,
            }
            for i, n in enumerate(outputs)
        ]
    else:
        choices = [
            {
                "index": i,
                "text": TOKEN_TEXT * n,
                "logprobs": None,
                "finish_reason": FINISH_REASON,
                "stop_reason": None,
            }
            for i, n in enumerate(outputs)
        ]
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, sum(outputs)),
    }


def chunk(
    response_id: str,
    created: int,
    model: str,
    *,
    chat: bool,
    index: int,
    tokens: int,
    finished: bool,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed chunk with `tokens` new tokens of choice `index`.

    For chat, the first chunk of a choice carries ``role`` (as vLLM sends it).
    """
    text = TOKEN_TEXT * tokens
    choice: dict[str, Any] = {"index": index, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta = {"role": "assistant", "content": text}
        choice["delta"] = delta
    else:
        choice["text"] = text
    choice["finish_reason"] = FINISH_REASON if finished else None
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    response_id: str, created: int, model: str, *, chat: bool, usage_body: dict[str, int]
) -> dict[str, Any]:
    """The final chunk sent when ``stream_options.include_usage`` is true."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
