"""A model of one vLLM V1 replica: queues, KV blocks, continuous batching (pure, no I/O).

`EngineModel.step(now_s)` mirrors vLLM V1's `Scheduler.schedule()` followed by one model
iteration whose duration comes from `engine_sim.cost_model.iteration_time_s`:

1. Running requests first, in admission order: each gets the tokens it still needs —
   one for a decode, the rest of its prompt (capped by the token budget) for a chunked
   prefill. If it cannot get the KV blocks those tokens need, the policy's victim (vLLM:
   the last running request) is preempted — blocks freed, computed tokens reset (recompute
   preemption), pushed to the front of the waiting queue — until it fits or it is itself
   the victim, which ends the running phase.
2. If nothing was preempted in this step, waiting requests in policy order: admitted while
   there is token budget, a free sequence slot (`max_num_seqs`) and free KV blocks for all
   their tokens (`reserve_full_prompt`, vLLM 0.32's default; blocks are then allocated
   chunk by chunk); the first one that does not fit stops the scan (no look-past). Without
   chunked prefill a prompt larger than the remaining budget also stops the scan.
3. The batch "runs" for `duration_s`. A request whose computed tokens catch up with its
   tokens (prompt + outputs so far) samples one output token at ``now_s + duration_s``;
   the first such token is its first token (TTFT), the `output_tokens`-th finishes it.

Token accounting as in vLLM: a request has ``prompt_tokens + output_done`` tokens, of
which ``num_computed_tokens`` have KV; it needs ``ceil(num_computed_tokens /
block_size)`` blocks. A preempted request recomputes its prompt and its outputs so far.

Prefix caching (`EngineConfig.enable_prefix_caching`, off by default; `engine_sim.kv_cache`):
full computed blocks with a key (`SimRequest.block_keys`) stay cached after their request
lets go of them; they count as free and are evicted least recently freed first. At
admission a request's leading cached blocks (at most all but its last token) are reused: no
compute for them, and blocks a running request holds are shared. While a request waits,
its cached prefix is left out of `/stats`' ``queued_prefill_tokens`` and of LARRY's memory
term (re-looked-up whenever the waiting queue's members change, for reordering policies).

Who calls it: the simulator on a virtual clock, the emulator on the wall clock; both
call `step()` only while `has_work()`. Deterministic: no randomness, no clock reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine_sim.cost_model import CostProfile, iteration_time_s
from engine_sim.kv_cache import PrefixCache
from engine_sim.schedulers import ENGINE_SCHEDULERS, EngineScheduler, make_scheduler
from sal_core.stats import ReplicaStats


@dataclass(slots=True)
class SimRequest:
    """One request inside the engine model; the engine fills in the fields after the four."""

    request_id: str
    arrival_s: float
    """Time it reached the engine (same clock as `EngineModel.step`)."""
    prompt_tokens: int
    output_tokens: int
    """Forced output length (``ignore_eos`` + ``max_tokens``)."""
    num_computed_tokens: int = 0
    """Prompt + output tokens whose KV exists (reset to 0 by a preemption)."""
    output_done: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    kv_blocks: int = 0
    """KV blocks the request holds now (engine bookkeeping; with prefix caching, shared
    cached blocks count for every request holding them)."""
    block_keys: Sequence[int] = ()
    """Chained keys of the full blocks of its token stream (`sal_core.prefix.chain_hashes`
    or `engine_sim.workloads.TokenBlocks.keys`): the prompt's, and the output's where a
    later prompt is known to repeat it. Empty: nothing of it is ever reused."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at its first admission (no prefill for them)."""
    prefix_hit_tokens: int = 0
    """While waiting: cached leading tokens at the last lookup (what `/stats` and LARRY's
    memory term leave out); 0 without prefix caching."""
    cached_keys: list[int] = field(default_factory=list)
    """Keys of the cached blocks it holds, in block order (engine bookkeeping)."""
    next_promote: int = 0
    """Index of its first block not yet offered to the cache (engine bookkeeping)."""
    adapter: str | None = None
    """Its LoRA adapter (None: the base model); see `EngineConfig.max_loras`."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine arguments the model honours (names as vLLM's CLI flags)."""

    num_kv_blocks: int
    """KV-cache blocks (vLLM's ``num_gpu_blocks`` minus the null block); see
    `CostProfile.num_kv_blocks`."""
    block_size: int = 16
    """Tokens per KV block (``--block-size``)."""
    max_num_seqs: int = 256
    """Most requests running at once (``--max-num-seqs``)."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget (``--max-num-batched-tokens``); the paper used 1024."""
    enable_chunked_prefill: bool = True
    """Split prompts across steps to fit the token budget (vLLM V1 default: on)."""
    scheduler: str = "fcfs"
    """A name in `engine_sim.schedulers.ENGINE_SCHEDULERS`."""
    alpha: float = 1.0
    """LARRY's waiting-time weight (per second)."""
    trail_c: float = 0.8
    """TRAIL+ preemption threshold: preemptible while ``output_done <= c * output_tokens``."""
    tail_margin_s: float | None = None
    """``larry_tail``'s ``margin_s`` (`sal_core.larry_tail.TailParams`; None: its default),
    what a deployment sets with ``--additional-config '{"larry_tail": {"margin_s": ...}}'``."""
    model_name: str = "tiny"
    """Served model name (reported in `/stats`)."""
    reserve_full_prompt: bool = True
    """Admit a waiting request only if KV blocks for all its tokens to (re)compute are free,
    though blocks are still allocated chunk by chunk (vLLM 0.32's
    ``--scheduler-reserve-full-isl``, on by default). Off: only the first chunk must fit."""
    enable_prefix_caching: bool = False
    """Keep computed full blocks cached and reuse them by `SimRequest.block_keys`
    (``--enable-prefix-caching``; `engine_sim.kv_cache`). Off by default here, so runs
    without it are exactly the model without a cache (vLLM turns it on by default)."""
    max_loras: int = 0
    """LoRA adapters one step's batch may hold (``--max-loras``; 0: LoRA off, no limit). As
    vLLM's scheduler does ("Scheduling would exceed max_loras, skip"), a waiting request
    whose adapter is not in the step's batch when the batch already holds `max_loras`
    adapters is skipped, keeping its place, and the requests behind it are considered. The
    kernels' LoRA cost is not modelled (the same for every router)."""

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {value}")
        if self.scheduler not in ENGINE_SCHEDULERS:
            known = ", ".join(sorted(ENGINE_SCHEDULERS))
            raise ValueError(f"unknown engine scheduler {self.scheduler!r} (known: {known})")
        if self.trail_c < 0:
            raise ValueError(f"EngineConfig.trail_c must be >= 0, got {self.trail_c}")
        if self.max_loras < 0:
            raise ValueError(f"EngineConfig.max_loras must be >= 0, got {self.max_loras}")
        if self.tail_margin_s is not None and not 0 <= self.tail_margin_s < float("inf"):
            raise ValueError(
                f"EngineConfig.tail_margin_s must be a finite number >= 0, got {self.tail_margin_s}"
            )


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one iteration did; tokens appear at ``now_s + duration_s``."""

    duration_s: float
    """Cost-model time of this iteration (0.0 when nothing was scheduled)."""
    new_tokens: list[tuple[str, int]]
    """(request_id, output tokens produced this step)."""
    finished: list[SimRequest]
    preempted: list[str]
    prefill_tokens: int = 0
    """Prompt (or recompute) tokens processed in this step."""
    decode_seqs: int = 0
    """Sequences that decoded one token in this step."""


class _Work(NamedTuple):
    """What one step's batch asks of the GPU (inputs of `iteration_time_s`)."""

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    attention_pairs: int


def _lora_waits(req: SimRequest, loras: set[str], max_loras: int) -> bool:
    """Whether `req` must wait for a LoRA slot: its adapter is not among the step's
    `loras`, which fill all `max_loras` slots (vLLM's scheduler skips it)."""
    return req.adapter is not None and req.adapter not in loras and len(loras) >= max_loras


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class EngineModel:
    """One replica: `add_request`, then `step` while `has_work`; `stats` for `/stats`."""

    def __init__(
        self, config: EngineConfig, profile: CostProfile, policy: EngineScheduler | None = None
    ) -> None:
        """`policy` overrides the scheduler named in `config` (parameter studies)."""
        self.config = config
        self.profile = profile
        self.policy: EngineScheduler = policy or make_scheduler(config)
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._live: dict[str, SimRequest] = {}
        self._free_blocks = config.num_kv_blocks
        self._waiting_dirty = False
        self._latest_arrival_s = float("-inf")
        # Uncomputed tokens of waiting requests (their KV is all gone: prompt + outputs).
        self._waiting_prefill_tokens = 0
        # Remaining prefill of running requests, refreshed at the end of every step.
        self._running_prefill_tokens = 0
        self._step_count = 0
        self._oom_preempted = False
        self._unscheduled_prefill_tokens = 0
        self.num_preemptions = 0
        """Preemptions since start (all requests)."""
        self.cache: PrefixCache | None = (
            PrefixCache(config.num_kv_blocks) if config.enable_prefix_caching else None
        )
        """The prefix cache (None: prefix caching off)."""
        self.prefix_queries_tokens = 0
        """Prompt tokens looked up in the prefix cache at admission (vLLM's
        ``prefix_cache_queries``); with `prefix_hits_tokens`, the achieved hit rate."""
        self.prefix_hits_tokens = 0
        """Of those, tokens found cached (vLLM's ``prefix_cache_hits``)."""

    # --- queries ------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self._free_blocks

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def step_count(self) -> int:
        return self._step_count

    @property
    def queued_prefill_tokens(self) -> int:
        """Uncomputed prompt tokens waiting plus remaining chunked prefill of running ones."""
        return self._waiting_prefill_tokens + self._running_prefill_tokens

    def has_work(self) -> bool:
        """Whether a `step()` would schedule anything (a request is waiting or running)."""
        return bool(self._running) or bool(self._waiting)

    @property
    def cached_blocks(self) -> int:
        """Distinct blocks in the prefix cache now, held or not (0 without caching)."""
        return 0 if self.cache is None else self.cache.cached_blocks

    def cached_prefix(self, keys: Sequence[int]) -> tuple[int, int]:
        """``(cached_blocks, held_blocks)`` of a prompt with block `keys` on this replica now:
        its leading cached blocks and how many of those a live request holds. No side
        effects (the simulator's "precise" cache source reads it, as vLLM's KV events would
        tell a router). ``(0, 0)`` without prefix caching."""
        if self.cache is None:
            return 0, 0
        return self.cache.lookup(keys, len(keys))

    def get(self, request_id: str) -> SimRequest | None:
        """The live (waiting or running) request with this id, if any."""
        return self._live.get(request_id)

    def stats(self, now_s: float) -> ReplicaStats:
        """The `/stats` snapshot (`time` = `now_s`, on the caller's clock)."""
        cfg = self.config
        return ReplicaStats(
            time=now_s,
            step=self._step_count,
            model=cfg.model_name,
            scheduler=self.policy.name,
            alpha=self.policy.alpha,
            block_size=cfg.block_size,
            kv_blocks_total=cfg.num_kv_blocks,
            kv_blocks_free=self._free_blocks,
            free_kv_tokens=self._free_blocks * cfg.block_size,
            queued_prefill_tokens=self.queued_prefill_tokens,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            # sal-stats/1.1: a router can track this replica's prefix cache.
            prefix_caching=self.cache is not None,
            prefix_cache_query_tokens=self.prefix_queries_tokens,
            prefix_cache_hit_tokens=self.prefix_hits_tokens,
            # sal-stats/1.2: LoRA slots.
            max_loras=cfg.max_loras,
            lora_running=self.lora_adapters()[0],
        )

    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(adapters of the running requests, adapters of the waiting ones), each sorted
        and without repeats: what vLLM's ``vllm:lora_requests_info`` labels carry."""
        running = tuple(sorted({r.adapter for r in self._running if r.adapter}))
        waiting = tuple(sorted({r.adapter for r in self._waiting if r.adapter}))
        return running, waiting

    # --- commands -----------------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        """Queue a fresh request. `ValueError` if it is malformed or can never fit."""
        cfg = self.config
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError(
                f"request {req.request_id!r}: prompt_tokens and output_tokens must be >= 1, "
                f"got {req.prompt_tokens} and {req.output_tokens}"
            )
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if req.num_computed_tokens or req.output_done or req.kv_blocks:
            raise ValueError(f"request {req.request_id!r} is not fresh")
        total = req.prompt_tokens + req.output_tokens
        if _blocks(total, cfg.block_size) > cfg.num_kv_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs {total} KV tokens; the engine holds "
                f"{cfg.num_kv_blocks * cfg.block_size}"
            )
        if not cfg.enable_chunked_prefill and total - 1 > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {req.request_id!r} has {total} tokens, more than "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} without chunked prefill"
            )
        self._live[req.request_id] = req
        self._waiting.append(req)
        req.prefix_hit_tokens = self._lookup_hit_tokens(req)
        self._waiting_prefill_tokens += req.prompt_tokens - req.prefix_hit_tokens
        self._waiting_dirty = True
        self._latest_arrival_s = max(self._latest_arrival_s, req.arrival_s)

    def abort(self, request_id: str) -> None:
        """Drop a waiting or running request and free its blocks; unknown ids are ignored."""
        req = self._live.pop(request_id, None)
        if req is None:
            return
        if req in self._running:
            self._running.remove(req)
            self._refresh_running_prefill()
        else:
            self._waiting.remove(req)
            self._waiting_prefill_tokens -= (
                req.prompt_tokens + req.output_done - req.prefix_hit_tokens
            )
            self._waiting_dirty = True
        self._release(req)

    def step(self, now_s: float) -> StepResult:
        """Schedule and run one iteration starting at `now_s` (see the module docstring)."""
        self._step_count += 1
        preempted: list[str] = []
        self._order_waiting(now_s)
        if self.policy.srpt and self._waiting:
            self._srpt_preempt(preempted)
            self._order_waiting(now_s)
        sched: list[SimRequest] = []
        sched_tokens: list[int] = []
        budget, work = self._schedule_running(sched, sched_tokens, preempted)
        backlogged = bool(self._waiting)
        # vLLM admits no waiting request in a step that had to preempt for KV.
        if (
            not self._oom_preempted
            and self._waiting
            and budget > 0
            and self.policy.admission_open(self._waiting, self._running, self._free_blocks)
        ):
            if self.cache is None:
                admitted = self._schedule_waiting(sched, sched_tokens, budget)
            else:
                admitted = self._schedule_waiting_cached(sched, sched_tokens, budget)
            work = _Work(
                work.prefill_tokens + admitted.prefill_tokens,
                work.decode_seqs,
                work.context_tokens + admitted.context_tokens,
                work.attention_pairs + admitted.attention_pairs,
            )
        duration_s = iteration_time_s(
            self.profile,
            work.prefill_tokens,
            work.decode_seqs,
            work.context_tokens,
            attention_pairs=work.attention_pairs,
        )
        new_tokens, finished = self._apply(sched, sched_tokens, now_s + duration_s)
        self.policy.observe_step(
            now_s + duration_s,
            duration_s,
            work.prefill_tokens,
            backlogged,
            self._running_prefill_tokens,
        )
        return StepResult(
            duration_s, new_tokens, finished, preempted, work.prefill_tokens, work.decode_seqs
        )

    # --- scheduling internals -----------------------------------------------------------

    def _order_waiting(self, now_s: float) -> None:
        # LARRY's and TRAIL+'s orders only change when the queue's members change (all
        # waiting times grow alike), so re-sorting on change is exact. An arrival stamped
        # in the future (clamped wait) keeps the queue dirty until it is in the past.
        if not (self.policy.reorders and self._waiting):
            return
        if not (self._waiting_dirty or self.policy.order_due(now_s)):
            return
        if self.cache is not None:
            self._refresh_waiting_hits()
        self._waiting = deque(self.policy.order_waiting(self._waiting, now_s))
        self._waiting_dirty = self._latest_arrival_s > now_s

    def _preempt(self, victim: SimRequest) -> None:
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(victim)
        # Its own blocks are cached now (unless evicted): a re-admission may reuse them.
        victim.prefix_hit_tokens = self._lookup_hit_tokens(victim)
        self._waiting_prefill_tokens += (
            victim.prompt_tokens + victim.output_done - victim.prefix_hit_tokens
        )
        self._waiting_dirty = True

    def _release(self, req: SimRequest) -> None:
        """`req` lets go of its KV blocks (finished, preempted or aborted)."""
        cache = self.cache
        if cache is None:
            self._free_blocks += req.kv_blocks
        else:
            keys = req.cached_keys
            self._free_blocks += cache.release(keys, req.kv_blocks - len(keys))
            req.cached_keys = []
            req.next_promote = 0
        req.kv_blocks = 0

    def _lookup_hit_tokens(self, req: SimRequest) -> int:
        """Leading tokens of waiting `req` the cache would give it now: at most all but its
        last token, as vLLM must compute one token to sample (0 without caching)."""
        if self.cache is None or not req.block_keys:
            return 0
        bs = self.config.block_size
        tokens = req.prompt_tokens + req.output_done
        hit, _ = self.cache.lookup(req.block_keys, (tokens - 1) // bs)
        return hit * bs

    def _refresh_waiting_hits(self) -> None:
        """Re-look-up every waiting request (the cache changed since they were counted)."""
        delta = 0
        for req in self._waiting:
            hit = self._lookup_hit_tokens(req)
            delta += req.prefix_hit_tokens - hit
            req.prefix_hit_tokens = hit
        self._waiting_prefill_tokens += delta

    def _srpt_preempt(self, preempted: list[str]) -> None:
        """TRAIL+: make room for the waiting head by preempting longer running requests."""
        cfg = self.config
        head = self._waiting[0]
        # The blocks its admission will check (see `_schedule_waiting`).
        admit_tokens = head.prompt_tokens + head.output_done
        if not cfg.reserve_full_prompt:
            admit_tokens = min(admit_tokens, cfg.max_num_batched_tokens)
        need = _blocks(admit_tokens, cfg.block_size)
        running = self._running
        while need > self._free_blocks or len(running) >= cfg.max_num_seqs:
            index = self.policy.srpt_victim(head, running)
            if index is None:
                break
            victim = running.pop(index)
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _schedule_running(
        self, sched: list[SimRequest], sched_tokens: list[int], preempted: list[str]
    ) -> tuple[int, _Work]:
        """vLLM's running phase; returns the token budget left and the batch's work."""
        bs = self.config.block_size
        budget = self.config.max_num_batched_tokens
        running = self._running
        policy = self.policy
        self._oom_preempted = False
        prefill_tokens = decode_seqs = context_tokens = attention_pairs = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            num_new = req.prompt_tokens + req.output_done - computed
            if num_new > budget:
                num_new = budget
            need = -(-(computed + num_new) // bs) - req.kv_blocks
            if need > self._free_blocks:
                victim = None
                while need > self._free_blocks:
                    victim = running.pop(policy.victim_index(running, i))
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    self._oom_preempted = True
                    if victim is req:
                        break
                if victim is req:
                    break
            if need > 0:
                req.kv_blocks += need
                self._free_blocks -= need
                if self.cache is not None:
                    self.cache.take_free(need)
            sched.append(req)
            sched_tokens.append(num_new)
            budget -= num_new
            if num_new == 1 and req.output_done > 0:
                decode_seqs += 1
                attention_pairs += computed + 1
            else:
                prefill_tokens += num_new
                attention_pairs += num_new * computed + num_new * (num_new + 1) // 2
            context_tokens += computed + num_new
            i += 1
        # Running requests left out of this step (budget spent, or a break) keep their
        # remaining prefill queued.
        unscheduled = 0
        for req in running[i:]:
            uncomputed = req.prompt_tokens + req.output_done - req.num_computed_tokens
            if uncomputed > 1 or req.output_done == 0:
                unscheduled += uncomputed
        self._unscheduled_prefill_tokens = unscheduled
        return budget, _Work(prefill_tokens, decode_seqs, context_tokens, attention_pairs)

    def _schedule_waiting(
        self, sched: list[SimRequest], sched_tokens: list[int], budget: int
    ) -> _Work:
        """vLLM's waiting phase in policy order; stops at the first request that does not fit."""
        cfg = self.config
        bs = cfg.block_size
        waiting = self._waiting
        running = self._running
        reserve_tokens = self.policy.reserve_tokens
        full = cfg.reserve_full_prompt
        prefill_tokens = attention_pairs = 0
        loras = self._step_loras(sched)
        skipped: list[SimRequest] = []
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            if loras is not None and _lora_waits(req, loras, cfg.max_loras):
                skipped.append(waiting.popleft())
                continue
            num_tokens = req.prompt_tokens + req.output_done
            num_new = num_tokens
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            blocks = -(-reserve_tokens(req, num_new) // bs)
            needed = -(-reserve_tokens(req, num_tokens) // bs) if full else blocks
            if not self.policy.admits(needed, self._free_blocks, len(running)):
                break
            waiting.popleft()
            self._waiting_prefill_tokens -= num_tokens
            self._waiting_dirty = True
            req.kv_blocks = blocks
            self._free_blocks -= blocks
            running.append(req)
            sched.append(req)
            sched_tokens.append(num_new)
            budget -= num_new
            prefill_tokens += num_new
            attention_pairs += num_new * (num_new + 1) // 2
            if loras is not None and req.adapter is not None:
                loras.add(req.adapter)
        waiting.extendleft(reversed(skipped))  # back at the front, in their order
        return _Work(prefill_tokens, 0, prefill_tokens, attention_pairs)

    def _schedule_waiting_cached(
        self, sched: list[SimRequest], sched_tokens: list[int], budget: int
    ) -> _Work:
        """`_schedule_waiting` with prefix caching (vLLM's ``get_computed_blocks`` then
        ``allocate_slots``): a request's leading cached blocks are reused, so only the rest
        is computed; the admission check counts its new blocks plus its cached hits that
        nobody holds (taking them off the free queue consumes free KV)."""
        cfg = self.config
        bs = cfg.block_size
        cache = self.cache
        assert cache is not None
        waiting = self._waiting
        running = self._running
        reserve_tokens = self.policy.reserve_tokens
        full = cfg.reserve_full_prompt
        prefill_tokens = context_tokens = attention_pairs = 0
        loras = self._step_loras(sched)
        skipped: list[SimRequest] = []
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            if loras is not None and _lora_waits(req, loras, cfg.max_loras):
                skipped.append(waiting.popleft())
                continue
            num_tokens = req.prompt_tokens + req.output_done
            keys = req.block_keys
            hit, held = cache.lookup(keys, (num_tokens - 1) // bs) if keys else (0, 0)
            computed = hit * bs
            num_new = num_tokens - computed
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            blocks = -(-max(computed + num_new, reserve_tokens(req, num_new)) // bs) - hit
            needed = blocks
            if full:
                needed = -(-max(num_tokens, reserve_tokens(req, num_tokens)) // bs) - hit
            # New blocks, plus cached hits nobody holds (taking them consumes free KV).
            if not self.policy.admits(needed + hit - held, self._free_blocks, len(running)):
                break
            waiting.popleft()
            self._waiting_prefill_tokens -= num_tokens - req.prefix_hit_tokens
            req.prefix_hit_tokens = 0
            self._waiting_dirty = True
            if hit:
                hit_keys = list(keys[:hit])
                self._free_blocks -= cache.acquire(hit_keys)
                req.cached_keys = hit_keys
            req.next_promote = hit
            cache.take_free(blocks)
            self._free_blocks -= blocks
            req.kv_blocks = hit + blocks
            req.num_computed_tokens = computed
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed
            self.prefix_queries_tokens += num_tokens
            self.prefix_hits_tokens += computed
            running.append(req)
            sched.append(req)
            sched_tokens.append(num_new)
            budget -= num_new
            prefill_tokens += num_new
            context_tokens += computed + num_new
            attention_pairs += num_new * computed + num_new * (num_new + 1) // 2
            if loras is not None and req.adapter is not None:
                loras.add(req.adapter)
        waiting.extendleft(reversed(skipped))  # back at the front, in their order
        return _Work(prefill_tokens, 0, context_tokens, attention_pairs)

    def _step_loras(self, sched: list[SimRequest]) -> set[str] | None:
        """The adapters of this step's batch so far (the running requests it scheduled);
        None when LoRA slots are off (`EngineConfig.max_loras` 0)."""
        if self.config.max_loras <= 0:
            return None
        return {r.adapter for r in sched if r.adapter is not None}

    def _apply(
        self, sched: list[SimRequest], sched_tokens: list[int], end_s: float
    ) -> tuple[list[tuple[str, int]], list[SimRequest]]:
        """Advance every scheduled request by its tokens; sample, finish, free."""
        new_tokens: list[tuple[str, int]] = []
        finished: list[SimRequest] = []
        running_prefill = self._unscheduled_prefill_tokens
        cache = self.cache
        bs = self.config.block_size
        for req, num_new in zip(sched, sched_tokens, strict=True):
            computed = req.num_computed_tokens + num_new
            req.num_computed_tokens = computed
            if cache is not None:
                full = min(computed // bs, len(req.block_keys))
                if full > req.next_promote:
                    keys = req.block_keys
                    for i in range(req.next_promote, full):
                        if cache.promote(keys[i]):
                            req.cached_keys.append(keys[i])
                    req.next_promote = full
            tokens = req.prompt_tokens + req.output_done
            if computed == tokens:
                done = req.output_done + 1
                req.output_done = done
                new_tokens.append((req.request_id, 1))
                if req.first_token_s is None:
                    req.first_token_s = end_s
                if done >= req.output_tokens:
                    req.finish_s = end_s
                    finished.append(req)
            else:
                # Still prefilling (a chunk): the rest stays queued.
                running_prefill += tokens - computed
        if finished:
            for req in finished:
                self._release(req)
                del self._live[req.request_id]
            self._running = [r for r in self._running if r.finish_s is None]
        self._running_prefill_tokens = running_prefill
        return new_tokens, finished

    def _refresh_running_prefill(self) -> None:
        total = 0
        for req in self._running:
            uncomputed = req.prompt_tokens + req.output_done - req.num_computed_tokens
            # A decoding request has exactly one uncomputed token (its last sample).
            if uncomputed > 1 or req.output_done == 0:
                total += uncomputed
        self._running_prefill_tokens = total
