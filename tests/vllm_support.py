"""Start real vLLM-on-CPU replicas for integration tests (shared by the engine and gateway tests).

`run_replica()` starts one replica of a tiny local model (random weights, ``--load-format
dummy``) through ``sal-engine serve`` (``python -m engine_patch.launcher serve``), or plain
vLLM for ``scheduler="stock"``, waits until ``/health`` answers, yields its base URL, and
stops it by PID on exit. Each start costs ~30-60 s and ~3 GB of RAM: share replicas between
tests with module-scoped fixtures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

# Small, CPU-friendly defaults; anything in `extra_args` comes later on the command line and
# wins (vLLM's argparse keeps the last value of a repeated option).
DEFAULT_ARGS: tuple[str, ...] = (
    "--load-format",
    "dummy",
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "32",
    "--num-gpu-blocks-override",
    "512",
    # bfloat16 kills the CPU worker on machines without AVX512-BF16 (seen here).
    "--dtype",
    "float32",
)

REPLICA_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

STOP_GRACE_S = 20.0


class ReplicaStartError(RuntimeError):
    """The replica exited or did not become healthy in time (message carries its log tail)."""


def replica_command(
    model_dir: Path,
    port: int,
    *,
    scheduler: str = "larry",
    alpha: float = 1.0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line `run_replica` starts (exposed so tests can show it on failure)."""
    if scheduler not in ("larry", "fcfs", "stock"):
        raise ValueError(f"scheduler must be 'larry', 'fcfs' or 'stock', got {scheduler!r}")
    cmd = [sys.executable, "-m", "engine_patch.launcher", "serve", str(model_dir)]
    cmd += ["--sal-scheduler", scheduler]
    if scheduler == "larry":
        cmd += ["--sal-alpha", repr(float(alpha))]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *DEFAULT_ARGS, *extra_args]
    return cmd


def _log_tail(log_path: Path, n_chars: int = 4000) -> str:
    try:
        return log_path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "<no log>"


def _wait_healthy(
    proc: subprocess.Popen[bytes], base_url: str, log: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ReplicaStartError(
                    f"replica exited with code {proc.returncode} before becoming healthy; "
                    f"log tail:\n{_log_tail(log)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            time.sleep(0.5)
    raise ReplicaStartError(
        f"replica not healthy after {timeout_s:.0f} s; log tail:\n{_log_tail(log)}"
    )


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the replica's PID; after `grace_s`, SIGKILL the process group it leads.

    The replica runs in its own session (started with ``start_new_session=True``), so the
    group holds exactly the processes it spawned (EngineCore, API servers) and nothing else.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        # Children that outlived a clean parent exit (or a parent that ignored SIGTERM).
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@contextlib.contextmanager
def run_replica(
    model_dir: Path,
    port: int,
    *,
    scheduler: str = "larry",
    alpha: float = 1.0,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300,
) -> Iterator[str]:
    """Start a vLLM-on-CPU replica of `model_dir` on 127.0.0.1:`port` and yield its base URL.

    `scheduler`: ``"larry"`` (LARRY + ``/stats``), ``"fcfs"`` (stock order + ``/stats``) or
    ``"stock"`` (plain vLLM, no patch, no ``/stats``). `extra_args` are appended to the vLLM
    command line (they override `DEFAULT_ARGS`). Yields once ``GET /health`` answers 200;
    on exit stops the replica by PID (SIGTERM, then SIGKILL after a grace period). Raises
    `ReplicaStartError` with the replica's log tail if it dies or is not healthy within
    `timeout_s`.
    """
    cmd = replica_command(model_dir, port, scheduler=scheduler, alpha=alpha, extra_args=extra_args)
    env = {**os.environ, **REPLICA_ENV}
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(
        prefix=f"vllm-replica-{port}-", suffix=".log", delete=False
    ) as log_file:
        log_path = Path(log_file.name)
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    failed = True
    try:
        _wait_healthy(proc, base_url, log_path, timeout_s)
        yield base_url
        failed = False
    finally:
        stop_process(proc)
        # Keep the log of a failed start or a failed test for the post-mortem.
        if not failed:
            with contextlib.suppress(OSError):
                log_path.unlink()
