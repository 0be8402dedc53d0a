"""Usage from responses, and asking streams for usage without the client seeing it."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from sal_gateway.usage import (
    PARSE_WHOLE_BYTES,
    USAGE_TAIL_BYTES,
    UsageStripper,
    usage_from_body,
    usage_from_json,
    usage_from_json_tail,
    usage_from_sse_tail,
    with_usage_requested,
)

CHUNK = b'data: {"id": "c", "choices": [{"index": 0, "text": " tok"}]}\n\n'
USAGE = (
    b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_usage_is_read_from_json_and_from_the_stream_tail() -> None:
    assert usage_from_json(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 7}}') == (5, 7)
    assert usage_from_json(b'{"choices": []}') is None
    assert usage_from_json(b"garbage") is None
    assert usage_from_sse_tail(CHUNK + USAGE + DONE) == (3, 2)
    assert usage_from_sse_tail(b'data: {"choices": [], "usage": null}\n\n') is None


def test_usage_is_requested_only_when_the_client_did_not() -> None:
    asked = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert with_usage_requested(asked, json.dumps(asked).encode()) is None
    body = {
        "model": "m",
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
        "ignore_eos": True,
    }
    raw = json.dumps(body, indent=1).encode() + b"\n"
    spliced = with_usage_requested(body, raw) or b""
    sent = json.loads(spliced)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert sent["ignore_eos"] is True
    assert spliced.startswith(raw.rstrip()[:-1])  # the client's bytes, not a re-encoding
    assert body["stream_options"] == {"continuous_usage_stats": True}  # caller's dict untouched
    # Not UTF-8 text (JSON may be UTF-16): re-encoded instead of spliced.
    sent16 = json.loads(with_usage_requested(body, json.dumps(body).encode("utf-16")) or b"")
    assert sent16["stream_options"]["include_usage"] is True


@settings(deadline=None)  # timing is not what this checks
@given(st.lists(st.integers(1, 40), max_size=30))
def test_stripper_removes_only_the_usage_event_at_any_chunking(cuts: list[int]) -> None:
    stream = CHUNK * 3 + USAGE + DONE
    stripper = UsageStripper()
    relayed = b""
    pos = 0
    for cut in cuts:
        relayed += stripper.feed(stream[pos : pos + cut])
        pos += cut
    relayed += stripper.feed(stream[pos:]) + stripper.flush()
    assert relayed == CHUNK * 3 + DONE
    assert stripper.usage == (3, 2)


def test_stripper_keeps_usage_inside_normal_chunks_and_held_bytes() -> None:
    stripper = UsageStripper()
    continuous = (
        b'data: {"choices": [{"text": "a"}], '
        b'"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
    )
    assert stripper.feed(continuous) == continuous
    assert stripper.usage is None
    assert stripper.feed(b"data: {partial") == b""
    assert stripper.flush() == b"data: {partial"


def test_usage_is_found_in_the_tail_of_a_json_body_too_large_to_parse_whole() -> None:
    # vLLM's shape: usage after the (huge) choices; the tail starts mid-text, mid-character.
    text = "é" * 50_000 + ' said "usage": {"prompt_tokens": 1, "completion_tokens": 1}'
    body = json.dumps(
        {
            "choices": [{"index": 0, "text": text}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": None},
            "kv_transfer_params": None,
        },
        ensure_ascii=False,
    ).encode()
    tail = body[-16384 + 1 :]  # cuts a 2-byte character in half
    assert usage_from_json_tail(tail) == (12, 3)
    # Quoted inside generated text only (escaped quotes), or cut off: nothing is made up.
    only_text = json.dumps({"choices": [{"text": text}]}).encode()
    assert usage_from_json_tail(only_text[-16384:]) is None
    assert usage_from_json_tail(body[: body.rindex(b'"usage"') + 20]) is None
    embeddings = (
        b'..., 0.25]}], "usage": {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}}'
    )
    assert usage_from_json_tail(embeddings) == (7, 0)


def test_a_large_answer_read_whole_is_not_parsed_whole_for_its_usage() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 8000}
    logprobs = [{"token": "a", "logprob": -0.1, "top_logprobs": [{"b": -1.0}] * 5}] * 8000
    body = json.dumps({"choices": [{"logprobs": logprobs}], "usage": usage}).encode()
    assert len(body) > PARSE_WHOLE_BYTES
    assert usage_from_body(body) == (5, 8000)  # from the tail
    # Usage not near the end of a large body: not counted rather than a long parse.
    moved = json.dumps({"usage": usage, "choices": [{"logprobs": logprobs}]}).encode()
    assert usage_from_body(moved) is None
    # A small body is parsed whole when its tail has no usage.
    small = json.dumps({"usage": usage, "echo": "x" * 20_000}).encode()
    assert USAGE_TAIL_BYTES < len(small) <= PARSE_WHOLE_BYTES
    assert usage_from_body(small) == (5, 8000)
    assert usage_from_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}') == (1, 2)
