"""Start real vLLM-on-CPU replicas for integration tests (shared by the engine and gateway tests).

`run_replica()` starts one replica of a tiny local model (random weights, ``--load-format
dummy``) through ``sal-engine serve`` (``python -m engine_patch.launcher serve``), or plain
vLLM for ``scheduler="stock"``, waits until ``/health`` answers, yields its base URL, and
stops it by PID on exit. Each start costs ~30-150 s (depending on how busy the machine is)
and ~3 GB of RAM: share replicas between tests with module-scoped fixtures.

Defaults (`DEFAULT_ARGS`): ``--load-format dummy --enforce-eager --max-model-len 2048
--max-num-seqs 32 --num-gpu-blocks-override 512 --dtype float32``; the served model name is
the model directory's path unless `extra_args` has ``--served-model-name``. On CPU the KV
block size is 128 tokens, so 512 blocks hold 65,536 tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from engine_patch.replica import (
    CPU_DEFAULT_ARGS,
    CPU_ENV,
    LocalReplica,
    ReplicaStartError,
    replica_command,
)

DEFAULT_ARGS = CPU_DEFAULT_ARGS
REPLICA_ENV = CPU_ENV

__all__ = [
    "DEFAULT_ARGS",
    "REPLICA_ENV",
    "ReplicaStartError",
    "replica_command",
    "run_replica",
]


@contextlib.contextmanager
def run_replica(
    model_dir: Path,
    port: int,
    *,
    scheduler: str = "larry",
    alpha: float = 1.0,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Start a vLLM-on-CPU replica of `model_dir` on 127.0.0.1:`port` and yield its base URL.

    `scheduler`: ``"larry"`` (LARRY + ``/stats``), ``"fcfs"`` (stock order + ``/stats``) or
    ``"stock"`` (plain vLLM, no patch, no ``/stats``). `extra_args` are appended to the vLLM
    command line (they override `DEFAULT_ARGS`). Yields once ``GET /health`` answers 200;
    on exit stops the replica by PID (SIGTERM, then SIGKILL after a grace period). Raises
    `ReplicaStartError` with the replica's log tail if it dies or is not healthy within
    `timeout_s`. The log file is kept when the start or the body fails. `env` adds to the
    replica's environment.
    """
    cmd = replica_command(model_dir, port, scheduler=scheduler, alpha=alpha, extra_args=extra_args)
    replica = LocalReplica(cmd, port, env=env)
    url = replica.start(timeout_s=timeout_s)
    try:
        yield url
    except BaseException:
        replica.stop()
        raise
    replica.stop()
    replica.remove_log()
