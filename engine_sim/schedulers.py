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

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sal_core.larry import LarryParams, larry_order
from sal_core.larry_tail import TailGuard, TailParams, admits_with_headroom, headroom_blocks
from sal_core.tgi import TgiAdmission, TgiParams, count_fitting

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

    def order_due(self, now_s: float) -> bool:
        """Whether the order must be recomputed although the queue did not change (a
        time-dependent order, e.g. a request became due); checked once per step."""
        return False

    def admission_open(
        self, waiting: Sequence[SimRequest], running: Sequence[SimRequest], free_blocks: int
    ) -> bool:
        """Whether this step may admit waiting requests at all (TGI); once per step."""
        return True

    def admits(self, needed_blocks: int, free_blocks: int, num_running: int) -> bool:
        """Whether the waiting head needing `needed_blocks` is admitted (vLLM: it fits);
        False stops the scan. Once per admission attempt."""
        return needed_blocks <= free_blocks

    def observe_step(
        self,
        end_s: float,
        duration_s: float,
        prefill_tokens: int,
        backlogged: bool,
        running_prefill_tokens: int,
    ) -> None:
        """After every step: it ended at `end_s`, lasted `duration_s`, prefilled
        `prefill_tokens`; `backlogged`: a request was waiting once the running requests were
        scheduled (requests this step preempted included; the vLLM patch looks before its
        running phase, which differs only in a step that preempts with nothing waiting);
        `running_prefill_tokens`: prefill left in running requests now."""


class FcfsScheduler(EngineScheduler):
    """vLLM's stock FCFS order with recompute preemption of the last running request."""


class LarryScheduler(EngineScheduler):
    """LARRY: waiting queue sorted by `sal_core.larry.larry_order` (the vLLM patch's code).

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


class LarryTailScheduler(EngineScheduler):
    """LARRY with the tail guard (`sal_core.larry_tail`, the vLLM patch's code).

    Requests whose FCFS wait is due are pinned ahead of LARRY's order; admissions keep a
    KV headroom while others run. The drain rate comes from `observe_step`, the queued
    prefill tokens from the waiting queue plus the running requests' remaining prefill.
    """

    name = "larry_tail"
    reorders = True

    def __init__(self, config: EngineConfig, params: TailParams | None = None) -> None:
        super().__init__(config)
        if params is None:
            params = (
                TailParams()
                if config.tail_margin_s is None
                else TailParams(margin_s=config.tail_margin_s)
            )
        self.params = params
        self.guard = TailGuard(
            self.params, block_size=config.block_size, kv_blocks_total=config.num_kv_blocks
        )
        self._running_prefill_tokens = 0

    @property
    def alpha(self) -> float | None:
        return self.params.alpha

    def order_due(self, now_s: float) -> bool:
        return now_s >= self.guard.next_due_s

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        queued = self._running_prefill_tokens + sum(_uncomputed_tokens(r) for r in waiting)
        return self.guard.order(
            waiting,
            now_s=now_s,
            queued_tokens=queued,
            arrival_s=_arrival_s,
            uncomputed_tokens=_uncomputed_tokens,
            request_id=_request_id,
        )

    def admits(self, needed_blocks: int, free_blocks: int, num_running: int) -> bool:
        return self.guard.admits(needed_blocks, free_blocks, num_running)

    def observe_step(
        self,
        end_s: float,
        duration_s: float,
        prefill_tokens: int,
        backlogged: bool,
        running_prefill_tokens: int,
    ) -> None:
        self._running_prefill_tokens = running_prefill_tokens
        self.guard.observe_step(duration_s, prefill_tokens, backlogged)


class HeadroomFcfsScheduler(EngineScheduler):
    """FCFS with the tail guard's KV headroom on admission (and nothing else)."""

    name = "fcfs_headroom"

    def __init__(self, config: EngineConfig, headroom: float | None = None) -> None:
        super().__init__(config)
        fraction = TailParams().headroom if headroom is None else headroom
        self.reserve_blocks = headroom_blocks(fraction, config.num_kv_blocks + 1)

    def admits(self, needed_blocks: int, free_blocks: int, num_running: int) -> bool:
        return admits_with_headroom(needed_blocks, free_blocks, num_running, self.reserve_blocks)


class TgiScheduler(EngineScheduler):
    """TGI's admission (`sal_core.tgi`): FCFS, prompt + full output reserved up front, and
    while a batch decodes, new requests join only when enough of them fit
    (waiting-served ratio) or the running batch has decoded `max_waiting_tokens` steps
    since the last admission. Nothing is ever preempted."""

    name = "tgi"
    preemptive = False

    def __init__(self, config: EngineConfig, params: TgiParams | None = None) -> None:
        super().__init__(config)
        self.tgi = TgiAdmission(params or TgiParams())

    def reserve_tokens(self, req: SimRequest, num_new_tokens: int) -> int:
        return req.prompt_tokens + req.output_tokens

    def admission_open(
        self, waiting: Sequence[SimRequest], running: Sequence[SimRequest], free_blocks: int
    ) -> bool:
        need = self.tgi.min_batch(len(running))
        if need is None:
            return True
        cfg = self.config
        head = list(itertools.islice(waiting, need))
        fitting = count_fitting(
            [-(-(r.prompt_tokens + r.output_tokens) // cfg.block_size) for r in head],
            [r.prompt_tokens + r.output_done for r in head],
            free_blocks=free_blocks,
            free_slots=cfg.max_num_seqs - len(running),
            prefill_budget_tokens=cfg.max_num_batched_tokens,
            enough=need,
        )
        return fitting >= need

    def admits(self, needed_blocks: int, free_blocks: int, num_running: int) -> bool:
        ok = needed_blocks <= free_blocks
        if ok:
            self.tgi.admitted()
        return ok

    def observe_step(
        self,
        end_s: float,
        duration_s: float,
        prefill_tokens: int,
        backlogged: bool,
        running_prefill_tokens: int,
    ) -> None:
        self.tgi.stepped()


def _arrival_s(req: SimRequest) -> float:
    return req.arrival_s


def _uncomputed_tokens(req: SimRequest) -> int:
    # A waiting request's cached prefix needs neither compute nor new blocks (vLLM-side
    # LARRY counts uncached blocks the same way); `prefix_hit_tokens` is 0 without caching.
    return req.prompt_tokens + req.output_done - req.num_computed_tokens - req.prefix_hit_tokens


def _request_id(req: SimRequest) -> str:
    return req.request_id


ENGINE_SCHEDULERS: dict[str, Callable[[EngineConfig], EngineScheduler]] = {
    "fcfs": FcfsScheduler,
    "larry": LarryScheduler,
    "no_preempt": NoPreemptScheduler,
    "trail_plus": TrailPlusScheduler,
    "larry_tail": LarryTailScheduler,
    "fcfs_headroom": HeadroomFcfsScheduler,
    "tgi": TgiScheduler,
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
