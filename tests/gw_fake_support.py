"""Fixtures for the gateway's integration tests against our fake backends (real sockets).

`gateway_rig()` starts N `FakeBackend`s and the gateway app (uvicorn, each in its own thread,
on 127.0.0.1 with OS-assigned ports) and stops them all on exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_sim.fake_vllm import FakeBackend, ServedApp, ServedBackend
from sal_gateway.app import Resolver, Runtime, create_app
from sal_gateway.config import GatewayConfig, build_config

MODEL = "tiny"

FAST_ROUTING: dict[str, Any] = {
    "poll_interval_s": 0.05,
    # Loose enough that a healthy fake never looks stale on a busy CI box; tests of staleness
    # pass their own tighter values.
    "poll_timeout_s": 1.0,
    "stale_after_s": 3.0,
    "eject_after_failures": 2,
    "seed": 1,
}

DEATH_UNNOTICED: dict[str, Any] = {
    "policy": "round_robin",
    "poll_interval_s": 5.0,
    "stale_after_s": 30.0,
    # Two failed polls (2.5 s apart at least) must not eject a stopped backend before a
    # request tries it on a loaded machine: ejection is not under test where this is used.
    "eject_after_failures": 1000,
}
"""Routing under which the pollers do not notice a stopped backend for seconds: the proxy
must (its connect fails and the request is retried on another backend)."""


def gateway_config(
    backends: list[str],
    *,
    tokenizer: Path | None = None,
    max_model_len: int | None = None,
    routing: dict[str, Any] | None = None,
    proxy: dict[str, Any] | None = None,
    discovery: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> GatewayConfig:
    """`extra` is deep-merged into the config data (lists of mappings item by item), e.g.
    ``{"auth": {"api_keys": ["k"]}, "models": [{"trust_request_chat_template": True}]}``."""
    model: dict[str, Any] = {"name": MODEL, "backends": backends}
    if tokenizer is not None:
        model["tokenizer"] = str(tokenizer)
    if max_model_len is not None:
        model["max_model_len"] = max_model_len
    if discovery is not None:
        model["discovery"] = discovery
    proxy_config: dict[str, Any] = {
        "connect_timeout_s": 1.0,  # short timeouts keep the fault tests quick
        "stream_header_timeout_s": 5.0,
        "total_timeout_s": 30.0,
    }
    proxy_config.update(proxy or {})
    routing_config: dict[str, Any] = dict(FAST_ROUTING)
    routing_config.update(routing or {})
    data = {
        "models": [model],
        "listen": {"host": "127.0.0.1", "port": 0},
        "routing": routing_config,
        "proxy": proxy_config,
    }
    return build_config(_merged(data, extra or {}))


def _merged(base: Any, extra: Any) -> Any:
    if isinstance(base, dict) and isinstance(extra, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in extra.items()}}
    if isinstance(base, list) and isinstance(extra, list) and len(base) == len(extra):
        return [_merged(b, e) for b, e in zip(base, extra, strict=True)]
    return extra


@dataclass
class Rig:
    """Running fakes + gateway."""

    served: list[ServedBackend]
    gateway: ServedApp
    url: str

    @property
    def fakes(self) -> list[FakeBackend]:
        return [s.backend for s in self.served]

    @property
    def runtime(self) -> Runtime:
        runtime: Runtime = self.gateway.app.state.runtime
        return runtime

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5.0).text


@contextmanager
def gateway_rig(
    n_backends: int = 2, resolve: Resolver | None = None, **config_kw: Any
) -> Iterator[Rig]:
    with ExitStack() as stack:
        served = []
        for i in range(n_backends):
            backend = ServedBackend(FakeBackend(name=chr(ord("a") + i), model=MODEL))
            stack.enter_context(backend)
            served.append(backend)
        config = gateway_config([s.url for s in served], **config_kw)
        gateway = ServedApp(create_app(config, resolve=resolve), lifespan=True)
        url = stack.enter_context(gateway)
        rig = Rig(served, gateway, url)
        # Ready: the backends are eligible and a request worker is up (it loads the
        # tokenizers: seconds on a loaded box).
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=5.0).status_code == 200, 60.0)
        yield rig


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Poll `predicate` until true; fail the test after `timeout_s` (a hang guard, not a
    timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(0.02)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` whose labels include `labels`."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
