"""The gateway's Prometheus metrics (names fixed by the cross-team contract, ``sal_`` prefix).

One `GatewayMetrics` per app, built in the lifespan on its own `CollectorRegistry` (no global
registry, so several apps or tests never collide). Counters and histograms are updated on the
request path; per-backend gauges are refreshed from the state table at scrape time
(`refresh()`), so they always describe the current pool. Every other series labelled with a
backend that left the pool is dropped too (`forget_backend()` when discovery removes it, and a
sweep at each scrape), so nothing grows with backend churn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from sal_gateway.state import SOURCES, StateTable

_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
_DECISION_BUCKETS_S = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)
_POLL_INTERVAL_BUCKETS_S = (0.05, 0.08, 0.09, 0.1, 0.11, 0.12, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_MB = ("model", "backend")
_LOOP_LAG_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
REJECT_REASONS = (
    "unauthorized",
    "over_limit",
    "body_timeout",
    "header_timeout",
    "template",
    "invalid_http",
)
"""Values of ``sal_rejected_requests_total{reason}``."""


@dataclass(frozen=True, slots=True)
class BackendSeries:
    """Pre-bound children of the per-request series of one (model, backend, policy): the
    request path touches these for every request, and `labels()` costs more than the update."""

    ttft: Histogram
    generation: Histogram
    ok_requests: Counter
    """``sal_requests_total{status="200"}``."""
    routing_decisions: Counter


class GatewayMetrics:
    """Every metric the gateway exports, on one private registry."""

    def __init__(self, version: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sal_requests", "Requests answered, by HTTP status", [*_MB, "status"], registry=r
        )
        self.ttft = Histogram(
            "sal_ttft_seconds",
            "Time to first content chunk (streaming) or to the response (non-streaming)",
            _MB,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.generation = Histogram(
            "sal_generation_seconds",
            "Total generation time",
            _MB,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sal_prompt_tokens", "Prompt tokens routed", ["model"], registry=r
        )
        self.output_tokens = Counter(
            "sal_output_tokens",
            "Output tokens reported by backends in usage",
            ["model"],
            registry=r,
        )
        self.prompt_tokens_estimated = Counter(
            "sal_prompt_tokens_estimated",
            "Requests whose prompt tokens were estimated (no tokenizer configured)",
            ["model"],
            registry=r,
        )
        self.routing_decisions = Counter(
            "sal_routing_decisions", "Routing decisions", [*_MB, "policy"], registry=r
        )
        self.routing_decision_seconds = Histogram(
            "sal_routing_decision_seconds",
            "Time to take one routing decision",
            ["policy"],
            buckets=_DECISION_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "sal_retries",
            "Attempts that failed before the client saw anything (connect failure, stream "
            "header timeout, a stream failing before its first byte, a 404 for an adapter the "
            "backend no longer serves), retried elsewhere",
            _MB,
            registry=r,
        )
        self.lora_slot_decisions = Counter(
            "sal_lora_slot_decisions",
            "LoRA adapter requests whose route the replicas' LoRA slots (--max-loras) decided: "
            "affinity (sent where the adapter already runs, past replicas with a free slot), "
            "steered (sent past replicas whose slots other adapters held) or no_free_slot "
            "(every candidate's slots were held: the request waits for one wherever it goes; "
            "sent where the fewest requests are in flight)",
            ["model", "outcome"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "sal_adapter_requests",
            "Requests for a LoRA adapter (a name the replicas list with a parent model), by "
            "HTTP status; also counted under their model in sal_requests_total",
            ["model", "adapter", "status"],
            registry=r,
        )
        self.adapter_ttft = Histogram(
            "sal_adapter_ttft_seconds",
            "Time to first content chunk of a LoRA adapter's requests (as sal_ttft_seconds)",
            ["model", "adapter"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.adapter_output_tokens = Counter(
            "sal_adapter_output_tokens",
            "Completion tokens of a LoRA adapter's answered requests (from usage)",
            ["model", "adapter"],
            registry=r,
        )
        self.stream_errors = Counter(
            "sal_stream_errors", "Upstream failures after the first byte", _MB, registry=r
        )
        self.ejections = Counter(
            "sal_backend_ejections", "Backends ejected after failed polls", _MB, registry=r
        )
        self.healthy = Gauge("sal_backend_healthy", "1 if eligible for routing", _MB, registry=r)
        self.serves_model = Gauge(
            "sal_backend_serves_model",
            "0 if the backend's /v1/models lists other models only (it gets no requests)",
            _MB,
            registry=r,
        )
        self.free_kv = Gauge(
            "sal_backend_free_kv_tokens",
            "Free KV tokens (with local accounting)",
            _MB,
            registry=r,
        )
        self.queued = Gauge(
            "sal_backend_queued_prefill_tokens",
            "Queued prefill tokens (local accounting; floor: our streams awaiting a first byte)",
            _MB,
            registry=r,
        )
        self.waiting = Gauge(
            "sal_backend_num_waiting", "Waiting requests (last poll)", _MB, registry=r
        )
        self.running = Gauge(
            "sal_backend_num_running", "Running requests (last poll)", _MB, registry=r
        )
        self.in_flight = Gauge(
            "sal_backend_in_flight", "Gateway requests in flight", _MB, registry=r
        )
        self.lora_slots = Gauge(
            "sal_backend_lora_slots",
            "LoRA adapters one batch may hold (--max-loras; only replicas that report it)",
            _MB,
            registry=r,
        )
        self.lora_slots_used = Gauge(
            "sal_backend_lora_slots_used",
            "LoRA slots held: adapters running at the last poll plus those routed since",
            _MB,
            registry=r,
        )
        self.state_age = Gauge(
            "sal_backend_state_age_seconds",
            "Age of the last good poll (+Inf: never)",
            _MB,
            registry=r,
        )
        self.stats_source = Gauge(
            "sal_backend_stats_source",
            "1 for the state source in use",
            [*_MB, "source"],
            registry=r,
        )
        self.beta = Gauge("sal_beta", "SAL's current beta", ["model"], registry=r)
        self.build_info = Gauge("sal_build_info", "Gateway build", ["version"], registry=r)
        self.build_info.labels(version=version).set(1)
        self._series: dict[tuple[str, str, str], BackendSeries] = {}
        # --- A (issue 8): the front door: loop health, process, rejections -------------
        self.loop_lag = Histogram(
            "sal_event_loop_lag_seconds",
            "How late the event loop woke a periodic ~50 ms sleep (time it was blocked)",
            buckets=_LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self.loop_tasks = Gauge("sal_event_loop_tasks", "asyncio tasks alive", registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, ...
        self.rejected = Counter(
            "sal_rejected_requests",
            "Requests refused before routing, by reason",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        # --- end A ---------------------------------------------------------------------
        # --- B: poll health and engine liveness -------------------------------------------
        self.poll_errors = Counter(
            "sal_poll_errors",
            "Failed polls by reason (timeout, connect, http_status, bad_body, schema, "
            "no_progress, internal)",
            [*_MB, "reason"],
            registry=r,
        )
        self.progress_age = Gauge(
            "sal_backend_progress_age_seconds",
            "Gateway-clock seconds since the engine last showed progress (+Inf: never)",
            _MB,
            registry=r,
        )
        self.poll_interval = Histogram(
            "sal_poll_interval_seconds",
            "Time between the starts of two consecutive polls of one backend",
            ["model"],
            buckets=_POLL_INTERVAL_BUCKETS_S,
            registry=r,
        )
        # --- end B ------------------------------------------------------------------------
        # --- C: upstream timeouts (issue 8) ---------------------------------------------
        self.stream_timeouts = Counter(
            "sal_stream_timeouts",
            "Streams cut by a timeout: kind=header (no headers in time; retried elsewhere) "
            "or idle (no byte in time after the headers; ended with an SSE error event)",
            [*_MB, "kind"],
            registry=r,
        )
        self.upstream_cancels = Counter(
            "sal_upstream_cancels",
            "Upstream connections the gateway closed on an unfinished exchange (vLLM aborts "
            "the request), by reason: client_disconnect, header_timeout, idle_timeout, "
            "total_timeout, aborted, shutdown",
            [*_MB, "reason"],
            registry=r,
        )
        # --- end C ---------------------------------------------------------------------
        # --- D: streams re-routed before their first byte (issue 8) ---------------------
        self.first_byte_failures = Counter(
            "sal_first_byte_failures",
            "Streams whose backend failed after its headers but before any body byte, while "
            "the client had seen nothing (retried elsewhere, sal_retries_total), by reason: "
            "closed (connection reset or closed) or empty (ended without content)",
            [*_MB, "reason"],
            registry=r,
        )
        # --- end D ---------------------------------------------------------------------
        self.degraded_routes = Counter(
            "sal_degraded_routes",
            "Requests routed while no backend was eligible, to a backend whose engine "
            "progressed recently (routing.degraded_max_progress_age_s) instead of a 503",
            _MB,
            registry=r,
        )
        # --- prefix cache (issue 9; `prefix_cache`, `kv_events`) ---------------------------
        self.prefix_lookup_tokens = Counter(
            "sal_prefix_lookup_prompt_tokens",
            "Prompt tokens of requests routed with a prefix-cache prediction "
            "(routing.prefix_cache), by the backend chosen",
            _MB,
            registry=r,
        )
        self.prefix_predicted_hit_tokens = Counter(
            "sal_prefix_predicted_hit_tokens",
            "Of those, the leading tokens the gateway predicted the chosen backend to hold in "
            "its prefix cache (predicted hit rate: this / sal_prefix_lookup_prompt_tokens)",
            _MB,
            registry=r,
        )
        self.prefix_engine_query_tokens = Counter(
            "sal_prefix_engine_query_tokens",
            "Prompt tokens the backend's engine looked up in its prefix cache, from its "
            "/stats (vLLM's prefix_cache_queries; every client of the engine)",
            _MB,
            registry=r,
        )
        self.prefix_engine_hit_tokens = Counter(
            "sal_prefix_engine_hit_tokens",
            "Of those, the tokens the engine found cached (achieved hit rate: this / "
            "sal_prefix_engine_query_tokens)",
            _MB,
            registry=r,
        )
        self.fleet_reuse_prompt_tokens = Counter(
            "sal_prefix_fleet_reuse_prompt_tokens",
            "Prompt tokens of routed requests that the fleet-reuse estimate saw (once per "
            "request; counted while some tracked backend has reported its KV capacity)",
            ["model"],
            registry=r,
        )
        self.fleet_reuse_hit_tokens = Counter(
            "sal_prefix_fleet_reuse_hit_tokens",
            "Of those, the tokens one LRU cache of kv_scale times the tracked fleet's KV "
            "would have held (estimated from a sample of blocks): what routing could keep "
            "with this fleet's memory (kv_scale 1) and what more KV would add (2, 4)",
            ["model", "kv_scale"],
            registry=r,
        )
        self.prefix_share_messages = Counter(
            "sal_prefix_share_messages",
            "Prompt-block messages between the workers of one host (listen.share_prefix_index), "
            "by outcome: sent, dropped (the receiving worker had no room or was not up), "
            "received, garbled",
            ["outcome"],
            registry=r,
        )
        self.prefix_told_holds = Gauge(
            "sal_prefix_told_holds",
            "Requests of other workers of this host (listen.share_prefix_index) or of other "
            "gateways (peers.share_prefix_blocks) whose prompt blocks this process's prefix "
            "index holds, not ended as far as they told, by source: workers, peers",
            ["source"],
            registry=r,
        )
        self.fleet_reuse_kv_blocks = Gauge(
            "sal_prefix_fleet_reuse_kv_blocks",
            "The tracked fleet's KV in blocks (every backend with prefix caching on, summed): "
            "what kv_scale 1 of sal_prefix_fleet_reuse_hit_tokens stands for",
            ["model"],
            registry=r,
        )
        self.prefix_index_blocks = Gauge(
            "sal_prefix_index_blocks",
            "KV blocks the gateway's prefix index holds for the backend (at its last poll)",
            _MB,
            registry=r,
        )
        self.kv_events = Counter(
            "sal_kv_events",
            "vLLM KV-cache events applied to the prefix index (routing.prefix_cache: "
            "kv_events), by kind: stored_blocks, removed_blocks, cleared; replayed_messages "
            "(messages a replay carried)",
            [*_MB, "kind"],
            registry=r,
        )
        self.kv_events_dropped = Counter(
            "sal_kv_events_dropped",
            "KV-cache event messages or events dropped, by reason (garbled, oversized, gap, "
            "unknown_parent, foreign: another block size, medium, group, LoRA or extra keys; "
            "backlog: the gateway's loop fell behind; replay_timeout: a replay abandoned)",
            [*_MB, "reason"],
            registry=r,
        )

        self.peer_datagrams = Counter(
            "sal_peer_datagrams",
            "Datagrams received from other gateways (peers), by result: accepted; old (a "
            "newer one had set its counts, or a newer blocks datagram came first); own (sent "
            "by this gateway); bad_tag (not sent with the shared secret, or changed); "
            "malformed; too_many_peers; blocks (prompt blocks indexed, "
            "peers.share_prefix_blocks); blocks_ignored (prompt blocks for a backend this "
            "gateway does not track, or with sharing off here)",
            ["result"],
            registry=r,
        )
        self.peer_datagrams_sent = Counter(
            "sal_peer_datagrams_sent", "Datagrams sent to other gateways (peers)", registry=r
        )
        self.peer_send_errors = Counter(
            "sal_peer_send_errors", "Datagrams to peers the system refused to send", registry=r
        )
        self.peers_heard = Gauge(
            "sal_peers_heard", "Other gateways heard within peers.expire_s", registry=r
        )

    def count_adapter_request(self, model: str, adapter: str | None, status: int) -> None:
        """One request for `adapter` (None: not an adapter's, nothing counted) ended with
        `status`. Adapter names come from the replicas' ``/v1/models`` only (a name no
        replica lists is a 404 before any label is made), so clients cannot mint series."""
        if adapter is not None:
            self.adapter_requests.labels(model, adapter, str(status)).inc()

    def on_peer_sent(self, sent: int, errors: int) -> None:
        """`sal_gateway.peers.PeerNetwork`'s send report."""
        if sent:
            self.peer_datagrams_sent.inc(sent)
        if errors:
            self.peer_send_errors.inc(errors)

    def series(self, model: str, backend: str, policy: str) -> BackendSeries:
        """The cached per-request children for (model, backend, policy)."""
        key = (model, backend, policy)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = BackendSeries(
                ttft=self.ttft.labels(model, backend),
                generation=self.generation.labels(model, backend),
                ok_requests=self.requests.labels(model, backend, "200"),
                routing_decisions=self.routing_decisions.labels(model, backend, policy),
            )
        return found

    def refresh(self, table: StateTable, now_s: float, betas: dict[str, float]) -> None:
        """Rewrite the per-backend gauges from the state table (called once per scrape)."""
        gauges = (
            self.healthy,
            self.serves_model,
            self.free_kv,
            self.queued,
            self.waiting,
            self.running,
            self.in_flight,
            self.lora_slots,
            self.lora_slots_used,
            self.state_age,
            self.stats_source,
            self.progress_age,
        )
        for gauge in gauges:
            gauge.clear()
        for model in table.models():
            for b in table.backends(model):
                labels = {"model": model, "backend": b.url}
                eligible = b.is_eligible(now_s, table.stale_after_s)
                self.healthy.labels(**labels).set(1 if eligible else 0)
                self.serves_model.labels(**labels).set(1 if b.serves_other is None else 0)
                self.free_kv.labels(**labels).set(b.free_kv_tokens())
                self.queued.labels(**labels).set(b.queued_prefill_tokens())
                self.waiting.labels(**labels).set(b.stats.num_waiting if b.stats else 0)
                self.running.labels(**labels).set(b.stats.num_running if b.stats else 0)
                self.in_flight.labels(**labels).set(b.in_flight)
                occupied = b.lora_occupied()
                if occupied is not None and b.stats is not None:
                    self.lora_slots.labels(**labels).set(b.stats.max_loras)
                    self.lora_slots_used.labels(**labels).set(len(occupied))
                age = b.age_s(now_s)
                self.state_age.labels(**labels).set(float("inf") if age is None else age)
                progress = b.progress_age_s(now_s)
                self.progress_age.labels(**labels).set(
                    float("inf") if progress is None else progress
                )
                for source in SOURCES:
                    self.stats_source.labels(**labels, source=source).set(
                        1 if source == b.source else 0
                    )
        for model, beta in betas.items():
            self.beta.labels(model=model).set(beta)
        self._prune({(m, b.url) for m in table.models() for b in table.backends(m)})

    # --- hygiene: series of removed backends disappear ------------------------------------

    def _backend_families(self) -> list[tuple[MetricWrapperBase, int, int]]:
        """Every family with ``model`` and ``backend`` labels, with their label positions.

        Found by inspection, so families added later in ``__init__`` are covered too.
        ``_labelnames`` / ``_metrics`` / ``_lock`` are prometheus_client internals (stable
        since 0.4); `tests/unit/test_gw_metrics.py` pins what is relied on."""
        found = []
        for value in vars(self).values():
            if isinstance(value, MetricWrapperBase):
                names = list(value._labelnames)
                if "model" in names and "backend" in names:
                    found.append((value, names.index("model"), names.index("backend")))
        return found

    def _remove_children(self, doomed: Callable[[str, str], bool]) -> None:
        for family, model_at, backend_at in self._backend_families():
            with family._lock:
                keys = [k for k in family._metrics if doomed(k[model_at], k[backend_at])]
            for key in keys:
                with contextlib.suppress(KeyError):
                    family.remove(*key)
        for key in [k for k in self._series if doomed(k[0], k[1])]:
            del self._series[key]

    def forget_backend(self, model: str, backend: str) -> None:
        """Drop every series of `backend` (called when discovery removes it)."""
        self._remove_children(lambda m, b: m == model and b == backend)

    def _prune(self, live: set[tuple[str, str]]) -> None:
        # Requests still in flight on a removed backend can recreate its series after
        # `forget_backend`; each scrape sweeps them again, so none outlives one scrape
        # period. ``backend="none"`` labels requests that never reached a backend.
        self._remove_children(lambda m, b: b != "none" and (m, b) not in live)

    def exposition(self) -> bytes:
        """The text exposition format served on ``GET /metrics``."""
        return generate_latest(self.registry)
