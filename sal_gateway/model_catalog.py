"""The gateway's ``/v1/models``: the union of what its replicas say they serve, per model.

A client's ``GET /v1/models`` never calls upstream: `refresh_models()` (one task per configured
model, started in the app's lifespan) reads each backend's ``/v1/models`` every
``models[].models_refresh_s`` (and every `RETRY_S` until a backend has answered once), and
`ModelCatalog` keeps the last good answer per backend. `ModelCatalog.listing()` builds the
answer:

* a configured model that at least one of its backends serves is listed with the card that
  backend reports (vLLM's ``created``, ``owned_by``, ``root``, ``max_model_len``, ...), plus
  ``sal_replicas``: how many of its backends serve it;
* a configured model none of whose backends has answered yet is listed from the configuration
  (``owned_by: sal-gateway``), as before the first refresh;
* a configured model whose backends answered without it (they serve another name: requests
  would meet vLLM's 404) is not listed;
* names a replica serves that are not configured models (another served name, LoRA adapters)
  are not listed: the gateway routes by configured model only.

Each good answer is also handed to ``on_served(url, names)``: the app marks a backend whose
answer lacks its model as not routable for it (`sal_gateway.state`), and such a backend is
re-read every `RETRY_S`, so a replica restarted with the right name serves again within a
second.

A failed read keeps the backend's last good answer (the pollers eject dead backends); a
backend that leaves the pool (discovery) is forgotten.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp

logger = logging.getLogger("sal_gateway.models")

RETRY_S = 1.0
"""Re-read a backend that has not answered yet this often (it may still be starting)."""
MAX_MODELS_BYTES = 1 << 20
"""A ``/v1/models`` answer larger than this is ignored (a replica lists a few models)."""
MAX_CARDS = 1000
READ_TIMEOUT_S = 5.0
"""One read of a backend's ``/v1/models``, all of it."""

Card = dict[str, Any]
Fetch = Callable[[str], Awaitable[tuple[Card, ...] | None]]
"""``fetch(backend_url)``: the backend's model cards, or None when the read failed."""


class ModelCatalog:
    """The last good ``/v1/models`` answer of each (model, backend); main loop only."""

    def __init__(self) -> None:
        self._cards: dict[tuple[str, str], tuple[Card, ...]] = {}

    def update(self, model: str, url: str, cards: tuple[Card, ...]) -> None:
        self._cards[(model, url)] = cards

    def known(self, model: str, url: str) -> bool:
        return (model, url) in self._cards

    def retain(self, model: str, urls: Sequence[str]) -> None:
        """Forget the backends of `model` not in `urls` (they left the pool)."""
        keep = set(urls)
        for key in [k for k in self._cards if k[0] == model and k[1] not in keep]:
            del self._cards[key]

    def listing(self, pools: Mapping[str, Sequence[str]], now_s: int) -> list[Card]:
        """The ``data`` of ``/v1/models``: `pools` maps each configured model, in order, to
        its backends now (see the module docstring for the rules)."""
        data = []
        for model, urls in pools.items():
            answered = [self._cards[(model, u)] for u in sorted(urls) if (model, u) in self._cards]
            if not answered:
                data.append(
                    {"id": model, "object": "model", "created": now_s, "owned_by": "sal-gateway"}
                )
                continue
            serving = [c for cards in answered for c in cards if c.get("id") == model]
            if serving:
                data.append({**serving[0], "sal_replicas": len(serving)})
        return data


def parse_cards(body: bytes) -> tuple[Card, ...] | None:
    """The model cards of a ``/v1/models`` answer; None when it is not one."""
    if len(body) > MAX_MODELS_BYTES:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list) or len(data) > MAX_CARDS:
        return None
    return tuple(c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str))


def http_fetch(
    session: aiohttp.ClientSession, headers: Mapping[str, str], timeout_s: float
) -> Fetch:
    """A `Fetch` reading ``GET {url}/v1/models`` within `timeout_s` through `session`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def fetch(url: str) -> tuple[Card, ...] | None:
        try:
            async with session.get(f"{url}/v1/models", headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                body = await resp.content.read(MAX_MODELS_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.debug("reading %s/v1/models failed: %s", url, exc)
            return None
        return parse_cards(body)

    return fetch


async def refresh_models(
    model: str,
    backends: Callable[[], list[str]],
    fetch: Fetch,
    catalog: ModelCatalog,
    interval_s: float,
    on_served: Callable[[str, tuple[str, ...]], None] | None = None,
) -> None:
    """Keep `catalog` current for `model` until cancelled, telling `on_served` what each
    backend that answered serves (see the module docstring)."""
    elsewhere: set[str] = set()
    while True:
        urls = backends()
        catalog.retain(model, urls)
        elsewhere.intersection_update(urls)
        results = await asyncio.gather(*(fetch(u) for u in urls))
        for url, cards in zip(urls, results, strict=True):
            if cards is None:
                continue
            catalog.update(model, url, cards)
            names = tuple(str(c["id"]) for c in cards)
            if model in names:
                elsewhere.discard(url)
            else:
                elsewhere.add(url)
            if on_served is not None:
                on_served(url, names)
        waiting = bool(elsewhere) or any(not catalog.known(model, u) for u in urls)
        await asyncio.sleep(min(RETRY_S, interval_s) if waiting else interval_s)
