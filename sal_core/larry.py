"""LARRY's ordering (Kossmann et al.), as a pure function shared by vLLM and the simulator.

    score(r) = alpha * wait_time_s(r) - queue_len * memory(r)

`memory(r)` is the number of KV blocks r's uncomputed prompt needs. The waiting queue is
sorted by score, highest first, ties broken by earlier arrival (then by request id, so the
order is total and deterministic). Callers: the vLLM scheduler mixin once per `schedule()`
call, and the simulator's engine model once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

DEFAULT_ALPHA = 1.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LarryParams:
    """LARRY's tunables (from ``--additional-config '{"larry": {...}}'`` in vLLM)."""

    alpha: float = DEFAULT_ALPHA
    """Weight of waiting time (per second); ``alpha >= ~1000`` degenerates to FCFS."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise ValueError(f"larry.alpha must be a finite number >= 0, got {self.alpha!r}")


def memory_blocks(uncomputed_tokens: int, block_size: int) -> int:
    """KV blocks needed for `uncomputed_tokens` tokens: ``ceil(tokens / block_size)``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return -(-max(0, uncomputed_tokens) // block_size)


def larry_score(wait_time_s: float, queue_len: int, memory: int, alpha: float) -> float:
    """The score of one waiting request; higher is scheduled first."""
    return alpha * wait_time_s - queue_len * memory


def larry_order(
    items: Iterable[T],
    *,
    now_s: float,
    alpha: float,
    block_size: int,
    arrival_s: Callable[[T], float],
    uncomputed_tokens: Callable[[T], int],
    request_id: Callable[[T], str],
) -> list[T]:
    """Return `items` sorted by LARRY score (descending), stable by arrival then id.

    `queue_len` is the number of items given. Accessors keep this independent of vLLM's
    `Request` and of the simulator's request type.
    """
    pending = list(items)
    queue_len = len(pending)

    def key(item: T) -> tuple[float, float, str]:
        wait = max(0.0, now_s - arrival_s(item))
        mem = memory_blocks(uncomputed_tokens(item), block_size)
        return (-larry_score(wait, queue_len, mem, alpha), arrival_s(item), request_id(item))

    return sorted(pending, key=key)
