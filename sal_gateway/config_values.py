"""Scalar checks of the gateway config: each turns one plain value (as decoded from YAML) into
a typed one, or raises `ConfigError` naming the key path and the bad value.

The section parsers in `sal_gateway.config_sections` call these
(``_as_int("routing.max_retries", v, 0)``); `sal_gateway.config_tree` uses `split_host_port`
and `_join_host_port` for ``peers`` addresses, and `sal_gateway.peers` uses `split_host_port`
(through `sal_gateway.config`, which re-exports it with `ConfigError`). Nothing here knows
the config tree's shape except `_check_keys`, which reads the field names of whichever
dataclass it is given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path and the source."""


# --- plain values ---------------------------------------------------------------------------


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


# --- network addresses and names --------------------------------------------------------


def _port(path: str, value: object) -> int:
    port = _as_int(path, value, 1)
    if port > 65535:
        raise ConfigError(f"{path}: must be <= 65535, got {port}")
    return port


def _backend_url(path: str, value: object) -> str:
    url = _as_str(path, value).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{path}: expected an http(s)://host:port URL, got {value!r}")
    if parts.path or parts.query:
        raise ConfigError(f"{path}: give the base URL without a path, got {value!r}")
    return url


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


def _session_header(path: str, value: object) -> str | None:
    if value is None:
        return None
    name = _as_str(path, value)
    if not set(name) <= _HEADER_NAME or len(name) > 128:
        raise ConfigError(f"{path}: not a valid HTTP header name: {name!r}")
    return name.lower()


def _topic(path: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise ConfigError(f"{path}: expected a string of at most 256 characters, got {value!r:.80}")
    return value


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) split, or `ConfigError`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_port(path: str, value: object, *, any_port: bool) -> str:
    text = _as_str(path, value)
    try:
        _, port = split_host_port(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if port == 0 and not any_port:
        raise ConfigError(f"{path}: port 0 names no peer, got {text!r}")
    return text


# --- routing knobs ----------------------------------------------------------------------


def _budget_spread(path: str, value: object) -> float:
    spread = _nonnegative(path, value)
    if 0 < spread < 1:
        raise ConfigError(f"{path}: must be 0 (no cap) or >= 1, got {value!r}")
    return spread


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
