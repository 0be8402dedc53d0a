"""LoRA slots through the gateway (fake backends, real sockets).

vLLM does not start a request whose adapter would make its batch hold more than
``--max-loras`` adapters: it waits, however idle the replica otherwise looks. What a user
would notice if this broke: requests for an adapter queue behind another adapter's on a
replica whose slots are full while a replica with a free slot stands by; or, with every
slot full everywhere, requests refused instead of queued. The replicas' slots come from
``/stats`` (``sal-stats/1.2``) or, for stock vLLM, from ``vllm:lora_requests_info``.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import httpx
import pytest

from engine_sim.fake_vllm import FakeBehaviour, default_stats
from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

RELAXED = {"stale_after_s": 5.0, "poll_timeout_s": 2.0, "eject_after_failures": 5}
QUICK_MODELS = {"models": [{"models_refresh_s": 0.2}]}
"""Re-read each replica's ``/v1/models`` often: the adapters are loaded after the gateway
started, and the tests wait until it knows that both replicas serve them (a first request
for a new name is served by the replica that lists it first)."""


def _ask(rig: Rig, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 2}
    return httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30.0)


def _sent(rig: Rig, index: int, model: str) -> int:
    return [b.get("model") for b in rig.fakes[index].received].count(model)


def _slot_decisions(rig: Rig, outcome: str) -> float:
    return metric(rig.metrics(), "sal_lora_slot_decisions_total", outcome=outcome) or 0.0


def _slots(rig: Rig, running: list[tuple[str, ...]]) -> None:
    """Every fake serves lora-a and lora-b with one LoRA slot; `running[i]` holds fake i's."""
    for fake, names in zip(rig.fakes, running, strict=True):
        fake.adapters = ("lora-a", "lora-b")
        fake.stats = dataclasses.replace(default_stats(), max_loras=1, lora_running=names)


def _seen_by_gateway(rig: Rig, running: list[tuple[str, ...]]) -> bool:
    """Whether the gateway's last polls carry `running` and both replicas list the adapters."""
    return _seen_by_gateway_slots(rig, running, 1)


def _seen_by_gateway_slots(rig: Rig, running: list[tuple[str, ...]], max_loras: int) -> bool:
    """`_seen_by_gateway`, with `max_loras` slots per replica."""
    catalog = rig.runtime.catalog
    for name in ("lora-a", "lora-b"):
        served = catalog.served(name)
        if served is None or len(served.urls) != len(rig.fakes):
            return False
    backends = rig.runtime.table.backends(MODEL)
    stats = [b.stats for b in backends]
    return [s.lora_running if s else None for s in stats] == running and all(
        s is not None and s.max_loras == max_loras for s in stats
    )


@pytest.mark.parametrize("policy", ["sal", "round_robin"])
def test_an_adapter_goes_where_a_lora_slot_is_free(tiny_model_dir: Path, policy: str) -> None:
    with gateway_rig(
        2, tokenizer=tiny_model_dir, routing={**RELAXED, "policy": policy}, extra=QUICK_MODELS
    ) as rig:
        running = [("lora-a",), ()]
        _slots(rig, running)
        wait_until(lambda: _seen_by_gateway(rig, running))
        for _ in range(6):
            assert _ask(rig, "lora-b").status_code == 200
        # Replica a's only slot is lora-a's: every lora-b request went to b (SAL's tie-break
        # and round robin's rotation would both have sent some, or all, to a).
        assert _sent(rig, 1, "lora-b") == 6
        assert _sent(rig, 0, "lora-b") == 0
        assert _slot_decisions(rig, "steered") >= 6
        # The adapter's own series (its requests also count under the model).
        text = rig.metrics()
        labels = {"model": MODEL, "adapter": "lora-b"}
        assert metric(text, "sal_adapter_requests_total", status="200", **labels) == 6
        assert metric(text, "sal_adapter_ttft_seconds_count", **labels) == 6
        assert metric(text, "sal_adapter_output_tokens_total", **labels) == 12
        # lora-a can start on a (its adapter is in the batch) and on b once b's polls show
        # its slot free again: nothing keeps it off either.
        for _ in range(4):
            assert _ask(rig, "lora-a").status_code == 200
        assert _sent(rig, 0, "lora-a") + _sent(rig, 1, "lora-a") == 4


def test_routing_lora_slots_false_routes_as_if_the_slots_did_not_exist(
    tiny_model_dir: Path,
) -> None:
    # The comparison switch of `sal-bench lora-real`: round robin blind to the slots sends
    # half of the lora-b requests into replica a, whose only slot lora-a holds.
    routing = {**RELAXED, "policy": "round_robin", "lora_slots": False}
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=routing, extra=QUICK_MODELS) as rig:
        running = [("lora-a",), ()]
        _slots(rig, running)
        wait_until(lambda: _seen_by_gateway(rig, running))
        for _ in range(6):
            assert _ask(rig, "lora-b").status_code == 200
        assert (_sent(rig, 0, "lora-b"), _sent(rig, 1, "lora-b")) == (3, 3)
        assert _slot_decisions(rig, "steered") == 0


def test_with_every_slot_full_the_request_is_still_routed(tiny_model_dir: Path) -> None:
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=RELAXED, extra=QUICK_MODELS) as rig:
        running = [("lora-a",), ("lora-a",)]
        _slots(rig, running)
        wait_until(lambda: _seen_by_gateway(rig, running))
        answers = [_ask(rig, "lora-b").status_code for _ in range(4)]
        assert answers == [200] * 4  # it waits for a slot in some engine, not a 503
        assert _sent(rig, 0, "lora-b") + _sent(rig, 1, "lora-b") == 4
        assert _slot_decisions(rig, "no_free_slot") == 4
        assert _slot_decisions(rig, "steered") == 0


def test_with_every_slot_full_the_request_goes_where_fewest_requests_run(
    tiny_model_dir: Path,
) -> None:
    # Both replicas' only slot is lora-a's; a also runs two long base-model streams, b has
    # a short queue. A lora-b request waits for a slot wherever it goes, and one frees
    # sooner where fewer requests run: b. SAL alone would take a (the shorter queue).
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=RELAXED, extra=QUICK_MODELS) as rig:
        b = rig.fakes[1]
        for fake in rig.fakes:
            fake.behaviour = FakeBehaviour(chunk_delay_s=0.2)
        b.stats = dataclasses.replace(default_stats(), queued_prefill_tokens=100_000)
        wait_until(lambda: _queued(rig) == [0, 100_000])
        gone = threading.Event()
        started: list[str] = []

        def hold() -> None:
            body = {"model": MODEL, "prompt": "long", "max_tokens": 1000, "stream": True}
            with httpx.stream("POST", f"{rig.url}/v1/completions", json=body, timeout=60) as r:
                started.append(r.headers.get("x-fake-backend", "?"))
                for _ in r.iter_lines():
                    if gone.is_set():
                        return

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
        try:
            for thread in threads:
                thread.start()
            wait_until(lambda: len(started) == 2)
            assert started == ["a", "a"]  # b looked busy
            running = [("lora-a",), ("lora-a",)]
            _slots(rig, running)
            b.stats = dataclasses.replace(b.stats, queued_prefill_tokens=500)
            wait_until(lambda: _seen_by_gateway(rig, running) and _queued(rig) == [0, 500])
            for _ in range(3):
                assert _ask(rig, "lora-b").status_code == 200
            assert (_sent(rig, 0, "lora-b"), _sent(rig, 1, "lora-b")) == (0, 3)
            assert _slot_decisions(rig, "no_free_slot") == 3
        finally:
            gone.set()
            for thread in threads:
                thread.join(timeout=30)


def _queued(rig: Rig) -> list[int | None]:
    """The queued prefill tokens of each backend's last poll, as the gateway saw them."""
    return [
        None if b.stats is None else b.stats.queued_prefill_tokens
        for b in rig.runtime.table.backends(MODEL)
    ]


def test_stock_vllm_slots_come_from_its_lora_requests_info(tiny_model_dir: Path) -> None:
    # No /stats (stock vLLM): vllm:lora_requests_info, whose newest series is now's (the
    # fake also serves an older one naming an adapter long gone).
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=RELAXED, extra=QUICK_MODELS) as rig:
        for fake, names in zip(rig.fakes, [("lora-a",), ()], strict=True):
            fake.adapters = ("lora-a", "lora-b")
            fake.behaviour = FakeBehaviour(stats_status=404)
            fake.metrics_max_lora = 1
            fake.metrics_running_loras = names

        def from_metrics() -> bool:
            backends = rig.runtime.table.backends(MODEL)
            served = rig.runtime.catalog.served("lora-b")
            if served is None or len(served.urls) != 2:
                return False
            return all(b.source == "metrics" for b in backends) and [
                b.stats.lora_running if b.stats else None for b in backends
            ] == [("lora-a",), ()]

        wait_until(from_metrics)
        for _ in range(4):
            assert _ask(rig, "lora-b").status_code == 200
        assert _sent(rig, 1, "lora-b") == 4


def _two_slots(rig: Rig, running: list[tuple[str, ...]], queued: list[int]) -> None:
    """Every fake serves lora-a and lora-b with two LoRA slots; fake i runs `running[i]`
    with `queued[i]` prompt tokens waiting."""
    for fake, names, tokens in zip(rig.fakes, running, queued, strict=True):
        fake.adapters = ("lora-a", "lora-b")
        fake.stats = dataclasses.replace(
            default_stats(), max_loras=2, lora_running=names, queued_prefill_tokens=tokens
        )


def _seen_queues(rig: Rig, queued: list[int]) -> bool:
    stats = [b.stats for b in rig.runtime.table.backends(MODEL)]
    return [s.queued_prefill_tokens if s else None for s in stats] == queued


def test_an_adapter_stays_where_it_runs_and_leaves_free_slots_to_others(
    tiny_model_dir: Path,
) -> None:
    """Round robin alone would alternate; the replica already running lora-a takes every
    lora-a request, and b's free slots stay free for other adapters."""
    with gateway_rig(
        2,
        tokenizer=tiny_model_dir,
        routing={**RELAXED, "policy": "round_robin"},
        extra=QUICK_MODELS,
    ) as rig:
        running = [("lora-a",), ()]
        _two_slots(rig, running, [0, 0])
        wait_until(lambda: _seen_by_gateway_slots(rig, running, 2))
        for _ in range(6):
            assert _ask(rig, "lora-a").status_code == 200
        assert (_sent(rig, 0, "lora-a"), _sent(rig, 1, "lora-a")) == (6, 0)
        assert _slot_decisions(rig, "affinity") == 6


def test_an_adapter_takes_a_free_slot_when_its_replica_is_more_than_a_step_behind(
    tiny_model_dir: Path,
) -> None:
    """The replica running lora-a has 50,000 prompt tokens queued (a step is 2,048): a free
    slot on the idle replica is the shorter wait."""
    with gateway_rig(
        2, tokenizer=tiny_model_dir, routing={**RELAXED, "policy": "sal"}, extra=QUICK_MODELS
    ) as rig:
        running = [("lora-a",), ()]
        _two_slots(rig, running, [50_000, 0])
        wait_until(
            lambda: _seen_by_gateway_slots(rig, running, 2) and _seen_queues(rig, [50_000, 0])
        )
        assert _ask(rig, "lora-a").status_code == 200
        assert (_sent(rig, 0, "lora-a"), _sent(rig, 1, "lora-a")) == (0, 1)
        assert _slot_decisions(rig, "affinity") == 0
