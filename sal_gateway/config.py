"""The gateway's typed configuration tree, loaded from ``config.yaml``.

`load_config(path)` reads the YAML file, applies environment overrides and returns a validated
`GatewayConfig`, or raises `ConfigError` whose message names the key path and the bad value
(``models[0].backends[1]: ...``). The CLI calls it before the server binds, so a bad config
never reaches a listening socket.

Environment overrides: ``SAL_GATEWAY__<SECTION>__<FIELD>=value`` (double underscore means
nesting, case-insensitive), e.g. ``SAL_GATEWAY__ROUTING__POLICY=p2c`` or
``SAL_GATEWAY__LISTEN__PORT=9000``. The value is parsed as a YAML scalar (so ``0.2`` is a
float, ``null`` is None). List items are addressed by index:
``SAL_GATEWAY__MODELS__0__MAX_MODEL_LEN=2048``. Overrides are applied before validation, so an
override with an unknown key is rejected like a bad file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from sal_core.policies import DEFAULT_MIN_MATCH_TOKENS, POLICIES

ENV_PREFIX = "SAL_GATEWAY__"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path and the source."""


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
    kv_events_endpoints: tuple[tuple[str, str], ...] = ()
    """``routing.prefix_cache: kv_events`` only: each backend URL's ZMQ endpoint of vLLM's
    KV-cache event publisher (its ``--kv-events-config`` ``endpoint``, as seen from the
    gateway), e.g. ``{"http://10.0.0.5:8000": "tcp://10.0.0.5:5557"}``. Backends not listed
    use ``tcp://<backend host>:<routing.kv_events_port>``."""


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
    kv_events_topic: str = ""
    """``kv_events`` mode: the topic the publishers use (their ``--kv-events-config``
    ``topic``; "" receives every topic)."""
    prefix_min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS
    """Cache-aware `sal` ignores a predicted hit shorter than this many tokens (>= 0): a
    short match is usually an opening block every prompt shares (a system prompt), and
    crediting it would make a replica that misses it lose every tie and never get it."""


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
    off the event loop. Each loads every model's tokenizer (~0.5 GiB resident with
    transformers); more than the gateway's cores only add memory. At least 1."""
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


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


# --- building the tree from plain data -----------------------------------------------------


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _as_int(path: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {_type_name(value)} {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return value


def _as_float(path: str, value: object, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: expected a number, got {_type_name(value)} {value!r}")
    result = float(value)
    if not math.isfinite(result) or (positive and result <= 0):
        raise ConfigError(f"{path}: must be a positive finite number, got {value!r}")
    return result


def _nonnegative(path: str, value: object) -> float:
    result = _as_float(path, value, positive=False)
    if result < 0:
        raise ConfigError(f"{path}: must be >= 0, got {value!r}")
    return result


def _as_str(path: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: expected a non-empty string, got {_type_name(value)} {value!r}")
    return value


def _as_bool(path: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {_type_name(value)} {value!r}")
    return value


def _optional_str(path: str, value: object) -> str | None:
    return None if value is None else _as_str(path, value)


def _str_list(path: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of strings, got {_type_name(value)} {value!r}")
    return tuple(_as_str(f"{path}[{i}]", v) for i, v in enumerate(value))


def _as_mapping(path: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_type_name(value)} {value!r}")
    return value


def _check_keys(path: str, data: Mapping[str, Any], cls: type[Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(known))})")


def _backend_url(path: str, value: object) -> str:
    url = _as_str(path, value).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{path}: expected an http(s)://host:port URL, got {value!r}")
    if parts.path or parts.query:
        raise ConfigError(f"{path}: give the base URL without a path, got {value!r}")
    return url


def _listen(path: str, data: Mapping[str, Any]) -> ListenConfig:
    _check_keys(path, data, ListenConfig)
    d = ListenConfig()
    port = _as_int(f"{path}.port", data.get("port", d.port), 0)
    if port > 65535:
        raise ConfigError(f"{path}.port: must be <= 65535, got {port}")
    return ListenConfig(
        host=_as_str(f"{path}.host", data.get("host", d.host)),
        port=port,
        keep_alive_s=_as_float(f"{path}.keep_alive_s", data.get("keep_alive_s", d.keep_alive_s)),
        header_timeout_s=_as_float(
            f"{path}.header_timeout_s", data.get("header_timeout_s", d.header_timeout_s)
        ),
        body_timeout_s=_as_float(
            f"{path}.body_timeout_s", data.get("body_timeout_s", d.body_timeout_s)
        ),
        shutdown_delay_s=_nonnegative(
            f"{path}.shutdown_delay_s", data.get("shutdown_delay_s", d.shutdown_delay_s)
        ),
        shutdown_grace_s=_nonnegative(
            f"{path}.shutdown_grace_s", data.get("shutdown_grace_s", d.shutdown_grace_s)
        ),
        **_workers(path, data, port),
    )


def _workers(path: str, data: Mapping[str, Any], port: int) -> dict[str, Any]:
    workers = _as_int(f"{path}.workers", data.get("workers", 1), 1)
    if workers > MAX_WORKERS:
        raise ConfigError(f"{path}.workers: must be <= {MAX_WORKERS}, got {workers}")
    first = data.get("worker_ports_from")
    if first is not None:
        first = _as_int(f"{path}.worker_ports_from", first, 0)
    share = _as_bool(f"{path}.share_accounting", data.get("share_accounting", True))
    listen = ListenConfig(port=port, workers=workers, worker_ports_from=first)
    ports = [p for p in listen.worker_ports() if p]
    if ports and ports[-1] > 65535:
        raise ConfigError(
            f"{path}.worker_ports_from: {workers} worker ports from {ports[0]} pass 65535"
        )
    if port and port in ports:
        raise ConfigError(
            f"{path}.worker_ports_from: the worker ports {ports[0]}-{ports[-1]} include "
            f"{path}.port {port}"
        )
    return {"workers": workers, "worker_ports_from": first, "share_accounting": share}


def _discovery(path: str, data: Mapping[str, Any]) -> DiscoveryConfig:
    _check_keys(path, data, DiscoveryConfig)
    if "dns_name" not in data:
        raise ConfigError(f"{path}.dns_name: required")
    scheme = _as_str(f"{path}.scheme", data.get("scheme", "http"))
    if scheme not in ("http", "https"):
        raise ConfigError(f"{path}.scheme: expected http or https, got {scheme!r}")
    port = _as_int(f"{path}.port", data.get("port", 8000), 1)
    return DiscoveryConfig(
        dns_name=_as_str(f"{path}.dns_name", data["dns_name"]),
        port=port,
        scheme=scheme,
        interval_s=_as_float(f"{path}.interval_s", data.get("interval_s", 10.0)),
    )


def _model(path: str, data: Mapping[str, Any]) -> ModelConfig:
    _check_keys(path, data, ModelConfig)
    if "name" not in data:
        raise ConfigError(f"{path}.name: required")
    raw_backends = data.get("backends", [])
    if not isinstance(raw_backends, list):
        raise ConfigError(f"{path}.backends: expected a list of URLs, got {raw_backends!r}")
    backends = tuple(_backend_url(f"{path}.backends[{i}]", b) for i, b in enumerate(raw_backends))
    if len(set(backends)) != len(backends):
        raise ConfigError(f"{path}.backends: duplicate URL in {list(backends)}")
    discovery = None
    if data.get("discovery") is not None:
        discovery = _discovery(
            f"{path}.discovery", _as_mapping(f"{path}.discovery", data["discovery"])
        )
    if not backends and discovery is None:
        raise ConfigError(f"{path}: needs `backends` or `discovery`")
    tokenizer = data.get("tokenizer")
    max_model_len = data.get("max_model_len")
    return ModelConfig(
        name=_as_str(f"{path}.name", data["name"]),
        tokenizer=None if tokenizer is None else _as_str(f"{path}.tokenizer", tokenizer),
        max_model_len=(
            None if max_model_len is None else _as_int(f"{path}.max_model_len", max_model_len, 1)
        ),
        backends=backends,
        discovery=discovery,
        fallback_max_num_batched_tokens=_as_int(
            f"{path}.fallback_max_num_batched_tokens",
            data.get("fallback_max_num_batched_tokens", 2048),
            1,
        ),
        trust_request_chat_template=_as_bool(
            f"{path}.trust_request_chat_template", data.get("trust_request_chat_template", False)
        ),
        runner=_runner(f"{path}.runner", data.get("runner", "generate")),
        models_refresh_s=_as_float(f"{path}.models_refresh_s", data.get("models_refresh_s", 15.0)),
        kv_events_endpoints=_kv_endpoints(
            f"{path}.kv_events_endpoints", data.get("kv_events_endpoints") or {}
        ),
    )


_ZMQ_SCHEMES = ("tcp://", "ipc://")
_HEADER_NAME = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def _zmq_endpoint(path: str, value: object) -> str:
    endpoint = _as_str(path, value)
    if not endpoint.startswith(_ZMQ_SCHEMES) or len(endpoint) <= len("tcp://"):
        raise ConfigError(
            f"{path}: expected a ZMQ endpoint tcp://host:port or ipc://path, got {endpoint!r}"
        )
    return endpoint


def _kv_endpoints(path: str, value: object) -> tuple[tuple[str, str], ...]:
    mapping = _as_mapping(path, value)
    return tuple(
        (_backend_url(f"{path}[{url!r}]", url), _zmq_endpoint(f"{path}[{url!r}]", endpoint))
        for url, endpoint in mapping.items()
    )


def _session_header(path: str, value: object) -> str | None:
    if value is None:
        return None
    name = _as_str(path, value)
    if not set(name) <= _HEADER_NAME or len(name) > 128:
        raise ConfigError(f"{path}: not a valid HTTP header name: {name!r}")
    return name.lower()


def _prefix_mode(path: str, value: object) -> str:
    modes = ("off", "approximate", "kv_events")
    if value not in modes:
        raise ConfigError(f"{path}: expected one of {', '.join(modes)}, got {value!r}")
    if value == "kv_events":
        import importlib.util

        missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"{path}: kv_events needs {' and '.join(missing)} (pip install "
                "'sal-gateway[kv-events]')"
            )
    return str(value)


def _runner(path: str, value: object) -> str:
    if value not in RUNNERS:
        raise ConfigError(f"{path}: expected one of {', '.join(RUNNERS)}, got {value!r}")
    return str(value)


def _routing(path: str, data: Mapping[str, Any]) -> RoutingConfig:
    _check_keys(path, data, RoutingConfig)
    d = RoutingConfig()
    policy = _as_str(f"{path}.policy", data.get("policy", d.policy))
    if policy not in POLICIES:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"{path}.policy: unknown policy {policy!r} (known: {known})")
    seed = data.get("seed", d.seed)
    beta_seed = _as_float(f"{path}.beta_seed", data.get("beta_seed", d.beta_seed))
    if beta_seed < 1.0:
        raise ConfigError(f"{path}.beta_seed: must be >= 1, got {beta_seed}")
    return RoutingConfig(
        policy=policy,
        poll_interval_s=_as_float(
            f"{path}.poll_interval_s", data.get("poll_interval_s", d.poll_interval_s)
        ),
        poll_timeout_s=_as_float(
            f"{path}.poll_timeout_s", data.get("poll_timeout_s", d.poll_timeout_s)
        ),
        stale_after_s=_as_float(
            f"{path}.stale_after_s", data.get("stale_after_s", d.stale_after_s)
        ),
        eject_after_failures=_as_int(
            f"{path}.eject_after_failures",
            data.get("eject_after_failures", d.eject_after_failures),
            1,
        ),
        beta_seed=beta_seed,
        seed=None if seed is None else _as_int(f"{path}.seed", seed),
        max_retries=_as_int(f"{path}.max_retries", data.get("max_retries", d.max_retries), 0),
        poll_backoff_max_s=_as_float(
            f"{path}.poll_backoff_max_s", data.get("poll_backoff_max_s", d.poll_backoff_max_s)
        ),
        degraded_max_progress_age_s=_nonnegative(
            f"{path}.degraded_max_progress_age_s",
            data.get("degraded_max_progress_age_s", d.degraded_max_progress_age_s),
        ),
        accounting_grace_s=_nonnegative(
            f"{path}.accounting_grace_s", data.get("accounting_grace_s", d.accounting_grace_s)
        ),
        budget_spread_max=_budget_spread(
            f"{path}.budget_spread_max", data.get("budget_spread_max", d.budget_spread_max)
        ),
        prefix_cache=_prefix_mode(f"{path}.prefix_cache", data.get("prefix_cache", d.prefix_cache)),
        session_header=_session_header(f"{path}.session_header", data.get("session_header")),
        kv_events_port=_port(
            f"{path}.kv_events_port", data.get("kv_events_port", d.kv_events_port)
        ),
        kv_events_topic=_topic(f"{path}.kv_events_topic", data.get("kv_events_topic", "")),
        prefix_min_match_tokens=_as_int(
            f"{path}.prefix_min_match_tokens",
            data.get("prefix_min_match_tokens", d.prefix_min_match_tokens),
            0,
        ),
    )


def _budget_spread(path: str, value: object) -> float:
    spread = _nonnegative(path, value)
    if 0 < spread < 1:
        raise ConfigError(f"{path}: must be 0 (no cap) or >= 1, got {value!r}")
    return spread


def _port(path: str, value: object) -> int:
    port = _as_int(path, value, 1)
    if port > 65535:
        raise ConfigError(f"{path}: must be <= 65535, got {port}")
    return port


def _topic(path: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise ConfigError(f"{path}: expected a string of at most 256 characters, got {value!r:.80}")
    return value


def _proxy(path: str, data: Mapping[str, Any]) -> ProxyConfig:
    _check_keys(path, data, ProxyConfig)
    d = ProxyConfig()

    def num(name: str) -> float:
        return _as_float(f"{path}.{name}", data.get(name, getattr(d, name)))

    def count(name: str) -> int:
        return _as_int(f"{path}.{name}", data.get(name, getattr(d, name)), 1)

    return ProxyConfig(
        connect_timeout_s=num("connect_timeout_s"),
        total_timeout_s=num("total_timeout_s"),
        stream_header_timeout_s=num("stream_header_timeout_s"),
        stream_idle_timeout_s=num("stream_idle_timeout_s"),
        stream_idle_spares_live_engines=_as_bool(
            f"{path}.stream_idle_spares_live_engines",
            data.get("stream_idle_spares_live_engines", d.stream_idle_spares_live_engines),
        ),
        max_body_bytes=count("max_body_bytes"),
        max_connections=count("max_connections"),
        tokenize_in_thread_chars=_as_int(
            f"{path}.tokenize_in_thread_chars",
            data.get("tokenize_in_thread_chars", d.tokenize_in_thread_chars),
            0,
        ),
        first_byte_hold_s=_nonnegative(
            f"{path}.first_byte_hold_s", data.get("first_byte_hold_s", d.first_byte_hold_s)
        ),
    )


def _limits(path: str, data: Mapping[str, Any]) -> LimitsConfig:
    _check_keys(path, data, LimitsConfig)
    d = LimitsConfig()

    def get(name: str) -> Any:
        return data.get(name, getattr(d, name))

    return LimitsConfig(
        max_concurrent_requests=_as_int(
            f"{path}.max_concurrent_requests", get("max_concurrent_requests"), 0
        ),
        retry_after_s=_as_int(f"{path}.retry_after_s", get("retry_after_s"), 0),
        max_n=_as_int(f"{path}.max_n", get("max_n"), 1),
        template_timeout_s=_as_float(f"{path}.template_timeout_s", get("template_timeout_s")),
        body_workers=_as_int(f"{path}.body_workers", get("body_workers"), 1),
        body_max_waiting=_as_int(f"{path}.body_max_waiting", get("body_max_waiting"), 0),
    )


def _auth(path: str, data: Mapping[str, Any]) -> AuthConfig:
    _check_keys(path, data, AuthConfig)
    d = AuthConfig()

    def get(name: str) -> Any:
        value = data.get(name, getattr(d, name))
        return list(value) if isinstance(value, tuple) else value

    open_paths = _str_list(f"{path}.open_paths", get("open_paths"))
    for i, p in enumerate(open_paths):
        if not p.startswith("/"):
            raise ConfigError(f"{path}.open_paths[{i}]: expected a path starting with /, got {p!r}")
    return AuthConfig(
        api_keys=_str_list(f"{path}.api_keys", get("api_keys")),
        api_keys_file=_optional_str(f"{path}.api_keys_file", get("api_keys_file")),
        api_keys_env=_as_str(f"{path}.api_keys_env", get("api_keys_env")),
        open_paths=open_paths,
        backend_api_key=_optional_str(f"{path}.backend_api_key", get("backend_api_key")),
        backend_api_key_file=_optional_str(
            f"{path}.backend_api_key_file", get("backend_api_key_file")
        ),
        backend_api_key_env=_as_str(f"{path}.backend_api_key_env", get("backend_api_key_env")),
    )


def _tracing(path: str, data: Mapping[str, Any]) -> TracingConfig:  # helper F
    _check_keys(path, data, TracingConfig)
    d = TracingConfig()
    exporter = _as_str(f"{path}.exporter", data.get("exporter", d.exporter))
    if exporter not in TRACE_EXPORTERS:
        known = ", ".join(TRACE_EXPORTERS)
        raise ConfigError(f"{path}.exporter: expected one of {known}, got {exporter!r}")
    endpoint = _optional_str(f"{path}.endpoint", data.get("endpoint", d.endpoint))
    if endpoint is not None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{path}.endpoint: expected an http(s)://host:port URL, got {endpoint!r}"
            )
    ratio = _as_float(
        f"{path}.sample_ratio", data.get("sample_ratio", d.sample_ratio), positive=False
    )
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"{path}.sample_ratio: must be within 0..1, got {ratio!r}")
    return TracingConfig(
        enabled=_as_bool(f"{path}.enabled", data.get("enabled", d.enabled)),
        exporter=exporter,
        endpoint=endpoint,
        service_name=_as_str(f"{path}.service_name", data.get("service_name", d.service_name)),
        sample_ratio=ratio,
    )


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) split, or `ConfigError`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _host_port(path: str, value: object, *, any_port: bool) -> str:
    text = _as_str(path, value)
    try:
        _, port = split_host_port(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if port == 0 and not any_port:
        raise ConfigError(f"{path}: port 0 names no peer, got {text!r}")
    return text


def _peers(path: str, data: Mapping[str, Any], listen: ListenConfig) -> PeersConfig:
    _check_keys(path, data, PeersConfig)
    d = PeersConfig()
    raw_listen = data.get("listen", d.listen)
    peer_listen = None
    if raw_listen is not None:
        peer_listen = _host_port(f"{path}.listen", raw_listen, any_port=True)
    addresses = tuple(
        _host_port(f"{path}.addresses[{i}]", a, any_port=False)
        for i, a in enumerate(_str_list(f"{path}.addresses", data.get("addresses", [])))
    )
    if peer_listen is None and addresses:
        raise ConfigError(f"{path}.addresses: set {path}.listen too (where peers send to)")
    if peer_listen is not None and not addresses:
        raise ConfigError(f"{path}.addresses: list the other gateways (host:port each)")
    if peer_listen is not None and listen.workers > 1:
        # Worker i listens on the port + i, and sends to every address's ports + 0..N-1.
        port = split_host_port(peer_listen)[1]
        ports = [split_host_port(a)[1] for a in (peer_listen, *addresses)]
        if port == 0:
            raise ConfigError(
                f"{path}.listen: with listen.workers > 1 give a port (worker i listens on "
                f"it + i), got {peer_listen!r}"
            )
        if max(ports) + listen.workers - 1 > 65535:
            raise ConfigError(
                f"{path}: with {listen.workers} workers, ports up to the highest one here "
                f"+ {listen.workers - 1} must stay within 65535"
            )
    heartbeat = _as_float(f"{path}.heartbeat_s", data.get("heartbeat_s", d.heartbeat_s))
    expire = _as_float(f"{path}.expire_s", data.get("expire_s", d.expire_s))
    if expire <= heartbeat:
        raise ConfigError(
            f"{path}.expire_s: must exceed heartbeat_s ({heartbeat:g}), got {expire:g}"
        )
    return PeersConfig(
        listen=peer_listen,
        addresses=addresses,
        secret_env=_as_str(f"{path}.secret_env", data.get("secret_env", d.secret_env)),
        heartbeat_s=heartbeat,
        expire_s=expire,
        resolve_s=_as_float(f"{path}.resolve_s", data.get("resolve_s", d.resolve_s)),
    )


def build_config(data: object) -> GatewayConfig:
    """Validate plain data (as decoded from YAML) into a `GatewayConfig`."""
    root = _as_mapping("<root>", data)
    _check_keys("", root, GatewayConfig)
    raw_models = root.get("models")
    if not isinstance(raw_models, list) or not raw_models:
        raise ConfigError(f"models: expected a non-empty list, got {raw_models!r}")
    models = tuple(
        _model(f"models[{i}]", _as_mapping(f"models[{i}]", m)) for i, m in enumerate(raw_models)
    )
    names = [m.name for m in models]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"models: model name {name!r} is configured twice")
    log_level = _as_str("log_level", root.get("log_level", "info")).lower()
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    listen = _listen("listen", _as_mapping("listen", root.get("listen") or {}))
    return GatewayConfig(
        models=models,
        listen=listen,
        routing=_routing("routing", _as_mapping("routing", root.get("routing") or {})),
        proxy=_proxy("proxy", _as_mapping("proxy", root.get("proxy") or {})),
        limits=_limits("limits", _as_mapping("limits", root.get("limits") or {})),
        auth=_auth("auth", _as_mapping("auth", root.get("auth") or {})),
        log_level=log_level,
        tracing=_tracing("tracing", _as_mapping("tracing", root.get("tracing") or {})),
        peers=_peers("peers", _as_mapping("peers", root.get("peers") or {}), listen),
    )


# --- environment overrides -----------------------------------------------------------------


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of `data` with every ``SAL_GATEWAY__A__B=value`` applied at ``a.b``."""
    import copy

    result = copy.deepcopy(data)
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX) :].split("__")]
        if not keys or any(not k for k in keys):
            raise ConfigError(f"environment {name}: malformed override name")
        try:
            value = yaml.safe_load(environ[name])
        except yaml.YAMLError as exc:
            raise ConfigError(f"environment {name}: cannot parse value: {exc}") from None
        _set_path(result, keys, value, name)
    return result


def _set_path(node: Any, keys: list[str], value: object, source: str) -> None:
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"environment {source}: no list item {key!r}")
            if last:
                node[int(key)] = value
            else:
                node = node[int(key)]
        elif isinstance(node, dict):
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            raise ConfigError(f"environment {source}: {key!r} is not inside a mapping")


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read, override from the environment (`os.environ` by default) and validate a config."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {_type_name(data)}")
    data = apply_env_overrides(data, os.environ if environ is None else environ)
    try:
        return build_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
