"""Selection and retry: forwarding one request to the best backend that will take it.

The app calls `Forwarder.forward()` once per validated request. The forwarder asks the
routing policy for a backend, sends the request (`upstream`'s pooled session), retries what
cannot have generated anything, and hands the answer to `relay.relay_answer`; how each
exchange ends is booked by `accounting.Accounting`.

Timeouts follow how vLLM answers (see docs/gateway.md):

* A non-streamed answer's headers come only when generation ends, so a non-streaming request
  is bounded by ``proxy.total_timeout_s`` alone (then 504, not retried: the backend worked).
* A stream's headers come as soon as vLLM accepts the request, so they are due within
  ``proxy.stream_header_timeout_s``. On expiry the upstream connection is closed (vLLM aborts
  the request: nothing runs twice), the backend is marked suspect and the request is retried
  like a connect failure; when every attempt timed out, 504.
* A stream's headers are held back from the client until the backend's first body byte
  (at most ``proxy.first_byte_hold_s``). A backend that fails in that window (connection
  reset or closed, or the stream ended without content) has sent the client nothing: its
  connection is closed, it is marked suspect and the request is retried like a connect
  failure (``sal_first_byte_failures_total``). Once the first byte went out (or the hold
  expired and the headers did), `relay.RelayResponse` bounds each silence by
  ``proxy.stream_idle_timeout_s`` (unless the replica's engine is demonstrably progressing:
  the request is queued there, `idle_watch`) and never retries: the client may have content.

Other failures:

* Connect failure before any response byte (refused, reset, connect timeout, closed before the
  headers): the backend is marked suspect and the request goes to the next best backend, at
  most ``routing.max_retries`` times; then 502.
* Except two failures that are not the backend's fault: the keep-alive race
  (`upstream.is_stale_connection`: a request that went out on a pooled connection the backend
  closed or reset before answering never reached its handler) and a connect timeout that
  fired only because the gateway's own process was stalled (`upstream.connect_held_up_by_stall`:
  the connection was made in the kernel meanwhile, but the loop ran the overdue timer first).
  The request is chosen again (the backend stays a candidate, not suspect) and sent on a new
  connection; once per request, not counted in ``routing.max_retries``. Marking a healthy
  last replica suspect for either had turned it into a 502 and 503s until the next poll.
* A backend's HTTP error (4xx *and* 5xx) is passed through with its status and body, never
  retried: generation may have happened.
* The request body is forwarded byte for byte, except that a stream whose client did not ask
  for usage is asked for it (`usage.with_usage_requested`) and the usage-only event removed
  again (`relay`). A client disconnect cancels the upstream request (its connection is
  closed). The state-table ticket is released on every exit path. Every connection the
  gateway closes on an unfinished exchange is counted in ``sal_upstream_cancels_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp
from starlette.responses import Response

from sal_core.beta import BetaEstimator
from sal_core.fleet_reuse import SCALES as FLEET_SCALES
from sal_core.lora_slots import lora_route
from sal_core.policies import (
    PREFIX_AWARE_POLICIES,
    BackendView,
    LeastRequests,
    NoEligibleBackend,
    Policy,
    RouteRequest,
)
from sal_gateway.accounting import Accounting
from sal_gateway.config import ProxyConfig, RoutingConfig
from sal_gateway.drain import Drain
from sal_gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoBackendAvailable,
    UpstreamError,
    UpstreamTimeout,
)
from sal_gateway.idle_watch import IdleWatch
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.model_catalog import says_model_missing
from sal_gateway.poller import pollers_behind
from sal_gateway.prefix_cache import PrefixTracker, PromptBlocks
from sal_gateway.relay import (
    Exchange,
    Head,
    comments_only,
    is_event_stream,
    relay_answer,
    sse_error_event,
)
from sal_gateway.request_body import InboundRequest
from sal_gateway.stall_guard import stall_tolerant_timeout
from sal_gateway.state import StateTable
from sal_gateway.trace_hooks import NO_TRACE, RequestTrace
from sal_gateway.upstream import (
    RETRYABLE,
    connect_held_up_by_stall,
    is_stale_connection,
    make_session,
    upstream_headers,
)
from sal_gateway.usage import with_usage_requested

__all__ = ["Forwarder", "make_session", "sse_error_event", "upstream_headers"]

logger = logging.getLogger("sal_gateway.proxy")


class _HeaderTimeout(Exception):
    """A stream's headers did not come within ``proxy.stream_header_timeout_s``."""


class _ReplicaStalled(Exception):
    """A non-streamed answer's replica stopped being alive while the request waited on it
    (`idle_watch`): the connection was closed, the client has seen nothing."""


class _Retry(Exception):
    """An attempt failed before the client saw anything and before the backend could have
    generated: try the next backend (its connection is closed already)."""

    def __init__(
        self,
        url: str,
        cause: Exception,
        *,
        header_timeout: bool = False,
        blameless: bool = False,
        not_served: bool = False,
    ) -> None:
        super().__init__(f"{url}: {cause}")
        self.url = url
        self.cause = cause
        self.header_timeout = header_timeout
        self.blameless = blameless
        """Not the backend's fault: the keep-alive race (`upstream.is_stale_connection`) or
        a connect timeout from a stall of the gateway (`upstream.connect_held_up_by_stall`)."""
        self.not_served = not_served
        """The backend answered 404 for the adapter the request named: it no longer serves
        it (unloaded, or restarted without it). Healthy otherwise: not held against it."""


NOT_FOUND_READ_BYTES = 64 * 1024
"""How much of a 404 for a served name is read to tell vLLM's "model does not exist"."""


def _excluding(
    views: list[BackendView], exclude: set[str], only: frozenset[str] | None = None
) -> list[BackendView]:
    """`views` without the backends not in `only` (when given: those serving the requested
    adapter; the policy sees that smaller pool, and round robin rotates through it apart),
    and with those in `exclude` (already tried) made ineligible."""
    if only is not None:
        views = [v for v in views if v.url in only]
    if not exclude:
        return views
    return [dataclasses.replace(v, eligible=False) if v.url in exclude else v for v in views]


def _being_cancelled() -> bool:
    """Whether the current task itself is being cancelled (not just what it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Forwarder:
    """Routes and forwards requests; one per app, built in the lifespan."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        table: StateTable,
        policy: Policy,
        metrics: GatewayMetrics,
        betas: Mapping[str, BetaEstimator],
        routing: RoutingConfig,
        proxy: ProxyConfig,
        clock: Callable[[], float] = time.monotonic,
        prefix: PrefixTracker | None = None,
        drain: Drain | None = None,
        on_not_served: Callable[[str, str, str], bool] | None = None,
    ) -> None:
        self._session = session
        self._on_not_served = on_not_served
        """``(model, url, name)``: `url` answered 404 for served name `name` (the catalog
        forgets it there until its next ``/v1/models`` read); True when `url`'s last
        ``/v1/models`` listed it."""
        self._drain = drain
        self._fresh: aiohttp.ClientSession | None = None
        """One connection per request, for the retry after a stale pooled connection
        (created on first use, closed by `aclose`)."""
        self._prefix = prefix
        self._table = table
        self._policy = policy
        self._metrics = metrics
        self._betas = betas
        self._routing = routing
        self._proxy = proxy
        self._clock = clock
        self._decision_seconds = metrics.routing_decision_seconds.labels(policy=policy.name)
        self._degraded_policy = LeastRequests()
        self.accounting = Accounting(
            metrics=metrics,
            betas=betas,
            policy_name=policy.name,
            stream_idle_timeout_s=proxy.stream_idle_timeout_s,
            clock=clock,
        )
        self._total_timeout = aiohttp.ClientTimeout(
            total=proxy.total_timeout_s, sock_connect=proxy.connect_timeout_s
        )
        # A stream's idle bound is the relay's `IdleWatch` (it tells a queued request on a
        # live engine from a frozen replica), not aiohttp's sock_read.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=proxy.total_timeout_s, sock_connect=proxy.connect_timeout_s
        )

    def _count_fleet_reuse(self, model: str, blocks: PromptBlocks) -> None:
        """Feed the routed prompt to the fleet-reuse estimate and count what it found."""
        assert self._prefix is not None
        found = self._prefix.fleet_reuse(model, blocks)
        if found is None:
            return
        metrics = self._metrics
        metrics.fleet_reuse_prompt_tokens.labels(model).inc(blocks.prompt_tokens)
        for scale, tokens in zip(FLEET_SCALES, found, strict=True):
            metrics.fleet_reuse_hit_tokens.labels(model, str(scale)).inc(tokens)

    def select(
        self,
        model: str,
        prompt_tokens: int,
        exclude: set[str],
        trace: RequestTrace = NO_TRACE,
        policy: Policy | None = None,
        blocks: PromptBlocks | None = None,
        affinity_key: str | None = None,
        only: frozenset[str] | None = None,
        adapter: str | None = None,
    ) -> tuple[str, BackendView, Policy]:
        """The policy's choice for `model` among backends not in `exclude` (records metrics
        and, when tracing, the decision on the request's span): its URL, its view and the
        policy that chose it. `policy` replaces the configured one (requests the gateway
        could not count). With `blocks`, each view carries what its backend is predicted to
        hold of the prompt (`PrefixTracker`). `only`: choose among these backends alone (those
        that serve the adapter or other name the request asked for). `adapter`: the LoRA
        adapter it names; backends where it would wait for a LoRA slot are left out while
        another eligible one can start it (`sal_core.lora_slots`)."""
        chosen = self._policy if policy is None else policy
        now_s = self._clock()
        views = _excluding(self._table.views(model, now_s), exclude, only)
        if adapter is not None and self._routing.lora_slots:
            views = self._by_lora_slots(model, adapter, views)
        if blocks is not None and self._prefix is not None:
            self._prefix.annotate(model, views, blocks)
        beta = self._betas[model].beta if model in self._betas else self._routing.beta_seed
        if affinity_key is None and blocks is not None and blocks.keys:
            affinity_key = str(blocks.keys[0])
        route = RouteRequest(prompt_tokens, beta, affinity_key)
        started = time.perf_counter()
        degraded = False
        try:
            try:
                decision = chosen.select(route, views)
            except NoEligibleBackend:
                # None eligible: the freshest-progressing backends, by fewest in flight.
                max_age_s = self._routing.degraded_max_progress_age_s
                if max_age_s <= 0:
                    raise
                views = _excluding(
                    self._table.degraded_views(model, now_s, max_age_s), exclude, only
                )
                chosen, degraded = self._degraded_policy, True
                decision = chosen.select(route, views)
        except NoEligibleBackend:
            raise self._none_available(model, only) from None
        finally:
            elapsed_s = time.perf_counter() - started
            if policy is None:
                self._decision_seconds.observe(elapsed_s)
            else:
                self._metrics.routing_decision_seconds.labels(policy=policy.name).observe(elapsed_s)
        self._metrics.series(model, decision.url, chosen.name).routing_decisions.inc()
        if blocks is not None and self._prefix is not None:
            self._metrics.prefix_lookup_tokens.labels(model, decision.url).inc(blocks.prompt_tokens)
            self._metrics.prefix_predicted_hit_tokens.labels(model, decision.url).inc(
                views[decision.index].cached_tokens
            )
        if degraded:
            self._metrics.degraded_routes.labels(model=model, backend=decision.url).inc()
            logger.warning(
                "no eligible backend for model %s: degraded routing to %s", model, decision.url
            )
        trace.routed(chosen.name, decision.url, decision.score)
        if logger.isEnabledFor(logging.DEBUG):
            view = views[decision.index]
            logger.debug(
                "route model=%s prompt_tokens=%d -> %s score=%.4g (free_kv=%d queued=%d "
                "in_flight=%d running=%d beta=%.3g cached=%d held=%d)",
                model,
                prompt_tokens,
                decision.url,
                decision.score,
                view.free_kv_tokens,
                view.queued_prefill_tokens,
                view.in_flight,
                view.num_running,
                beta,
                view.cached_tokens,
                view.cached_held_tokens,
            )
        return decision.url, views[decision.index], chosen

    def _by_lora_slots(
        self, model: str, adapter: str, views: list[BackendView]
    ) -> list[BackendView]:
        """`views` narrowed for `adapter` (`sal_core.lora_slots.lora_route`): to the backends
        that can start it now, when any can, and among those to the ones already running it
        unless their queues are more than a step longer; counts what decided it."""
        blocked, holders = self._table.lora_slots(model, adapter)
        if not blocked and not holders:
            return views
        narrowed, outcome = lora_route(views, blocked, holders)
        if outcome is not None:
            self._metrics.lora_slot_decisions.labels(model=model, outcome=outcome).inc()
        return narrowed

    async def forward(
        self,
        inbound: InboundRequest,
        raw_body: bytes,
        headers: Mapping[str, str],
        prompt_tokens: int,
        trace: RequestTrace = NO_TRACE,
        policy: Policy | None = None,
        blocks: PromptBlocks | None = None,
        affinity_key: str | None = None,
        only: frozenset[str] | None = None,
        adapter: str | None = None,
        listed: bool = True,
    ) -> Response:
        """Send `inbound` to the best backend (chosen by `policy`, default the configured
        one) and return the response to relay. `blocks` (the prompt's block keys) and
        `affinity_key` (a session header) inform cache-aware and affinity policies; the
        chosen backend's prefix entry holds `blocks` until the request ends. `only`: the
        backends that serve the name the request asked for (`inbound.served_model`: an
        adapter or other name besides the model's own), the others are never tried.
        `adapter`: the LoRA adapter it names (routed where a LoRA slot lets it start now,
        when one does). `listed` False: no backend lists the name yet (an adapter the
        replicas load on first use, ``resolvable_adapters``): the first backend's "does not
        exist" 404 is the answer (the others' resolvers would say the same; no flood of
        made-up names multiplies upstream), and the request gets no adapter series.

        Retries (at most ``routing.max_retries``, each on a backend not tried yet) only what
        cannot have generated anything and what the client has seen nothing of: connect
        failures, streams whose headers timed out, and streams whose backend failed after
        its headers but before any body byte (`_first_body`); a pooled connection the
        backend closed as the request went out is retried once more, on a new connection,
        without holding it against the backend. Each failed connection is
        closed first, so vLLM aborts what it had accepted. All attempts failed: 502, or 504
        when every one was a header timeout. A backend's vLLM "model does not exist" 404 for
        the adapter the request named moves it to another backend in `only` (no retry spent);
        when every backend in `only` said so, the client gets that 404 (503 while some could
        not be tried)."""
        model = inbound.model
        tried: set[str] = set()
        failures: list[_Retry] = []
        # Ask streams for usage (beta and token counters need it) without the client seeing it.
        ask = inbound.stream and inbound.ask_stream_usage
        injected = with_usage_requested(inbound.body, raw_body) if ask else None
        body = raw_body if injected is None else injected
        attempts = 0
        fresh = False  # the next attempt opens a connection of its own
        profiled = False  # the fleet-reuse estimate saw this request's prompt
        while attempts <= self._routing.max_retries:
            choose = functools.partial(
                self.select,
                model,
                prompt_tokens,
                tried,
                trace,
                policy,
                blocks,
                affinity_key,
                only,
                adapter,
            )
            try:
                try:
                    url, view, chooser = choose()
                except NoBackendAvailable as none:
                    url, view, chooser = await self._choose_after_catch_up(model, choose, none)
            except NoBackendAvailable:
                if not failures:
                    raise
                break
            if failures:  # this is a retry of what failed on the last backend tried
                self._metrics.retries.labels(model=model, backend=failures[-1].url).inc()
            # A cache-aware policy chose by the tokens the backend still has to prefill and
            # store: its books count the same until the engine's own numbers include the
            # request, as the simulator's do (the paper's Eq. 2 counts whole prompts).
            queued_tokens, kv_tokens = prompt_tokens, prompt_tokens
            if self._prefix is not None and chooser.name in PREFIX_AWARE_POLICIES:
                queued_tokens -= view.cached_tokens
                kv_tokens -= view.cached_held_tokens
            ticket = self._table.route(
                model,
                url,
                queued_tokens,
                kv_tokens=kv_tokens,
                streamed=inbound.stream,
                adapter=adapter,
            )
            if blocks is not None and self._prefix is not None:
                ticket.on_release = self._prefix.hold(model, url, blocks)
                if not profiled:  # once per request, not per retry
                    profiled = True
                    self._count_fleet_reuse(model, blocks)
            ex = Exchange(
                model,
                url,
                ticket,
                time.perf_counter(),
                prompt_tokens,
                injected is not None,
            )
            ex.span = trace.upstream(url, inbound.upstream_path)
            ex.adapter_label = adapter if listed else None
            ex.idle_s = self._proxy.stream_idle_timeout_s
            ex.fresh_connection = fresh
            ex.drain = self._drain
            if self._proxy.stream_idle_spares_live_engines:
                ex.live = functools.partial(self._is_live, model, url)
            try:
                return await self._attempt(ex, inbound, body, headers)
            except _Retry as failure:
                ex.span.end(None, failure.cause)
                StateTable.release(ex.ticket)
                failures.append(failure)
                if failure.not_served and not listed:
                    raise failure.cause from None  # no replica could load it
                if failure.not_served:  # another replica may still serve the adapter
                    tried.add(url)
                    fresh = False
                    continue
                if failure.blameless and not fresh:
                    # The backend closed an idle pooled connection as the request went out
                    # on it, or the connect timed out only because this process stalled:
                    # nothing reached its handler and it is not at fault. Once per request,
                    # choose again (it stays a candidate) on a new connection.
                    fresh = True
                    continue
                fresh = False
                self._table.mark_suspect(model, url)
                tried.add(url)
                attempts += 1
        reached = [f for f in failures if not f.not_served]
        if not reached:
            if only is not None and only <= tried:
                raise failures[-1].cause  # every replica that listed the name: not any more
            raise self._none_available(model, only)  # the others may serve it again soon
        attempted = len({f.url for f in reached})  # a blameless retry reuses its backend
        message = (
            f"could not reach a backend for model {model!r} after {attempted} attempt(s): "
            f"{reached[-1].cause}"
        )
        if all(f.header_timeout for f in reached):
            raise UpstreamTimeout(message)
        raise UpstreamError(message)

    def _none_available(self, model: str, only: frozenset[str] | None) -> NoBackendAvailable:
        """The 503 for `model` having no backend to route to, saying when some of its
        backends serve other models (a configuration error; their names are in the log,
        not told to clients), or when the request's adapter is served by `only` of them."""
        message = f"no eligible backend for model {model!r}"
        if only is not None:
            return NoBackendAvailable(
                f"{message} among the {len(only)} that serve the requested name"
            )
        elsewhere = len(self._table.serving_elsewhere(model))
        if elsewhere:
            total = len(self._table.backends(model))
            message += (
                f": {elsewhere} of its {total} backends do not serve it (their /v1/models "
                "lists other models; see the gateway's log)"
            )
        return NoBackendAvailable(message)

    async def _choose_after_catch_up(
        self,
        model: str,
        choose: Callable[[], tuple[str, BackendView, Policy]],
        none: NoBackendAvailable,
    ) -> tuple[str, BackendView, Policy]:
        """`choose()` found no backend. If that may be because pollers have not been running
        (`poller.pollers_behind`: the gateway's own process was not scheduled, as in a
        CPU-throttled container or a paused VM, and a backend only *looks* stale), wait
        at most one poll round (``routing.poll_interval_s + poll_timeout_s``) for their next
        outcomes and choose again after each; a request that arrived during the stall is
        then served instead of getting a 503. Otherwise, or if still none, raise `none`
        (what `choose()` raised)."""
        round_s = self._routing.poll_interval_s + self._routing.poll_timeout_s
        started_s = self._clock()
        seen_s = self._table.last_outcome_s(model)
        behind = pollers_behind(self._table.backends(model), started_s, self._routing)
        if seen_s is None or not behind:
            raise none
        logger.warning(
            "polls of model %s are overdue (the gateway was not scheduled?): "
            "waiting up to %.1f s for the pollers",
            model,
            round_s,
        )
        while self._clock() - started_s < round_s:
            await asyncio.sleep(min(self._routing.poll_interval_s, 0.05))
            latest_s = self._table.last_outcome_s(model)
            if latest_s is not None and latest_s > seen_s:
                seen_s = latest_s
                with contextlib.suppress(NoBackendAvailable):
                    return choose()
        raise none

    async def _post_watched(
        self, url: str, body: bytes, headers: Mapping[str, str], ex: Exchange
    ) -> aiohttp.ClientResponse:
        """A non-streamed exchange: its headers come when generation ends, so it is bounded
        by the total timeout, except that a replica which stops being alive meanwhile
        (`ex.live`, judged after `ex.idle_s` and every second after) is given up on: the
        connection is closed (vLLM aborts the request when it resumes) and `_ReplicaStalled`
        raised, which `forward` retries elsewhere."""
        post = self._session_for(ex).post(
            url,
            data=body,
            headers=headers,
            timeout=self._total_timeout,
            trace_request_ctx=ex.connection,
        )
        if ex.live is None:
            return await post
        task = asyncio.ensure_future(post)
        loop = asyncio.get_running_loop()

        def give_up() -> None:
            task.cancel()  # closes the connection: vLLM aborts the request

        watch = IdleWatch(loop, ex.idle_s, ex.live, give_up)
        watch.start()
        try:
            return await task
        except asyncio.CancelledError:
            if watch.fired and not _being_cancelled():
                raise _ReplicaStalled from None
            raise
        finally:
            watch.stop()

    def _session_for(self, ex: Exchange) -> aiohttp.ClientSession:
        """The pooled session, or for `ex.fresh_connection` one that opens a new connection."""
        if not ex.fresh_connection:
            return self._session
        if self._fresh is None:
            self._fresh = make_session(self._proxy, fresh=True)
        return self._fresh

    async def aclose(self) -> None:
        """Close the connections the forwarder opened itself (not the pooled session's)."""
        if self._fresh is not None:
            await self._fresh.close()
            self._fresh = None

    def _is_live(self, model: str, url: str) -> bool:
        return self._table.is_live(model, url, self._clock())

    async def _attempt(
        self, ex: Exchange, inbound: InboundRequest, body: bytes, headers: Mapping[str, str]
    ) -> Response:
        """One exchange with `ex.backend`: the client's response, or `_Retry` (the ticket is
        then the caller's to release; every other path settles it)."""
        url = ex.backend
        try:
            resp = await self._open(
                url + inbound.upstream_path, body, ex.span.inject(headers), inbound.stream, ex
            )
        except RETRYABLE as exc:
            if is_stale_connection(exc, ex.connection):
                logger.warning(
                    "%s closed a pooled connection as a request went out on it (%s): "
                    "retrying on a new connection",
                    url,
                    type(exc).__name__,
                )
                raise _Retry(url, exc, blameless=True) from None
            now_s = asyncio.get_running_loop().time()
            timeout_s = self._proxy.connect_timeout_s
            if connect_held_up_by_stall(exc, ex.connection, timeout_s, now_s):
                logger.warning(
                    "connect to %s timed out only because the gateway's process was stalled "
                    "(the %s s bound fired %.1f s after the connect began): retrying it on a "
                    "new connection",
                    url,
                    timeout_s,
                    now_s - (ex.connection.connect_started_s or now_s),
                )
                raise _Retry(url, exc, blameless=True) from None
            logger.warning("connect to %s failed: %s: %s", url, type(exc).__name__, exc)
            raise _Retry(url, exc) from None
        except _ReplicaStalled:
            self.accounting.count_timeout(ex, "idle")
            logger.warning(
                "%s stopped progressing while a non-streamed request waited there for %s s: "
                "closed, retrying elsewhere",
                url,
                self._proxy.stream_idle_timeout_s,
            )
            cause = UpstreamTimeout(f"{url} stopped progressing while the request waited")
            raise _Retry(url, cause) from None
        except _HeaderTimeout as exc:
            self.accounting.count_timeout(ex, "header")
            logger.warning("%s: %s", url, exc)
            raise _Retry(url, exc, header_timeout=True) from None
        except GatewayError as exc:
            StateTable.release(ex.ticket)
            exc.backend = url
            if isinstance(exc, UpstreamTimeout):
                self.accounting.upstream_cancelled(ex, "total_timeout")
            ex.span.end(None, exc)
            raise
        except BaseException:  # cancelled: the client went away while we waited
            StateTable.release(ex.ticket)
            self.accounting.upstream_cancelled(ex, "client_disconnect")
            self._metrics.requests.labels(model=ex.model, backend=url, status="499").inc()
            self._metrics.count_adapter_request(ex.model, ex.adapter_label, 499)
            ex.span.end(None)
            raise
        read = b""
        if resp.status == 404 and inbound.served_model is not None:
            read = await self._read_404(ex, inbound.served_model, resp)
        head = Head()
        if inbound.stream and is_event_stream(resp):
            ex.headers_at_s = asyncio.get_running_loop().time()
            head = await self._first_body(ex, resp)
        return await relay_answer(self.accounting, ex, resp, inbound.stream, head, read)

    async def _first_body(self, ex: Exchange, resp: aiohttp.ClientResponse) -> Head:
        """Wait (at most ``proxy.first_byte_hold_s``) for a 200 stream's first content
        before the client's headers go out, so that a backend that fails before sending any
        can still be replaced: the connection reset or closed, or the stream ended without
        content, raises `_Retry` (connection closed, counted). SSE comments (vLLM's
        keep-alive while the request waits) are not content: they are kept and the wait goes
        on. The hold expiring, or the idle or total bound, leaves it to the relay (headers,
        what was read, then what the relay does)."""
        # Never past the idle bound: a frozen replica's stream gets its error event as soon.
        hold_s = min(self._proxy.first_byte_hold_s, self._proxy.stream_idle_timeout_s)
        if hold_s <= 0:
            return Head()
        bound = asyncio.timeout(hold_s)
        read = b""
        try:
            async with bound:  # readany is cancellation-safe: nothing read is lost
                while chunk := await resp.content.readany():
                    read += chunk
                    if not comments_only(read):
                        break
        except TimeoutError as exc:  # the hold (relay as usual), or the idle/total bound
            return Head(read) if bound.expired() else Head(read, error=exc)
        except aiohttp.ClientError as exc:  # reset, or closed in the middle of the body
            resp.close()
            self._count_first_byte_failure(ex, "closed")
            raise _Retry(ex.backend, exc) from None
        except BaseException:  # cancelled: the client went away while we waited
            resp.close()
            self.accounting.upstream_cancelled(ex, "client_disconnect")
            self.accounting.finish(ex, 499, None)
            raise
        if comments_only(read):  # a clean end without content (nothing, or comments only)
            resp.close()
            self._count_first_byte_failure(ex, "empty")
            raise _Retry(ex.backend, UpstreamError("the stream ended without content"))
        return Head(read)

    async def _read_404(self, ex: Exchange, name: str, resp: aiohttp.ClientResponse) -> bytes:
        """`ex.backend` answered 404 to a request for the served name `name`: read the
        answer (at most `NOT_FOUND_READ_BYTES`, within the request's bounds). vLLM's "The
        model ... does not exist" (`says_model_missing`) means nothing ran there: tell the
        catalog and raise `_Retry` (`not_served`), so the request goes to another replica
        serving it. Any other 404 (a stored response another replica holds, a route this
        vLLM lacks) is returned, to be relayed as it is."""
        read = b""
        try:
            while len(read) <= NOT_FOUND_READ_BYTES and (chunk := await resp.content.readany()):
                read += chunk
        except (aiohttp.ClientError, TimeoutError):
            return read  # the relay reads on and reports the failure
        except BaseException:  # cancelled: the client went away
            resp.close()
            self.accounting.upstream_cancelled(ex, "client_disconnect")
            self.accounting.finish(ex, 499, None)
            raise
        if not says_model_missing(read):
            return read
        resp.close()
        # A replica that never listed the name (one that could not load a resolvable
        # adapter another replica has loaded) is no news worth a warning.
        if self._on_not_served is not None and self._on_not_served(ex.model, ex.backend, name):
            logger.warning(
                "%s answered 404 for %r, which its last /v1/models listed: it no longer "
                "serves it (unloaded, or restarted without it); trying another replica",
                ex.backend,
                name,
            )
        cause = ModelNotFound(f"The model `{name}` does not exist.", param="model")
        raise _Retry(ex.backend, cause, not_served=True)

    def _count_first_byte_failure(self, ex: Exchange, reason: str) -> None:
        self._metrics.first_byte_failures.labels(ex.model, ex.backend, reason).inc()
        logger.warning(
            "stream from %s failed before its first byte (%s): retrying elsewhere",
            ex.backend,
            reason,
        )

    async def _open(
        self, url: str, body: bytes, headers: Mapping[str, str], stream: bool, ex: Exchange
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers; raises what `forward` sorts out."""
        try:
            if not stream:
                return await self._post_watched(url, body, headers, ex)
            # Leaving this block by timeout cancels the request: aiohttp closes its connection.
            async with stall_tolerant_timeout(self._proxy.stream_header_timeout_s):
                return await self._session_for(ex).post(
                    url,
                    data=body,
                    headers=headers,
                    timeout=self._stream_timeout,
                    trace_request_ctx=ex.connection,
                )
        except RETRYABLE:
            raise
        except TimeoutError:
            if stream:  # the header bound, or the idle bound if that one is shorter
                bound = min(self._proxy.stream_header_timeout_s, self._proxy.stream_idle_timeout_s)
                raise _HeaderTimeout(f"stream headers not received within {bound} s") from None
            raise UpstreamTimeout(
                f"backend did not answer within {self._proxy.total_timeout_s} s "
                f"(proxy.total_timeout_s)"
            ) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"backend request failed: {type(exc).__name__}: {exc}") from None
