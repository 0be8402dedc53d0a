"""Upstream timeouts over real sockets, shaped after how vLLM answers: a non-streamed answer's
headers come when generation ends (bounded by the total timeout only), a stream's headers come
on acceptance (short header timeout, retried elsewhere with the first connection closed), and a
stream's silences are bounded by the idle timeout (error event, never retried)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

# Tight bounds keep the tests quick; the fakes' delays are chosen well clear of them.
TIGHT = {"stream_header_timeout_s": 1.0, "stream_idle_timeout_s": 1.5, "total_timeout_s": 20.0}
FIRST_A = {"policy": "round_robin"}  # a fresh round robin tries backend a first
# For the tests of a live engine's long silence: each idle check must find a good poll within
# stale_after_s, which a loaded CI machine can delay past 3 s; a frozen engine is not
# under test there (a longer staleness bound only spares more).
LIVE = {"stale_after_s": 10.0}


def _stream(rig: Rig, max_tokens: int = 4) -> httpx.Response:
    with httpx.stream(
        "POST",
        f"{rig.url}/v1/completions",
        timeout=30.0,
        json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True},
    ) as resp:
        resp.read()
    return resp


def _events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def _settled(rig: Rig) -> None:
    """Every ticket released (the in-flight gauge of every backend back to 0)."""

    def idle() -> bool:
        text = rig.metrics()
        return all(metric(text, "sal_backend_in_flight", backend=s.url) == 0.0 for s in rig.served)

    wait_until(idle)


def test_non_stream_slower_than_the_stream_bounds_succeeds() -> None:
    # vLLM sends a non-streamed answer's headers only when generation ends: a generation
    # longer than the stream header and idle bounds must still be answered, not cut with a 504.
    with gateway_rig(1, proxy=TIGHT) as rig:
        fake = rig.fakes[0]
        fake.behaviour.first_byte_delay_s = 2.5
        with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="x", max_retries=0) as client:
            answer = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert answer.choices[0].text == " tok" * 3
        assert fake.generation_requests == 1
        assert metric(rig.metrics(), "sal_stream_timeouts_total") is None
        _settled(rig)


def test_non_stream_over_the_total_timeout_gives_504_not_retried() -> None:
    with gateway_rig(2, proxy={**TIGHT, "total_timeout_s": 0.5}) as rig:
        for fake in rig.fakes:
            fake.behaviour.hang = True
        resp = httpx.post(
            f"{rig.url}/v1/completions",
            timeout=30.0,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        )
        assert resp.status_code == 504
        assert resp.json()["error"]["type"] == "upstream_timeout"
        assert sum(f.generation_requests for f in rig.fakes) == 1  # the GPU may have worked
        wait_until(lambda: sum(f.disconnects for f in rig.fakes) == 1)
        text = rig.metrics()
        assert metric(text, "sal_upstream_cancels_total", reason="total_timeout") == 1.0
        assert metric(text, "sal_requests_total", status="504") == 1.0
        _settled(rig)


def test_stream_header_timeout_is_retried_on_the_other_backend() -> None:
    with gateway_rig(2, routing=FIRST_A, proxy=TIGHT) as rig:
        a, b = rig.fakes
        a_url = rig.served[0].url
        a.behaviour.hang = True  # accepts the connection, never sends headers (frozen server)
        with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="x", max_retries=0) as client:
            stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == " tok" * 4  # one whole answer
        assert (a.generation_requests, b.generation_requests) == (1, 1)
        wait_until(lambda: a.disconnects == 1)  # a's connection closed: vLLM aborts there
        m = rig.metrics()
        assert metric(m, "sal_stream_timeouts_total", backend=a_url, kind="header") == 1.0
        assert metric(m, "sal_upstream_cancels_total", backend=a_url, reason="header_timeout") == 1
        assert metric(m, "sal_retries_total", backend=a_url) == 1.0
        assert metric(m, "sal_requests_total", backend=rig.served[1].url, status="200") == 1.0
        _settled(rig)


def test_stream_header_timeout_on_every_backend_gives_504() -> None:
    with gateway_rig(2, proxy=TIGHT) as rig:
        for fake in rig.fakes:
            fake.behaviour.hang = True
        resp = _stream(rig)
        assert resp.status_code == 504
        error = json.loads(resp.content)["error"]
        assert error["type"] == "upstream_timeout"
        assert set(error) == {"message", "type", "param", "code"}
        assert [f.generation_requests for f in rig.fakes] == [1, 1]
        wait_until(lambda: [f.disconnects for f in rig.fakes] == [1, 1])
        m = rig.metrics()
        assert metric(m, "sal_stream_timeouts_total", backend=rig.served[0].url) == 1.0
        assert metric(m, "sal_stream_timeouts_total", backend=rig.served[1].url) == 1.0
        assert metric(m, "sal_requests_total", status="504") == 1.0
        _settled(rig)


def test_stream_header_timeout_within_retry_budget_only() -> None:
    with gateway_rig(2, routing={"max_retries": 0}, proxy=TIGHT) as rig:
        for fake in rig.fakes:
            fake.behaviour.hang = True
        assert _stream(rig).status_code == 504
        assert sum(f.generation_requests for f in rig.fakes) == 1
        _settled(rig)


def test_stream_idle_after_first_bytes_ends_with_error_event_not_retried() -> None:
    with gateway_rig(2, routing=FIRST_A, proxy=TIGHT) as rig:
        a, b = rig.fakes
        a_url = rig.served[0].url
        a.behaviour.stall_after_chunks = 2  # two tokens, then silence: a frozen replica
        a.behaviour.stall_freezes_engine = True
        resp = _stream(rig, max_tokens=10)
        assert resp.status_code == 200
        events = _events(resp.content)
        assert len(events) == 4  # two chunks, the error event, [DONE]
        assert [json.loads(e[len(b"data: ") :])["choices"][0]["text"] for e in events[:2]] == [
            " tok",
            " tok",
        ]
        error = json.loads(events[2][len(b"data: ") :])["error"]
        assert error["type"] == "upstream_timeout"
        assert "stream_idle_timeout_s" in error["message"]
        assert events[3] == b"data: [DONE]"
        assert b.generation_requests == 0  # never retried after the first byte
        wait_until(lambda: a.disconnects == 1)  # the upstream connection was closed
        m = rig.metrics()
        assert metric(m, "sal_stream_timeouts_total", backend=a_url, kind="idle") == 1.0
        assert metric(m, "sal_upstream_cancels_total", backend=a_url, reason="idle_timeout") == 1
        assert metric(m, "sal_stream_errors_total", backend=a_url) == 1.0
        _settled(rig)


def test_stream_idle_before_first_token_ends_with_error_event_in_the_sdk() -> None:
    # Headers, then nothing: an engine that accepted the request, then froze. Not retried
    # either: the silence may be a long prefill that would only be wasted again.
    with gateway_rig(1, proxy=TIGHT) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 0
        fake.behaviour.stall_freezes_engine = True
        with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="x", max_retries=0) as client:
            stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
            with pytest.raises(openai.APIError, match="stream_idle_timeout_s"):
                list(stream)
        assert fake.generation_requests == 1
        wait_until(lambda: fake.disconnects == 1)
        _settled(rig)


def test_slow_stream_within_the_idle_bound_is_not_cut() -> None:
    # The idle bound limits each silence, not the stream: 8 chunks 0.3 s apart take longer
    # than the 1.5 s bound in total and must arrive whole.
    with gateway_rig(1, proxy=TIGHT) as rig:
        fake = rig.fakes[0]
        fake.behaviour.chunk_delay_s = 0.3
        resp = _stream(rig, max_tokens=8)
        events = _events(resp.content)
        assert len(events) == 9  # eight chunks, [DONE]
        assert events[-1] == b"data: [DONE]"
        assert metric(rig.metrics(), "sal_stream_timeouts_total") is None
        _settled(rig)


def test_silent_stream_on_a_live_engine_is_queued_not_cut() -> None:
    # Two tokens, then 4 s of silence (over twice the 1.5 s idle bound) while the replica's
    # engine keeps progressing: a request queued behind others. It must arrive whole.
    with gateway_rig(1, routing=LIVE, proxy=TIGHT) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 2
        fake.behaviour.stall_s = 4.0
        resp = _stream(rig, max_tokens=6)
        events = _events(resp.content)
        assert len(events) == 7  # six chunks, [DONE]
        assert events[-1] == b"data: [DONE]"
        assert b"error" not in resp.content
        backend = rig.served[0].url
        assert metric(rig.metrics(), "sal_stream_timeouts_total", backend=backend, kind="idle") in (
            None,
            0.0,
        )
        _settled(rig)


def test_literal_idle_bound_cuts_a_queued_stream_too() -> None:
    # proxy.stream_idle_spares_live_engines off: the same silence ends the stream.
    literal = {**TIGHT, "stream_idle_spares_live_engines": False}
    with gateway_rig(1, proxy=literal) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 2
        fake.behaviour.stall_s = 4.0
        resp = _stream(rig, max_tokens=6)
        events = _events(resp.content)
        assert len(events) == 4  # two chunks, the error event, [DONE]
        assert (
            "stream_idle_timeout_s" in json.loads(events[2][len(b"data: ") :])["error"]["message"]
        )
        wait_until(lambda: fake.disconnects == 1)
        _settled(rig)


def test_keep_alive_comments_from_a_frozen_replica_do_not_hold_the_stream_open() -> None:
    # vLLM's API server sends `: keep-alive` comments (--sse-keep-alive-interval) even when
    # its engine froze: they are not content, the stream still ends at the idle bound.
    with gateway_rig(1, proxy=TIGHT) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 1
        fake.behaviour.stall_freezes_engine = True
        fake.behaviour.keep_alive_s = 0.2
        started = time.monotonic()
        resp = _stream(rig, max_tokens=6)
        took_s = time.monotonic() - started
        events = _events(resp.content)
        assert b": keep-alive" in resp.content  # relayed as they came (clients ignore them)
        assert events[-1] == b"data: [DONE]"
        assert b"stream_idle_timeout_s" in events[-2]
        assert took_s < 15.0  # not the 20 s total bound
        _settled(rig)


def test_time_to_first_token_is_the_first_token_not_a_keep_alive_comment() -> None:
    # A stream queued 1.2 s on a live engine, vLLM's keep-alive comments every 0.2 s
    # meanwhile: the gateway's TTFT (and its own books: the prompt waits until then) is the
    # first token's. Counting the first comment had recorded ~0.2 s.
    with gateway_rig(1, proxy=TIGHT) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 0
        fake.behaviour.stall_s = 1.2
        fake.behaviour.keep_alive_s = 0.2
        resp = _stream(rig)
        assert resp.content.startswith(b": keep-alive")  # relayed as they came
        assert _events(resp.content)[-1] == b"data: [DONE]"
        text = rig.metrics()
        url = rig.served[0].url
        assert metric(text, "sal_ttft_seconds_count", backend=url) == 1.0
        ttft_s = metric(text, "sal_ttft_seconds_sum", backend=url)
        assert ttft_s is not None
        assert ttft_s >= 1.1, ttft_s
        _settled(rig)


def test_a_replica_that_dies_after_keep_alive_comments_is_replaced() -> None:
    # a sends keep-alive comments for 0.6 s (the request queued there), then crashes before
    # its first token: nothing was generated and the client has seen nothing (its headers
    # wait for content, `proxy.first_byte_hold_s`), so b answers the whole stream. Taking
    # the first comment for content had sent the headers and ended the stream with an error.
    with gateway_rig(2, routing=FIRST_A, proxy=TIGHT) as rig:
        a, b = rig.fakes
        a.behaviour.stall_after_chunks = 0
        a.behaviour.stall_s = 0.6
        a.behaviour.keep_alive_s = 0.2
        a.behaviour.close_after_chunks = 0
        resp = _stream(rig, max_tokens=4)
        assert resp.status_code == 200
        events = _events(resp.content)
        assert events[-1] == b"data: [DONE]"
        assert not any(b"error" in e for e in events), events
        assert [json.loads(e[len(b"data: ") :])["backend"] for e in events[:-1]] == ["b"] * 4
        assert (a.generation_requests, b.generation_requests) == (1, 1)
        assert metric(rig.metrics(), "sal_first_byte_failures_total", reason="closed") == 1.0
        _settled(rig)


def _complete_whole(rig: Rig) -> httpx.Response:
    return httpx.post(
        f"{rig.url}/v1/completions",
        timeout=30.0,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
    )


def test_non_streamed_request_on_a_replica_that_froze_is_answered_elsewhere() -> None:
    # a accepts the request and freezes (headers of a non-streamed answer only come at the
    # end): once a stops being alive, the request is closed there and sent to b.
    with gateway_rig(2, routing=FIRST_A, proxy=TIGHT) as rig:
        a, b = rig.fakes
        a.behaviour.hang = True
        a.behaviour.stall_freezes_engine = True
        started = time.monotonic()
        resp = _complete_whole(rig)
        assert resp.status_code == 200
        assert resp.json()["backend"] == "b"
        assert time.monotonic() - started < 15.0  # not the 20 s total bound
        assert a.generation_requests == 1
        assert b.generation_requests == 1
        wait_until(lambda: a.disconnects == 1)  # closed there: vLLM aborts it
        m = rig.metrics()
        a_url = rig.served[0].url
        assert metric(m, "sal_stream_timeouts_total", backend=a_url, kind="idle") == 1.0
        assert metric(m, "sal_retries_total", backend=a_url) == 1.0
        _settled(rig)


def test_non_streamed_request_queued_on_a_live_replica_waits_for_its_answer() -> None:
    # 4 s before the answer (queued, then generated) on a replica whose engine progresses:
    # longer than the 1.5 s idle bound, and answered by that replica.
    with gateway_rig(2, routing={**FIRST_A, **LIVE}, proxy=TIGHT) as rig:
        a, b = rig.fakes
        a.behaviour.first_byte_delay_s = 4.0
        resp = _complete_whole(rig)
        assert resp.status_code == 200
        assert resp.json()["backend"] == "a"
        assert b.generation_requests == 0
        _settled(rig)
