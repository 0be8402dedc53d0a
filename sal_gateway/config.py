"""Loading the gateway's typed configuration tree from ``config.yaml``.

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

The pieces live in their own modules: the tree itself (the frozen dataclasses, every field
documented) in `sal_gateway.config_tree`, the section parsers in `sal_gateway.config_sections`,
the scalar checks and `ConfigError` in `sal_gateway.config_values`. This module assembles them
(`build_config`, the environment overrides, `load_config`) and re-exports every public name of
the others, so ``from sal_gateway.config import GatewayConfig, ConfigError`` keeps working.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from sal_gateway.config_sections import (
    _auth,
    _limits,
    _listen,
    _model,
    _peers,
    _proxy,
    _routing,
    _tracing,
)
from sal_gateway.config_sections import _discovery as _discovery
from sal_gateway.config_sections import _kv_endpoints as _kv_endpoints
from sal_gateway.config_sections import _runner as _runner
from sal_gateway.config_sections import _workers as _workers
from sal_gateway.config_tree import (
    LOG_LEVELS,
    MAX_WORKERS,
    RUNNERS,
    TRACE_EXPORTERS,
    AuthConfig,
    DiscoveryConfig,
    GatewayConfig,
    LimitsConfig,
    ListenConfig,
    ModelConfig,
    PeersConfig,
    ProxyConfig,
    RoutingConfig,
    TracingConfig,
)
from sal_gateway.config_values import _HEADER_NAME as _HEADER_NAME
from sal_gateway.config_values import _ZMQ_SCHEMES as _ZMQ_SCHEMES
from sal_gateway.config_values import (
    ConfigError,
    _as_mapping,
    _as_str,
    _check_keys,
    _type_name,
    split_host_port,
)
from sal_gateway.config_values import _as_bool as _as_bool
from sal_gateway.config_values import _as_float as _as_float
from sal_gateway.config_values import _as_int as _as_int
from sal_gateway.config_values import _backend_url as _backend_url
from sal_gateway.config_values import _budget_spread as _budget_spread
from sal_gateway.config_values import _host_port as _host_port
from sal_gateway.config_values import _join_host_port as _join_host_port
from sal_gateway.config_values import _nonnegative as _nonnegative
from sal_gateway.config_values import _optional_str as _optional_str
from sal_gateway.config_values import _port as _port
from sal_gateway.config_values import _prefix_mode as _prefix_mode
from sal_gateway.config_values import _session_header as _session_header
from sal_gateway.config_values import _str_list as _str_list
from sal_gateway.config_values import _topic as _topic
from sal_gateway.config_values import _zmq_endpoint as _zmq_endpoint

# The public surface. The private helpers imported above as ``_name as _name`` are unused here:
# they lived in this module before it was split and stay reachable by their old names
# (``sal_gateway.config._as_int``).
__all__ = [
    "ENV_PREFIX",
    "LOG_LEVELS",
    "MAX_WORKERS",
    "RUNNERS",
    "TRACE_EXPORTERS",
    "AuthConfig",
    "ConfigError",
    "DiscoveryConfig",
    "GatewayConfig",
    "LimitsConfig",
    "ListenConfig",
    "ModelConfig",
    "PeersConfig",
    "ProxyConfig",
    "RoutingConfig",
    "TracingConfig",
    "apply_env_overrides",
    "build_config",
    "load_config",
    "split_host_port",
]

ENV_PREFIX = "SAL_GATEWAY__"


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
