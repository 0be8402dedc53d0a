"""TGI's admission rule (Hugging Face text-generation-inference's router), pure.

As the scheduler overview in the seed documents describes it, and as TGI's batching loop
implements it: requests wait in FCFS order; a new prefill batch is started at once when
nothing runs; while a batch decodes, new requests join only when at least
``floor(running * waiting_served_ratio)`` of them can join together (enough waiting work to
be worth pausing decode for), or when the running batch has decoded `max_waiting_tokens`
steps since the last admission (then whatever fits joins). TGI reserves each request's
prompt plus its full ``max_new_tokens`` of KV up front, so nothing is ever preempted (the
engine model's `TgiScheduler` does the reservation).

`TgiAdmission` is one engine's state (decode steps since the last admission). The engine
model calls `admission_open` once per step, `admitted` per admitted request and `stepped`
after each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TgiParams:
    """TGI's launcher options of the same names."""

    waiting_served_ratio: float = 1.2
    """``--waiting-served-ratio`` (the value the seed's overview quotes)."""
    max_waiting_tokens: int = 20
    """``--max-waiting-tokens``: decode steps after which waiting requests join anyway."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.waiting_served_ratio) and self.waiting_served_ratio >= 0):
            raise ValueError(
                f"waiting_served_ratio must be a finite number >= 0, got "
                f"{self.waiting_served_ratio!r}"
            )
        if self.max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1, got {self.max_waiting_tokens}")


def count_fitting(
    reserve_blocks: Sequence[int],
    prompt_tokens: Sequence[int],
    *,
    free_blocks: int,
    free_slots: int,
    prefill_budget_tokens: int,
    enough: int | None = None,
) -> int:
    """How many requests from the head of the queue can join one prefill batch together.

    In order, while each one's `reserve_blocks` fit the remaining `free_blocks`, a sequence
    slot is free and the prompts so far fit `prefill_budget_tokens` (the first always counts
    against the budget, as chunked prefill will split it). Stops early at `enough`.
    """
    count = 0
    blocks_left = free_blocks
    tokens = 0
    for blocks, prompt in zip(reserve_blocks, prompt_tokens, strict=True):
        if count >= free_slots or blocks > blocks_left:
            break
        if count > 0 and tokens + prompt > prefill_budget_tokens:
            break
        blocks_left -= blocks
        tokens += prompt
        count += 1
        if enough is not None and count >= enough:
            break
    return count


class TgiAdmission:
    """One engine's waiting-served-ratio state."""

    def __init__(self, params: TgiParams) -> None:
        self.params = params
        self.steps_since_admission = 0
        """Decode steps of the running batch since requests last joined it."""

    def min_batch(self, num_running: int) -> int | None:
        """Requests that must be able to join now for admission to open (None: any)."""
        if num_running == 0 or self.steps_since_admission >= self.params.max_waiting_tokens:
            return None
        return max(1, math.floor(num_running * self.params.waiting_served_ratio))

    def admission_open(self, *, num_running: int, fitting: int) -> bool:
        """Whether waiting requests may join now, `fitting` of them being able to."""
        need = self.min_batch(num_running)
        return fitting >= (1 if need is None else need)

    def admitted(self) -> None:
        """A request joined the running batch in this step."""
        self.steps_since_admission = 0

    def stepped(self) -> None:
        """One engine step ran."""
        self.steps_since_admission += 1
