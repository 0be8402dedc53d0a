"""The FastAPI application: `create_app(config)`; everything stateful is built in the lifespan.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (alive), ``GET /ready`` (every model has an eligible backend, else 503),
``GET /metrics`` (Prometheus). Every error is an OpenAI-style JSON body (`errors`), unknown
paths (404), wrong methods (405) and framework validation (422) included; an unexpected
exception is logged with the request id and answered 500 naming that id, never a traceback.

In front of the routes, `front_door.FrontDoor` sets the request id, checks API keys and
limits concurrent generation requests; `admission.admit` reads, validates and counts each
generation request within its bounds; `error_handlers` shapes the framework's errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from sal_gateway import __version__
from sal_gateway.admission import (
    LARGE_BODY_SLOTS,
    admit,
    count_rejection,
    forward_headers,
    request_id_of,
)
from sal_gateway.auth import KeyChecker, backend_key, is_loopback, load_keys
from sal_gateway.beta import BetaEstimator
from sal_gateway.config import GatewayConfig, ModelConfig
from sal_gateway.error_handlers import error_response, install_error_handlers
from sal_gateway.errors import (
    GatewayError,
)
from sal_gateway.front_door import FrontDoor
from sal_gateway.loop_monitor import watch_loop
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.policies import make_policy
from sal_gateway.poller import Poller
from sal_gateway.proxy import Forwarder, make_session
from sal_gateway.request_body import Endpoint
from sal_gateway.state import StateTable
from sal_gateway.template_pool import TemplatePool
from sal_gateway.tokenizer import PromptCounter, load_model_tokenizer

logger = logging.getLogger("sal_gateway.app")

Resolver = Callable[[str, int], Awaitable[list[str]]]

TEMPLATE_WORKERS = 2
"""Processes rendering trusted request templates (only started when some model trusts them)."""


@dataclass(slots=True)
class Runtime:
    """Everything one running app owns (built in the lifespan, closed on shutdown)."""

    config: GatewayConfig
    table: StateTable
    metrics: GatewayMetrics
    betas: dict[str, BetaEstimator]
    counters: dict[str, PromptCounter]
    session: aiohttp.ClientSession
    poller: Poller
    """Polls every backend on its own thread, loop and HTTP session."""
    forwarder: Forwarder
    executor: ThreadPoolExecutor
    clock: Callable[[], float]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    discovered: dict[str, set[str]] = field(default_factory=dict)
    templates: TemplatePool | None = None
    """Renderers of trusted request templates (None: no model trusts them)."""
    backend_key: str | None = None
    """Sent upstream as ``Authorization: Bearer`` (never the client's own)."""
    large_bodies: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(LARGE_BODY_SLOTS)
    )

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.poller.stop_all()
        await self.session.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def on_discovered(self, model: ModelConfig, urls: list[str]) -> None:
        """Discovery callback: add new backends (and poll them), drop vanished ones."""
        current = self.discovered.setdefault(model.name, set())
        static = set(model.backends)
        wanted = set(urls)
        for url in sorted(wanted - current):
            if self.table.add_backend(model.name, url, model.fallback_max_num_batched_tokens):
                self.poller.start(model.name, url)
        for url in sorted(current - wanted - static):
            self.poller.cancel(model.name, url)
            self.table.remove_backend(model.name, url)
            self.metrics.forget_backend(model.name, url)
        self.discovered[model.name] = wanted


def load_counters(config: GatewayConfig) -> dict[str, PromptCounter]:
    """Load every model's tokenizer (slow, blocking); raises `TokenizerLoadError`."""
    return {m.name: load_model_tokenizer(m.tokenizer, m.max_model_len) for m in config.models}


async def build_runtime(
    config: GatewayConfig,
    *,
    counters: Mapping[str, PromptCounter] | None = None,
    resolve: Resolver | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Runtime:
    """Build and start everything (pollers, discovery); call inside the running loop."""
    if counters is None:
        counters = await asyncio.to_thread(load_counters, config)
    routing = config.routing
    table = StateTable(
        routing.stale_after_s,
        routing.eject_after_failures,
        accounting_grace_s=routing.accounting_grace_s,
        clock=clock,
    )
    metrics = GatewayMetrics(__version__)
    betas = {m.name: BetaEstimator(seed=routing.beta_seed) for m in config.models}
    session = make_session(config.proxy)
    # Polls run on their own thread, loop and connection pool, so they never queue behind
    # proxied streams or a saturated event loop (a late poll would make a busy but healthy
    # backend look stale).
    poller = Poller(table, metrics, routing, clock)
    forwarder = Forwarder(
        session=session,
        table=table,
        policy=make_policy(routing.policy, routing.seed),
        metrics=metrics,
        betas=betas,
        routing=routing,
        proxy=config.proxy,
        clock=clock,
    )
    runtime = Runtime(
        config=config,
        table=table,
        metrics=metrics,
        betas=betas,
        counters=dict(counters),
        session=session,
        poller=poller,
        forwarder=forwarder,
        executor=ThreadPoolExecutor(max_workers=2, thread_name_prefix="sal-tokenize"),
        clock=clock,
    )
    for model in config.models:
        table.add_model(model.name)
        for url in model.backends:
            table.add_backend(model.name, url, model.fallback_max_num_batched_tokens)
            poller.start(model.name, url)
        if model.discovery is not None:
            from sal_gateway.discovery import watch_dns

            d = model.discovery
            runtime.tasks.append(
                asyncio.create_task(
                    watch_dns(
                        d.dns_name,
                        d.port,
                        d.scheme,
                        d.interval_s,
                        functools.partial(runtime.on_discovered, model),
                        resolve=resolve,
                    ),
                    name=f"discovery {model.name}",
                )
            )
    return runtime


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run `work`, cancelling it if the client disconnects before it returns a response
    (so a waiting or non-streaming upstream request is abandoned, and its connection closed).
    Once a streaming response is returned, its own disconnect watch takes over (`proxy`)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself is cancelled (shutdown): take the work along
        work_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if not work_task.done():
        work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        return Response(status_code=499)  # nobody is listening any more
    return work_task.result()


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    rt: Runtime = request.app.state.runtime
    model_label = "unknown"  # unconfigured names never become label values
    try:
        inbound, raw, count = await admit(request, endpoint, rt)
        model_label = inbound.model
        rt.metrics.prompt_tokens.labels(model=model_label).inc(count.total)
        if count.estimated:
            rt.metrics.prompt_tokens_estimated.labels(model=model_label).inc()
        headers = forward_headers(request, rt, request_id_of(request))
        # vLLM runs one engine request per choice: n (or best_of) times the prompt's load.
        load = count.total * inbound.fan_out
        forward = rt.forwarder.forward(inbound, raw, headers, load)
        return await _unless_disconnected(request, forward)
    except ClientDisconnect:
        return Response(status_code=499)  # went away while sending its body
    except GatewayError as exc:
        count_rejection(rt, exc)
        if not exc.counted:
            rt.metrics.requests.labels(
                model=model_label, backend=exc.backend or "none", status=str(exc.status)
            ).inc()
        return error_response(exc)


def _front_door(app: FastAPI, config: GatewayConfig) -> None:
    """Install `FrontDoor` (keys are read now, so a bad key file fails before serving)."""
    checker = KeyChecker(load_keys(config.auth))
    if not checker.enabled and not is_loopback(config.listen.host):
        logger.warning(
            "listening on %s without API keys: anyone who can reach it can use the fleet "
            "(set auth.api_keys, auth.api_keys_file or $%s)",
            config.listen.host,
            config.auth.api_keys_env,
        )

    def on_reject(reason: str) -> None:
        runtime: Runtime | None = getattr(app.state, "runtime", None)
        if runtime is not None:
            runtime.metrics.rejected.labels(reason=reason).inc()

    app.add_middleware(
        FrontDoor,
        checker=checker,
        open_paths=frozenset(config.auth.open_paths),
        max_concurrent=config.limits.max_concurrent_requests,
        retry_after_s=config.limits.retry_after_s,
        on_reject=on_reject,
    )


def create_app(
    config: GatewayConfig,
    *,
    counters: Mapping[str, PromptCounter] | None = None,
    resolve: Resolver | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The gateway app. `counters` (preloaded tokenizers, as the CLI does) avoids loading them
    again; `resolve` replaces DNS resolution for discovery (tests); `clock` is monotonic."""
    upstream_key = backend_key(config.auth)  # read now: a bad key file fails before serving

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await build_runtime(config, counters=counters, resolve=resolve, clock=clock)
        runtime.backend_key = upstream_key
        runtime.tasks.append(
            asyncio.create_task(
                watch_loop(runtime.metrics.loop_lag, runtime.metrics.loop_tasks),
                name="loop monitor",
            )
        )
        if any(m.trust_request_chat_template for m in config.models):
            limits = config.limits
            runtime.templates = TemplatePool(
                TEMPLATE_WORKERS, limits.template_timeout_s, limits.retry_after_s
            )
            runtime.templates.start()
        app.state.runtime = runtime
        try:
            yield
        finally:
            if runtime.templates is not None:
                await runtime.templates.aclose()
            await runtime.aclose()

    app = FastAPI(
        title="SAL gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    install_error_handlers(app)
    _front_door(app, config)

    async def completions(request: Request) -> Response:
        return await _generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, Endpoint.CHAT)

    # Plain Starlette routes on the hot path: FastAPI's dependency solving costs ~15% of the
    # gateway's CPU per request and these handlers take the raw request anyway.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        now = int(time.time())
        data = [
            {"id": m.name, "object": "model", "created": now, "owned_by": "sal-gateway"}
            for m in config.models
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        rt: Runtime = request.app.state.runtime
        now_s = rt.clock()
        per_model = {
            model: sum(
                b.is_eligible(now_s, rt.table.stale_after_s) for b in rt.table.backends(model)
            )
            for model in rt.table.models()
        }
        is_ready = all(n > 0 for n in per_model.values())
        return JSONResponse(
            {"ready": is_ready, "eligible_backends": per_model},
            status_code=200 if is_ready else 503,
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        rt: Runtime = request.app.state.runtime
        rt.metrics.refresh(rt.table, rt.clock(), {m: b.beta for m, b in rt.betas.items()})
        return Response(
            rt.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
