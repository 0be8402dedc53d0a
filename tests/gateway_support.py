"""Run the gateway as a user does (``python -m sal_gateway.cli serve --config PATH``) in tests.

`run_gateway()` writes a config, starts the CLI in a child process, waits until ``/health``
answers (and ``/ready`` too when asked), yields its base URL and stops it by PID on exit.
`scrape_metrics()` reads the gateway's Prometheus text into ``{(name, labels): value}``.
Used by the e2e tests and the real-vLLM integration tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

GATEWAY_CMD = (sys.executable, "-m", "sal_gateway.cli")
SAL_GATEWAY_SCRIPT = Path(sys.executable).with_name("sal-gateway")
"""The console script ``pip install`` puts next to the interpreter (what a user runs)."""

MetricKey = tuple[str, frozenset[tuple[str, str]]]


class GatewayStartError(RuntimeError):
    """The gateway exited or did not answer in time (message carries its log tail)."""


def free_port(start: int, stop: int) -> int:
    """The first TCP port in [start, stop) on 127.0.0.1 that can be bound now."""
    for port in range(start, stop):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{start}, {stop})")


def gateway_config(
    port: int,
    backends: list[str],
    *,
    tokenizer: Path | None,
    policy: str = "sal",
    model: str = "tiny",
    max_model_len: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A config dict in the documented ``config.yaml`` shape."""
    model_cfg: dict[str, Any] = {"name": model, "backends": backends}
    if tokenizer is not None:
        model_cfg["tokenizer"] = str(tokenizer)
    if max_model_len is not None:
        model_cfg["max_model_len"] = max_model_len
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [model_cfg],
        "routing": {"policy": policy, "poll_interval_s": 0.1},
        "log_level": "info",
    }
    config.update(extra or {})
    return config


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "<no log>"


def wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Poll ``url`` until 200; `GatewayStartError` with the log tail if the child exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise GatewayStartError(
                    f"gateway exited with {proc.returncode}; log tail:\n{_tail(log)}"
                )
            try:
                resp = client.get(url)
                if resp.status_code == 200:
                    return
                last = f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
    raise GatewayStartError(f"{url} not OK after {timeout_s} s ({last}); log:\n{_tail(log)}")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM by PID, SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)


@contextlib.contextmanager
def run_gateway(
    config: Mapping[str, Any],
    *,
    wait_ready: bool = True,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] = GATEWAY_CMD,
) -> Iterator[str]:
    """`run_gateway_process`, yielding only the base URL."""
    with run_gateway_process(
        config, wait_ready=wait_ready, timeout_s=timeout_s, env=env, command=command
    ) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def run_gateway_process(
    config: Mapping[str, Any],
    *,
    wait_ready: bool = True,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] = GATEWAY_CMD,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``<command> serve --config <file>`` with ``config`` written to a temporary file;
    yield ``(http://127.0.0.1:<port>, the process)`` once ``/health`` (and ``/ready``) answer
    200.

    The gateway's log lives in the temporary folder; with ``SAL_TEST_KEEP_LOGS=<dir>`` set it
    is copied there as ``gateway-<port>.log`` when the gateway stops (for a failure's story)."""
    port = config["listen"]["port"]
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="sal-gw-test-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(yaml.safe_dump(dict(config)))
        log_path = Path(tmp) / "gateway.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [*command, "serve", "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
            )
        try:
            wait_ok(f"{base_url}/health", proc, log_path, timeout_s)
            if wait_ready:
                wait_ok(f"{base_url}/ready", proc, log_path, timeout_s)
            yield base_url, proc
        finally:
            stop_process(proc)
            keep = os.environ.get("SAL_TEST_KEEP_LOGS")
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(log_path, Path(keep) / f"gateway-{port}.log")


def scrape_metrics(base_url: str, timeout_s: float = 5.0) -> dict[MetricKey, float]:
    """``GET /metrics`` parsed into ``{(sample name, labels): value}``."""
    text = httpx.get(f"{base_url}/metrics", timeout=timeout_s).text
    samples: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric(samples: Mapping[MetricKey, float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def serve_refused(
    config_text: str, tmp_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``sal-gateway serve`` on `config_text` (a config the test expects it to refuse at
    start) and return the finished process; asserts the refusal's shape: exit status 2 and
    no traceback (the caller checks what the message says)."""
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    done = subprocess.run(
        [sys.executable, "-m", "sal_gateway.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=None if env is None else dict(env),
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    return done
