"""Reading ``usage`` (prompt and completion tokens) from backend responses (pure).

The proxy calls `usage_from_body()` on every non-streaming 200 body it reads whole,
`usage_from_json_tail()` on the last bytes of one too large for that (passed through), and
`usage_from_sse_tail()` on the last bytes of every finished stream; the counts feed
`BetaEstimator` and ``sal_output_tokens_total``. vLLM puts ``usage`` in non-streaming responses
always, and in a last, usage-only SSE event only when asked with
``stream_options.include_usage``; for streams whose client did not ask, the proxy asks on its
behalf (`with_usage_requested`) and removes that event again (`UsageStripper`).
"""

from __future__ import annotations

import json
from typing import Any

USAGE_TAIL_BYTES = 16384
"""How much of a stream's end the proxy keeps to find the usage chunk."""


def usage_from_json(body: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a non-streaming response body, if present."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return _usage_of(obj)


PARSE_WHOLE_BYTES = 256 << 10
"""A body larger than this is never parsed whole on the event loop for its usage (1.7 MB of
logprobs took 23 ms there): `usage_from_body` reads it from the tail only."""


def usage_from_body(body: bytes) -> tuple[int, int] | None:
    """The usage of a non-streamed answer read whole: from its last `USAGE_TAIL_BYTES` first
    (where vLLM writes it), parsing the whole body only when that finds nothing and the body
    is at most `PARSE_WHOLE_BYTES` (a larger one then counts no usage)."""
    if len(body) > USAGE_TAIL_BYTES:
        found = usage_from_json_tail(body[-USAGE_TAIL_BYTES:])
        if found is not None or len(body) > PARSE_WHOLE_BYTES:
            return found
    return usage_from_json(body)


def usage_from_json_tail(tail: bytes) -> tuple[int, int] | None:
    """The ``usage`` member found in the last bytes of a JSON body too large to parse whole
    (vLLM writes it after ``choices`` / ``data``, near the end): the last ``"usage":{...}``
    in `tail` that decodes as an object with valid counts. Text inside a JSON string cannot
    match (its quotes are escaped)."""
    text = tail.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    end = len(text)
    while (at := text.rfind('"usage"', 0, end)) >= 0:
        end = at
        rest = text[at + len('"usage"') :].lstrip()
        if not rest.startswith(":"):
            continue
        try:
            value, _ = decoder.raw_decode(rest[1:].lstrip())
        except ValueError:
            continue
        found = _usage_of({"usage": value})
        if found is not None:
            return found
    return None


def _usage_of(obj: object) -> tuple[int, int] | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    response = obj.get("response")
    if usage is None and isinstance(response, dict):  # a Responses API stream's last event
        usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt is None and completion is None:  # the Responses API's names
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    # A backend's odd numbers (negative, bool) must not reach the counters: they raise.
    if _count(prompt) and _count(completion):
        assert isinstance(prompt, int)
        assert isinstance(completion, int)
        return prompt, completion
    return None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def usage_from_sse_tail(tail: bytes) -> tuple[int, int] | None:
    """The last ``usage`` in an SSE stream's tail (vLLM sends it in the last chunk when the
    client asked with ``stream_options.include_usage``)."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if line.startswith(b"event:"):  # named events (Responses API): the data line follows
            line = line.partition(b"\n")[2].strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            found = _usage_of(json.loads(line[5:]))
        except (ValueError, UnicodeDecodeError):
            continue
        if found is not None:
            return found
    return None


def with_usage_requested(body: dict[str, Any], raw: bytes) -> bytes | None:
    """For a streaming body whose client did not ask for usage: the body with
    ``stream_options.include_usage`` on (and ``continuous_usage_stats`` off, so no other chunk
    changes); None when the client asked for usage itself (forward its bytes untouched).

    `raw` is the body as received (`body` decoded). The new ``stream_options`` member is
    spliced in before the object's closing brace instead of re-encoding the whole body: a
    JSON reader keeps the last of duplicate keys (Python's ``json``, hence vLLM), and
    re-encoding a 10 MiB body cost 50-470 ms on the event loop. Bodies that are not plain
    UTF-8 text ending in ``}`` (UTF-16/32 are valid JSON too) are re-encoded."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return None
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    merged["continuous_usage_stats"] = False
    if splices(raw, body):
        head = raw.rstrip()
        return head[:-1] + b', "stream_options": ' + json.dumps(merged).encode() + b"}"
    return json.dumps({**body, "stream_options": merged}).encode()


def splices(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether `with_usage_requested` can splice a member into `raw` (a non-empty object as
    UTF-8 text) rather than re-encode `body` (`body_worker` re-encodes the others itself)."""
    return raw.lstrip()[:1] == b"{" and raw.rstrip().endswith(b"}") and bool(body)


def _usage_only_event(event: bytes) -> tuple[int, int] | None:
    """The usage of an SSE event that carries nothing but usage (``choices: []``), else None."""
    line = event.strip()
    if not line.startswith(b"data:") or b'"usage"' not in line:
        return None
    try:
        obj = json.loads(line[5:])
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or obj.get("choices") != []:
        return None
    return _usage_of(obj)


class UsageStripper:
    """Removes, from a stream, the usage-only event the gateway asked for on the client's
    behalf (`with_usage_requested`), keeping its counts in `usage`.

    Events are passed on whole: bytes of an event not yet terminated by a blank line wait for
    the rest (at most one event's worth), everything else is relayed as it arrives.
    """

    def __init__(self) -> None:
        self._carry = b""
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The part of `chunk` (with earlier held bytes) to relay now."""
        data = self._carry + chunk if self._carry else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._carry = data
            return b""
        complete, self._carry = data[: end + 2], data[end + 2 :]
        if b'"usage"' not in complete:
            return complete
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            usage = _usage_only_event(event)
            if usage is None:
                kept.append(event + b"\n\n")
            else:
                self.usage = usage
        return b"".join(kept)

    def flush(self) -> bytes:
        """Bytes still held (an unterminated last event), to relay as they are."""
        held, self._carry = self._carry, b""
        return held
