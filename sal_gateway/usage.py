"""Reading ``usage`` (prompt and completion tokens) from backend responses (pure).

The proxy calls `usage_from_json()` on every non-streaming 200 body and
`usage_from_sse_tail()` on the last bytes of every finished stream; the counts feed
`BetaEstimator` and ``sal_output_tokens_total``. vLLM puts ``usage`` in non-streaming responses
always, and in the last SSE chunk only when the client asked with
``stream_options.include_usage``.
"""

from __future__ import annotations

import json

USAGE_TAIL_BYTES = 16384
"""How much of a stream's end the proxy keeps to find the usage chunk."""


def usage_from_json(body: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a non-streaming response body, if present."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return _usage_of(obj)


def _usage_of(obj: object) -> tuple[int, int] | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None


def usage_from_sse_tail(tail: bytes) -> tuple[int, int] | None:
    """The last ``usage`` in an SSE stream's tail (vLLM sends it in the last chunk when the
    client asked with ``stream_options.include_usage``)."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            found = _usage_of(json.loads(line[5:]))
        except (ValueError, UnicodeDecodeError):
            continue
        if found is not None:
            return found
    return None
