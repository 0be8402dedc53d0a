"""vLLM V1 scheduler classes: LARRY ordering and/or `/stats` snapshot publication.

Select one with ``--scheduler-cls`` (the launcher does it for you):

=====================  ==========================================  ==========================
class                  order of the waiting queue                  vLLM scheduling mode
=====================  ==========================================  ==========================
`LarryScheduler`       LARRY score, recomputed every step          sync (CPU default)
`LarryAsyncScheduler`  LARRY score, recomputed every step          async (GPU default)
`LarryTailScheduler`   LARRY + tail guard (`sal_core.larry_tail`)  sync (CPU default)
`LarryTailAsync...`    LARRY + tail guard                          async (GPU default)
`FcfsScheduler`        vLLM's own FCFS (stats only)                sync
`FcfsAsyncScheduler`   vLLM's own FCFS (stats only)                async
=====================  ==========================================  ==========================

(``LarryTail...`` is `LarryTailAsyncScheduler`.)

How LARRY is wired in: at the start of every ``schedule()`` the waiting queue (vLLM's FCFS
deque) is re-sorted in place by `sal_core.larry.larry_order`; vLLM's own waiting scan
then admits from the front and stops at the first request whose KV blocks cannot be
allocated (or, without chunked prefill, whose prompt exceeds the remaining token budget) —
exactly LARRY's "stop at the first request that does not fit". LARRY's ``memory(r)`` counts
the blocks of r's prompt that vLLM's prefix cache does not hold (`cached_prefix_tokens`, a
lookup without side effects), and so does ``queued_prefill_tokens`` in `/stats`: a waiting
request whose prompt is mostly cached needs little prefill and few new blocks. Requests vLLM
preempts go back into the waiting queue and are rescored with the others at the next step. Running
requests are never preempted by LARRY itself. Nothing in vLLM is edited or monkey-patched.

After every step (``schedule()``, ``update_from_output()``, aborts) the scheduler writes its
state to a shared-memory snapshot (`engine_patch.snapshot`), which the API servers serve on
``GET /stats`` (`engine_patch.stats_route`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from engine_patch import patch_config
from engine_patch.snapshot import SnapshotRecord, SnapshotWriter, snapshot_path
from engine_patch.versions import ensure_supported_vllm
from sal_core.larry import larry_order
from sal_core.larry_tail import TailGuard, headroom_blocks
from sal_core.stats import ReplicaStats

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.2
"""How often an idle engine refreshes its snapshot's ``time`` (see `restamp_if_idle`)."""


def _served_model_name(vllm_config: Any) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else vllm_config.model_config.model
    return str(name)


def _uncomputed_tokens(request: Any) -> int:
    return max(0, int(request.num_tokens) - int(request.num_computed_tokens))


def cached_prefix_tokens(kv_cache_manager: Any, request: Any) -> int:
    """Leading tokens of `request`'s prompt that vLLM's prefix cache holds now, as vLLM's
    own admission would find them (`KVCacheManager.get_computed_blocks`), without its side
    effects.

    ``get_computed_blocks`` is the coordinator's ``find_longest_cache_hit`` (a walk of the
    request's precomputed ``block_hashes`` through the block pool's hash-to-block map, plain
    dict lookups) plus, in ``kv_cache_report_mode == "full"``, BlockStored events for the hit.
    The hit statistics are recorded by the scheduler separately
    (``record_prefix_cache_stats``) and the LRU order changes only when blocks are touched
    (``allocate_slots``). Calling the coordinator directly therefore leaves the LRU order, the
    hit counters and the event stream untouched. As vLLM does, the last prompt token is
    never a hit (its logits must be computed)."""
    if not kv_cache_manager.prefix_cache_lookup_enabled(request):
        return 0
    _, hit_tokens, _ = kv_cache_manager.coordinator.find_longest_cache_hit(
        request.block_hashes, int(request.num_tokens) - 1
    )
    return int(hit_tokens)


class _SalSchedulerMixin:
    """Publishes the `/stats` snapshot after every step; subclasses choose the order.

    Placed before vLLM's `Scheduler` / `AsyncScheduler` in the bases. Called by vLLM's
    EngineCore: ``schedule()`` and ``update_from_output()`` once per engine step each.
    """

    sal_scheduler_name: ClassVar[str] = "fcfs"
    sal_async: ClassVar[bool] = False

    # Attributes provided by vLLM's Scheduler (declared for the type checker only).
    vllm_config: Any
    scheduler_config: Any
    kv_cache_manager: Any
    lora_config: Any
    waiting: Any
    kv_holding_waiting: Any
    running: list[Any]
    block_size: int
    max_num_scheduled_tokens: int
    max_num_running_reqs: int

    sal_clock: Callable[[], float]
    """Wall clock used for waiting times (vLLM stamps ``arrival_time`` with ``time.time()``);
    tests replace it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ensure_supported_vllm()
        cast(Any, super()).__init__(*args, **kwargs)
        self._sal_check_mode()
        self.sal_clock = time.time
        self.sal_alpha: float | None = None
        self._sal_step = 0
        self._sal_model = _served_model_name(self.vllm_config)
        cache_config = self.vllm_config.cache_config
        self._sal_prefix_caching = bool(self.kv_cache_manager.enable_caching)
        self._sal_hash_algo: str | None = (
            str(cache_config.prefix_caching_hash_algo) if self._sal_prefix_caching else None
        )
        self._sal_hit_tokens = 0
        self._sal_query_tokens = 0
        self._sal_cached: dict[str, int] = {}
        """Request id -> cached prefix tokens found this step (`_sal_uncached_tokens`)."""
        parallel = self.vllm_config.parallel_config
        # data_parallel_index keeps the engine's DP rank even where vLLM reconfigures a
        # dense model's engines as independent DP=1 engines (data_parallel_rank = 0).
        self._sal_dp_rank = int(
            getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        )
        self._sal_dp_local = patch_config.dp_local_count(int(parallel.data_parallel_size_local))
        path = snapshot_path(patch_config.stats_prefix(), self._sal_dp_rank)
        self._sal_writer = SnapshotWriter(path)
        self._sal_stop = threading.Event()
        self._sal_heartbeat = threading.Thread(
            target=self._sal_heartbeat_loop, name="sal-stats-heartbeat", daemon=True
        )
        self._sal_configure()
        self._sal_publish()
        self._sal_heartbeat.start()
        logger.info(
            "SAL %s scheduler (%s) publishing /stats snapshots to %s",
            self.sal_scheduler_name,
            type(self).__name__,
            path,
        )

    def _sal_check_mode(self) -> None:
        async_on = bool(self.scheduler_config.async_scheduling)
        if async_on != self.sal_async:
            base = type(self).__name__.removesuffix("AsyncScheduler").removesuffix("Scheduler")
            wanted = f"{base}AsyncScheduler" if async_on else f"{base}Scheduler"
            mode = "on" if async_on else "off"
            raise RuntimeError(
                f"{type(self).__name__} cannot run with async scheduling {mode}; "
                f"use --scheduler-cls engine_patch.scheduler.{wanted}"
            )

    def _sal_configure(self) -> None:
        """Read subclass settings from vLLM's config (hook; FCFS has none)."""

    def _sal_reorder(self) -> None:
        """Reorder the waiting queue before vLLM's scan (hook; FCFS keeps vLLM's order)."""

    def _sal_uncached_tokens(self, request: Any) -> int:
        """Prompt tokens `request` still has to prefill *and* that the prefix cache does not
        hold: LARRY's memory term and the queued prefill tokens of `/stats`.

        A waiting request's leading cached blocks need neither prefill nor new blocks when it
        is admitted (vLLM touches them); a request that has started (chunked prefill, or
        resumed) already counts its hit in ``num_computed_tokens``. Looked up at most once
        per request and step (`cached_prefix_tokens`: O(hit blocks), no side effects)."""
        computed = int(request.num_computed_tokens)
        if not self._sal_prefix_caching or computed > 0:
            return _uncomputed_tokens(request)
        rid = str(request.request_id)
        cached = self._sal_cached.get(rid)
        if cached is None:
            cached = cached_prefix_tokens(self.kv_cache_manager, request)
            self._sal_cached[rid] = cached
        return max(0, int(request.num_tokens) - cached)

    # vLLM entry points -------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._sal_cached.clear()  # the cache changed since the last step
        self._sal_reorder()
        output = cast(Any, super()).schedule(*args, **kwargs)
        self._sal_cached.clear()  # admitted requests cached new blocks
        self._sal_step += 1
        self._sal_publish()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM's prefix-cache counters of this step, read just before vLLM's own make_stats()
        # hands them to its loggers and resets them (only with log stats on).
        counters = self.kv_cache_manager.prefix_cache_stats
        if counters is not None:
            self._sal_hit_tokens += int(counters.hits)
            self._sal_query_tokens += int(counters.queries)
        outputs = cast(Any, super()).update_from_output(*args, **kwargs)
        self._sal_publish()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        result = cast(Any, super()).finish_requests(*args, **kwargs)
        self._sal_publish()
        return result

    def shutdown(self) -> None:
        self._sal_stop.set()
        if self._sal_heartbeat.is_alive():
            self._sal_heartbeat.join(timeout=1.0)
        self._sal_writer.close()
        cast(Any, super()).shutdown()

    # Snapshot ------------------------------------------------------------------------

    def sal_stats(self) -> ReplicaStats:
        """The scheduler's state now, as served on `/stats` (O(waiting + running))."""
        pool = self.kv_cache_manager.block_pool
        # Block 0 is vLLM's null block and never allocatable.
        kv_total = int(pool.num_gpu_blocks) - 1
        kv_free = int(pool.get_num_free_blocks())
        waiting = list(itertools.chain(self.kv_holding_waiting, self.waiting))
        waiting_uncomputed = sum(_uncomputed_tokens(r) for r in waiting)
        waiting_uncached = sum(self._sal_uncached_tokens(r) for r in waiting)
        queued = waiting_uncached
        queued += sum(_uncomputed_tokens(r) for r in self.running if r.is_prefill_chunk)
        max_loras, lora_running = self._sal_lora_slots()
        return ReplicaStats(
            time=self.sal_clock(),
            step=self._sal_step,
            model=self._sal_model,
            scheduler=self.sal_scheduler_name,
            alpha=self.sal_alpha,
            block_size=int(self.block_size),
            kv_blocks_total=kv_total,
            kv_blocks_free=kv_free,
            free_kv_tokens=kv_free * int(self.block_size),
            queued_prefill_tokens=queued,
            num_waiting=len(waiting),
            num_running=len(self.running),
            max_num_batched_tokens=int(self.max_num_scheduled_tokens),
            max_num_seqs=int(self.max_num_running_reqs),
            prefix_caching=self._sal_prefix_caching,
            prefix_hash_algo=self._sal_hash_algo,
            cached_prefill_tokens=waiting_uncomputed - waiting_uncached,
            prefix_cache_query_tokens=self._sal_query_tokens,
            prefix_cache_hit_tokens=self._sal_hit_tokens,
            max_loras=max_loras,
            lora_running=lora_running,
        )

    def _sal_lora_slots(self) -> tuple[int, tuple[str, ...]]:
        """vLLM's ``--max-loras`` and the sorted names of the running requests' adapters.

        vLLM's admission (``Scheduler.schedule``) counts the adapters of the scheduled running
        requests (``lora_int_id > 0``) and skips a waiting request whose adapter would make
        them more than ``lora_config.max_loras``; without ``--enable-lora`` there is no
        ``lora_config`` and no adapter, and this returns (0, ()) without walking anything.
        One pass over ``self.running``; only the few distinct names are sorted."""
        lora_config = self.lora_config
        if lora_config is None:
            return 0, ()
        names = {
            r.lora_request.lora_name
            for r in self.running
            if r.lora_request is not None and r.lora_request.lora_int_id > 0
        }
        return int(lora_config.max_loras), tuple(sorted(names))

    def _sal_publish(self) -> None:
        record = SnapshotRecord(self.sal_stats(), self._sal_dp_rank, self._sal_dp_local)
        self._sal_writer.publish(record)

    def _sal_heartbeat_loop(self) -> None:
        while not self._sal_stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._sal_writer.restamp_if_idle(self.sal_clock())
            except ValueError:  # the mapping was closed by shutdown()
                return


class _LarryMixin(_SalSchedulerMixin):
    """Reorders vLLM's waiting queue by LARRY score at the start of every step."""

    sal_scheduler_name: ClassVar[str] = "larry"

    def _sal_configure(self) -> None:
        params = patch_config.larry_params(self.vllm_config.additional_config)
        self.sal_alpha = params.alpha
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise RuntimeError(
                "LARRY replaces vLLM's waiting order and needs --scheduling-policy fcfs "
                f"(got {self.scheduler_config.policy!r})"
            )

    def _sal_reorder(self) -> None:
        queue = self.waiting
        if len(queue) < 2:
            return
        alpha = self.sal_alpha if self.sal_alpha is not None else 1.0
        ordered = larry_order(
            queue,
            now_s=self.sal_clock(),
            alpha=alpha,
            block_size=int(self.block_size),
            arrival_s=lambda r: float(r.arrival_time),
            uncomputed_tokens=self._sal_uncached_tokens,
            request_id=lambda r: str(r.request_id),
        )
        # In place: vLLM holds no other reference to the deque's order.
        queue.clear()
        queue.extend(ordered)


class _LarryTailMixin(_SalSchedulerMixin):
    """LARRY with the tail guard: pins requests whose FCFS wait is due, keeps KV headroom.

    Per ``schedule()``: the previous step is fed to the guard's drain-rate estimate (wall
    time since the previous call, the prefill tokens it scheduled, whether a request was
    waiting), then the waiting queue is re-sorted in place by `TailGuard.order`. The
    headroom is vLLM's own admission watermark (``--watermark``, `KVCacheManager`'s
    ``watermark_blocks``: blocks a waiting or preempted request must leave free while
    others run), raised to ``larry_tail.headroom`` when that is larger.
    """

    sal_scheduler_name: ClassVar[str] = "larry_tail"

    def _sal_configure(self) -> None:
        params = patch_config.larry_tail_params(self.vllm_config.additional_config)
        self.sal_alpha = params.alpha
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise RuntimeError(
                "larry_tail replaces vLLM's waiting order and needs --scheduling-policy fcfs "
                f"(got {self.scheduler_config.policy!r})"
            )
        manager = self.kv_cache_manager
        num_blocks = int(manager.block_pool.num_gpu_blocks)
        if not isinstance(getattr(manager, "watermark_blocks", None), int):
            raise RuntimeError("larry_tail needs vLLM's KV admission watermark (vLLM >= 0.32)")
        manager.watermark_blocks = max(
            manager.watermark_blocks, headroom_blocks(params.headroom, num_blocks)
        )
        # Block 0 is the null block; the guard sizes nothing else from it.
        self.sal_guard = TailGuard(
            params, block_size=int(self.block_size), kv_blocks_total=num_blocks - 1
        )
        self._sal_prev_schedule_s: float | None = None
        self._sal_prev_prefill_tokens = 0
        self._sal_prev_backlogged = False
        logger.info(
            "larry_tail: pin %s, slack %g, cap %g, margin %g s, alpha %g, headroom %d of %d "
            "KV blocks",
            params.pin,
            params.slack,
            params.cap,
            params.margin_s,
            params.alpha,
            manager.watermark_blocks,
            num_blocks,
        )

    def sal_headroom_blocks(self) -> int:
        """KV blocks a waiting request must leave free while others run (vLLM applies it)."""
        return int(self.kv_cache_manager.watermark_blocks)

    def _sal_queued_tokens(self) -> int:
        waiting = itertools.chain(self.kv_holding_waiting, self.waiting)
        queued = sum(_uncomputed_tokens(r) for r in waiting)
        return queued + sum(_uncomputed_tokens(r) for r in self.running if r.is_prefill_chunk)

    def _sal_reorder(self) -> None:
        now_s = self.sal_clock()
        if self._sal_prev_schedule_s is not None:
            self.sal_guard.observe_step(
                now_s - self._sal_prev_schedule_s,
                self._sal_prev_prefill_tokens,
                self._sal_prev_backlogged,
            )
        self._sal_prev_schedule_s = now_s
        self._sal_prev_backlogged = bool(self.waiting) or bool(self.kv_holding_waiting)
        queue = self.waiting
        if not queue:
            return
        ordered = self.sal_guard.order(
            queue,
            now_s=now_s,
            queued_tokens=self._sal_queued_tokens(),
            arrival_s=lambda r: float(r.arrival_time),
            uncomputed_tokens=_uncomputed_tokens,
            request_id=lambda r: str(r.request_id),
        )
        queue.clear()
        queue.extend(ordered)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        # Prefill tokens of this step: chunks of more than one token (a decode is one).
        self._sal_prev_prefill_tokens = sum(
            int(n) for n in output.num_scheduled_tokens.values() if int(n) > 1
        )
        return output


class LarryScheduler(_LarryMixin, Scheduler):
    """LARRY for vLLM's synchronous scheduling (CPU, ``--no-async-scheduling``)."""


class LarryAsyncScheduler(_LarryMixin, AsyncScheduler):
    """LARRY for vLLM's async scheduling (the GPU default)."""

    sal_async: ClassVar[bool] = True


class LarryTailScheduler(_LarryTailMixin, Scheduler):
    """LARRY + tail guard for vLLM's synchronous scheduling (CPU, ``--no-async-scheduling``)."""


class LarryTailAsyncScheduler(_LarryTailMixin, AsyncScheduler):
    """LARRY + tail guard for vLLM's async scheduling (the GPU default)."""

    sal_async: ClassVar[bool] = True


class FcfsScheduler(_SalSchedulerMixin, Scheduler):
    """vLLM's own FCFS order, plus the `/stats` snapshot (synchronous scheduling)."""


class FcfsAsyncScheduler(_SalSchedulerMixin, AsyncScheduler):
    """vLLM's own FCFS order, plus the `/stats` snapshot (async scheduling)."""

    sal_async: ClassVar[bool] = True
