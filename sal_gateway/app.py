"""The FastAPI application: `create_app(config)`; everything stateful is built in the lifespan.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST`` every other
endpoint of `endpoints.ENDPOINTS` (``/v1/responses``, ``/v1/embeddings``, ``/tokenize``,
``/v1/rerank``, ...; same admission and `Forwarder`), ``GET /v1/models`` (the replicas'
union, `model_catalog`), ``GET /health`` (alive), ``GET /ready`` (every model has an eligible
backend and a request worker is up, else 503), ``GET /metrics`` (Prometheus). Every error is
an OpenAI-style JSON body (`errors`), unknown paths (404), wrong methods (405) and framework
validation (422) included; an unexpected exception is logged with the request id and answered
500 naming that id, never a traceback.

In front of the routes, `front_door.FrontDoor` sets the request id, checks API keys and
limits concurrent relayed requests; `admission.admit` reads, validates and counts each
generation request within its bounds; `error_handlers` shapes the framework's errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from sal_core.beta import BetaEstimator
from sal_core.policies import Policy, PolicySettings, make_policy
from sal_gateway import __version__
from sal_gateway.admission import (
    LARGE_BODY_SLOTS,
    admit,
    count_rejection,
    forward_headers,
    request_id_of,
)
from sal_gateway.auth import KeyChecker, backend_key, is_loopback, load_keys
from sal_gateway.body_pool import BodyPool
from sal_gateway.config import GatewayConfig, ModelConfig
from sal_gateway.drain import Drain, uncancel_current_task
from sal_gateway.endpoints import ENDPOINTS, LEGACY_PATHS, ApiEndpoint, route_policy
from sal_gateway.error_handlers import error_response, install_error_handlers
from sal_gateway.errors import (
    GatewayError,
)
from sal_gateway.front_door import FrontDoor
from sal_gateway.loop_monitor import watch_loop
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.model_catalog import (
    READ_TIMEOUT_S,
    ModelCatalog,
    ServedName,
    http_fetch,
    refresh_models,
)
from sal_gateway.peers import BothCounts, PeerLink, PeerNetwork, group_of, open_peer_link
from sal_gateway.poller import Poller
from sal_gateway.prefix_cache import PrefixTracker, PromptBlocks
from sal_gateway.prefix_share import PrefixShare, ShareSpec
from sal_gateway.proxy import Forwarder, make_session
from sal_gateway.request_body import Endpoint, InboundRequest
from sal_gateway.shared_accounting import SharedAccounting
from sal_gateway.state import PeerCounts, StateTable
from sal_gateway.template_pool import TemplatePool
from sal_gateway.tokenizer import PromptCount, PromptCounter, load_model_tokenizer
from sal_gateway.tracing import Tracing, TracingMiddleware, build_tracing, trace_of

if TYPE_CHECKING:
    from sal_core.stats import ReplicaStats
    from sal_gateway.kv_subscriber import KvEventSubscribers

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
    clock: Callable[[], float]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    discovered: dict[str, set[str]] = field(default_factory=dict)
    templates: TemplatePool | None = None
    """Renderers of trusted request templates (None: no model trusts them)."""
    bodies: BodyPool | None = None
    """Workers for large bodies (None: not started, large bodies are handled inline)."""
    backend_key: str | None = None
    """Sent upstream as ``Authorization: Bearer`` (never the client's own)."""
    large_bodies: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(LARGE_BODY_SLOTS)
    )
    fallback_policy: Policy | None = None
    """Routes the requests the gateway cannot count (`endpoints.route_policy`); None: the
    configured policy routes them too."""
    catalog: ModelCatalog = field(default_factory=ModelCatalog)
    """What each backend's ``/v1/models`` says it serves (`model_catalog`)."""
    prefix: PrefixTracker | None = None
    """What each replica holds in its prefix cache (None: ``routing.prefix_cache: off``)."""
    kv_events: KvEventSubscribers | None = None
    """Subscribers to the replicas' KV-cache events (``routing.prefix_cache: kv_events``)."""
    drain: Drain = field(default_factory=Drain)
    """Whether the process is shutting down (`sal_gateway.drain`)."""
    peers: PeerNetwork | None = None
    """The exchange of between-poll accounting with gateways on other hosts (``peers``)."""
    prefix_share: PrefixShare | None = None
    """The exchange of routed prompt blocks with this host's other workers."""

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.poller.stop_all()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.peers is not None:
            await self.peers.close()
        if self.prefix_share is not None:
            await self.prefix_share.aclose()
        await self.forwarder.aclose()
        await self.session.close()

    def start_backend(self, model: ModelConfig, url: str) -> None:
        """Poll a backend that joined `model`'s pool (and follow its KV events)."""
        self.poller.start(model.name, url)
        if self.kv_events is not None:
            from sal_gateway.kv_subscriber import endpoints_for

            routing = self.config.routing
            endpoints = endpoints_for(
                url,
                routing.kv_events_port,
                dict(model.kv_events_endpoints),
                routing.kv_events_replay_port,
                dict(model.kv_events_replay_endpoints),
            )
            self.kv_events.add(model.name, url, endpoints)

    def on_stats(self, model: str, url: str, stats: ReplicaStats) -> None:
        """Poll callback (main loop): what the prefix tracker learns from a good poll."""
        if self.prefix is None:
            return
        grown = self.prefix.observe(model, url, stats)
        if self.kv_events is not None and self.prefix.tracking(model, url):
            self.kv_events.tracked(model, url)  # its replay, once, now that blocks are keyed
        metrics = self.metrics
        # Every polled backend's series exist from its first poll (a rate of 0, not "no
        # data", until its engine looks up or hits anything).
        metrics.prefix_engine_query_tokens.labels(model, url).inc(grown.query_tokens)
        metrics.prefix_engine_hit_tokens.labels(model, url).inc(grown.hit_tokens)
        metrics.prefix_index_blocks.labels(model, url).set(self.prefix.indexed_blocks(model, url))
        metrics.fleet_reuse_kv_blocks.labels(model).set(self.prefix.fleet_blocks(model))

    def prompt_blocks(self, counted: bool, count: PromptCount) -> PromptBlocks | None:
        """What the prefix tracker looks up for one admitted request (None: nothing)."""
        if self.prefix is None or not counted or len(count.per_prompt) != 1:
            return None
        return PromptBlocks(count.block_keys, count.per_prompt[0])

    def on_discovered(self, model: ModelConfig, urls: list[str]) -> None:
        """Discovery callback: add new backends (and poll them), drop vanished ones."""
        current = self.discovered.setdefault(model.name, set())
        static = set(model.backends)
        wanted = set(urls)
        for url in sorted(wanted - current):
            if self.table.add_backend(model.name, url, model.fallback_max_num_batched_tokens):
                self.start_backend(model, url)
        for url in sorted(current - wanted - static):
            self.poller.cancel(model.name, url)
            self.table.remove_backend(model.name, url)
            self.metrics.forget_backend(model.name, url)
            if self.kv_events is not None:
                self.kv_events.remove(model.name, url)
            if self.prefix is not None:
                self.prefix.forget(model.name, url)
                self.metrics.fleet_reuse_kv_blocks.labels(model.name).set(
                    self.prefix.fleet_blocks(model.name)
                )
        self.discovered[model.name] = wanted


def load_counters(config: GatewayConfig) -> dict[str, PromptCounter]:
    """Load every model's tokenizer (slow, blocking); raises `TokenizerLoadError`."""
    return {m.name: load_model_tokenizer(m.tokenizer, m.max_model_len) for m in config.models}


def _peer_counts(
    accounting: SharedAccounting | None, network: PeerNetwork | None
) -> Callable[[str, str], PeerCounts | None] | None:
    """Where a backend's other counts come from: this host's other workers (`accounting`),
    gateways on other hosts (`network`), both, or nobody (None)."""
    if network is None:
        return None if accounting is None else accounting.slot
    if accounting is None:
        return network.slot

    def both(model: str, url: str) -> PeerCounts | None:
        remote = network.slot(model, url)
        local = accounting.slot(model, url)
        return remote if local is None else BothCounts(local, remote)

    return both


async def build_runtime(
    config: GatewayConfig,
    *,
    counters: Mapping[str, PromptCounter] | None = None,
    resolve: Resolver | None = None,
    clock: Callable[[], float] = time.monotonic,
    drain: Drain | None = None,
    accounting: SharedAccounting | None = None,
    peer_link: PeerLink | None = None,
    prefix_share: ShareSpec | None = None,
) -> Runtime:
    """Build and start everything (pollers, discovery); call inside the running loop.
    `drain`: the process's shutdown state (`sal_gateway.drain`; a new one when None);
    `accounting`: the workers' shared between-poll accounting (None: this process alone);
    `prefix_share`: this worker's end of the workers' prefix-index exchange (used with
    ``routing.prefix_cache: approximate``; None: not shared);
    `peer_link`: the secret and bound socket of ``peers`` (`open_peer_link`; None: off)."""
    drain = Drain() if drain is None else drain
    if counters is None:
        counters = await asyncio.to_thread(load_counters, config)
    routing = config.routing
    metrics = GatewayMetrics(__version__)
    network = None
    if peer_link is not None:
        network = PeerNetwork(
            config.peers,
            peer_link.secret,
            peer_link.sock,
            clock=clock,
            on_datagram=lambda result: metrics.peer_datagrams.labels(result=result).inc(),
            on_sent=metrics.on_peer_sent,
            group=None if accounting is None else group_of(accounting.name),
        )
        await network.start()
    table = StateTable(
        routing.stale_after_s,
        routing.eject_after_failures,
        accounting_grace_s=routing.accounting_grace_s,
        clock=clock,
        peers=_peer_counts(accounting, network),
        budget_spread_max=routing.budget_spread_max,
    )
    betas = {m.name: BetaEstimator(seed=routing.beta_seed) for m in config.models}
    session = make_session(config.proxy)
    prefix = None if routing.prefix_cache == "off" else PrefixTracker(routing.prefix_cache)
    # Polls run on their own thread, loop and connection pool, so they never queue behind
    # proxied streams or a saturated event loop (a late poll would make a busy but healthy
    # backend look stale).
    poller = Poller(table, metrics, routing, clock)
    catalog = ModelCatalog([m.name for m in config.models])
    forwarder = Forwarder(
        session=session,
        table=table,
        policy=make_policy(
            routing.policy,
            routing.seed,
            PolicySettings(min_match_tokens=routing.prefix_min_match_tokens),
        ),
        metrics=metrics,
        betas=betas,
        routing=routing,
        proxy=config.proxy,
        clock=clock,
        prefix=prefix,
        drain=drain,
        on_not_served=catalog.forget_name,
    )
    runtime = Runtime(
        config=config,
        catalog=catalog,
        table=table,
        metrics=metrics,
        betas=betas,
        counters=dict(counters),
        session=session,
        poller=poller,
        forwarder=forwarder,
        clock=clock,
        prefix=prefix,
        drain=drain,
        peers=network,
    )
    if prefix is not None:
        poller.on_stats = runtime.on_stats
    if prefix is not None and prefix_share is not None and routing.prefix_cache == "approximate":
        outcomes = metrics.prefix_share_messages
        share = PrefixShare(prefix_share, prefix.told, lambda o: outcomes.labels(o).inc())
        try:
            await share.start()
        except OSError as exc:  # the folder vanished, a path too long for a Unix socket
            logger.warning("prefix index not shared with the other workers: %s", exc)
            await share.aclose()
        else:
            prefix.hold_listeners.append(share.tell)
            runtime.prefix_share = share
    if (
        prefix is not None
        and network is not None
        and routing.prefix_cache == "approximate"
        and config.peers.share_prefix_blocks
    ):
        prefix.hold_listeners.append(network.tell_blocks)
        network.on_blocks = prefix.told
    if prefix is not None and routing.prefix_cache == "kv_events":
        from sal_gateway.kv_subscriber import KvEventSubscribers

        runtime.kv_events = KvEventSubscribers(prefix, metrics, routing.kv_events_topic)
    fallback = route_policy(False, routing.policy)
    if fallback is not None:
        runtime.fallback_policy = make_policy(fallback, routing.seed)
    for model in config.models:
        table.add_model(model.name)
        for url in model.backends:
            table.add_backend(model.name, url, model.fallback_max_num_batched_tokens)
            runtime.start_backend(model, url)
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
        with contextlib.suppress(asyncio.CancelledError):
            await work_task  # its upstream connection closed (vLLM aborts), its ticket freed
        raise
    finally:
        watch_task.cancel()
    if not work_task.done():
        work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        return Response(status_code=499)  # nobody is listening any more
    return work_task.result()


def _blocks(
    rt: Runtime, inbound: InboundRequest, count: PromptCount, served: ServedName | None
) -> PromptBlocks | None:
    """The prompt's blocks for the prefix tracker: an adapter's are its own (vLLM keys them
    by adapter), so they never match the base model's or another adapter's."""
    blocks = rt.prompt_blocks(inbound.counted, count)
    if blocks is None or served is None or not served.adapter or inbound.served_model is None:
        return blocks
    return blocks.for_adapter(inbound.served_model)


async def _generate(request: Request, endpoint: Endpoint | ApiEndpoint) -> Response:
    rt: Runtime = request.app.state.runtime
    model_label = "unknown"  # unconfigured names never become label values
    adapter: str | None = None  # a LoRA adapter's name, once admitted (its own metrics)
    try:
        inbound, raw, count, served = await admit(request, endpoint, rt)
        model_label = inbound.model
        routed_adapter = inbound.served_model if served is not None and served.adapter else None
        listed = served is None or served.listed
        if listed:
            adapter = routed_adapter
        rt.metrics.prompt_tokens.labels(model=model_label).inc(count.total)
        if count.estimated:
            rt.metrics.prompt_tokens_estimated.labels(model=model_label).inc()
        headers = forward_headers(request, rt, request_id_of(request))
        # vLLM runs one engine request per choice: n (or best_of) times the prompt's load.
        load = count.total * inbound.fan_out
        policy = None if inbound.counted else rt.fallback_policy
        session = rt.config.routing.session_header
        forward = rt.forwarder.forward(
            inbound,
            raw,
            headers,
            load,
            trace=trace_of(request),
            policy=policy,
            blocks=_blocks(rt, inbound, count, served),
            affinity_key=None if session is None else request.headers.get(session),
            only=None if served is None else served.urls,
            adapter=routed_adapter,
            listed=listed,
        )
        return await _unless_disconnected(request, forward)
    except ClientDisconnect:
        return Response(status_code=499)  # went away while sending its body
    except asyncio.CancelledError as cancelled:
        if not rt.drain.is_shutdown(cancelled):
            raise
        # Still unanswered when the shutdown grace ran out: a clean 503, not a dropped
        # connection (the upstream one is closed already).
        uncancel_current_task()
        exc = rt.drain.error()
        rt.metrics.requests.labels(model=model_label, backend="none", status="503").inc()
        rt.metrics.count_adapter_request(model_label, adapter, 503)
        return error_response(exc)
    except GatewayError as exc:
        count_rejection(rt, exc)
        if not exc.counted:
            rt.metrics.requests.labels(
                model=model_label, backend=exc.backend or "none", status=str(exc.status)
            ).inc()
            rt.metrics.count_adapter_request(model_label, adapter, exc.status)
        return error_response(exc)


def _relay_handler(endpoint: ApiEndpoint) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        return await _generate(request, endpoint)

    return handler


def _start_model_refresh(rt: Runtime) -> None:
    """One `refresh_models` task per model (reads its backends' ``/v1/models``)."""
    headers = {} if rt.backend_key is None else {"Authorization": f"Bearer {rt.backend_key}"}
    fetch = http_fetch(rt.session, headers, READ_TIMEOUT_S)
    for model in rt.config.models:
        name = model.name

        def backends(name: str = name) -> list[str]:
            return [b.url for b in rt.table.backends(name)]

        def on_served(url: str, served: tuple[str, ...], name: str = name) -> None:
            if not rt.table.set_served(name, url, served):
                return
            if name in served:
                logger.info("backend %s serves model %s again: routable", url, name)
            else:
                logger.warning(
                    "backend %s does not serve model %s (its /v1/models lists %s): no request "
                    "is sent there until it does",
                    url,
                    name,
                    ", ".join(served[:5]) or "nothing",
                )

        rt.tasks.append(
            asyncio.create_task(
                refresh_models(
                    name, backends, fetch, rt.catalog, model.models_refresh_s, on_served
                ),
                name=f"models {name}",
            )
        )


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


def _body_pool(config: GatewayConfig) -> BodyPool:
    models = [
        {"name": m.name, "tokenizer": m.tokenizer, "max_model_len": m.max_model_len}
        for m in config.models
    ]
    limits = config.limits
    return BodyPool(models, limits.body_workers, limits.body_max_waiting, limits.retry_after_s)


def create_app(
    config: GatewayConfig,
    *,
    counters: Mapping[str, PromptCounter] | None = None,
    resolve: Resolver | None = None,
    clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
    accounting: SharedAccounting | None = None,
    prefix_share: ShareSpec | None = None,
) -> FastAPI:
    """The gateway app. `counters` (preloaded tokenizers, as the CLI does) avoids loading them
    again; `resolve` replaces DNS resolution for discovery (tests); `clock` is monotonic;
    `accounting` / `prefix_share`: what a worker shares with the others (`build_runtime`);
    `tracing` replaces the one ``config.tracing`` describes (tests: an in-memory exporter).
    Raises `TracingError` when tracing is enabled but cannot be set up."""
    upstream_key = backend_key(config.auth)  # read now: a bad key file fails before serving
    peer_link = open_peer_link(config.peers, os.environ)  # likewise a missing secret or port
    drain = Drain()
    if tracing is None:
        tracing = build_tracing(config.tracing, os.environ)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await build_runtime(
            config,
            counters=counters,
            resolve=resolve,
            clock=clock,
            drain=drain,
            accounting=accounting,
            peer_link=peer_link,
            prefix_share=prefix_share,
        )
        runtime.backend_key = upstream_key
        _start_model_refresh(runtime)
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
        runtime.bodies = _body_pool(config)
        runtime.bodies.start()
        app.state.runtime = runtime
        try:
            yield
        finally:
            if runtime.templates is not None:
                await runtime.templates.aclose()
            await runtime.bodies.aclose()
            await runtime.aclose()
            if tracing is not None:  # flushes buffered spans: network I/O, off the loop
                await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(
        title="SAL gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    app.state.drain = drain  # the server's signal handler starts the drain (`cli`)
    install_error_handlers(app)
    _front_door(app, config)
    if tracing is not None:  # outermost: rejected requests (401, 429) get their span too
        app.add_middleware(TracingMiddleware, tracing=tracing)

    async def completions(request: Request) -> Response:
        return await _generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, Endpoint.CHAT)

    # Plain Starlette routes on the hot path: FastAPI's dependency solving costs ~15% of the
    # gateway's CPU per request and these handlers take the raw request anyway.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    for api_endpoint in ENDPOINTS:
        if api_endpoint.path not in LEGACY_PATHS:
            app.add_route(api_endpoint.path, _relay_handler(api_endpoint), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        rt: Runtime = request.app.state.runtime
        pools = {m.name: [b.url for b in rt.table.backends(m.name)] for m in config.models}
        data = rt.catalog.listing(pools, int(time.time()))
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
        # A model with no eligible backend still routes (degraded) to those whose engine
        # progressed recently: the gateway stays ready, so a busy host's transient staleness
        # does not also take it out of its load balancer.
        max_age_s = config.routing.degraded_max_progress_age_s
        degraded = [
            model
            for model, n in per_model.items()
            if n == 0
            and max_age_s > 0
            and any(v.eligible for v in rt.table.degraded_views(model, now_s, max_age_s))
        ]
        # The worker processes load the tokenizers at start-up (seconds): until one is up,
        # a large request or a trusted template would wait for it.
        workers_ready = (rt.bodies is None or rt.bodies.ready) and (
            rt.templates is None or rt.templates.ready
        )
        is_ready = (
            workers_ready
            and not rt.drain.draining
            and all(n > 0 or model in degraded for model, n in per_model.items())
        )
        return JSONResponse(
            {
                "ready": is_ready,
                "draining": rt.drain.draining,
                "eligible_backends": per_model,
                "degraded_models": degraded,
                "workers_ready": workers_ready,
            },
            status_code=200 if is_ready else 503,
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        rt: Runtime = request.app.state.runtime
        rt.metrics.refresh(rt.table, rt.clock(), {m: b.beta for m, b in rt.betas.items()})
        if rt.peers is not None:
            rt.metrics.peers_heard.set(rt.peers.heard())
            if rt.prefix is not None:
                rt.metrics.prefix_told_holds.labels("peers").set(rt.peers.held_requests())
        if rt.prefix_share is not None:
            rt.metrics.prefix_told_holds.labels("workers").set(rt.prefix_share.held_requests)
        return Response(
            rt.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
