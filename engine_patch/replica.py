"""Start and stop one local vLLM-on-CPU replica process (tests, benchmarks, demos).

`LocalReplica` runs ``python -m engine_patch.launcher serve MODEL ...`` (or plain vLLM for
``scheduler="stock"``) in its own session, waits for ``GET /health``, and stops it by PID:
SIGTERM, then SIGKILL to the process group it leads (its EngineCore / API-server children)
after a grace period. Output goes to a log file whose tail is quoted when the start fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

CPU_DEFAULT_ARGS: tuple[str, ...] = (
    "--load-format",
    "dummy",
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "32",
    "--num-gpu-blocks-override",
    "512",
    # bfloat16 kills the CPU worker on machines without AVX512-BF16 (seen on the test boxes).
    "--dtype",
    "float32",
)
"""Small, CPU-friendly vLLM arguments for a tiny dummy-weight model; later arguments win."""

CPU_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's CPU worker binds spinning OpenMP threads to the cores it does not reserve; on a
    # 2-core machine that starved the API server, which then held new requests back (they
    # reached the engine only after the running stream ended). One unbound thread leaves the
    # API server room; the tiny model does not need more.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}

STOP_GRACE_S = 20.0
SCHEDULERS = ("larry", "larry_tail", "fcfs", "stock")


class ReplicaStartError(RuntimeError):
    """The replica exited or did not become healthy in time (message carries its log tail)."""


def replica_command(
    model_dir: Path,
    port: int,
    *,
    scheduler: str = "larry",
    alpha: float = 1.0,
    extra_args: Sequence[str] = (),
    base_args: Sequence[str] = CPU_DEFAULT_ARGS,
) -> list[str]:
    """The command line of a replica (`extra_args` come last and win over `base_args`)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    cmd = [sys.executable, "-m", "engine_patch.launcher", "serve", str(model_dir)]
    cmd += ["--sal-scheduler", scheduler]
    if scheduler in ("larry", "larry_tail"):
        cmd += ["--sal-alpha", repr(float(alpha))]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *base_args, *extra_args]
    return cmd


class LocalReplica:
    """One replica process; use as a context manager or call `start()` / `stop()`."""

    def __init__(
        self, command: Sequence[str], port: int, *, env: Mapping[str, str] | None = None
    ) -> None:
        self.command = list(command)
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **CPU_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def log_tail(self, n_chars: int = 4000) -> str:
        """The end of the replica's log (for error messages)."""
        if self.log_path is None:
            return "<no log>"
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "<no log>"

    def start(self, timeout_s: float = 300.0) -> str:
        """Start the process and block until ``/health`` answers 200; return the base URL."""
        port = self.base_url.rsplit(":", 1)[1]
        with tempfile.NamedTemporaryFile(
            prefix=f"vllm-replica-{port}-", suffix=".log", delete=False
        ) as log_file:
            self.log_path = Path(log_file.name)
            self.proc = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ReplicaStartError(
                        f"replica exited with code {self.proc.returncode} before becoming "
                        f"healthy; log tail:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                time.sleep(0.5)
        raise ReplicaStartError(
            f"replica not healthy after {timeout_s:.0f} s; log tail:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the replica's PID; after `grace_s`, SIGKILL the process group it leads.

        The replica runs in its own session, so its group holds exactly the processes it
        spawned (EngineCore, workers, API servers) and nothing else.
        """
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # Children that outlived their parent (or a parent that ignored SIGTERM).
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def remove_log(self) -> None:
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self) -> LocalReplica:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        # Keep the log of a failed run for the post-mortem.
        if exc_type is None:
            self.remove_log()
