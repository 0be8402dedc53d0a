"""Engine scheduling policies of the engine model, registered by name (pure, no I/O).

A policy decides three things and nothing else; the mechanics (budgets, KV blocks,
preemption, chunked prefill) live in `engine_sim.engine.EngineModel`, which mirrors
vLLM V1's `Scheduler.schedule()`:

* the order of the waiting queue (re-computed each step when the queue changed);
* the victim when a running request cannot get a KV block (vLLM: the last running one);
* how many KV tokens an admitted request reserves (vLLM: what its first chunk needs).

`trail_plus` adds a fourth: which running request to preempt so a shorter waiting one
can run (SRPT with the TRAIL threshold ``c``).

Registry: `ENGINE_SCHEDULERS` maps the names used by the simulator CLI and the emulator
(``fcfs``, ``larry``, ``no_preempt``, ``trail_plus``) to their classes; `make_scheduler`
builds one from an `EngineConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine_patch.larry import LarryParams, larry_order

if TYPE_CHECKING:
    from engine_sim.engine import EngineConfig, SimRequest


def _remaining_output(req: SimRequest) -> int:
    return req.output_tokens - req.output_done


class EngineScheduler:
    """FCFS, vLLM V1's default: arrival order, preempted requests go back to the front.

    Subclasses override the hooks below. Hooks are called by `EngineModel.step()`: at most
    once per step for `order_waiting` / `srpt_victim`, once per needed preemption for
    `victim_index`, once per admission for `reserve_tokens`.
    """

    name = "fcfs"
    reorders = False
    """Whether `order_waiting` must be called when the waiting queue changed."""
    preemptive = True
    """Whether the engine may preempt running requests at all."""
    srpt = False
    """Whether `srpt_victim` is consulted before each step."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @property
    def alpha(self) -> float | None:
        """LARRY's alpha as reported in `/stats` (None for other policies)."""
        return None

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        """The waiting queue in admission order (head first)."""
        return list(waiting)

    def victim_index(self, running: Sequence[SimRequest], start: int) -> int:
        """Index (>= `start`) of the running request to preempt when KV runs out.

        Only indices >= `start` are candidates: those before it are already scheduled in
        this step (vLLM FCFS preempts ``running[-1]``, which is never one of them).
        """
        return len(running) - 1

    def reserve_tokens(self, req: SimRequest, num_new_tokens: int) -> int:
        """KV tokens to allocate when `req` is admitted with its first `num_new_tokens`."""
        return num_new_tokens

    def srpt_victim(self, head: SimRequest, running: Sequence[SimRequest]) -> int | None:
        """Index of a running request to preempt in favour of waiting `head`, or None."""
        return None


class FcfsScheduler(EngineScheduler):
    """vLLM's stock FCFS order with recompute preemption of the last running request."""


class LarryScheduler(EngineScheduler):
    """LARRY: waiting queue sorted by `engine_patch.larry.larry_order` (the vLLM patch's code).

    Non-preemptive by design; when KV runs out vLLM's default preemption (last running
    request) still applies, exactly as in the patched vLLM.
    """

    name = "larry"
    reorders = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.params = LarryParams(alpha=config.alpha)

    @property
    def alpha(self) -> float | None:
        return self.params.alpha

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        return larry_order(
            waiting,
            now_s=now_s,
            alpha=self.params.alpha,
            block_size=self.config.block_size,
            arrival_s=_arrival_s,
            uncomputed_tokens=_uncomputed_tokens,
            request_id=_request_id,
        )


class NoPreemptScheduler(EngineScheduler):
    """FCFS that reserves KV for prompt + full output at admission (TensorRT-LLM / Orca).

    A request is admitted only if ``ceil((prompt + output) / block_size)`` blocks are
    free, so running requests never need a block later and nothing is ever preempted.
    """

    name = "no_preempt"
    preemptive = False

    def reserve_tokens(self, req: SimRequest, num_new_tokens: int) -> int:
        return req.prompt_tokens + req.output_tokens


class TrailPlusScheduler(EngineScheduler):
    """TRAIL+: SRPT on the oracle remaining output length, limited preemption.

    Waiting requests are ordered by remaining output tokens (fewest first, then arrival).
    Reading of the paper's threshold ``c`` (TRAIL, Shahout et al.; Kossmann et al. §6):
    a running request may be preempted in favour of a waiting one with fewer remaining
    output tokens only while it is early in its life, i.e. while
    ``output_done <= c * output_tokens``. With ``c = 0`` (the paper's tuned value) only
    requests that have not produced a token yet (still prefilling) can be displaced.
    Among candidates the one with the most remaining output is preempted. When KV runs
    out during a step, the running request with the most remaining output is preempted.
    """

    name = "trail_plus"
    reorders = True
    srpt = True

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        return sorted(waiting, key=lambda r: (_remaining_output(r), r.arrival_s, r.request_id))

    def victim_index(self, running: Sequence[SimRequest], start: int) -> int:
        best = len(running) - 1
        best_key = (-1, 0.0)
        for i in range(start, len(running)):
            r = running[i]
            key = (_remaining_output(r), r.arrival_s)
            if key >= best_key:
                best, best_key = i, key
        return best

    def srpt_victim(self, head: SimRequest, running: Sequence[SimRequest]) -> int | None:
        c = self.config.trail_c
        head_remaining = _remaining_output(head)
        best: int | None = None
        best_key = (head_remaining, 0.0)
        for i, r in enumerate(running):
            remaining = _remaining_output(r)
            if r.output_done > c * r.output_tokens:
                continue
            key = (remaining, r.arrival_s)
            if remaining > head_remaining and key > best_key:
                best, best_key = i, key
        return best


def _arrival_s(req: SimRequest) -> float:
    return req.arrival_s


def _uncomputed_tokens(req: SimRequest) -> int:
    return req.prompt_tokens + req.output_done - req.num_computed_tokens


def _request_id(req: SimRequest) -> str:
    return req.request_id


ENGINE_SCHEDULERS: dict[str, Callable[[EngineConfig], EngineScheduler]] = {
    "fcfs": FcfsScheduler,
    "larry": LarryScheduler,
    "no_preempt": NoPreemptScheduler,
    "trail_plus": TrailPlusScheduler,
}


def make_scheduler(config: EngineConfig) -> EngineScheduler:
    """The policy named by ``config.scheduler``; `ValueError` names the known ones."""
    try:
        factory = ENGINE_SCHEDULERS[config.scheduler]
    except KeyError:
        known = ", ".join(sorted(ENGINE_SCHEDULERS))
        raise ValueError(
            f"unknown engine scheduler {config.scheduler!r} (known: {known})"
        ) from None
    return factory(config)
