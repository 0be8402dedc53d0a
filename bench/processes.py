"""Start benchmark servers as child processes, wait until they answer, stop them by PID.

Each server under test (fake backend, gateway, bare proxies) and the load generator run in
processes of their own, so that one process's event loop never competes with another's inside
the same interpreter; on a 2-core machine they still share the cores (ratios matter, absolute
numbers are noisy).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port(start: int = 19000, stop: int = 20000) -> int:
    """The first TCP port in [start, stop) on 127.0.0.1 that can be bound now."""
    for port in range(start, stop):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{start}, {stop})")


class PortAllocator:
    """Hands out distinct free ports from a range (the benchmark's range is 19000-19999)."""

    def __init__(self, start: int = 19000, stop: int = 20000) -> None:
        self._next = start
        self._stop = stop

    def take(self) -> int:
        port = free_port(self._next, self._stop)
        self._next = port + 1
        return port


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; raise with the child's log tail if it died first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the child by PID, then SIGKILL it if it has not exited after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


class ServerGroup:
    """Child servers started together and awaited together (their start-ups overlap).

    Use as a context manager: `start()` each server, then `wait_all()`; on exit every child
    is stopped by PID, in reverse start order."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = {**os.environ, **(env or {})}
        self._children: list[tuple[subprocess.Popen[bytes], str, Path]] = []

    def start(self, args: Sequence[str], health_url: str, log_path: Path) -> None:
        """Start ``python <args>`` with its output in ``log_path``; do not wait."""
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
            )
        self._children.append((proc, health_url, log_path))

    def wait_all(self, timeout_s: float = 60.0) -> None:
        """Wait until every started server answers 200 on its health URL."""
        deadline = time.monotonic() + timeout_s
        for proc, url, log_path in self._children:
            try:
                wait_http_ok(url, max(1.0, deadline - time.monotonic()), proc)
            except (RuntimeError, TimeoutError) as exc:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{exc}\n--- {log_path} ---\n{tail}") from exc

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, _, _ in reversed(self._children):
            stop_process(proc)
