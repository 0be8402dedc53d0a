"""The keep-alive race over real sockets: a backend that closes a pooled connection just as
the gateway sends a request on it is not a failed backend.

A server closes an idle keep-alive connection after its own timeout (vLLM's uvicorn: 5 s). If
the gateway's loop runs late, a request can go out on a connection the backend has just
closed: the gateway sees the connection reset or closed before any answer. Before this was
told apart, such a request was retried on *another* backend and this one marked suspect: with
one healthy replica left (the other frozen or dead) the request got a 502 and the next ones
503s until the next poll. `KeepAliveCutter` plays that backend deterministically: every
request that arrives on a reused connection has its connection reset unread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from engine_sim.fake_vllm import FakeBackend, ServedApp, ServedBackend
from sal_gateway.app import create_app
from tests.gw_fake_support import MODEL, gateway_config, metric, wait_until


class KeepAliveCutter:
    """A TCP relay in front of one backend (its own thread and loop). The first request on a
    client connection passes; a later ``POST`` on the same connection (a kept-alive one) is
    met with a reset, as when the backend's keep-alive timer fired as it arrived. Polls
    (``GET``) always pass, so the backend stays healthy in the gateway's eyes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut = 0
        """Requests whose connection was reset unread."""
        self.passed_posts = 0
        self.reset_every_post = False
        """Reset every ``POST``, on new connections too (a broken backend)."""
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = started.result(10.0)

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in self._writers:
                writer.close()
            await asyncio.sleep(0.05)  # let the transports close

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        answered = asyncio.Event()

        async def downstream() -> None:
            while data := await up_reader.read(65536):
                answered.set()
                writer.write(data)
                await writer.drain()
            writer.close()

        down = asyncio.create_task(downstream())
        try:
            while data := await reader.read(65536):
                reused = answered.is_set() or self.reset_every_post
                if reused and data.startswith(b"POST "):
                    self.cut += 1
                    writer.transport.abort()  # a reset, the request unread
                    return
                if data.startswith(b"POST "):
                    self.passed_posts += 1
                up_writer.write(data)
                await up_writer.drain()
        finally:
            down.cancel()
            up_writer.close()


@contextmanager
def _cut_rig(**routing: object) -> Iterator[tuple[str, KeepAliveCutter]]:
    with ServedBackend(FakeBackend(name="a", model=MODEL)) as backend_url:
        cutter = KeepAliveCutter(int(backend_url.rsplit(":", 1)[1]))
        cutter.start()
        try:
            config = gateway_config([cutter.url], routing=dict(routing))
            with ServedApp(create_app(config), lifespan=True) as url:
                wait_until(lambda: httpx.get(f"{url}/ready", timeout=5.0).status_code == 200, 60)
                yield url, cutter
        finally:
            cutter.stop()


def test_a_pooled_connection_closed_by_the_backend_is_retried_there_on_a_new_one() -> None:
    # One backend, polled rarely: had the reset marked it suspect, the request would have
    # had nowhere else to go (502) and the next ones none until the next poll (503).
    with _cut_rig(poll_interval_s=2.0, stale_after_s=30.0) as (url, cutter):
        with httpx.Client(timeout=30.0) as client:
            answers = []
            for i in range(6):
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": i % 2 == 1}
                answers.append(client.post(f"{url}/v1/completions", json=body))
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert all(b"[DONE]" in a.content for a in answers[1::2])  # streams ran to their end
        assert cutter.cut >= 2  # the race really happened, on both kinds of request
        assert cutter.passed_posts == 6  # each request reached the backend exactly once
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
        assert metric(text, "sal_retries_total", backend=cutter.url) == cutter.cut
        assert metric(text, "sal_backend_healthy", backend=cutter.url) == 1.0


def test_a_backend_that_resets_new_connections_too_is_still_given_up_on() -> None:
    # Only a failure on a reused connection is forgiven, once per request: a reset on the new
    # connection is the backend's, and the request fails over as before (here: nowhere).
    with _cut_rig(poll_interval_s=2.0, stale_after_s=30.0) as (url, cutter):
        with httpx.Client(timeout=30.0) as client:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            assert client.post(f"{url}/v1/completions", json=body).status_code == 200
            cutter.reset_every_post = True
            failed = client.post(f"{url}/v1/completions", json=body)
        assert failed.status_code == 502, failed.text
        assert "after 1 attempt" in failed.text
        assert cutter.cut == 2  # the pooled connection, then the new one: no more tries
        assert cutter.passed_posts == 1
