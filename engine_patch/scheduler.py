"""vLLM V1 scheduler classes: LARRY ordering and/or `/stats` snapshot publication.

Select one with ``--scheduler-cls`` (the launcher does it for you):

=====================  ==========================================  ==========================
class                  order of the waiting queue                  vLLM scheduling mode
=====================  ==========================================  ==========================
`LarryScheduler`       LARRY score, recomputed every step          sync (CPU default)
`LarryAsyncScheduler`  LARRY score, recomputed every step          async (GPU default)
`FcfsScheduler`        vLLM's own FCFS (stats only)                sync
`FcfsAsyncScheduler`   vLLM's own FCFS (stats only)                async
=====================  ==========================================  ==========================

How LARRY is wired in: at the start of every ``schedule()`` the waiting queue (vLLM's FCFS
deque) is re-sorted in place by `engine_patch.larry.larry_order`; vLLM's own waiting scan
then admits from the front and stops at the first request whose KV blocks cannot be
allocated (or, without chunked prefill, whose prompt exceeds the remaining token budget) —
exactly LARRY's "stop at the first request that does not fit". Requests vLLM preempts go
back into the waiting queue and are rescored with the others at the next step. Running
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
from engine_patch.larry import larry_order
from engine_patch.snapshot import SnapshotRecord, SnapshotWriter, snapshot_path
from engine_patch.versions import ensure_supported_vllm
from sal_gateway.stats import ReplicaStats

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

    # vLLM entry points -------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._sal_reorder()
        output = cast(Any, super()).schedule(*args, **kwargs)
        self._sal_step += 1
        self._sal_publish()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
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
        queued = sum(_uncomputed_tokens(r) for r in waiting)
        queued += sum(_uncomputed_tokens(r) for r in self.running if r.is_prefill_chunk)
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
        )

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
            uncomputed_tokens=_uncomputed_tokens,
            request_id=lambda r: str(r.request_id),
        )
        # In place: vLLM holds no other reference to the deque's order.
        queue.clear()
        queue.extend(ordered)


class LarryScheduler(_LarryMixin, Scheduler):
    """LARRY for vLLM's synchronous scheduling (CPU, ``--no-async-scheduling``)."""


class LarryAsyncScheduler(_LarryMixin, AsyncScheduler):
    """LARRY for vLLM's async scheduling (the GPU default)."""

    sal_async: ClassVar[bool] = True


class FcfsScheduler(_SalSchedulerMixin, Scheduler):
    """vLLM's own FCFS order, plus the `/stats` snapshot (synchronous scheduling)."""


class FcfsAsyncScheduler(_SalSchedulerMixin, AsyncScheduler):
    """vLLM's own FCFS order, plus the `/stats` snapshot (async scheduling)."""

    sal_async: ClassVar[bool] = True
