"""LoRA slots: send an adapter's request where vLLM can start it now (pure).

vLLM admits a waiting request only if its adapter is already in the batch or the batch holds
fewer than ``--max-loras`` adapters (`vllm/v1/core/sched/scheduler.py`: "Scheduling would
exceed max_loras, skip"). A request whose adapter finds every slot taken waits, however
much KV is free and however short the queue, until every running request of some other
adapter has finished: a wait that neither of SAL's terms sees. The Gateway API Inference
Extension's LoRA affinity filter acts on the same signal (vLLM's ``vllm:lora_requests_info``:
``running_lora_adapters``, ``max_lora``); here it narrows the candidates before any policy
scores them, so every policy keeps its own choice among the replicas that can start the
request.

Among the replicas that can start it, `prefer_running_adapter` keeps the request where its
adapter already runs, unless those replicas' queues are more than one engine step longer than
the others': a request sent to a free slot takes it for as long as the adapter's requests
run there, and the next adapter to need a slot on that replica waits. In the simulator
(``sal-bench lora``: Azure chat and code windows, 32 Zipf-popular adapters, 8 replicas;
docs/results/lora.md, 8 windows), that preference (with the step below) lowered SAL's p95
TTFT 3.7-5.9x against the free-slot filter alone where slots were scarce (chat,
``--max-loras 4``) and p99 4.2x at
``--max-loras 8`` under full load; on code TTFT tied but TGT p50 was 7-12 % longer in 3 of 4
scenarios (an adapter's long requests concentrated on fewer replicas). Always taking the
replica that runs the adapter, whatever its queue, piled popular adapters onto few replicas
in an exploratory run (p95 16-26x worse at ``--max-loras 8`` and full load). One step's
token budget (``max_num_batched_tokens``) is the margin: a replica whose queue is that much
longer delays the request's prefill by about one more step.

When every replica's slots are held, the request waits for one wherever it goes;
`fewest_in_flight` then keeps the replicas with the fewest requests in flight (a slot frees
once every running request of some adapter has ended). On chat with 4 slots at full load
that lowered SAL's p95 and p99 TTFT medians 1.74x and 1.33x (8 windows, ties by the spread;
p99 lower in 7), and tied at half load.

`lora_route` combines the steps for one adapter request, as the gateway and the simulator
call it; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Sequence
from typing import TypeVar

from sal_core.policies import BackendView

K = TypeVar("K", bound=Hashable)
"""An adapter's identity: its name, or a hash of it (`sal_gateway.shared_accounting`)."""


def can_start(adapter: K, max_loras: int, occupied: Collection[K]) -> bool:
    """Whether a request for `adapter` can start on a replica whose batch holds the adapters
    `occupied` out of `max_loras` slots: it is one of them, or a slot is free. ``max_loras``
    0 (LoRA slots unknown: a stock replica without the metric, an older ``/stats``) says
    yes: nothing is known to hold the request back."""
    return max_loras <= 0 or adapter in occupied or len(occupied) < max_loras


def prefer_free_slots(views: Sequence[BackendView], blocked: Collection[str]) -> list[BackendView]:
    """`views` with the backends in `blocked` (URLs where the adapter would wait for a slot)
    made ineligible, as long as some eligible backend is not blocked; otherwise `views`
    unchanged (every replica is full: the policy weighs them as usual, the request waits for
    a slot wherever it goes). Positions and URLs never change, so a policy's per-pool state
    (round robin's place) stays the pool's."""
    if not blocked or not any(v.eligible and v.url not in blocked for v in views):
        return list(views)
    return [
        dataclasses.replace(v, eligible=False) if v.eligible and v.url in blocked else v
        for v in views
    ]


def prefer_running_adapter(
    views: Sequence[BackendView], holders: Collection[str]
) -> list[BackendView]:
    """`views` narrowed to the eligible backends in `holders` (URLs whose batch holds the
    request's adapter, or that were sent one of its requests since their last poll) whose
    queued prefill is at most one step (their ``max_num_batched_tokens``) above the least
    queued of the other eligible backends; unchanged when no holder qualifies or when every
    eligible backend is a holder (nothing to prefer). Positions and URLs never change."""
    eligible = [v for v in views if v.eligible]
    others = [v.queued_prefill_tokens for v in eligible if v.url not in holders]
    if not others:
        return list(views)
    floor = min(others)
    keep = {
        v.url
        for v in eligible
        if v.url in holders and v.queued_prefill_tokens <= floor + max(1, v.max_num_batched_tokens)
    }
    if not keep:
        return list(views)
    return [
        dataclasses.replace(v, eligible=False) if v.eligible and v.url not in keep else v
        for v in views
    ]


def fewest_in_flight(views: Sequence[BackendView]) -> list[BackendView]:
    """`views` narrowed to the eligible backends with the fewest requests in flight (the
    policy chooses among those). For a request that waits for a LoRA slot wherever it goes:
    a slot frees once every running request of some adapter has ended, sooner where fewer
    requests run, whatever the queue of prompt tokens. Positions and URLs never change."""
    eligible = [v for v in views if v.eligible]
    if not eligible:
        return list(views)
    low = min(v.in_flight for v in eligible)
    return [
        dataclasses.replace(v, eligible=False) if v.eligible and v.in_flight > low else v
        for v in views
    ]


def lora_route(
    views: Sequence[BackendView],
    blocked: Collection[str],
    holders: Collection[str],
    *,
    when_full: bool = True,
) -> tuple[list[BackendView], str | None]:
    """The candidates for one adapter request: `prefer_free_slots` (`blocked`: URLs where it
    would wait for a slot), then `prefer_running_adapter` (`holders`); when every eligible
    backend is blocked (and `when_full`), `fewest_in_flight`. Also what decided it (None:
    nothing changed): ``"affinity"`` (passed over replicas with a free slot for one running
    the adapter), ``"steered"`` (passed over replicas whose slots other adapters hold) or
    ``"no_free_slot"`` (every eligible replica's slots are held: the request waits for one
    wherever it goes)."""
    outcome = None
    narrowed = list(views)
    if any(v.eligible and v.url in blocked for v in views):
        free = any(v.eligible and v.url not in blocked for v in views)
        outcome = "steered" if free else "no_free_slot"
        narrowed = prefer_free_slots(views, blocked)
        if not free and when_full:
            narrowed = fewest_in_flight(narrowed)
    if holders:
        preferred = prefer_running_adapter(narrowed, holders)
        if [v.eligible for v in preferred] != [v.eligible for v in narrowed]:
            outcome = "affinity"
        narrowed = preferred
    return narrowed, outcome
