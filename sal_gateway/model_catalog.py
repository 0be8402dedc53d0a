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
* a name some backends of a configured model serve besides the model's own (a LoRA adapter,
  vLLM's ``--lora-modules`` or ``/v1/load_lora_adapter``; another ``--served-model-name``) is
  listed after that model, with the card its first backend reports plus ``sal_replicas``, and
  is routed within that model's pool to the backends that list it (`ModelCatalog.served`); a
  name served in two configured models' pools belongs to the first in configuration order,
  a configured model's own name is never taken for another's, and a backend that does not
  serve its pool's model (not routable, above) contributes no names.

A name the catalog does not know may have been loaded a moment ago (``/v1/load_lora_adapter``
on the replicas): `ModelCatalog.refresh_now` has every refresh loop read its backends again
and waits for those reads, within a bound; such reads are at least `RETRY_S` apart (requests
naming unknown models cannot make the gateway poll faster than that: a request within
`RETRY_S` of the last read waits for the next).

Each good answer is also handed to ``on_served(url, names)``: the app marks a backend whose
answer lacks its model as not routable for it (`sal_gateway.state`), and such a backend is
re-read every `RETRY_S`, so a replica restarted with the right name serves again within a
second.

A failed read keeps the backend's last good answer (the pollers eject dead backends); a
backend that leaves the pool (discovery) is forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class ServedName:
    """A name backends of a configured model serve besides the model's own name."""

    model: str
    """The configured model whose pool, tokenizer and limits the requests use."""
    urls: frozenset[str]
    """Its backends whose ``/v1/models`` lists the name."""
    adapter: bool
    """A LoRA adapter (its card names a ``parent``): vLLM keys its KV blocks by the adapter,
    so the base model's prefix cache is not its own."""
    listed: bool = True
    """Some backend's ``/v1/models`` lists the name. False: it only matched the model's
    ``resolvable_adapters`` (`adapter_patterns`), and a replica will load it on first use."""


@dataclass(slots=True)
class _Demand:
    """An on-demand refresh, due at `at_s`: the loops still to finish a round begun after
    it woke them."""

    at_s: float
    waiting: set[str]
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    rounds_at_wake: dict[str, int] | None = None
    """Each loop's round number when the demand woke them (None: not yet); a round counts
    for the demand when it began later."""


class ModelCatalog:
    """The last good ``/v1/models`` answer of each (model, backend); main loop only.

    `models`: the configured model names in configuration order (which model a name served
    in several pools belongs to; configured names are never served names).
    """

    def __init__(
        self, models: Sequence[str] = (), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._models = tuple(models)
        self._clock = clock
        self._cards: dict[tuple[str, str], tuple[Card, ...]] = {}
        self._served: dict[str, ServedName] | None = None
        """Served name -> where it is served (rebuilt after a change)."""
        self._wake: dict[str, asyncio.Event] = {}
        self._demand: _Demand | None = None
        self._rounds: dict[str, int] = {}
        """Rounds of reads each refresh loop has begun."""
        self._aliases: dict[str, str] | None = None
        self._change: asyncio.Future[None] | None = None
        """Resolved at the next change of the cards (`find` waits on it)."""

    def update(self, model: str, url: str, cards: tuple[Card, ...]) -> None:
        if self._cards.get((model, url)) != cards:
            self._changed()
        self._cards[(model, url)] = cards

    def _changed(self) -> None:
        """The served names may differ now: rebuild the index on next use, and wake the
        requests waiting for a name (`find`)."""
        self._served = None
        self._aliases = None
        change, self._change = self._change, None
        if change is not None and not change.done():
            change.set_result(None)

    def known(self, model: str, url: str) -> bool:
        return (model, url) in self._cards

    def retain(self, model: str, urls: Sequence[str]) -> None:
        """Forget the backends of `model` not in `urls` (they left the pool)."""
        keep = set(urls)
        for key in [k for k in self._cards if k[0] == model and k[1] not in keep]:
            del self._cards[key]
            self._changed()

    def forget_name(self, model: str, url: str, name: str) -> bool:
        """`url` (of `model`'s pool) answered 404 for `name`: drop it there until the
        backend's next read says otherwise. Whether its last read listed `name`."""
        cards = self._cards.get((model, url))
        if cards is None or not any(c["id"] == name for c in cards):
            return False
        self._cards[(model, url)] = tuple(c for c in cards if c["id"] != name)
        self._changed()
        return True

    # --- names served besides the configured ones ----------------------------------------

    def served(self, name: str) -> ServedName | None:
        """Where `name` is served when it is not a configured model (None: nowhere known)."""
        return self._served_index().get(name)

    def aliases(self) -> dict[str, str]:
        """Every served name -> its configured model (for the body workers' counting; kept
        until the names change: do not modify)."""
        if self._aliases is None:
            self._aliases = {name: s.model for name, s in self._served_index().items()}
        return self._aliases

    def _served_index(self) -> dict[str, ServedName]:
        if self._served is not None:
            return self._served
        configured = set(self._models) | {model for model, _ in self._cards}
        found: dict[str, tuple[str, set[str], bool]] = {}
        order = {m: i for i, m in enumerate(self._models)}
        keys = sorted(self._cards, key=lambda k: (order.get(k[0], len(order)), k[1]))
        for model, url in keys:
            cards = self._cards[(model, url)]
            if not any(c["id"] == model for c in cards):
                continue  # serves another model: not routable for this one (`state`)
            for card in cards:
                name = card["id"]
                if name in configured:
                    continue
                owner = found.get(name)
                if owner is None:
                    found[name] = (model, {url}, card.get("parent") is not None)
                elif owner[0] == model:
                    owner[1].add(url)
        self._served = {
            name: ServedName(model, frozenset(urls), adapter)
            for name, (model, urls, adapter) in found.items()
        }
        return self._served

    # --- reading again on demand ---------------------------------------------------------

    async def find(self, name: str, timeout_s: float) -> ServedName | None:
        """Where `name` is served, reading the backends' model lists again first when it is
        not known (`refresh_now`), and returning as soon as a read shows it, at most after
        `timeout_s`; None: not served anywhere."""
        served = self.served(name)
        if served is not None:
            return served
        demand = self._demand_now()
        if demand is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not demand.done.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if self._change is None:
                self._change = loop.create_future()
            await asyncio.wait(
                (demand.done, self._change), timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            served = self.served(name)
            if served is not None:
                return served
        return self.served(name)

    async def refresh_now(self, timeout_s: float) -> None:
        """Have every running refresh loop read its backends again and wait for those reads
        (rounds begun after the demand), at most `timeout_s`. Demands are at least `RETRY_S`
        apart: within `RETRY_S` of the last one, the next is due then and the call waits for
        it; a pending demand is joined. So however many requests name unknown models, each
        backend's ``/v1/models`` is read at most once per `RETRY_S` on their account (per
        gateway process)."""
        demand = self._demand_now()
        if demand is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(demand.done)

    def _demand_now(self) -> _Demand | None:
        """The pending demand, or a new one (due now, or `RETRY_S` after the last); None
        when no refresh loop runs."""
        demand = self._demand
        if demand is None or demand.done.done():
            if not self._wake:
                return None
            now_s = self._clock()
            start_s = now_s if demand is None else max(now_s, demand.at_s + RETRY_S)
            demand = self._demand = _Demand(start_s, set(self._wake))
            if start_s <= now_s:
                self._wake_loops()
            else:
                asyncio.get_running_loop().call_later(start_s - now_s, self._wake_loops)
        return demand

    def _wake_loops(self) -> None:
        if self._demand is not None:
            self._demand.rounds_at_wake = dict(self._rounds)
        for event in self._wake.values():
            event.set()

    # The refresh loops' side (`refresh_models`).

    def loop_started(self, model: str) -> None:
        self._wake.setdefault(model, asyncio.Event())

    def begin_round(self, model: str) -> int:
        """`model`'s loop begins a round of reads: its number (for `round_done`)."""
        self._rounds[model] = self._rounds.get(model, 0) + 1
        return self._rounds[model]

    async def pause(self, model: str, delay_s: float) -> None:
        """A refresh loop's wait between rounds: `delay_s`, or until a demand wakes it."""
        event = self._wake.setdefault(model, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await event.wait()
        event.clear()

    def round_done(self, model: str, round_number: int) -> None:
        """`model`'s loop finished round `round_number` (`begin_round`)."""
        demand = self._demand
        if demand is None or demand.done.done() or demand.rounds_at_wake is None:
            return
        if round_number <= demand.rounds_at_wake.get(model, 0):
            return  # begun before the demand woke the loops: may predate what it looks for
        demand.waiting.discard(model)
        if not demand.waiting:
            demand.done.set_result(None)

    def loop_stopped(self, model: str) -> None:
        """`model`'s loop ended: no demand waits for it."""
        self._wake.pop(model, None)
        demand = self._demand
        if demand is not None and not demand.done.done():
            demand.waiting.discard(model)
            if not demand.waiting:
                demand.done.set_result(None)

    # --- the gateway's /v1/models --------------------------------------------------------

    def listing(self, pools: Mapping[str, Sequence[str]], now_s: int) -> list[Card]:
        """The ``data`` of ``/v1/models``: `pools` maps each configured model, in order, to
        its backends now (see the module docstring for the rules)."""
        data = []
        served = self._served_index()
        for model, urls in pools.items():
            answered = [
                (u, self._cards[(model, u)]) for u in sorted(urls) if (model, u) in self._cards
            ]
            if not answered:
                data.append(
                    {"id": model, "object": "model", "created": now_s, "owned_by": "sal-gateway"}
                )
                continue
            serving = [c for _, cards in answered for c in cards if c.get("id") == model]
            if serving:
                data.append({**serving[0], "sal_replicas": len(serving)})
            extra: dict[str, tuple[Card, int]] = {}
            for _, cards in answered:
                for card in cards:
                    name = card["id"]
                    where = served.get(name)
                    if where is None or where.model != model:
                        continue
                    first, n = extra.get(name, (card, 0))
                    extra[name] = (first, n + 1)
            for name in sorted(extra):
                card, n = extra[name]
                data.append({**card, "sal_replicas": n})
        return data


def says_model_missing(body: bytes) -> bool:
    """Whether `body` is vLLM's answer to a model it does not serve: an OpenAI error whose
    ``param`` is ``model`` or whose message is "The model `...` does not exist."."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        return False
    message = error.get("message")
    named = isinstance(message, str) and message.startswith("The model `")
    return error.get("param") == "model" or (named and "does not exist" in str(message))


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
    backend that answered serves (see the module docstring); `ModelCatalog.refresh_now`
    cuts its wait short."""
    try:
        await _refresh_loop(model, backends, fetch, catalog, interval_s, on_served)
    finally:
        catalog.loop_stopped(model)


async def _refresh_loop(
    model: str,
    backends: Callable[[], list[str]],
    fetch: Fetch,
    catalog: ModelCatalog,
    interval_s: float,
    on_served: Callable[[str, tuple[str, ...]], None] | None,
) -> None:
    elsewhere: set[str] = set()
    catalog.loop_started(model)

    async def read(url: str) -> None:
        # Each backend's answer is used as soon as it comes: a slow one does not hold back
        # the others (nor the requests waiting for a name, `ModelCatalog.find`).
        cards = await fetch(url)
        if cards is None:
            return
        catalog.update(model, url, cards)
        names = tuple(str(c["id"]) for c in cards)
        if model in names:
            elsewhere.discard(url)
        else:
            elsewhere.add(url)
        if on_served is not None:
            on_served(url, names)

    while True:
        round_number = catalog.begin_round(model)
        urls = backends()
        catalog.retain(model, urls)
        elsewhere.intersection_update(urls)
        async with asyncio.TaskGroup() as group:
            for url in urls:
                group.create_task(read(url))
        catalog.round_done(model, round_number)
        waiting = bool(elsewhere) or any(not catalog.known(model, u) for u in urls)
        await catalog.pause(model, min(RETRY_S, interval_s) if waiting else interval_s)
