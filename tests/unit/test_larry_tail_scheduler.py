"""The tail-guarded LARRY inside vLLM's real V1 `Scheduler`, on CPU, no server.

Built and driven as in `tests/unit/test_larry_scheduler.py` (`tests.vllm_scheduler_support`):
fabricated model outputs, a clock the test advances. The guard's drain rate is forced by
feeding it measured steps, so due times are exact.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from engine_patch.patch_config import PatchConfigError
    from engine_patch.scheduler import (
        FcfsScheduler,
        LarryTailAsyncScheduler,
        LarryTailScheduler,
    )
    from tests.vllm_scheduler_support import (
        BLOCK_SIZE,
        Clock,
        make_request,
        make_scheduler,
        run_step,
    )


@pytest.fixture(autouse=True)
def stats_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    prefix = tmp_path / "stats"
    monkeypatch.setenv("SAL_STATS_PREFIX", str(prefix))
    return prefix


def admitted(output: Any) -> list[str]:
    return [r.req_id for r in output.scheduled_new_reqs]


def tail(clock: Clock, model_dir: Path, **section: Any) -> Any:
    kwargs: dict[str, Any] = {
        "clock": clock,
        "max_num_batched_tokens": 256,
        "max_model_len": 256,
        "enable_chunked_prefill": False,
    }
    return make_scheduler(
        LarryTailScheduler, model_dir, additional_config={"larry_tail": section}, **kwargs
    )


def test_order_is_larry_until_the_big_request_is_due_then_it_goes_first(
    tiny_model_dir: Path,
) -> None:
    clock = Clock(1000.0)
    sched = tail(clock, tiny_model_dir, pin="fcfs_due", margin_s=2.0, slack=1.0, headroom=0.0)
    # A measured drain rate of 1,000 prefill tokens per backlogged second.
    for _ in range(20):
        sched.sal_guard.observe_step(0.1, 100, backlogged=True)
    big = make_request("big", 250, arrival_s=clock.now_s)
    sched.add_request(big)
    sched._sal_reorder()  # first sight: nothing ahead, due at arrival + 2 s
    for i in range(3):
        sched.add_request(make_request(f"small{i}", 40, arrival_s=clock.now_s))

    clock.now_s += 1.0  # not due yet: LARRY's order, small prompts first
    first = admitted(run_step(sched))
    assert first[0].startswith("small")
    assert "big" not in first

    sched2 = tail(clock, tiny_model_dir, pin="fcfs_due", margin_s=2.0, slack=1.0, headroom=0.0)
    for _ in range(20):
        sched2.sal_guard.observe_step(0.1, 100, backlogged=True)
    sched2.add_request(make_request("big", 250, arrival_s=clock.now_s))
    sched2._sal_reorder()
    for i in range(3):
        sched2.add_request(make_request(f"small{i}", 40, arrival_s=clock.now_s))
    clock.now_s += 2.5  # past its due time: pinned ahead of the small ones
    assert admitted(run_step(sched2)) == ["big"]  # 250 tokens fill the 256-token step


def test_the_drain_rate_is_measured_from_real_steps(tiny_model_dir: Path) -> None:
    clock = Clock(1000.0)
    sched = tail(clock, tiny_model_dir)
    for i in range(12):
        sched.add_request(make_request(f"r{i}", 200, arrival_s=clock.now_s, max_tokens=2))
    for _ in range(12):
        run_step(sched)
        clock.now_s += 0.1  # each step takes 0.1 s and prefills one 200-token prompt
    rate = sched.sal_guard.drain_rate_tokens_s()
    assert rate is not None
    assert 1500 <= rate <= 2100


def test_headroom_keeps_blocks_free_while_others_run(tiny_model_dir: Path) -> None:
    clock = Clock(1000.0)
    kwargs: dict[str, Any] = {"clock": clock, "num_blocks": 41}
    guarded = make_scheduler(
        LarryTailScheduler,
        tiny_model_dir,
        additional_config={"larry_tail": {"headroom": 0.25}},
        **kwargs,
    )
    fcfs = make_scheduler(FcfsScheduler, tiny_model_dir, **kwargs)
    assert guarded.sal_headroom_blocks() == int(0.25 * 41)
    for sched in (guarded, fcfs):
        sched.add_request(make_request("running", 20 * BLOCK_SIZE, arrival_s=999.0, max_tokens=50))
        run_step(sched)
        # 20 of 40 usable blocks left; this one needs 12 and would leave 8 < 10 free.
        sched.add_request(make_request("next", 12 * BLOCK_SIZE, arrival_s=999.5))
    assert admitted(run_step(fcfs)) == ["next"]
    assert admitted(run_step(guarded)) == []
    assert guarded.sal_stats().num_waiting == 1


def test_stats_name_the_scheduler_and_alpha(tiny_model_dir: Path) -> None:
    sched = tail(Clock(), tiny_model_dir, alpha=3.0)
    stats = sched.sal_stats()
    assert stats.scheduler == "larry_tail"
    assert stats.alpha == 3.0


def test_async_variant_builds_with_async_scheduling(tiny_model_dir: Path) -> None:
    sched = make_scheduler(LarryTailAsyncScheduler, tiny_model_dir, async_scheduling=True)
    assert sched.sal_stats().scheduler == "larry_tail"
    with pytest.raises(RuntimeError, match="LarryTailScheduler"):
        make_scheduler(LarryTailAsyncScheduler, tiny_model_dir, async_scheduling=False)


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"slak": 1.0}, "unknown key additional_config.larry_tail.slak"),
        ({"slack": "big"}, "larry_tail.slack must be a number"),
        ({"headroom": 1.5}, "headroom"),
        ({"pin": "edf"}, "pin"),
    ],
)
def test_bad_config_fails_at_construction(
    tiny_model_dir: Path, section: dict[str, Any], match: str
) -> None:
    with pytest.raises(PatchConfigError, match=match):
        tail(Clock(), tiny_model_dir, **section)
