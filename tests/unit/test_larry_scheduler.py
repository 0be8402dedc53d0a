"""LARRY and the stats-only FCFS class inside vLLM's real V1 `Scheduler`, on CPU, no server.

The scheduler is built the way vLLM's own ``tests/v1/core`` build it (configs + a fake
KV-cache layout) and driven with requests and fabricated model outputs: one sampled token
per request that finished its prefill. The clock the scheduler reads is replaced, so waiting
times are exact.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# torch and vLLM emit DeprecationWarnings of their own at import time (torch.jit.script_method
# and friends); `filterwarnings=error` would turn them into collection errors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import LoRAConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import RequestStatus

    from engine_patch.scheduler import (
        FcfsScheduler,
        LarryAsyncScheduler,
        LarryScheduler,
    )
    from engine_patch.snapshot import SnapshotReader, snapshot_path
    from sal_core.larry import larry_order
    from tests.vllm_scheduler_support import (
        BLOCK_SIZE,
        Clock,
        make_request,
        make_scheduler,
        run_step,
    )


@pytest.fixture(autouse=True)
def stats_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Each test's schedulers publish their snapshots into the test's own directory.
    prefix = tmp_path / "stats"
    monkeypatch.setenv("SAL_STATS_PREFIX", str(prefix))
    return prefix


def admitted(output: Any) -> list[str]:
    """Request ids newly admitted by one ``schedule()``, in admission order."""
    return [r.req_id for r in output.scheduled_new_reqs]


def expected_larry(scheduler: Any, now_s: float, alpha: float) -> list[str]:
    return [
        r.request_id
        for r in larry_order(
            scheduler.waiting,
            now_s=now_s,
            alpha=alpha,
            block_size=BLOCK_SIZE,
            arrival_s=lambda r: r.arrival_time,
            uncomputed_tokens=lambda r: r.num_tokens - r.num_computed_tokens,
            request_id=lambda r: r.request_id,
        )
    ]


# Ordering -------------------------------------------------------------------------------


def test_larry_admits_short_prompts_before_long_ones_that_arrived_earlier(
    tiny_model_dir: Path,
) -> None:
    clock = Clock(1000.0)
    larry = make_scheduler(LarryScheduler, tiny_model_dir, clock=clock)
    fcfs = make_scheduler(FcfsScheduler, tiny_model_dir, clock=clock)
    lengths = {"long-a": 300, "mid-b": 120, "short-c": 10, "short-d": 20}
    for i, (rid, n) in enumerate(lengths.items()):
        larry.add_request(make_request(rid, n, arrival_s=999.0 + i * 0.01))
        fcfs.add_request(make_request(rid, n, arrival_s=999.0 + i * 0.01))

    assert admitted(larry.schedule()) == ["short-c", "short-d", "mid-b", "long-a"]
    assert admitted(fcfs.schedule()) == ["long-a", "mid-b", "short-c", "short-d"]


def test_larry_order_matches_the_shared_score_function(tiny_model_dir: Path) -> None:
    clock = Clock(2000.0)
    # Room for only some prompts per step (no chunking), so the order decides who goes first.
    sched = make_scheduler(
        LarryScheduler,
        tiny_model_dir,
        clock=clock,
        max_num_batched_tokens=256,
        max_model_len=256,
        enable_chunked_prefill=False,
    )
    specs = [(37, 1990.0), (250, 1950.0), (5, 1999.0), (130, 1980.0), (64, 1995.0)]
    for i, (n, arrival) in enumerate(specs):
        sched.add_request(make_request(f"r{i}", n, arrival_s=arrival))
    expected = expected_larry(sched, clock.now_s, alpha=1.0)
    order = admitted(run_step(sched))
    assert order == expected[: len(order)]
    assert len(order) < len(specs)


def test_stop_at_first_request_that_does_not_fit(tiny_model_dir: Path) -> None:
    clock = Clock(1000.0)
    # 12 usable blocks; a running request takes 8 of them.
    sched = make_scheduler(LarryScheduler, tiny_model_dir, num_blocks=13, clock=clock)
    sched.add_request(make_request("running", 8 * BLOCK_SIZE - 1, arrival_s=999.0, max_tokens=50))
    run_step(sched)
    # "old-big" needs 6 blocks (does not fit in the 4 left) and has waited long enough to be
    # first; "new-small" (1 block) would fit, but LARRY does not look past the head.
    sched.add_request(make_request("old-big", 6 * BLOCK_SIZE, arrival_s=900.0))
    sched.add_request(make_request("new-small", 10, arrival_s=999.9))
    assert expected_larry(sched, clock.now_s, 1.0) == ["old-big", "new-small"]

    output = run_step(sched)

    assert admitted(output) == []
    assert {r.request_id for r in sched.waiting} == {"old-big", "new-small"}
    assert sched.sal_stats().num_waiting == 2


def test_old_large_request_is_not_starved_by_a_stream_of_small_ones(
    tiny_model_dir: Path,
) -> None:
    clock = Clock(1000.0)
    sched = make_scheduler(
        LarryScheduler, tiny_model_dir, num_blocks=17, clock=clock, max_num_seqs=4
    )
    # 16 usable blocks; three small requests (3 blocks each) are running when "big"
    # (12 blocks) arrives, so it cannot start until LARRY holds the others back for it.
    for i in range(3):
        sched.add_request(make_request(f"warm{i}", 40, arrival_s=clock.now_s, max_tokens=3))
    run_step(sched)
    sched.add_request(make_request("big", 12 * BLOCK_SIZE, arrival_s=clock.now_s, max_tokens=2))
    small_first: list[str] = []
    big_admitted_at = None
    for step in range(400):
        # A new small request every step: there is always a younger, cheaper competitor.
        sched.add_request(make_request(f"s{step}", 40, arrival_s=clock.now_s, max_tokens=3))
        new = admitted(run_step(sched))
        if "big" in new:
            big_admitted_at = step
            break
        small_first += new
        clock.now_s += 0.5
    assert big_admitted_at is not None, "the large request starved"
    assert small_first, "small requests should have been admitted ahead of the large one"


def test_large_alpha_degenerates_to_fcfs(tiny_model_dir: Path) -> None:
    clock = Clock(5000.0)
    kwargs: dict[str, Any] = {"clock": clock, "num_blocks": 40, "max_num_batched_tokens": 256}
    larry = make_scheduler(LarryScheduler, tiny_model_dir, alpha=1e6, **kwargs)
    fcfs = make_scheduler(FcfsScheduler, tiny_model_dir, **kwargs)
    lengths = [200, 15, 90, 7, 150, 33, 64, 120]
    for i, n in enumerate(lengths):
        for sched in (larry, fcfs):
            sched.add_request(make_request(f"r{i}", n, arrival_s=4990.0 + i * 0.1, max_tokens=2))
    order_larry: list[str] = []
    order_fcfs: list[str] = []
    for _ in range(60):
        order_larry += admitted(run_step(larry))
        order_fcfs += admitted(run_step(fcfs))
        clock.now_s += 0.05
    assert order_larry == order_fcfs == [f"r{i}" for i in range(len(lengths))]


# Chunked prefill --------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False])
def test_first_request_over_the_token_budget(tiny_model_dir: Path, chunked: bool) -> None:
    sched = make_scheduler(
        LarryScheduler,
        tiny_model_dir,
        max_num_batched_tokens=256,
        max_model_len=256,
        enable_chunked_prefill=chunked,
    )
    # LARRY order (same arrival): z (1 block), x (7 blocks), y (13 blocks).
    sched.add_request(make_request("x", 100, arrival_s=999.0))
    sched.add_request(make_request("y", 200, arrival_s=999.0))
    sched.add_request(make_request("z", 10, arrival_s=999.0))

    output = sched.schedule()

    if chunked:
        # The first request over the remaining budget (146 tokens) gets a partial chunk.
        assert admitted(output) == ["z", "x", "y"]
        assert output.num_scheduled_tokens == {"z": 10, "x": 100, "y": 146}
        assert sched.sal_stats().queued_prefill_tokens == 200 - 146
    else:
        # Without chunking it stops the scan: nothing after it is admitted.
        assert admitted(output) == ["z", "x"]
        assert [r.request_id for r in sched.waiting] == ["y"]
        assert sched.sal_stats().queued_prefill_tokens == 200


# Preemption and prefix caching --------------------------------------------------------------


def test_preempted_requests_reenter_waiting_and_are_rescored(tiny_model_dir: Path) -> None:
    clock = Clock(1000.0)
    # 6 usable blocks: two requests of 2 blocks each grow while decoding until one is
    # preempted (vLLM recomputes it later).
    sched = make_scheduler(LarryScheduler, tiny_model_dir, num_blocks=7, clock=clock)
    sched.add_request(make_request("a", 2 * BLOCK_SIZE - 2, arrival_s=999.0, max_tokens=40))
    sched.add_request(make_request("b", 2 * BLOCK_SIZE - 2, arrival_s=999.1, max_tokens=40))
    victim_id = None
    first_after_preemption = None
    for _ in range(300):
        clock.now_s += 0.1
        expected = expected_larry(sched, clock.now_s, 1.0)
        output = run_step(sched)
        if victim_id is not None and first_after_preemption is None:
            started = admitted(output) + sorted(output.scheduled_cached_reqs.resumed_req_ids)
            if started:
                # Whichever of the two starts first is the one LARRY scored higher.
                first_after_preemption = started[0]
                assert first_after_preemption == expected[0]
        victims = [r for r in sched.waiting if r.status == RequestStatus.PREEMPTED]
        if victims and victim_id is None:
            victim = victims[0]
            victim_id = victim.request_id
            # Its prompt and its outputs need recomputing, and count as queued prefill.
            assert victim.num_computed_tokens == 0
            assert sched.sal_stats().queued_prefill_tokens >= victim.num_tokens
            # A newcomer arrives; the next step scores both the same way.
            sched.add_request(make_request("c", 4, arrival_s=clock.now_s, max_tokens=2))
        if not sched.requests:
            break
    assert victim_id is not None, "no request was preempted"
    assert first_after_preemption is not None
    assert not sched.requests, "every request, the preempted one included, finishes"


def test_prefix_caching_on(tiny_model_dir: Path) -> None:
    sched = make_scheduler(LarryScheduler, tiny_model_dir, enable_prefix_caching=True)
    shared = list(range(30, 30 + 4 * BLOCK_SIZE))
    sched.add_request(make_request("first", 0, arrival_s=999.0, prompt=[*shared, 1, 2, 3]))
    for _ in range(6):
        run_step(sched)
    sched.add_request(make_request("second", 0, arrival_s=999.5, prompt=[*shared, 4, 5]))
    sched.add_request(make_request("other", 40, arrival_s=999.6))
    output = run_step(sched)
    scheduled = output.num_scheduled_tokens
    # The cached prefix is not recomputed ...
    assert scheduled["second"] == len(shared) + 2 - 4 * BLOCK_SIZE
    for _ in range(10):
        run_step(sched)
    # ... and every request finishes.
    assert not sched.requests


# Variants, stats ----------------------------------------------------------------------------


def test_async_variant_orders_like_the_sync_one(tiny_model_dir: Path) -> None:
    sched = make_scheduler(LarryAsyncScheduler, tiny_model_dir, async_scheduling=True)
    sched.add_request(make_request("long", 300, arrival_s=999.0))
    sched.add_request(make_request("short", 10, arrival_s=999.5))
    assert admitted(sched.schedule()) == ["short", "long"]


def test_variant_mismatch_fails_at_construction(tiny_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="LarryAsyncScheduler"):
        make_scheduler(LarryScheduler, tiny_model_dir, async_scheduling=True)


def test_bad_larry_config_fails_at_construction(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="alpha"):
        make_scheduler(LarryScheduler, tiny_model_dir, alpha=-1.0)


def test_snapshot_after_each_step_matches_the_scheduler(
    tiny_model_dir: Path, stats_prefix: Path
) -> None:
    clock = Clock(1000.0)
    sched = make_scheduler(
        LarryScheduler, tiny_model_dir, clock=clock, num_blocks=30, max_num_batched_tokens=128
    )
    reader = SnapshotReader(snapshot_path(str(stats_prefix), 0))
    idle = reader.read()
    assert idle is not None
    assert (idle.stats.num_waiting, idle.stats.num_running) == (0, 0)
    assert idle.stats.kv_blocks_total == idle.stats.kv_blocks_free == 29
    for i, n in enumerate([100, 60, 300]):
        sched.add_request(make_request(f"r{i}", n, arrival_s=999.0 + i))
    run_step(sched)
    record = reader.read()
    assert record is not None
    stats = record.stats
    assert replace(sched.sal_stats(), time=stats.time) == stats
    assert stats.step == 1
    assert stats.scheduler == "larry"
    assert stats.alpha == 1.0
    assert stats.num_running + stats.num_waiting == 3
    assert stats.kv_blocks_free == sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert stats.free_kv_tokens == stats.kv_blocks_free * BLOCK_SIZE
    # 128-token budget: 60 + the first 68 of r0 were computed; the rest is queued.
    assert stats.queued_prefill_tokens == (100 - 68) + 300
    assert stats.max_num_batched_tokens == 128
    sched.shutdown()
    assert not snapshot_path(str(stats_prefix), 0).exists()


# LoRA slots ---------------------------------------------------------------------------------


def _adapter(name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, f"/adapters/{name}")


def test_stats_report_the_lora_slots_vllm_admits_by(
    tiny_model_dir: Path, stats_prefix: Path
) -> None:
    """With --max-loras 2, vLLM skips a waiting request whose adapter would be a third one in
    the batch; `/stats` shows the two slots taken by name, so a router can see why it waits."""
    sched = make_scheduler(FcfsScheduler, tiny_model_dir)
    sched.lora_config = LoRAConfig(max_loras=2)  # as --enable-lora --max-loras 2 sets it
    a, b, c = _adapter("chat", 1), _adapter("sql", 2), _adapter("code", 3)
    for rid, adapter in [("a1", a), ("b1", b), ("c1", c), ("a2", a), ("base", None)]:
        sched.add_request(make_request(rid, 20, arrival_s=999.0, lora_request=adapter))

    assert admitted(run_step(sched)) == ["a1", "b1", "a2", "base"]

    stats = sched.sal_stats()
    assert (stats.max_loras, stats.lora_running) == (2, ("chat", "sql"))
    assert (stats.num_running, stats.num_waiting) == (4, 1)
    record = SnapshotReader(snapshot_path(str(stats_prefix), 0)).read()
    assert record is not None
    assert (record.stats.max_loras, record.stats.lora_running) == (2, ("chat", "sql"))
    for _ in range(20):  # the others finish, then "code" gets a slot
        if "c1" in admitted(run_step(sched)):
            break
    assert sched.sal_stats().lora_running == ("code",)
    sched.shutdown()


def test_lora_running_lists_each_adapter_of_the_running_requests_once(
    tiny_model_dir: Path,
) -> None:
    sched = make_scheduler(FcfsScheduler, tiny_model_dir)
    # No --enable-lora: no slots to report.
    assert (sched.sal_stats().max_loras, sched.sal_stats().lora_running) == (0, ())
    sched.lora_config = LoRAConfig(max_loras=4)
    chat = _adapter("chat", 1)

    def running(lora_request: object) -> SimpleNamespace:
        return SimpleNamespace(lora_request=lora_request, is_prefill_chunk=False)

    sched.running = [
        running(_adapter("sql", 2)),
        running(chat),
        running(None),  # the base model takes no slot
        running(chat),
        running(SimpleNamespace(lora_name="zero-id", lora_int_id=0)),  # vLLM's "no adapter"
        running(_adapter("alpha", 3)),
    ]
    stats = sched.sal_stats()
    assert stats.max_loras == 4
    assert stats.lora_running == ("alpha", "chat", "sql")
    assert stats.num_running == 6
    sched.running = []
    sched.shutdown()
