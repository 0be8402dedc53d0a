"""The section parsers of the gateway config: each turns one plain mapping (a section of
``config.yaml`` as decoded from YAML, environment overrides applied) into its frozen dataclass
of `sal_gateway.config_tree`, or raises `ConfigError` naming the key path and the bad value.

Only `sal_gateway.config.build_config` calls these (``_routing("routing", data)``); the
scalar checks they share are in `sal_gateway.config_values`. Checks that span fields of one
section live here (``peers.expire_s`` must exceed ``peers.heartbeat_s``); checks across
sections are passed what they need (`_peers` gets the parsed ``listen``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from sal_core.policies import POLICIES
from sal_gateway.config_tree import (
    MAX_WORKERS,
    RUNNERS,
    TRACE_EXPORTERS,
    AuthConfig,
    DiscoveryConfig,
    LimitsConfig,
    ListenConfig,
    ModelConfig,
    PeersConfig,
    ProxyConfig,
    RoutingConfig,
    TracingConfig,
)
from sal_gateway.config_values import (
    ConfigError,
    _as_bool,
    _as_float,
    _as_int,
    _as_mapping,
    _as_str,
    _backend_url,
    _budget_spread,
    _check_keys,
    _host_port,
    _nonnegative,
    _optional_str,
    _port,
    _prefix_mode,
    _session_header,
    _str_list,
    _topic,
    _zmq_endpoint,
    split_host_port,
)


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
    share_prefix = _as_bool(f"{path}.share_prefix_index", data.get("share_prefix_index", True))
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
    return {
        "workers": workers,
        "worker_ports_from": first,
        "share_accounting": share,
        "share_prefix_index": share_prefix,
    }


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
        resolvable_adapters=_patterns(
            f"{path}.resolvable_adapters", data.get("resolvable_adapters", [])
        ),
        kv_events_endpoints=_kv_endpoints(
            f"{path}.kv_events_endpoints", data.get("kv_events_endpoints") or {}
        ),
        kv_events_replay_endpoints=_kv_endpoints(
            f"{path}.kv_events_replay_endpoints", data.get("kv_events_replay_endpoints") or {}
        ),
    )


def _kv_endpoints(path: str, value: object) -> tuple[tuple[str, str], ...]:
    mapping = _as_mapping(path, value)
    return tuple(
        (_backend_url(f"{path}[{url!r}]", url), _zmq_endpoint(f"{path}[{url!r}]", endpoint))
        for url, endpoint in mapping.items()
    )


MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 256


def _patterns(path: str, value: object) -> tuple[str, ...]:
    patterns = _str_list(path, value)
    if len(patterns) > MAX_PATTERNS:
        raise ConfigError(f"{path}: at most {MAX_PATTERNS} patterns, got {len(patterns)}")
    for i, pattern in enumerate(patterns):
        if not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise ConfigError(
                f"{path}[{i}]: a pattern of 1 to {MAX_PATTERN_CHARS} characters, "
                f"got {pattern!r:.80}"
            )
    return patterns


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
        kv_events_replay_port=(
            None
            if data.get("kv_events_replay_port") is None
            else _port(f"{path}.kv_events_replay_port", data["kv_events_replay_port"])
        ),
        kv_events_topic=_topic(f"{path}.kv_events_topic", data.get("kv_events_topic", "")),
        prefix_min_match_tokens=_as_int(
            f"{path}.prefix_min_match_tokens",
            data.get("prefix_min_match_tokens", d.prefix_min_match_tokens),
            0,
        ),
        lora_slots=_as_bool(f"{path}.lora_slots", data.get("lora_slots", d.lora_slots)),
    )


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
        share_adapters=_as_bool(
            f"{path}.share_adapters", data.get("share_adapters", d.share_adapters)
        ),
        share_prefix_blocks=_as_bool(
            f"{path}.share_prefix_blocks", data.get("share_prefix_blocks", d.share_prefix_blocks)
        ),
    )
