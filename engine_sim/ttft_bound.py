"""A lower bound on every request's TTFT that no router and no engine order can beat (pure).

What would a perfect router achieve on a workload with prefix reuse? Give each request the
best case at once: it starts the moment it arrives, on a replica doing nothing else, that
still holds every full block of every earlier request (an infinite prefix cache that never
evicts), and it prefills the rest alone in chunks of the engine's token budget. Its TTFT
is then the time of those prefill steps, by the same cost model the engine model uses
(`engine_sim.cost_model.iteration_time_s`, with the engine's exact attention work per
chunk). A real run can only be slower: it waits for other work, shares steps with other
requests' decodes, and finds fewer blocks cached. Because every request's TTFT is at least
its bound, every percentile of the TTFTs is at least the same percentile of the bounds, so
``best baseline's p50 / bound's p50`` is the most any router could gain over that baseline.

The bound is tight where the fleet is lightly loaded and its KV cache holds the reuse; it
is loose where KV memory binds (the infinite cache then credits blocks a real replica has
evicted).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_sim.cost_model import CostProfile, iteration_time_s
from engine_sim.trace import TraceRequest


def best_cached_tokens(requests: Sequence[TraceRequest], block_size: int) -> list[int]:
    """Per request (in the order given), the most prompt tokens any replica could hold.

    That is its leading full blocks that some request arriving earlier computed (prompt or
    output: a multi-turn prompt repeats the earlier turns' replies, which vLLM caches as it
    decodes them; the last output token is sampled, never computed), capped like vLLM's
    lookup at ``(prompt_tokens - 1) // block_size`` blocks so that at least one token is
    computed. Requests arriving at the same instant do not count for each other. Requests
    without `TraceRequest.blocks` share nothing.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    seen: set[int] = set()
    pending: list[list[int]] = []  # keys of requests at the current arrival instant
    current_s: float | None = None
    out = [0] * len(requests)
    for i in order:
        req = requests[i]
        if req.arrival_s != current_s:
            for keys in pending:
                seen.update(keys)
            pending.clear()
            current_s = req.arrival_s
        keys = req.blocks.keys(block_size) if req.blocks is not None else []
        limit = min(len(keys), (req.prompt_tokens - 1) // block_size)
        hit = 0
        while hit < limit and keys[hit] in seen:
            hit += 1
        out[i] = hit * block_size
        pending.append(keys[: (req.prompt_tokens + req.output_tokens - 1) // block_size])
    return out


def isolated_prefill_s(
    profile: CostProfile, prompt_tokens: int, cached_tokens: int, token_budget: int
) -> float:
    """Seconds to prefill a prompt alone on an idle replica, its first `cached_tokens`
    already cached, in chunks of at most `token_budget` tokens (vLLM's chunked prefill
    with ``--max-num-batched-tokens``): the time until its first token.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be > 0, got {token_budget}")
    if not 0 <= cached_tokens < max(1, prompt_tokens):
        raise ValueError(f"cached_tokens {cached_tokens} outside [0, {prompt_tokens})")
    computed = cached_tokens
    left = prompt_tokens - cached_tokens
    total = 0.0
    while left > 0:
        n = min(left, token_budget)
        pairs = n * computed + n * (n + 1) // 2
        total += iteration_time_s(profile, n, 0, computed + n, attention_pairs=pairs)
        computed += n
        left -= n
    return total


def ttft_lower_bounds(
    requests: Sequence[TraceRequest],
    profile: CostProfile,
    *,
    block_size: int = 16,
    token_budget: int = 2048,
    cached_tokens: Sequence[int] | None = None,
) -> list[float]:
    """Per request (in the order given), the TTFT bound of the module docstring.

    `block_size` and `token_budget` must be the engine's (the simulator's defaults: 16
    and 2,048), or the bound is not one. `cached_tokens`: `best_cached_tokens` of the same
    requests and block size, when the caller has it already.
    """
    cached = best_cached_tokens(requests, block_size) if cached_tokens is None else cached_tokens
    return [
        isolated_prefill_s(profile, r.prompt_tokens, c, token_budget)
        for r, c in zip(requests, cached, strict=True)
    ]
