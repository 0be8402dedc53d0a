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

The gateway calls `can_start` per candidate and `prefer_free_slots` once per adapter
request; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from sal_core.policies import BackendView


def can_start(adapter: str, max_loras: int, occupied: Collection[str]) -> bool:
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
