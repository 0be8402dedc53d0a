"""The engine emulator: the engine model behind vLLM's HTTP API, on the wall clock.

Each replica is one FastAPI app (built by `create_app`) serving

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` — OpenAI-shaped, streaming
  (SSE, ``stream_options.include_usage``) or not, always with ``usage``; every output is
  forced to ``max_tokens`` tokens (``ignore_eos`` or not; default `default_max_tokens`);
  prompts are counted as the gateway counts them (`sal_gateway.tokenizer`: the tokenizer
  directory when given, else the documented ``ceil(utf8_bytes / 4)`` estimate; token-ID
  prompts count exactly);
* ``GET /v1/models``, ``GET /health``;
* LoRA adapters (``--lora-modules``, ``--max-loras``): listed with their ``parent``, accepted
  as ``model`` and run in the engine model's LoRA slots, as vLLM's scheduler does;
* ``GET /stats`` — the ``sal-stats/1`` contract from `EngineModel.stats`;
* ``GET /metrics`` — the stock-vLLM subset the gateway's fallback reads, with vLLM's
  prefix-cache counters (``vllm:prefix_cache_queries_total``, ``..._hits_total``) and, with
  LoRA adapters, ``vllm:lora_requests_info`` (the slots a stock-vLLM backend reports).

Prefix caching is on, as in vLLM: a prompt's full blocks are keyed from the tokens the
replica sees (`engine_sim.prompt_blocks`) and reused by later prompts that share them.

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
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse

from engine_sim.cost_model import PROFILES, get_profile
from engine_sim.engine import EngineConfig, EngineModel
from engine_sim.generation import ReplicaState, generate, metrics_text
from engine_sim.replica import ReplicaRuntime
from engine_sim.schedulers import ENGINE_SCHEDULERS
from sal_gateway.request_body import Endpoint
from sal_gateway.tokenizer import load_model_tokenizer

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
    reserve_full_prompt: bool = True
    """vLLM 0.32's ``--scheduler-reserve-full-isl`` (see `EngineConfig`)."""
    enable_prefix_caching: bool = True
    """Reuse cached prompt blocks (vLLM's default; ``--no-enable-prefix-caching`` turns it
    off); block keys come from the prompt's tokens (`engine_sim.prompt_blocks`)."""
    tokenizer: str | None = None
    """Tokenizer directory for exact prompt counts; None: the documented estimate."""
    max_model_len: int | None = None
    """Context limit; None: the tokenizer dir's, else the KV capacity in tokens."""
    default_max_tokens: int = 16
    """Output length when a request has no ``max_tokens`` (OpenAI's completions default)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served besides the model (vLLM's ``--enable-lora --lora-modules``): listed
    by ``/v1/models`` with ``parent``, accepted as ``model``, run in the engine's LoRA slots;
    their prompts' cached blocks are their own (vLLM keys them by adapter)."""
    max_loras: int = 1
    """Adapters one step's batch may hold when `lora_modules` are served (``--max-loras``,
    vLLM's default 1); reported in ``/stats`` (``max_loras``, ``lora_running``)."""

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
            reserve_full_prompt=self.reserve_full_prompt,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduler=self.scheduler,
            alpha=self.alpha,
            trail_c=self.trail_c,
            model_name=self.model_name,
            max_loras=self.max_loras if self.lora_modules else 0,
        )


def create_app(config: EmulatorConfig) -> FastAPI:
    """One replica's app; its engine and stepping task live in the app's lifespan."""
    engine_config = config.engine_config()  # validates names before anything starts
    profile = get_profile(config.profile)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Loaded on the loop thread on purpose: several replicas of one process start
        # together, and concurrent first imports of transformers from worker threads race in
        # its lazy module loader (ImportError: cannot import name 'AutoTokenizer'). Start-up
        # only; no request is being served yet.
        counter = load_model_tokenizer(config.tokenizer, config.max_model_len)
        capacity = engine_config.num_kv_blocks * engine_config.block_size
        runtime = ReplicaRuntime(EngineModel(engine_config, profile), config.time_scale)
        runtime.start()
        app.state.replica = ReplicaState(
            model_name=config.model_name,
            runtime=runtime,
            counter=counter,
            max_model_len=counter.max_model_len or capacity,
            default_max_tokens=config.default_max_tokens,
            adapters=config.lora_modules,
        )
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
        replica: ReplicaState = request.app.state.replica
        base = {
            "id": config.model_name,
            "object": "model",
            "created": replica.created,
            "owned_by": "engine_sim",
            "root": config.model_name,
            "max_model_len": replica.max_model_len,
        }
        adapters = [
            {**base, "id": name, "root": f"/adapters/{name}", "parent": config.model_name}
            for name in config.lora_modules
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        replica: ReplicaState = request.app.state.replica
        return replica.runtime.stats().to_dict()

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        replica: ReplicaState = request.app.state.replica
        return PlainTextResponse(metrics_text(replica.runtime, config.model_name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, Endpoint.COMPLETIONS, request.app.state.replica)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, Endpoint.CHAT, request.app.state.replica)

    return app


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
    parser.add_argument(
        "--no-scheduler-reserve-full-isl",
        dest="reserve_full_prompt",
        action="store_false",
        help="admit when the first chunk fits, not the whole prompt (as vLLM's flag)",
    )
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="no prefix cache (as vLLM's flag; on by default, as in vLLM)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (exact counts)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens)
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME",
        help="LoRA adapters served besides the model (their slots: --max-loras)",
    )
    parser.add_argument(
        "--max-loras", type=int, default=defaults.max_loras, help="adapters per batch (1)"
    )
    parser.add_argument("--log-level", default="warning")
    return parser


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    names = {f.name for f in fields(EmulatorConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["lora_modules"] = tuple(args.lora_modules)
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
