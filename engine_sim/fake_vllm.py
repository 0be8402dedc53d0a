"""Typed fake backends for tests and benchmarks (like httpx's ``MockTransport``, but over HTTP).

`FakeBackend` is a plain ASGI app that behaves like a vLLM OpenAI server as far as the gateway
can tell: ``POST /v1/completions`` and ``/v1/chat/completions`` (JSON or SSE, with ``usage``),
``GET /v1/models``, ``/health``, ``/stats`` (sal-stats/1, from the settable `stats`) and a
stock-vLLM-style ``/metrics``. Like a live engine, ``/stats`` stamps a fresh ``time`` on each
read and advances ``step`` when the settable `stats` show requests waiting or running. A
request naming a model other than `model` gets vLLM's 404 (``NotFoundError``). Knobs
(`FakeBehaviour`) set delays, tokens per chunk, and faults: answer 500, hang before answering,
close the connection mid-stream, hang, 404, be slow or serve a malformed body on ``/stats``,
freeze the engine (``/stats`` repeats its last snapshot). It records what it received
(`received`), how many generation requests it saw (`generation_requests`) and how many
clients went away mid-answer (`disconnects`).

`ServedBackend` runs one on 127.0.0.1 in a background thread with uvicorn and can stop and
restart it on the same port (a backend killed and coming back)::

    backend = FakeBackend(name="a")
    with ServedBackend(backend) as url:
        ...  # url == "http://127.0.0.1:<port>"

Responses carry ``"backend": name`` (JSON) / the ``x-fake-backend`` header so tests can tell
who answered; the request body is echoed under ``"echo"`` in non-streaming responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

from sal_core.stats import ReplicaStats

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def default_stats(model: str = "tiny") -> ReplicaStats:
    """An idle replica with 1000 KV blocks of 16 tokens."""
    return ReplicaStats(
        time=time.time(),
        step=0,
        model=model,
        scheduler="larry",
        alpha=1.0,
        block_size=16,
        kv_blocks_total=1000,
        kv_blocks_free=1000,
        free_kv_tokens=16000,
        queued_prefill_tokens=0,
        num_waiting=0,
        num_running=0,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
    )


BODY_PIECE_BYTES = 1 << 20
"""A non-streamed answer larger than this is sent chunked, in pieces of this size."""


@dataclass(slots=True)
class FakeBehaviour:
    """How the fake answers (mutable at any time; read per request)."""

    default_output_tokens: int = 8
    """Output tokens when the request has no ``max_tokens``."""
    tokens_per_chunk: int = 1
    """Output tokens per SSE chunk."""
    first_byte_delay_s: float = 0.0
    """Delay before the response starts (a slow prefill)."""
    chunk_delay_s: float = 0.0
    """Delay between two SSE chunks."""
    fail_status: int | None = None
    """Answer every generation request with this HTTP status (e.g. 500)."""
    hang: bool = False
    """Never answer generation requests (until the client goes away)."""
    close_after_chunks: int | None = None
    """Drop the connection after this many SSE chunks (a crash mid-stream; after the stall,
    if one comes at the same point), or, for a non-streamed answer over `BODY_PIECE_BYTES`,
    after this many of its pieces."""
    stats_hang: bool = False
    """``/stats`` never answers."""
    stats_status: int = 200
    """``/stats`` status; 404 makes it look like stock vLLM."""
    engine_frozen: bool = False
    """The engine is frozen behind a live API server (SIGSTOP on vLLM's EngineCore):
    ``/stats`` keeps serving the last snapshot, ``time`` and ``step`` no longer advance."""
    stats_delay_s: float = 0.0
    """Delay before ``/stats`` answers (a slow or overloaded API server)."""
    stats_raw_body: bytes | None = None
    """Serve exactly these bytes on ``/stats`` with status 200 (a malformed body)."""
    stall_after_chunks: int | None = None
    """Streams: after the headers and this many SSE chunks, send nothing more but keep the
    connection open until the client goes away (0: a frozen engine behind a live API server),
    or for `stall_s`."""
    stall_s: float | None = None
    """A stall lasts this long, then the stream goes on (a request queued behind others on a
    working engine); None: until the client goes away."""
    stall_freezes_engine: bool = False
    """When a stream stalls (or a request hangs, `hang`), the engine freezes too
    (`engine_frozen`): a hung replica, as opposed to a request queued on a live one."""
    keep_alive_s: float | None = None
    """During a stall, an SSE comment (``: keep-alive``) every this many seconds, as vLLM's
    API server sends with ``--sse-keep-alive-interval`` (even when its engine froze)."""
    end_delay_s: float = 0.0
    """Streams: the body's end (the chunked terminator) follows ``data: [DONE]`` this much
    later, in a write of its own (vLLM's API server sends the two apart too; a busy one
    can leave a gap between them)."""


@dataclass(slots=True)
class FakeBackend:
    """The fake vLLM server (an ASGI app). Counters are plain attributes; read them freely."""

    name: str = "fake"
    model: str = "tiny"
    also_serves: tuple[str, ...] = ()
    """Further served names (vLLM's ``--served-model-name a b``): listed and accepted."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters (vLLM's ``--lora-modules``): listed with ``parent`` = `model` and
    accepted; assign a new tuple to load or unload one."""
    resolvable: tuple[str, ...] = ()
    """Adapters a LoRA resolver would load on first use: a request naming one adds it to
    `adapters` (then listed) and is served; any other unknown name is vLLM's 404."""
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    stats: ReplicaStats = field(default_factory=default_stats)
    metrics_waiting: int = 0
    metrics_running: int = 0
    metrics_kv_usage: float = 0.0
    metrics_num_gpu_blocks: int = 1000
    metrics_block_size: int = 16
    metrics_max_lora: int = 0
    """``--max-loras`` on ``/metrics`` (``vllm:lora_requests_info``; 0: LoRA off, no series)."""
    metrics_running_loras: tuple[str, ...] = ()
    """The adapters ``vllm:lora_requests_info`` says are running (with `metrics_max_lora`)."""
    received: list[dict[str, Any]] = field(default_factory=list)
    last_headers: dict[str, str] = field(default_factory=dict)
    """Headers of the last generation request (lower-case names)."""
    generation_requests: int = 0
    disconnects: int = 0
    stats_polls: int = 0
    models_reads: int = 0
    """``GET /v1/models`` answered."""
    keep_received: int = 1000
    """How many request bodies `received` keeps (the newest)."""
    _served: ReplicaStats | None = None
    """The last snapshot `/stats` served (what a frozen engine keeps serving)."""
    _extra_steps: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path != "/v1/models":  # completions, chat, or any other relay
            self.last_headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            await self._generate(path, receive, send)
        elif method == "GET" and path == "/stats":
            await self._stats(send)
        elif method == "GET" and path == "/metrics":
            await _send(send, 200, self.metrics_text().encode(), b"text/plain; version=0.0.4")
        elif method == "GET" and path == "/health":
            await _send(send, 200, b"", b"text/plain")
        elif method == "GET" and path == "/v1/models":
            self.models_reads += 1
            names = (self.model, *self.also_serves)
            cards = [{"id": n, "object": "model", "parent": None} for n in names]
            cards += [{"id": a, "object": "model", "parent": self.model} for a in self.adapters]
            body = {"object": "list", "data": cards}
            await _send_json(send, 200, body, self.name)
        else:
            await _send_json(send, 404, {"error": {"message": "not found", "code": 404}}, self.name)

    def metrics_text(self) -> str:
        """Stock vLLM 0.32-style Prometheus text for the settable ``metrics_*`` fields."""
        labels = f'engine="0",model_name="{self.model}"'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(self.metrics_running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(self.metrics_waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.metrics_kv_usage}\n"
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.metrics_block_size}",'
            f'cache_dtype="auto",engine="0",'
            f'num_gpu_blocks="{self.metrics_num_gpu_blocks}"}} 1.0\n'
        ) + self._lora_text()

    def _lora_text(self) -> str:
        """vLLM's LoRA info gauge: every label set it ever reported stays, valued at the time
        it was set, so an older series (a long-finished adapter here) precedes now's."""
        if self.metrics_max_lora <= 0:
            return ""
        series = (
            'vllm:lora_requests_info{{max_lora="{}",running_lora_adapters="{}",'
            'waiting_lora_adapters=""}} {}\n'
        )
        running = ",".join(self.metrics_running_loras)
        return (
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            + series.format(self.metrics_max_lora, "long-gone", 1.0e9)
            + series.format(self.metrics_max_lora, running, time.time())
        )

    def snapshot(self) -> ReplicaStats:
        """What ``/stats`` serves now: `stats` stamped with the current time and a step
        counter that advances on every read while busy; the previous one when frozen."""
        if self.behaviour.engine_frozen and self._served is not None:
            return self._served
        if self.stats.num_waiting + self.stats.num_running > 0:
            self._extra_steps += 1
        self._served = replace(
            self.stats, time=time.time(), step=self.stats.step + self._extra_steps
        )
        return self._served

    async def _stats(self, send: Send) -> None:
        self.stats_polls += 1
        b = self.behaviour
        if b.stats_hang:
            await asyncio.Event().wait()
        if b.stats_delay_s > 0:
            await asyncio.sleep(b.stats_delay_s)
        if b.stats_status != 200:
            await _send_json(
                send, b.stats_status, {"error": {"message": "no stats", "code": 404}}, self.name
            )
        elif b.stats_raw_body is not None:
            await _send(send, 200, b.stats_raw_body, b"application/json")
        else:
            await _send_json(send, 200, self.snapshot().to_dict(), self.name)

    async def _generate(self, path: str, receive: Receive, send: Send) -> None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.generation_requests += 1
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            await _send_json(send, 400, {"error": {"message": "bad json", "code": 400}}, self.name)
            return
        self.received.append(body)
        requested = body.get("model") if isinstance(body, dict) else None
        served = (self.model, *self.also_serves, *self.adapters)
        if isinstance(requested, str) and requested not in served and requested in self.resolvable:
            self.adapters = (*self.adapters, requested)  # a LoRA resolver loaded it
            served = (*served, requested)
        if isinstance(requested, str) and requested not in served:
            # vLLM's answer to a model it does not serve (`OpenAIServingModels.check_model`).
            error = {
                "message": f"The model `{requested}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
            await _send_json(send, 404, {"error": error}, self.name)
            return
        # `[:-0]` would be empty: 0 keeps nothing, as documented.
        del self.received[: len(self.received) - max(0, self.keep_received)]
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        try:
            await self._answer(path, body, send, gone)
        finally:
            watcher.cancel()
        if gone.is_set():
            self.disconnects += 1

    async def _answer(
        self, path: str, body: dict[str, Any], send: Send, gone: asyncio.Event
    ) -> None:
        b = self.behaviour
        if b.hang:
            if b.stall_freezes_engine:
                b.engine_frozen = True
            await gone.wait()
            return
        if b.first_byte_delay_s > 0:
            await asyncio.sleep(b.first_byte_delay_s)
        if b.fail_status is not None:
            await _send_json(
                send,
                b.fail_status,
                {"error": {"message": "fake failure", "code": b.fail_status}},
                self.name,
            )
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            await self._answer_other(path, body, send)
            return
        chat = path.endswith("/chat/completions")
        prompt_tokens = _prompt_tokens(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        output_tokens = max_tokens if isinstance(max_tokens, int) else b.default_output_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
        }
        created = int(time.time())
        base = {
            "id": f"cmpl-{self.name}-{self.generation_requests}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": body.get("model", self.model),
        }
        if not body.get("stream"):
            text = " tok" * output_tokens
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            obj = {
                **base,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [choice],
                "usage": usage,
                "backend": self.name,
                "echo": body,
            }
            await self._send_large_json(send, obj, gone)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"x-fake-backend", self.name.encode()),
                ],
            }
        )
        sent = 0
        n_chunks = 0
        stalled = False
        while sent < output_tokens:
            if gone.is_set():
                return
            if (
                not stalled
                and b.stall_after_chunks is not None
                and n_chunks >= b.stall_after_chunks
            ):
                stalled = True
                if b.stall_freezes_engine:
                    b.engine_frozen = True
                if await self._stall(send, gone):
                    return
            if b.close_after_chunks is not None and n_chunks >= b.close_after_chunks:
                raise ConnectionAbortedError("fake backend crashed mid-stream")
            k = min(b.tokens_per_chunk, output_tokens - sent)
            sent += k
            n_chunks += 1
            finish = "length" if sent >= output_tokens else None
            delta = (
                {"index": 0, "delta": {"content": " tok" * k}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": " tok" * k, "finish_reason": finish}
            )
            event = {**base, "choices": [delta], "backend": self.name}
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                }
            )
            if b.chunk_delay_s > 0:
                await asyncio.sleep(b.chunk_delay_s)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            event = {**base, "choices": [], "usage": usage}
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                }
            )
        if b.end_delay_s <= 0:
            await send(
                {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
            )
            return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), b.end_delay_s)
        if not gone.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_large_json(self, send: Send, obj: object, gone: asyncio.Event) -> None:
        """A non-streamed answer: up to `BODY_PIECE_BYTES`, one message with its length; a
        larger one chunked in pieces of that size, `FakeBehaviour.chunk_delay_s` apart, the
        connection dropped after `FakeBehaviour.close_after_chunks` pieces (a crash while
        sending a long answer)."""
        data = json.dumps(obj).encode()
        if len(data) <= BODY_PIECE_BYTES:
            await _send(
                send, 200, data, b"application/json", [(b"x-fake-backend", self.name.encode())]
            )
            return
        headers = [(b"content-type", b"application/json"), (b"x-fake-backend", self.name.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        b = self.behaviour
        for n, at in enumerate(range(0, len(data), BODY_PIECE_BYTES)):
            if gone.is_set():
                return
            if b.close_after_chunks is not None and n >= b.close_after_chunks:
                raise ConnectionAbortedError("fake backend crashed while sending its answer")
            piece = data[at : at + BODY_PIECE_BYTES]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if b.chunk_delay_s > 0:
                await asyncio.sleep(b.chunk_delay_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stall(self, send: Send, gone: asyncio.Event) -> bool:
        """Send nothing but keep-alive comments for the stall (`FakeBehaviour.stall_s`);
        True when the client went away meanwhile."""
        b = self.behaviour
        until = None if b.stall_s is None else time.monotonic() + b.stall_s
        while until is None or time.monotonic() < until:
            wait_s = b.keep_alive_s
            if until is not None:
                left = until - time.monotonic()
                wait_s = left if wait_s is None else min(wait_s, left)
            try:
                await asyncio.wait_for(gone.wait(), wait_s)
                return True
            except TimeoutError:
                pass
            if b.keep_alive_s is not None and (until is None or time.monotonic() < until):
                comment = b": keep-alive\n\n"
                await send({"type": "http.response.body", "body": comment, "more_body": True})
        return gone.is_set()

    async def _answer_other(self, path: str, body: dict[str, Any], send: Send) -> None:
        """Any other endpoint (responses, embeddings, tokenize, ...): JSON naming the path
        with the body echoed, or for ``stream: true`` two named SSE events, the last one
        with Responses-style usage."""
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": 0}
        if not body.get("stream"):
            obj = {"object": "fake.relay", "path": path, "backend": self.name, "echo": body}
            await _send_json(send, 200, {**obj, "usage": usage}, self.name)
            return
        headers = [(b"content-type", b"text/event-stream"), (b"x-fake-backend", self.name.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        done = {"input_tokens": usage["prompt_tokens"], "output_tokens": 1}
        events = (
            ("response.created", {"type": "response.created", "path": path}),
            ("response.completed", {"type": "response.completed", "response": {"usage": done}}),
        )
        for name, event in events:
            data = f"event: {name}\ndata: {json.dumps(event)}\n\n".encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _prompt_tokens(body: dict[str, Any]) -> int:
    """A stand-in count: token IDs count as themselves, text as whitespace-separated words."""
    prompt = body.get("prompt")
    if prompt is None:
        messages = body.get("messages") or []
        return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return sum(len(p) for p in prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(len(p.split()) for p in prompt)
    return len(prompt) if isinstance(prompt, list) else 0


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


async def _send(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, obj: object, name: str) -> None:
    await _send(
        send,
        status,
        json.dumps(obj).encode(),
        b"application/json",
        [(b"x-fake-backend", name.encode())],
    )


class ServedApp:
    """Serves any ASGI app on 127.0.0.1 from a background thread (uvicorn, its own loop).

    `stop()` kills it (listening socket and open connections closed), `start()` brings it
    back on the same port. Also a context manager yielding the base URL. With
    ``lifespan=True`` the app's lifespan runs (the gateway needs it; the fake does not).
    """

    def __init__(
        self, app: Any, port: int = 0, host: str = "127.0.0.1", lifespan: bool = False
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.lifespan = lifespan
        self._thread: threading.Thread | None = None
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            loop="asyncio",
            http="httptools",
            lifespan="on" if self.lifespan else "off",
            timeout_graceful_shutdown=1,
            ws="none",
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=server.run, name="served app", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.app!r} did not start on port {self.port}")
            time.sleep(0.01)
        self.port = server.servers[0].sockets[0].getsockname()[1]
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True  # graceful: open requests get 1 s, then are cut
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._server = None
        self._thread = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServedBackend(ServedApp):
    """A `FakeBackend` served by `ServedApp`."""

    def __init__(self, backend: FakeBackend, port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__(backend, port, host)
        self.backend = backend
