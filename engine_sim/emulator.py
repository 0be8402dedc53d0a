"""The engine emulator: the engine model behind vLLM's HTTP API, on the wall clock.

Each replica is one FastAPI app (built by `create_app`) serving

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` — OpenAI-shaped, streaming
  (SSE, ``stream_options.include_usage``) or not, always with ``usage``; every output is
  forced to ``max_tokens`` tokens (``ignore_eos`` or not; default `default_max_tokens`);
  prompts are counted as the gateway counts them (`sal_gateway.tokenizer`: the tokenizer
  directory when given, else the documented ``ceil(utf8_bytes / 4)`` estimate; token-ID
  prompts count exactly);
* ``GET /v1/models``, ``GET /health``;
* ``GET /stats`` — the ``sal-stats/1`` contract from `EngineModel.stats`;
* ``GET /metrics`` — the stock-vLLM subset the gateway's fallback reads.

A client disconnect aborts its requests in the engine. Several replicas run in one process
(`run_emulators`, or ``python -m engine_sim.emulator --replicas 4 --base-port 8001``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from engine_sim import openai_bodies as bodies
from engine_sim.cost_model import PROFILES, get_profile
from engine_sim.engine import EngineConfig, EngineModel
from engine_sim.replica import ReplicaRuntime, TokenEvent
from engine_sim.schedulers import ENGINE_SCHEDULERS
from sal_gateway.errors import BadRequest, GatewayError, ModelNotFound, error_body
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import PromptCounter, check_length, load_model_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated replica (every replica of a `run_emulators` call shares it)."""

    model_name: str = "tiny"
    """Served model name (``model`` in requests, ``/v1/models``, ``/stats``)."""
    profile: str = "tiny-cpu"
    """Cost profile in `engine_sim.cost_model.PROFILES`."""
    scheduler: str = "fcfs"
    """Engine policy in `engine_sim.schedulers.ENGINE_SCHEDULERS`."""
    alpha: float = 1.0
    trail_c: float = 0.8
    time_scale: float = 1.0
    """Wall-clock seconds per modelled second (0.1: ten times faster than the GPU)."""
    block_size: int = 16
    num_kv_blocks: int | None = None
    """KV blocks; None: what the profile's GPU memory holds."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    tokenizer: str | None = None
    """Tokenizer directory for exact prompt counts; None: the documented estimate."""
    max_model_len: int | None = None
    """Context limit; None: the tokenizer dir's, else the KV capacity in tokens."""
    default_max_tokens: int = 16
    """Output length when a request has no ``max_tokens`` (OpenAI's completions default)."""

    def engine_config(self) -> EngineConfig:
        blocks = self.num_kv_blocks
        if blocks is None:
            blocks = get_profile(self.profile).num_kv_blocks(self.block_size)
        return EngineConfig(
            num_kv_blocks=blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduler=self.scheduler,
            alpha=self.alpha,
            trail_c=self.trail_c,
            model_name=self.model_name,
        )


@dataclass
class _Replica:
    config: EmulatorConfig
    runtime: ReplicaRuntime
    counter: PromptCounter
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(config: EmulatorConfig) -> FastAPI:
    """One replica's app; its engine and stepping task live in the app's lifespan."""
    engine_config = config.engine_config()  # validates names before anything starts
    profile = get_profile(config.profile)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        counter = await asyncio.to_thread(
            load_model_tokenizer, config.tokenizer, config.max_model_len
        )
        capacity = engine_config.num_kv_blocks * engine_config.block_size
        runtime = ReplicaRuntime(EngineModel(engine_config, profile), config.time_scale)
        runtime.start()
        app.state.replica = _Replica(config, runtime, counter, counter.max_model_len or capacity)
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title="engine_sim emulator", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        replica: _Replica = request.app.state.replica
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": replica.created,
                    "owned_by": "engine_sim",
                    "root": config.model_name,
                    "max_model_len": replica.max_model_len,
                }
            ],
        }

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        replica: _Replica = request.app.state.replica
        return replica.runtime.stats().to_dict()

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        replica: _Replica = request.app.state.replica
        return PlainTextResponse(metrics_text(replica.runtime, config.model_name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, Endpoint.CHAT)

    return app


def metrics_text(runtime: ReplicaRuntime, model_name: str) -> str:
    """The stock vLLM ``/metrics`` series the gateway's fallback reads, plus counters."""
    engine = runtime.engine
    cfg = engine.config
    labels = f'engine="0",model_name="{model_name}"'
    used = 1.0 - engine.free_blocks / cfg.num_kv_blocks
    c = runtime.counters
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(engine.num_running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(engine.num_waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {used}",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{cfg.block_size}",engine="0",'
        f'num_gpu_blocks="{cfg.num_kv_blocks}"}} 1.0',
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{labels}}} {float(engine.num_preemptions)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{labels}}} {float(c.prompt_tokens)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {float(c.generation_tokens)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{labels},finished_reason="length"}} '
        f"{float(c.requests_finished)}",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class _Generation:
    """One HTTP generation request after validation."""

    response_id: str
    chat: bool
    stream: bool
    include_usage: bool
    prompt_counts: tuple[int, ...]
    max_tokens: int


def _error(exc: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def _validate(replica: _Replica, raw: bytes, endpoint: Endpoint) -> _Generation:
    inbound = parse_body(raw, endpoint)
    config = replica.config
    if inbound.model != config.model_name:
        raise ModelNotFound(f"The model `{inbound.model}` does not exist.", param="model")
    n = inbound.body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("the emulator supports only n=1", param="n")
    count = replica.counter.count_sync(inbound)
    check_length(count, inbound.max_tokens, replica.max_model_len)
    max_tokens = config.default_max_tokens if inbound.max_tokens is None else inbound.max_tokens
    if max_tokens < 1:
        raise BadRequest("`max_tokens` must be at least 1", param="max_tokens")
    # vLLM clamps max_tokens to what is left of the context (it does not reject).
    longest = max(count.per_prompt)
    max_tokens = max(1, min(max_tokens, replica.max_model_len - longest))
    options = inbound.body.get("stream_options") or {}
    chat = endpoint is Endpoint.CHAT
    return _Generation(
        response_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        chat=chat,
        stream=inbound.stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        prompt_counts=tuple(max(1, c) for c in count.per_prompt),
        max_tokens=max_tokens,
    )


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    replica: _Replica = request.app.state.replica
    try:
        gen = _validate(replica, await request.body(), endpoint)
    except GatewayError as exc:
        return _error(exc)
    queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
    request_ids: list[str] = []
    try:
        for index, prompt_tokens in enumerate(gen.prompt_counts):
            request_ids.append(replica.runtime.submit(prompt_tokens, gen.max_tokens, queue, index))
    except ValueError as exc:
        _abort_all(replica, request_ids)
        return _error(BadRequest(str(exc), param="max_tokens"))
    if gen.stream:
        return StreamingResponse(
            _stream(replica, gen, queue, request_ids), media_type="text/event-stream"
        )
    return await _complete(request, replica, gen, queue, request_ids)


def _abort_all(replica: _Replica, request_ids: Sequence[str]) -> None:
    for request_id in request_ids:
        replica.runtime.abort(request_id)


async def _collect(queue: asyncio.Queue[TokenEvent], choices: int) -> list[int]:
    outputs = [0] * choices
    remaining = choices
    while remaining:
        event = await queue.get()
        outputs[event.index] += event.tokens
        remaining -= event.finished
    return outputs


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(
    request: Request,
    replica: _Replica,
    gen: _Generation,
    queue: asyncio.Queue[TokenEvent],
    request_ids: list[str],
) -> Response:
    """Non-streaming: wait for every choice, or abort them all if the client leaves."""
    collect = asyncio.ensure_future(_collect(queue, len(request_ids)))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():
            collect.cancel()
            _abort_all(replica, request_ids)
    if collect.cancelled():
        return Response(status_code=499)
    body = bodies.completion_body(
        gen.response_id,
        replica.created,
        replica.config.model_name,
        collect.result(),
        sum(gen.prompt_counts),
        chat=gen.chat,
    )
    return JSONResponse(body)


async def _stream(
    replica: _Replica,
    gen: _Generation,
    queue: asyncio.Queue[TokenEvent],
    request_ids: list[str],
) -> AsyncIterator[bytes]:
    """SSE: one chunk per engine step per choice; aborts the engine side when closed early."""
    model = replica.config.model_name
    outputs = [0] * len(request_ids)
    remaining = len(request_ids)
    try:
        while remaining:
            event = await queue.get()
            first = outputs[event.index] == 0
            outputs[event.index] += event.tokens
            remaining -= event.finished
            yield bodies.sse(
                bodies.chunk(
                    gen.response_id,
                    replica.created,
                    model,
                    chat=gen.chat,
                    index=event.index,
                    tokens=event.tokens,
                    finished=event.finished,
                    first=first,
                )
            )
        if gen.include_usage:
            usage_body = bodies.usage(sum(gen.prompt_counts), sum(outputs))
            yield bodies.sse(
                bodies.usage_chunk(
                    gen.response_id, replica.created, model, chat=gen.chat, usage_body=usage_body
                )
            )
        yield bodies.SSE_DONE
    finally:
        if remaining:
            _abort_all(replica, request_ids)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner (several share a loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def run_emulators(
    n: int,
    host: str = "127.0.0.1",
    base_port: int = 0,
    profile: str = "tiny-cpu",
    *,
    config: EmulatorConfig | None = None,
    log_level: str = "warning",
    start_timeout_s: float = 30.0,
    **overrides: Any,
) -> AsyncIterator[list[str]]:
    """Serve `n` emulated replicas on ports ``base_port + i`` (0: any free port each).

    Yields their base URLs (``http://host:port``) once all accept connections; stops them
    all on exit. `overrides` are `EmulatorConfig` fields (``scheduler="larry"``, ...).
    """
    base = config if config is not None else EmulatorConfig()
    cfg = replace(base, profile=profile, **overrides)
    servers: list[_Server] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for i in range(n):
            port = base_port + i if base_port else 0
            uv_config = uvicorn.Config(
                create_app(cfg),
                host=host,
                port=port,
                log_level=log_level,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=2,
            )
            server = _Server(uv_config)
            servers.append(server)
            tasks.append(asyncio.create_task(server.serve(), name=f"emulator-{i}"))
        urls = [
            await _started_url(s, t, host, start_timeout_s)
            for s, t in zip(servers, tasks, strict=True)
        ]
        yield urls
    finally:
        for server in servers:
            server.should_exit = True
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
        for task in tasks:
            if not task.done():
                task.cancel()


async def _started_url(
    server: _Server, task: asyncio.Task[None], host: str, timeout_s: float
) -> str:
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if task.done():
            task.result()  # re-raise the start-up error
            raise RuntimeError("emulator server exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"emulator server did not start within {timeout_s} s")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    return f"http://{url_host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine_sim.emulator",
        description="Emulated vLLM replicas (engine model on the wall clock) behind the "
        "OpenAI API, /stats and /metrics.",
    )
    defaults = EmulatorConfig()
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=8001, help="replica i listens on base+i")
    parser.add_argument("--profile", default=defaults.profile, choices=sorted(PROFILES))
    parser.add_argument("--model", default=defaults.model_name, help="served model name")
    parser.add_argument(
        "--scheduler", default=defaults.scheduler, choices=sorted(ENGINE_SCHEDULERS)
    )
    parser.add_argument("--alpha", type=float, default=defaults.alpha, help="LARRY's alpha")
    parser.add_argument("--trail-c", type=float, default=defaults.trail_c)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=defaults.time_scale,
        help="wall seconds per modelled second (0.1 = ten times faster than the GPU)",
    )
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens
    )
    parser.add_argument(
        "--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (exact counts)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens)
    parser.add_argument("--log-level", default="warning")
    return parser


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    names = {f.name for f in fields(EmulatorConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    return EmulatorConfig(model_name=args.model, **values)


async def _serve_forever(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    config = config_from_args(args)
    async with run_emulators(
        args.replicas,
        args.host,
        args.base_port,
        config.profile,
        config=config,
        log_level=args.log_level,
    ) as urls:
        for url in urls:
            print(f"emulated replica ({config.profile}, {config.scheduler}) at {url}", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: serve replicas until SIGINT/SIGTERM."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    asyncio.run(_serve_forever(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
