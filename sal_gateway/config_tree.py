"""The gateway's typed configuration tree: one frozen dataclass per ``config.yaml`` section,
each field with its default and a docstring saying what it does.

`GatewayConfig` is the root. `sal_gateway.config` builds it from YAML (`load_config`,
`build_config`) and re-exports every name here; the rest of the gateway (app, proxy, poller,
peers, workers, tracing, auth, cli) only reads these objects. Validation is not here: the
section parsers are `sal_gateway.config_sections`, the scalar checks `sal_gateway.config_values`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sal_core.policies import DEFAULT_MIN_MATCH_TOKENS
from sal_gateway.config_values import _join_host_port, split_host_port

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""Accepted ``log_level`` values (`GatewayConfig.log_level`)."""


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """Where the gateway's HTTP server binds."""

    host: str = "127.0.0.1"
    """Interface address to bind."""
    port: int = 8080
    """TCP port (0 picks a free one)."""
    keep_alive_s: float = 75.0
    """Seconds an idle client connection is kept open. Longer than the usual client pool
    expiry (httpx and the OpenAI SDK: 5 s), so the server never closes a connection just as a
    client reuses it (which the client sees as a read error on its next request)."""
    header_timeout_s: float = 10.0
    """A connection must deliver a request's complete headers within this many seconds of
    opening (or of the request's first byte); else it is closed (slow-header clients)."""
    body_timeout_s: float = 30.0
    """A request body must arrive completely within this many seconds of its headers; else
    408 and the connection is closed (slow-body clients)."""
    shutdown_delay_s: float = 0.0
    """After SIGTERM, keep accepting and serving this long while ``/ready`` answers 503
    (``draining``), so a load balancer or Kubernetes Service stops sending first (their
    endpoint updates lag the signal by seconds). See `sal_gateway.drain`."""
    shutdown_grace_s: float = 30.0
    """Then stop accepting and let requests in flight finish for at most this long; a stream
    still open after it ends with an SSE error event (503 ``gateway_shutdown``), a request
    not answered yet gets that 503; vLLM aborts both."""
    workers: int = 1
    """Gateway processes sharing `port` (``SO_REUSEPORT``: the kernel spreads connections
    over them), so one host's cores can all serve. Each is a whole gateway: its own pollers,
    between-poll accounting and metrics (`sal_gateway.workers`)."""
    worker_ports_from: int | None = None
    """With `workers` > 1, worker i also listens alone on this port + i (the whole API;
    scrape each worker's ``/metrics`` there). None: `port` + 1 (any free ports when `port`
    is 0)."""
    share_accounting: bool = True
    """With `workers` > 1, the workers share their between-poll accounting and in-flight
    counts through shared memory (`sal_gateway.shared_accounting`), so they route as one
    gateway; False: each decides on its own counts only (they herd)."""
    share_prefix_index: bool = True
    """With `workers` > 1 and ``routing.prefix_cache: approximate``, each worker tells the
    others the prompt blocks it routes (`sal_gateway.prefix_share`), so a conversation's next
    turn finds its prefix whichever worker its connection reached; False: each worker knows
    only the blocks it routed itself."""

    def worker_ports(self) -> tuple[int, ...]:
        """Each worker's own port (0: any free one); empty with one worker."""
        if self.workers <= 1:
            return ()
        first = self.worker_ports_from
        if first is None:
            first = 0 if self.port == 0 else self.port + 1
        if first == 0:
            return (0,) * self.workers
        return tuple(first + i for i in range(self.workers))


MAX_WORKERS = 256
"""Most gateway processes on one host (`ListenConfig.workers`)."""


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """DNS-based backend discovery (e.g. a Kubernetes headless service)."""

    dns_name: str
    """Name resolved every `interval_s`; each address becomes one backend."""
    port: int = 8000
    """Backend port appended to each address."""
    scheme: str = "http"
    """``http`` or ``https``."""
    interval_s: float = 10.0
    """Seconds between resolutions."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One served model and its pool of backends."""

    name: str
    """Served model name, matched against the request's ``model`` field."""
    tokenizer: str | None = None
    """Local tokenizer directory or Hugging Face repo id found in the local cache (offline).
    None: prompt tokens are estimated (see docs/gateway.md) and flagged in metrics."""
    max_model_len: int | None = None
    """Context length; None: the tokenizer's ``model_max_length`` when sane, else unchecked."""
    backends: tuple[str, ...] = ()
    """Static backend base URLs (``http://host:port``)."""
    discovery: DiscoveryConfig | None = None
    """Optional DNS discovery; its backends are added to the static ones."""
    fallback_max_num_batched_tokens: int = 2048
    """Per-step token budget assumed for backends without ``/stats`` (stock vLLM's
    ``/metrics`` does not expose it)."""
    trust_request_chat_template: bool = False
    """Accept a request-supplied ``chat_template`` (like vLLM's
    ``--trust-request-chat-template``); rendered in a killable worker process within
    ``limits.template_timeout_s``. False: such requests get a 400."""
    # --- E: API surface ---
    runner: str = "generate"
    """What the replicas run (vLLM's ``--runner``): ``generate`` (completions, chat,
    responses, ...) or ``pooling`` (embeddings, pooling, classify, score, rerank). The
    gateway sends each endpoint only to models whose runner serves it (`endpoints`)."""
    models_refresh_s: float = 15.0
    """How often each backend's ``/v1/models`` is read for the gateway's own ``/v1/models``
    (the union of what the replicas serve, never an upstream call per client request)."""
    resolvable_adapters: tuple[str, ...] = ()
    """Glob patterns (``fnmatch``, case-sensitive; ``*`` for any) of LoRA adapter names this
    model's replicas load on first use (vLLM's LoRA resolver plugins, with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). A request naming one that no replica lists
    may go to any of the model's replicas, which loads it; empty: a name no replica lists is
    a 404. Names with ``..``, a leading ``/``, a backslash, whitespace or control
    characters never match (`model_catalog.resolvable_owner`)."""
    kv_events_endpoints: tuple[tuple[str, str], ...] = ()
    """``routing.prefix_cache: kv_events`` only: each backend URL's ZMQ endpoint of vLLM's
    KV-cache event publisher (its ``--kv-events-config`` ``endpoint``, as seen from the
    gateway), e.g. ``{"http://10.0.0.5:8000": "tcp://10.0.0.5:5557"}``. Backends not listed
    use ``tcp://<backend host>:<routing.kv_events_port>``."""
    kv_events_replay_endpoints: tuple[tuple[str, str], ...] = ()
    """``kv_events`` only: each backend URL's ZMQ endpoint of its publisher's replay socket
    (its ``--kv-events-config`` ``replay_endpoint``, as seen from the gateway). Backends not
    listed use ``tcp://<backend host>:<routing.kv_events_replay_port>`` when that is set,
    else no replay."""


RUNNERS = ("generate", "pooling")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Backend selection and state polling."""

    policy: str = "sal"
    """A name in `sal_core.policies.POLICIES`."""
    poll_interval_s: float = 0.1
    """Seconds between two polls of one backend's ``/stats`` (jittered by +-10%)."""
    poll_timeout_s: float = 0.5
    """Timeout of one poll."""
    stale_after_s: float = 1.0
    """State older than this is unknown: the backend is not eligible until polled again."""
    eject_after_failures: int = 3
    """Consecutive failed polls that eject a backend; one good poll re-admits it."""
    beta_seed: float = 2.0
    """SAL's beta before any request finished (>= 1)."""
    seed: int | None = None
    """RNG seed of the ``random`` and ``p2c`` policies (None: nondeterministic)."""
    max_retries: int = 2
    """Retries on another backend after a connect failure before the first byte."""
    poll_backoff_max_s: float = 2.0
    """Longest wait between two polls of a failing backend: after a failed poll the next
    comes after ``poll_interval_s * 2**(failures)``, jittered, capped at this."""
    degraded_max_progress_age_s: float = 10.0
    """When no backend is eligible, route anyway (by fewest in-flight requests) to the
    backends whose engine showed progress within this many seconds and not more than
    ``stale_after_s`` later than the freshest one, or whose content reached the gateway
    within ``stale_after_s`` (ejected or not: it serves), instead of answering 503: a busy
    host can make every backend look a little stale at once. Counted in
    ``sal_degraded_routes_total``. 0 disables (503 as soon as none is eligible)."""
    accounting_grace_s: float = 0.05
    """Transit allowance of the between-poll accounting (>= 0): a snapshot written at t is
    taken to include only the requests routed before t minus this. Larger is more
    conservative (a request counts a little longer, never forgotten too early)."""
    budget_spread_max: float = 4.0
    """A replica's per-step token budget (``max_num_batched_tokens`` from ``/stats``) counts
    at most this many times the smallest an eligible replica of its pool reports: one whose
    ``/stats`` claims a huge budget would otherwise look idle however long its queue and take
    nearly every request. Raise it for a fleet whose replicas really differ more; 0: no cap."""
    # --- prefix cache (issue 9) ------------------------------------------------------------
    prefix_cache: str = "approximate"
    """What the gateway knows of each replica's prefix cache, for cache-aware policies
    (`sal` counts only the prompt tokens a replica does not hold): ``off`` (nothing: SAL is
    Eq. 2 blind to caches), ``approximate`` (an index of the prompt blocks the gateway routed to
    each replica, LRU-bounded by its KV capacity from ``/stats``), ``kv_events`` (the same,
    corrected by vLLM's own KV-cache events; needs the ``kv-events`` extra and replicas
    started with ``--kv-events-config``). Replicas whose ``/stats`` does not report prefix
    caching on are never predicted to hold anything."""
    session_header: str | None = None
    """Request header whose value is the affinity key of affinity policies (a session or
    conversation id); without it (or when absent) the prompt's first block is the key."""
    kv_events_port: int = 5557
    """``kv_events`` mode: the port of each backend's KV-event publisher, on the backend's
    host, unless ``models[].kv_events_endpoints`` names its endpoint."""
    kv_events_replay_port: int | None = None
    """``kv_events`` mode: the port of each backend's replay socket (vLLM's
    ``replay_endpoint``), on the backend's host, unless
    ``models[].kv_events_replay_endpoints`` names it; None: no replay. With it, a gateway
    that starts after its replicas asks each for the events it still buffers, and one that
    lost events (a sequence gap) asks for them again (`sal_gateway.kv_subscriber`)."""
    kv_events_topic: str = ""
    """``kv_events`` mode: the topic the publishers use (their ``--kv-events-config``
    ``topic``; "" receives every topic)."""
    prefix_min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS
    """Cache-aware `sal` ignores a predicted hit shorter than this many tokens (>= 0): a
    short match is usually an opening block every prompt shares (a system prompt), and
    crediting it would make a replica that misses it lose every tie and never get it."""
    lora_slots: bool = True
    """Pass over replicas whose ``--max-loras`` slots other adapters hold while another can
    start an adapter's request now, whatever the policy (`sal_core.lora_slots`). ``false``
    routes as if slots did not exist, as routers blind to them do: for comparison
    (``sal-bench lora-real``), not for production."""


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Upstream HTTP behaviour."""

    connect_timeout_s: float = 2.0
    """Timeout to establish a TCP connection to a backend. One whose timer ran late because
    the gateway's own process was stalled is retried once on the same backend, not held
    against it (`upstream.connect_held_up_by_stall`)."""
    total_timeout_s: float = 600.0
    """Timeout of the whole upstream exchange, streaming included. The bound of a
    non-streaming request (vLLM sends its headers only when generation ends), unless its
    replica stops being alive while it waits (`stream_idle_spares_live_engines`): then it is
    closed there after `stream_idle_timeout_s` and retried on another backend."""
    stream_header_timeout_s: float = 10.0
    """Streams only: timeout from sending the request to the response headers, which vLLM
    sends as soon as it accepts the request. On expiry the upstream connection is closed (vLLM
    aborts the request) and the request is retried on another backend (``routing.max_retries``)."""
    stream_idle_timeout_s: float = 60.0
    """Streams only: longest silence (no content byte from the backend; SSE comments such as
    vLLM's ``--sse-keep-alive-interval`` ones do not count) once the headers arrived; the
    stream then ends with an SSE error event and the upstream connection is closed. With
    `stream_idle_spares_live_engines`, a silence on a replica whose engine is progressing is
    not cut (the request is queued there behind other work)."""
    stream_idle_spares_live_engines: bool = True
    """Streams only: a stream silent for `stream_idle_timeout_s` is ended only when its
    replica is not demonstrably alive (its ``/stats`` heartbeat and step no longer advance,
    or its polls fail: not eligible); while the engine progresses the silent request is
    queued behind others and waits, bounded by `total_timeout_s`. False: every silence of
    `stream_idle_timeout_s` ends the stream, queued or not."""
    max_body_bytes: int = 10 * 1024 * 1024
    """Largest accepted request body (413 above)."""
    max_connections: int = 1024
    """Pooled upstream connections, all backends together."""
    tokenize_in_thread_chars: int = 2048
    """Prompts with more characters than this are tokenized off the event loop, in a body
    worker process (`body_pool`; the name predates the processes), so that long prompts do
    not stall the loop (short ones are cheaper inline than the round trip)."""
    # --- D: re-route a stream before its first byte (issue 8) ---------------------------
    first_byte_hold_s: float = 10.0
    """Streams only: the client's response headers are held back until the backend's first
    body byte, at most this long, so that a backend that fails after its headers but before
    sending anything (connection reset or closed, or an empty stream) can be replaced by
    another one (``routing.max_retries``): the client has seen nothing. Past it the headers
    are sent and the stream is relayed as before (never retried). 0: headers at once."""
    # --- end D ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds on what one client or request may cost the gateway."""

    max_concurrent_requests: int = 1024
    """Generation requests in progress at once (a stream counts until it ends); beyond it
    429 with ``Retry-After``. 0: unlimited."""
    retry_after_s: int = 1
    """Seconds sent in ``Retry-After`` with a 429."""
    max_n: int = 16
    """Largest accepted ``n`` and ``best_of`` (vLLM runs one engine request per choice)."""
    template_timeout_s: float = 2.0
    """Time budget of rendering one request-supplied chat template (then 400)."""
    body_workers: int = 2
    """Worker processes that decode, validate and count large request bodies (`body_pool`)
    off the event loop. Each loads every model's tokenizer (~80-90 MiB resident with a small
    vocabulary, without PyTorch: `sal_gateway.torch_free`); more than the gateway's cores
    only add memory. At least 1."""
    body_max_waiting: int = 16
    """Large requests waiting for a body worker beyond this get a 429 with ``Retry-After``
    at once (a flood of large bodies is refused, not queued in memory)."""


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Client API keys (``Authorization: Bearer``) and the key sent to the backends."""

    api_keys: tuple[str, ...] = ()
    """Accepted client keys. With no key from any source, authentication is off."""
    api_keys_file: str | None = None
    """File with one accepted key per line (``#`` starts a comment)."""
    api_keys_env: str = "SAL_GATEWAY_API_KEYS"
    """Environment variable with accepted keys (comma or whitespace separated)."""
    open_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")
    """Paths served without a key."""
    backend_api_key: str | None = None
    """Key sent upstream as ``Authorization: Bearer`` (replicas started with ``--api-key``);
    the client's own ``Authorization`` is never forwarded."""
    backend_api_key_file: str | None = None
    """File holding the backend key (first non-comment line)."""
    backend_api_key_env: str = "SAL_GATEWAY_BACKEND_API_KEY"
    """Environment variable holding the backend key."""


# --- helper F: OpenTelemetry tracing ---------------------------------------------------------

TRACE_EXPORTERS = ("otlp_http", "otlp_grpc", "console")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Optional OpenTelemetry tracing (`sal_gateway.tracing`; needs the ``otel`` extra).

    The standard ``OTEL_*`` environment variables take precedence over these keys where both
    name the same thing (docs/gateway.md, "Tracing")."""

    enabled: bool = False
    """Export one span tree per request. False: no tracing code runs and the OpenTelemetry
    packages are never imported. ``OTEL_SDK_DISABLED=true`` turns it off too."""
    exporter: str = "otlp_http"
    """``otlp_http`` (OTLP/HTTP protobuf, port 4318), ``otlp_grpc`` (port 4317) or
    ``console`` (spans printed to stdout, for a quick look)."""
    endpoint: str | None = None
    """Collector URL, e.g. ``http://otel-collector:4318`` (``/v1/traces`` is appended to an
    OTLP/HTTP URL without a path). None: ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, else the
    SDK default (``http://localhost:4318/v1/traces`` or ``localhost:4317``)."""
    service_name: str = "sal-gateway"
    """The ``service.name`` resource attribute (``OTEL_SERVICE_NAME`` overrides it)."""
    sample_ratio: float = 1.0
    """Fraction of new traces recorded (0..1), parent-based: a request whose ``traceparent``
    says sampled (or not) follows its caller. ``OTEL_TRACES_SAMPLER`` overrides it."""


@dataclass(frozen=True, slots=True)
class PeersConfig:
    """Gateways on separate hosts telling each other their between-poll accounting over UDP
    (`sal_gateway.peers`), so that several gateways in front of the same replicas route as
    one. Off unless `listen` is set."""

    listen: str | None = None
    """``host:port`` to receive the other gateways' counts on (UDP), e.g. ``0.0.0.0:7946``
    (with ``listen.workers`` N: worker i on the port + i, `for_worker`). None: off."""
    addresses: tuple[str, ...] = ()
    """The other gateways, ``host:port`` each; a name is resolved again every `resolve_s`
    and every address it resolves to is a peer (a Kubernetes headless service names every
    gateway pod). Listing this gateway itself is harmless."""
    secret_env: str = "SAL_GATEWAY_PEERS_SECRET"
    """Environment variable holding the secret every gateway shares (at least 16 bytes):
    datagrams without its tag are dropped."""
    heartbeat_s: float = 0.1
    """A gateway sends its full state at least this often (changes go out at once)."""
    expire_s: float = 1.0
    """A peer not heard for this long stops counting (a dead gateway's requests)."""
    resolve_s: float = 5.0
    """Seconds between resolutions of `addresses`."""
    share_adapters: bool = False
    """Also tell (and hear) the LoRA adapters of the requests routed since the last poll,
    which hold the replicas' ``--max-loras`` slots (`sal_core.lora_slots`). Off by default:
    in the simulator, with 1 ms between gateways, it ties, has not shown a win, and in one
    version of the rule raised SAL's p95 TTFT in most windows where slots were scarce
    (README, "LoRA fleets"). The workers of one host always share them."""
    share_prefix_blocks: bool = True
    """With ``routing.prefix_cache: approximate``: also tell (and hear) the blocks of every
    prompt routed, so that each gateway's prefix index holds what every gateway routed
    (`sal_gateway.peers.PeerNetwork.tell_blocks`; held until the request's end is told, or
    the sender's watermark passes it). Without it a conversation whose turns reach
    different gateways loses its prefix (simulated, 8 gateways: 27 % of multi-turn chat's
    prompt tokens cached against 72 % told, as with one gateway; SAL's p95 TTFT 4x
    worse)."""

    @property
    def enabled(self) -> bool:
        return self.listen is not None

    def for_worker(self, index: int, workers: int) -> PeersConfig:
        """Worker `index`'s view with ``listen.workers`` = `workers` > 1: it listens on the
        `listen` port + `index`, and every address stands for its `workers` consecutive
        ports (every gateway runs as many workers, each on its own UDP port: the kernel
        would hand a datagram on a shared port to one worker only)."""
        if self.listen is None or workers <= 1:
            return self
        host, port = split_host_port(self.listen)
        expanded = []
        for address in self.addresses:
            peer_host, peer_port = split_host_port(address)
            expanded += [_join_host_port(peer_host, peer_port + j) for j in range(workers)]
        return dataclasses.replace(
            self,
            listen=_join_host_port(host, port + index),
            addresses=tuple(expanded),
        )


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The whole gateway configuration (``config.yaml``)."""

    models: tuple[ModelConfig, ...]
    """Served models (at least one; names unique)."""
    listen: ListenConfig = field(default_factory=ListenConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    log_level: str = "info"
    """One of critical, error, warning, info, debug."""
    # helper F: OpenTelemetry tracing
    tracing: TracingConfig = field(default_factory=TracingConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)

    def model(self, name: str) -> ModelConfig | None:
        """The model config served as `name`, or None."""
        for m in self.models:
            if m.name == name:
                return m
        return None
