"""A stream the client read to its end is a served request, however the connection closes.

What a user would notice if it broke: clients that stop reading at ``data: [DONE]`` and drop
the connection (most SSE clients do: they have the whole answer) while the backend's body
has not quite ended (vLLM sends the chunked terminator in a write of its own, and a busy API
server can leave a gap) were booked as client cancellations: ``sal_requests_total`` showed
a 499 for an answered request, ``sal_upstream_cancels_total`` a cancellation that cancelled
nothing, and the answer's output tokens went uncounted. Dashboards built on those series
(error rate, tokens per second, cost per tenant) were wrong by the share of such clients.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from tests.gw_fake_support import MODEL, gateway_rig, metric, wait_until

END_DELAY_S = 1.0
OUTPUT_TOKENS = 5


def _chat_stream(url: str, body: bytes) -> socket.socket:
    """A raw connection to the gateway with the streamed chat request `body` sent."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10.0)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def _read_until(sock: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    """Read from `sock` until `done(everything read)`, then close it at once (no wait for
    the rest, the chunked terminator included)."""
    with sock:
        seen = b""
        while not done(seen):
            chunk = sock.recv(65536)
            assert chunk, f"the gateway closed first: {seen!r}"
            seen += chunk
    return seen


@pytest.mark.parametrize("client_usage", [True, False])
def test_a_stream_read_to_done_is_booked_as_served_when_the_client_hangs_up(
    client_usage: bool,
) -> None:
    """`client_usage`: the client asked for the usage event itself (else the gateway asks on
    its behalf and strips it)."""
    with gateway_rig(1) as rig:
        fake = rig.fakes[0]
        fake.behaviour.end_delay_s = END_DELAY_S
        options = ', "stream_options": {"include_usage": true}' if client_usage else ""
        body = (
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
            f'"max_tokens": {OUTPUT_TOKENS}, "stream": true{options}}}'
        ).encode()
        seen = _read_until(_chat_stream(rig.url, body), lambda b: b"data: [DONE]" in b)
        assert seen.count(b"data: {") == OUTPUT_TOKENS + (1 if client_usage else 0)
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight") == 0.0)
        text = rig.metrics()
        assert metric(text, "sal_requests_total", status="200") == 1.0
        assert metric(text, "sal_requests_total", status="499") is None
        assert metric(text, "sal_upstream_cancels_total", reason="client_disconnect") is None
        assert metric(text, "sal_output_tokens_total", model=MODEL) == OUTPUT_TOKENS


def test_a_client_leaving_before_done_is_still_a_cancellation() -> None:
    """The counterpart: a client gone before ``[DONE]`` reached it is a 499, and the
    upstream request is closed (vLLM aborts it)."""
    with gateway_rig(1) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 2  # two tokens, then nothing until it is closed
        body = (
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
            f'"max_tokens": {OUTPUT_TOKENS}, "stream": true}}'
        ).encode()
        _read_until(_chat_stream(rig.url, body), lambda b: b.count(b"data: {") >= 2)
        wait_until(lambda: fake.disconnects == 1)
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight") == 0.0)
        text = rig.metrics()
        assert metric(text, "sal_requests_total", status="499") == 1.0
        assert metric(text, "sal_upstream_cancels_total", reason="client_disconnect") == 1.0


def test_a_backend_that_never_ends_its_body_after_done_gives_no_error_event() -> None:
    """The backend sent ``data: [DONE]`` and then nothing, not even the chunked terminator
    (a hung API server): the client has its whole answer. When the idle bound closes that
    connection, the gateway ends the client's body cleanly: no error event after
    ``[DONE]``, a 200 with its usage, no stream error counted."""
    proxy = {"stream_idle_timeout_s": 1.0, "stream_idle_spares_live_engines": False}
    with gateway_rig(1, proxy=proxy) as rig:
        fake = rig.fakes[0]
        fake.behaviour.end_delay_s = 30.0
        body = (
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
            f'"max_tokens": {OUTPUT_TOKENS}, "stream": true}}'
        ).encode()
        # Read everything until the gateway ends the body (its chunked terminator).
        seen = _read_until(_chat_stream(rig.url, body), lambda b: b.endswith(b"0\r\n\r\n"))
        assert seen.count(b"data: [DONE]") == 1
        assert b'"error"' not in seen
        assert seen.rstrip(b"\r\n0").endswith(b"data: [DONE]")
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight") == 0.0)
        text = rig.metrics()
        assert metric(text, "sal_requests_total", status="200") == 1.0
        assert metric(text, "sal_stream_errors_total") is None
        assert metric(text, "sal_output_tokens_total", model=MODEL) == OUTPUT_TOKENS
