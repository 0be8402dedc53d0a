"""Helpers for the deploy/ tests: file locations, compose interpolation, PromQL inspection.

Nothing here talks to Docker or Kubernetes (neither runs where the tests run): the tests check
the files the way those tools would read them, with the schemas and parsers available offline.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import promql_parser
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "sal.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

SCRAPE_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus adds at scrape time (not exported by the gateway itself)."""
PROMETHEUS_SYNTHETIC = frozenset({"up"})
"""Series Prometheus makes up per target (queried by alert rules, exported by nobody)."""


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def render_module() -> ModuleType:
    """``deploy/render_replicas.py`` imported as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("render_replicas", DEPLOY / "render_replicas.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_env(path: Path) -> dict[str, str]:
    result: dict[str, str] = render_module().read_env(path)
    return result


# --- compose variable interpolation ------------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})"
)


class MissingVariable(KeyError):
    """A ``${VAR}`` / ``${VAR:?msg}`` with no value: compose would refuse the file."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Substitute compose variables in every string of `value`, as ``docker compose`` does.

    Supports ``$$``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}`` and
    ``${VAR?err}``. A plain ``${VAR}`` that is unset raises `MissingVariable` (compose would
    substitute an empty string with a warning; for our files that is always a mistake).
    """
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match.group("escaped"):
        return "$"
    name, op, arg = match.group("name"), match.group("op"), match.group("arg")
    present = name in env
    usable = present and (env[name] != "" or (op is not None and not op.startswith(":")))
    if op in (":-", "-"):
        return env[name] if usable else arg
    if op in (":?", "?"):
        if not usable:
            raise MissingVariable(f"{name}: {arg}")
        return env[name]
    if not present:
        raise MissingVariable(name)
    return env[name]


def variables(value: Any) -> Iterator[str]:
    """Names of every compose variable referenced in `value`."""
    if isinstance(value, str):
        for match in _VAR.finditer(value):
            if match.group("name"):
                yield match.group("name")
    elif isinstance(value, list):
        for v in value:
            yield from variables(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from variables(v)


def compose_project(env_file: Path) -> dict[str, Any]:
    """The merged, interpolated compose model that ``docker compose --env-file F`` would see.

    Follows ``COMPOSE_FILE`` (``:``-separated, relative to deploy/) from the env file; services
    of the later files are merged into the earlier ones key by key (mappings merge, other
    values replace), which is all our override file needs.
    """
    result: dict[str, Any] = interpolate(compose_raw(env_file), read_env(env_file))
    return result


def compose_raw(env_file: Path) -> dict[str, Any]:
    """Like `compose_project`, without interpolation (``${VAR}`` left as written)."""
    merged: dict[str, Any] = {}
    for name in read_env(env_file)["COMPOSE_FILE"].split(":"):
        _merge(merged, load_yaml(DEPLOY / name))
    return merged


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = json.loads(json.dumps(value))  # deep copy of plain data


# --- PromQL ------------------------------------------------------------------------------

GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$model": "tiny",
}


@dataclass
class QueryRefs:
    """What one PromQL expression refers to."""

    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def promql_refs(expr: str) -> QueryRefs:
    """Metric names and label names used by `expr` (Grafana variables substituted first).

    Raises ``ValueError`` when the expression does not parse, as Prometheus would reject it.
    """
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    refs = QueryRefs()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                refs.metrics.add(node.name)
            refs.labels.update(m.name for m in node.matchers.matchers if m.name != "__name__")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            refs.labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                refs.labels.update(node.modifier.matching.labels)
            refs.labels.update(node.modifier.group_labels or [])

    promql_parser.walk(promql_parser.parse(expr), visit)
    return refs


def exposition_families(text: str) -> dict[str, set[str]]:
    """Sample names -> label names seen, from Prometheus text exposition.

    Every family announced by ``# TYPE`` contributes its sample names (``_total`` for
    counters; ``_bucket``/``_sum``/``_count`` for histograms) even when it has no samples yet,
    so a labelled metric nobody incremented still counts as exported.
    """
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created", ""),
    }
    families: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            base = name.removesuffix("_total") if kind == "counter" else name
            for suffix in suffixes.get(kind, ("",)):
                families.setdefault(base + suffix, set())
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split()[0]
            labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=\"", rest)) if rest else set()
            families.setdefault(name, set()).update(labels)
    return families
