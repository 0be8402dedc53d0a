"""Serve `engine_sim.fake_vllm.FakeBackend` in a process of its own, for benchmarks and fault tests.

``python -m bench.fake_backend_server --port P [--model tiny] [--also-serves NAME]`` runs the
fake vLLM server (OpenAI API with ``usage``, ``/stats``, ``/metrics``) with uvicorn on uvloop
+ httptools on 127.0.0.1. With the default zero delays every response is as fast as the fake
can produce it, so what the benchmark measures on top of it is the gateway's own cost; with
``--first-byte-delay-s`` / ``--chunk-delay-s`` it paces its tokens like a real replica.

Fault knobs (used by the real-process fault tests), in `FaultyFake`:

* ``POST /_fault`` with a JSON object sets, at run time, any `FakeBehaviour` field (e.g.
  ``{"engine_frozen": true, "stall_after_chunks": 0}`` for an engine frozen behind a live
  API server, ``{"stats_delay_s": 2}`` for a slow ``/stats``) and ``stats_mode``, a malformed
  ``/stats`` (`STATS_MODES`), and ``fail_after_headers`` (`AFTER_HEADERS_MODES`, or null):
  each recorded streaming request gets 200 ``text/event-stream`` headers, then ``exit`` (the
  process dies at once: a replica killed right after it accepted a request) or ``empty``
  (the stream ends cleanly without a byte of content), and ``stats``, an object of
  sal-stats fields the fake reports from then on (e.g. ``{"queued_prefill_tokens": 0}`` on a
  replica whose requests wait: a replica that lies about its queue). It answers the knobs
  now in force.
* ``--record PATH`` appends one line per generation request to PATH, flushed at once (so it
  survives a SIGKILL): ``start ID`` when the request arrives, then ``done ID`` when the last
  byte of its answer was handed to the server with the client still there, or ``abort ID``
  otherwise. ID is the request body's ``user`` field (the tests put a unique id there; the
  gateway forwards bodies unchanged). Tests count from it what each backend generated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import IO, Any

import uvicorn

from engine_sim.fake_vllm import FakeBackend, FakeBehaviour, Message, Receive, Scope, Send

STATS_MODES = ("ok", "nested", "nan", "schema", "status_503", "stock_nan")
"""``/stats`` bodies: ``ok`` (the fake's own), ``nested`` (JSON nested 100,000 deep), ``nan``
(a well-formed snapshot with ``NaN`` fields), ``schema`` (valid JSON, wrong schema),
``status_503`` (an error status), ``stock_nan`` (``/stats`` 404 like stock vLLM, and a
``NaN`` in ``/metrics``)."""

NESTED_DEPTH = 100_000
AFTER_HEADERS_MODES = ("exit", "empty")
"""``fail_after_headers`` modes: what a stream gets after its headers (see the docstring)."""


class FaultyFake:
    """ASGI wrapper around a `FakeBackend`: fault control, malformed stats, request record."""

    def __init__(self, backend: FakeBackend, record: IO[str] | None = None) -> None:
        self.backend = backend
        self.record = record
        self.stats_mode = "ok"
        self.fail_after_headers: str | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.backend(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path == "/_fault":
            await self._control(receive, send)
        elif method == "GET" and path == "/stats" and self.stats_mode != "ok":
            await self._bad_stats(send)
        elif method == "GET" and path == "/metrics" and self.stats_mode == "stock_nan":
            text = self.backend.metrics_text().replace(
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.backend.model}"}} '
                f"{self.backend.metrics_kv_usage}",
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.backend.model}"}} NaN',
            )
            await _reply(send, 200, text.encode(), b"text/plain; version=0.0.4")
        elif method == "POST" and path.startswith("/v1/") and self.record is not None:
            await self._recorded(scope, receive, send)
        else:
            await self.backend(scope, receive, send)

    async def _control(self, receive: Receive, send: Send) -> None:
        knobs = json.loads(await _read_body(receive) or b"{}")
        behaviour = self.backend.behaviour
        for key, value in knobs.items():
            if key == "stats_mode":
                if value not in STATS_MODES:
                    await _reply(
                        send, 400, f"stats_mode not in {STATS_MODES}".encode(), b"text/plain"
                    )
                    return
                self.stats_mode = value
            elif key == "fail_after_headers":
                if value is not None and value not in AFTER_HEADERS_MODES:
                    await _reply(
                        send, 400, f"{key} not in {AFTER_HEADERS_MODES}".encode(), b"text/plain"
                    )
                    return
                self.fail_after_headers = value
            elif key == "stats":
                fields = {f.name for f in dataclasses.fields(self.backend.stats)}
                unknown = sorted(set(value) - fields) if isinstance(value, dict) else ["?"]
                if unknown:
                    await _reply(
                        send, 400, f"unknown stats fields {unknown}".encode(), b"text/plain"
                    )
                    return
                self.backend.stats = dataclasses.replace(self.backend.stats, **value)
            elif key in {f.name for f in dataclasses.fields(behaviour)}:
                setattr(behaviour, key, value)
            else:
                await _reply(send, 400, f"unknown knob {key!r}".encode(), b"text/plain")
                return
        state = {
            **dataclasses.asdict(behaviour),
            "stats_mode": self.stats_mode,
            "fail_after_headers": self.fail_after_headers,
        }
        state.pop("stats_raw_body", None)  # bytes: not JSON
        await _reply(send, 200, json.dumps(state).encode(), b"application/json")

    async def _bad_stats(self, send: Send) -> None:
        mode = self.stats_mode
        stats = self.backend.snapshot()
        if mode == "nested":
            body = b"[" * NESTED_DEPTH + b"]" * NESTED_DEPTH
        elif mode == "nan":
            obj = {**stats.to_dict(), "free_kv_tokens": float("nan"), "time": float("nan")}
            body = json.dumps(obj).encode()  # Python writes NaN, as a careless server would
        elif mode == "schema":
            body = json.dumps({"schema": "sal-stats/1", "engines": [stats.to_dict()]}).encode()
        elif mode == "status_503":
            await _reply(send, 503, b'{"error": {"message": "no snapshot"}}', b"application/json")
            return
        else:  # stock_nan: look like stock vLLM, whose /metrics is read instead
            await _reply(send, 404, b'{"detail": "Not Found"}', b"application/json")
            return
        await _reply(send, 200, body, b"application/json")

    async def _recorded(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        try:
            parsed = json.loads(body)
            request_id, stream = str(parsed.get("user", "-")), parsed.get("stream") is True
        except (ValueError, AttributeError):
            request_id, stream = "-", False
        self._write(f"start {request_id}")
        if self.fail_after_headers is not None and stream:
            await self._fail_after_headers(send, request_id)
            return
        replayed = False
        gone = False
        finished = False

        async def replay() -> Message:
            nonlocal replayed, gone
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
            return message

        async def watched_send(message: Message) -> None:
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True

        try:
            await self.backend(scope, replay, watched_send)
        finally:
            self._write(f"{'done' if finished and not gone else 'abort'} {request_id}")

    async def _fail_after_headers(self, send: Send, request_id: str) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.fail_after_headers == "exit":
            os._exit(17)  # uvicorn wrote the headers to the socket already; nothing flushes
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._write(f"abort {request_id}")

    def _write(self, line: str) -> None:
        assert self.record is not None
        self.record.write(line + "\n")
        self.record.flush()


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _reply(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="fast fake vLLM backend for benchmarks")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--also-serves", action="append", default=[], help="a further served name (repeatable)"
    )
    parser.add_argument(
        "--adapter", action="append", default=[], help="a LoRA adapter it serves (repeatable)"
    )
    parser.add_argument("--name", default=None, help="reported as 'backend' (default fake-PORT)")
    parser.add_argument("--first-byte-delay-s", type=float, default=0.0)
    parser.add_argument("--chunk-delay-s", type=float, default=0.0)
    parser.add_argument("--default-output-tokens", type=int, default=8)
    parser.add_argument("--record", type=Path, default=None, help="append a request log here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    behaviour = FakeBehaviour(
        first_byte_delay_s=args.first_byte_delay_s,
        chunk_delay_s=args.chunk_delay_s,
        default_output_tokens=args.default_output_tokens,
    )
    backend = FakeBackend(
        name=args.name or f"fake-{args.port}",
        model=args.model,
        also_serves=tuple(args.also_serves),
        adapters=tuple(args.adapter),
        behaviour=behaviour,
        keep_received=0,
    )
    record: Any = args.record.open("a", encoding="utf-8") if args.record else None
    try:
        uvicorn.run(
            FaultyFake(backend, record),
            host="127.0.0.1",
            port=args.port,
            loop="uvloop",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
    finally:
        if record is not None:
            record.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
