"""The ``sal-gateway`` command as a user runs it: ``--version`` and bad configs.

Each case runs the installed console script in a child process and checks what the user sees:
the exit status and the one-line message naming the problem. A bad config must be rejected
before the server binds, so the port stays free.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import sal_gateway
from tests.gateway_support import SAL_GATEWAY_SCRIPT as SAL_GATEWAY
from tests.gateway_support import free_port, gateway_config

EXIT_BAD_CONFIG = 2


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the console script with a hard time bound (a bad config must never start serving)."""
    return subprocess.run(
        [str(SAL_GATEWAY), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def write_config(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _bindable(port: int) -> bool:
    try:
        free_port(port, port + 1)
    except RuntimeError:
        return False
    return True


def test_console_script_is_installed() -> None:
    assert SAL_GATEWAY.is_file(), "pip install -e . should install the sal-gateway script"


def test_version_prints_package_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"sal-gateway {sal_gateway.__version__}"


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = run_cli("serve", "--config", str(missing))
    assert result.returncode == EXIT_BAD_CONFIG
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr


def _valid_config(port: int) -> dict[str, Any]:
    return gateway_config(port, ["http://127.0.0.1:19999"], tokenizer=None)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(lambda c: c["routing"].update(polcy="sal"), "routing.polcy", id="unknown-key"),
        pytest.param(
            lambda c: c["routing"].update(policy="fastest"), "fastest", id="unknown-policy"
        ),
        pytest.param(
            lambda c: c["models"][0].update(backends=["127.0.0.1:8001"]),
            "models[0].backends[0]",
            id="backend-without-scheme",
        ),
        pytest.param(
            lambda c: c["listen"].update(port="eighty"), "listen.port", id="port-not-a-number"
        ),
        pytest.param(
            lambda c: c["models"][0].update(tokenizer="/nonexistent/tokenizer"),
            "/nonexistent/tokenizer",
            id="tokenizer-not-found",
        ),
    ],
)
def test_bad_config_exits_2_naming_the_problem(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], None], expected: str
) -> None:
    port = free_port(19700, 19800)
    config = _valid_config(port)
    mutate(config)
    result = run_cli("serve", "--config", str(write_config(tmp_path, config)))
    assert result.returncode == EXIT_BAD_CONFIG, result.stderr
    assert "bad config" in result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert _bindable(port), "a rejected config must not leave a server bound"


def test_environment_override_is_validated_too(tmp_path: Path) -> None:
    config = write_config(tmp_path, _valid_config(free_port(19700, 19800)))
    result = run_cli(
        "serve", "--config", str(config), env={"SAL_GATEWAY__ROUTING__POLICY": "fastest"}
    )
    assert result.returncode == EXIT_BAD_CONFIG
    assert "routing.policy" in result.stderr
    assert "fastest" in result.stderr


def test_invalid_yaml_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("models: [unclosed\n")
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == EXIT_BAD_CONFIG
    assert "invalid YAML" in result.stderr
