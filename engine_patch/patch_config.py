"""The patch's settings as vLLM hands them to the scheduler (pure parsing, no vLLM import).

LARRY's parameters travel in ``--additional-config '{"larry": {"alpha": 1.0}}'``
(``vllm_config.additional_config``), the tail-guarded LARRY's in
``'{"larry_tail": {"slack": 1.0, "margin_s": 1.0, "headroom": 0.02, ...}}'`` (every field of
`sal_core.larry_tail.TailParams`); the snapshot location travels in the environment
(`STATS_PREFIX_ENV`), because the API-server processes that read it never see the engine
config. The launcher sets both.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sal_core.larry import LarryParams
from sal_core.larry_tail import TailParams

LARRY_CONFIG_KEY = "larry"
LARRY_TAIL_CONFIG_KEY = "larry_tail"
LARRY_TAIL_KEYS: dict[str, type] = {
    "alpha": float,
    "pin": str,
    "slack": float,
    "cap": float,
    "margin_s": float,
    "headroom": float,
    "rate_window_s": float,
    "memory_s": float,
}
"""The keys of ``additional_config.larry_tail`` and their types (`TailParams`' fields)."""
STATS_PREFIX_ENV = "SAL_STATS_PREFIX"
"""Path prefix of the snapshot files (``{prefix}.dp{rank}``); shared by engine and API side."""
DEFAULT_STATS_BASENAME = "sal-stats"
DP_LOCAL_ENV = "SAL_STATS_DP_LOCAL"
"""How many data-parallel engines run on this host, as launched. vLLM reconfigures each
engine of a dense (non-MoE) model as an independent DP=1 engine, so the engines cannot tell
from their config how many siblings the API server should wait for; the launcher says."""


class PatchConfigError(ValueError):
    """Bad LARRY settings in ``--additional-config`` (names the key at fault)."""


def larry_params(additional_config: Mapping[str, Any] | None) -> LarryParams:
    """`LarryParams` from vLLM's ``additional_config`` (defaults when absent).

    Unknown keys under ``larry`` are rejected, so a typo (``"alpah"``) fails at start
    instead of silently running with the default.
    """
    section = (additional_config or {}).get(LARRY_CONFIG_KEY, {})
    if not isinstance(section, Mapping):
        raise PatchConfigError(
            f"additional_config.{LARRY_CONFIG_KEY} must be an object, got {section!r}"
        )
    unknown = sorted(set(section) - {"alpha"})
    if unknown:
        raise PatchConfigError(
            f"unknown key additional_config.{LARRY_CONFIG_KEY}.{unknown[0]} (known: alpha)"
        )
    alpha = section.get("alpha", LarryParams().alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise PatchConfigError(
            f"additional_config.{LARRY_CONFIG_KEY}.alpha must be a number, got {alpha!r}"
        )
    try:
        return LarryParams(alpha=float(alpha))
    except ValueError as exc:
        raise PatchConfigError(str(exc)) from exc


def larry_tail_params(additional_config: Mapping[str, Any] | None) -> TailParams:
    """`TailParams` from vLLM's ``additional_config`` (defaults when absent).

    Unknown keys under ``larry_tail`` and values of the wrong type or range are rejected
    with `PatchConfigError` naming the key.
    """
    key = LARRY_TAIL_CONFIG_KEY
    section = (additional_config or {}).get(key, {})
    if not isinstance(section, Mapping):
        raise PatchConfigError(f"additional_config.{key} must be an object, got {section!r}")
    known = ", ".join(LARRY_TAIL_KEYS)
    values: dict[str, Any] = {}
    for name, value in section.items():
        kind = LARRY_TAIL_KEYS.get(name)
        if kind is None:
            raise PatchConfigError(f"unknown key additional_config.{key}.{name} (known: {known})")
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise PatchConfigError(
                    f"additional_config.{key}.{name} must be a number, got {value!r}"
                )
            value = float(value)
        elif not isinstance(value, str):
            raise PatchConfigError(
                f"additional_config.{key}.{name} must be a string, got {value!r}"
            )
        values[name] = value
    try:
        return TailParams(**values)
    except ValueError as exc:
        raise PatchConfigError(f"additional_config.{key}: {exc}") from exc


def default_stats_dir() -> Path:
    """``/dev/shm`` where it exists (RAM-backed), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def stats_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The snapshot prefix: `STATS_PREFIX_ENV` if set, else ``<shm>/sal-stats``.

    The fixed default suits one replica per host (a container); the launcher always sets a
    per-launch prefix, so several replicas on one host do not collide.
    """
    env = os.environ if environ is None else environ
    value = env.get(STATS_PREFIX_ENV)
    return value if value else str(default_stats_dir() / DEFAULT_STATS_BASENAME)


def dp_local_count(config_value: int, environ: Mapping[str, str] | None = None) -> int:
    """Local data-parallel engine count: the larger of vLLM's config and `DP_LOCAL_ENV`."""
    env = os.environ if environ is None else environ
    try:
        from_env = int(env.get(DP_LOCAL_ENV, "0"))
    except ValueError:
        from_env = 0
    return max(1, config_value, from_env)
