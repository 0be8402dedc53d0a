"""The model catalog: which configured model a served name (LoRA adapter, alias) belongs to,
what ``/v1/models`` lists, and re-reading the replicas on demand without letting unknown
names make the gateway poll them faster than once per `RETRY_S`."""

from __future__ import annotations

import asyncio
import time

import pytest

from sal_gateway.model_catalog import RETRY_S, Card, ModelCatalog, ServedName, refresh_models


def card(name: str, parent: str | None = None) -> Card:
    return {"id": name, "object": "model", "parent": parent}


def fleet() -> ModelCatalog:
    catalog = ModelCatalog(["m1", "m2"])
    catalog.update("m1", "u1", (card("m1"), card("lora-a", "m1"), card("m1-alt")))
    catalog.update("m1", "u2", (card("m1"), card("lora-a", "m1")))
    # u3 (m2's pool) also lists lora-a and the name m1: neither becomes m2's.
    catalog.update("m2", "u3", (card("m2"), card("lora-a", "m2"), card("m1")))
    return catalog


def test_a_served_name_belongs_to_the_first_configured_model_listing_it() -> None:
    catalog = fleet()
    assert catalog.served("lora-a") == ServedName("m1", frozenset({"u1", "u2"}), adapter=True)
    assert catalog.served("m1-alt") == ServedName("m1", frozenset({"u1"}), adapter=False)
    assert catalog.served("m1") is None  # configured names are routed as themselves
    assert catalog.served("nope") is None
    assert catalog.aliases() == {"lora-a": "m1", "m1-alt": "m1"}


def test_a_backend_leaving_or_unloading_takes_its_names_along() -> None:
    catalog = fleet()
    catalog.retain("m1", ["u1"])
    assert catalog.served("lora-a") == ServedName("m1", frozenset({"u1"}), adapter=True)
    catalog.update("m1", "u1", (card("m1"),))  # both unloaded
    assert catalog.served("m1-alt") is None
    # lora-a is still served, by m2's backend now.
    assert catalog.served("lora-a") == ServedName("m2", frozenset({"u3"}), adapter=True)


def test_a_404_for_a_name_drops_it_on_that_backend_only() -> None:
    catalog = fleet()
    assert catalog.forget_name("m1", "u2", "lora-a") is True  # its last read listed it
    assert catalog.served("lora-a") == ServedName("m1", frozenset({"u1"}), adapter=True)
    assert catalog.forget_name("m1", "u2", "lora-a") is False  # forgotten already
    assert catalog.forget_name("m1", "u1", "lora-a") is True
    assert catalog.served("lora-a") == ServedName("m2", frozenset({"u3"}), adapter=True)
    assert catalog.forget_name("m1", "u1", "never-listed") is False
    # A backend that left: nothing to do.
    assert catalog.forget_name("m1", "nowhere", "lora-a") is False
    # The next good read restores it.
    catalog.update("m1", "u1", (card("m1"), card("lora-a", "m1")))
    assert catalog.served("lora-a") == ServedName("m1", frozenset({"u1"}), adapter=True)


def test_listing_shows_served_names_after_their_model() -> None:
    data = fleet().listing({"m1": ["u1", "u2"], "m2": ["u3"]}, now_s=0)
    assert [(c["id"], c["sal_replicas"]) for c in data] == [
        ("m1", 2),
        ("lora-a", 2),
        ("m1-alt", 1),
        ("m2", 1),
    ]
    assert data[1]["parent"] == "m1"


Loops = tuple[ModelCatalog, dict[str, int], dict[str, list[str]], list[asyncio.Task[None]]]


async def _catalog_with_loops(delay_s: float = 0.0) -> Loops:
    """A catalog kept by two refresh loops (models m1 on u1, m2 on u3) that would not read
    again for an hour on their own; what each backend lists is `served`, editable."""
    catalog = ModelCatalog(["m1", "m2"])
    reads = {"u1": 0, "u3": 0}
    served = {"u1": ["m1"], "u3": ["m2"]}

    async def fetch(url: str) -> tuple[Card, ...]:
        reads[url] += 1
        if delay_s:
            await asyncio.sleep(delay_s)
        return tuple(card(n, None if n.startswith("m") else "m1") for n in served[url])

    tasks = [
        asyncio.create_task(refresh_models(m, lambda u=u: [u], fetch, catalog, 3600.0))
        for m, u in (("m1", "u1"), ("m2", "u3"))
    ]
    await asyncio.sleep(0.05)  # first rounds
    return catalog, reads, served, tasks


async def test_refresh_now_reads_every_backend_again_and_finds_a_new_adapter() -> None:
    catalog, reads, served, tasks = await _catalog_with_loops()
    try:
        assert reads == {"u1": 1, "u3": 1}
        served["u1"].append("lora-new")
        assert catalog.served("lora-new") is None
        await catalog.refresh_now(2.0)
        assert reads == {"u1": 2, "u3": 2}
        assert catalog.served("lora-new") == ServedName("m1", frozenset({"u1"}), adapter=True)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_flood_of_unknown_names_costs_one_read_per_retry_period() -> None:
    catalog, reads, _, tasks = await _catalog_with_loops(delay_s=0.05)
    try:
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await asyncio.gather(*(catalog.refresh_now(2.0) for _ in range(200)))
        # All 200 waited for the same re-read, which took one fetch (~50 ms).
        assert reads == {"u1": 2, "u3": 2}
        assert time.monotonic() - started < 1.5
        # Within RETRY_S of the last read: all wait for the next one, RETRY_S after it.
        await asyncio.gather(*(catalog.refresh_now(2.0) for _ in range(200)))
        assert reads == {"u1": 3, "u3": 3}
        assert time.monotonic() - started >= RETRY_S
        await asyncio.sleep(RETRY_S)
        second = time.monotonic()
        await catalog.refresh_now(2.0)  # a second after the last: read at once
        assert reads == {"u1": 4, "u3": 4}
        assert time.monotonic() - second < 0.5
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_refresh_now_is_bounded_when_a_backend_hangs() -> None:
    catalog, _, _, tasks = await _catalog_with_loops()
    try:

        async def hang(url: str) -> tuple[Card, ...]:
            await asyncio.sleep(3600)
            raise AssertionError

        # A round begun after the demand never ends: the caller waits its bound, no more.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tasks = [asyncio.create_task(refresh_models("m1", lambda: ["u1"], hang, catalog, 3600.0))]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        await catalog.refresh_now(0.3)
        assert 0.25 <= time.monotonic() - started < 2.0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_refresh_now_without_loops_returns_at_once() -> None:
    started = time.monotonic()
    await ModelCatalog(["m1"]).refresh_now(5.0)
    assert time.monotonic() - started < 0.5


def test_a_backend_not_serving_its_pools_model_lends_it_no_names() -> None:
    catalog = ModelCatalog(["m1"])
    catalog.update("m1", "u1", (card("other"), card("lora-x", "other")))
    assert catalog.served("other") is None
    assert catalog.served("lora-x") is None
    assert catalog.listing({"m1": ["u1"]}, now_s=0) == []


@pytest.mark.parametrize("parent", [None, "m1"])
def test_a_card_without_parent_is_an_alias_with_one_an_adapter(parent: str | None) -> None:
    catalog = ModelCatalog(["m1"])
    catalog.update("m1", "u1", (card("m1"), card("x", parent)))
    served = catalog.served("x")
    assert served is not None
    assert served.adapter is (parent is not None)


async def test_find_returns_as_soon_as_a_backend_lists_the_name_while_another_hangs() -> None:
    catalog = ModelCatalog(["m1"])
    served = {"u1": ["m1"]}
    slow = asyncio.Event()

    async def fetch(url: str) -> tuple[Card, ...]:
        if url == "u2" and slow.is_set():
            await asyncio.sleep(30)  # an unreachable replica: the read's own timeout is 5 s
        return tuple(card(n, None if n == "m1" else "m1") for n in served.get(url, ["m1"]))

    task = asyncio.create_task(refresh_models("m1", lambda: ["u1", "u2"], fetch, catalog, 3600.0))
    try:
        await asyncio.sleep(0.05)
        slow.set()
        served["u1"].append("lora-new")
        started = time.monotonic()
        found = await catalog.find("lora-new", 2.0)
        assert found == ServedName("m1", frozenset({"u1"}), adapter=True)
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        assert await catalog.find("nope", 0.3) is None  # bounded, though u2 never answers
        assert time.monotonic() - started < 1.5
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
