"""API keys: which client keys are accepted, and which key the gateway sends to backends.

`load_keys(auth, environ)` gathers the accepted client keys from the config list, the keys
file (one per line, ``#`` comments) and the environment variable (comma or whitespace
separated); none at all means authentication is off. `KeyChecker.accepts()` compares an
``Authorization`` header against every key with `hmac.compare_digest` (constant time per
key, and every key is compared, so the answer's timing does not tell which key came close).
`backend_key()` resolves the upstream key from config, file or environment. Called once at
start-up (`app.build_runtime`); a missing or unreadable file raises `AuthConfigError`.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from sal_gateway.config import AuthConfig


class AuthConfigError(ValueError):
    """A configured key file cannot be read."""


def _file_lines(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthConfigError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def load_keys(auth: AuthConfig, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every accepted client key (deduplicated, order kept)."""
    env = os.environ if environ is None else environ
    keys: list[str] = list(auth.api_keys)
    if auth.api_keys_file is not None:
        keys.extend(_file_lines(auth.api_keys_file))
    keys.extend(env.get(auth.api_keys_env, "").replace(",", " ").split())
    return tuple(dict.fromkeys(k for k in keys if k))


def backend_key(auth: AuthConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The key to send upstream: config value, else the file's first key, else the env var."""
    env = os.environ if environ is None else environ
    if auth.backend_api_key is not None:
        return auth.backend_api_key
    if auth.backend_api_key_file is not None:
        lines = _file_lines(auth.backend_api_key_file)
        return lines[0] if lines else None
    return env.get(auth.backend_api_key_env) or None


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (no key needed to be safe there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KeyChecker:
    """Accepts ``Authorization: Bearer <key>`` for any configured key."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether the raw ``Authorization`` header value carries an accepted key."""
        if not self._keys:
            return True
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        token = token.strip()
        ok = False
        for key in self._keys:  # no early exit: every key costs the same time
            ok |= hmac.compare_digest(token, key)
        return ok and scheme.lower() == b"bearer"
