"""`sal-gateway` subcommands contributed through the ``sal_gateway.commands`` entry points.

The gateway's CLI finds ``demo`` (the simulator's) by entry point, never by import; these tests
build the dispatch from entry points made here, so they hold without reinstalling the package.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from sal_gateway import cli

REPO = Path(__file__).resolve().parents[2]


@dataclass
class EchoCommand:
    """A contributed command that records what it was run with."""

    help: str = "echo a number"
    description: str = "Echoes --n."
    runs: list[int] = field(default_factory=list)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=1)

    def run(self, args: argparse.Namespace) -> int:
        self.runs.append(args.n)
        return 7


ECHO = EchoCommand()
NOT_A_COMMAND = object()


def _entry(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=cli.COMMANDS_GROUP)


def test_a_contributed_command_is_parsed_and_run(monkeypatch: pytest.MonkeyPatch) -> None:
    found = [_entry("echo", f"{__name__}:ECHO")]
    monkeypatch.setattr(
        cli, "entry_points", lambda group: found if group == cli.COMMANDS_GROUP else []
    )
    assert cli.main(["echo", "--n", "3"]) == 7
    assert ECHO.runs[-1] == 3


def test_broken_contributions_are_left_out_and_serve_still_parses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands = cli.plugin_commands(
        [
            _entry("missing", "no_such_module_sal_test:COMMAND"),
            _entry("plain", f"{__name__}:NOT_A_COMMAND"),
            _entry("serve", f"{__name__}:ECHO"),  # may not shadow the gateway's own command
            _entry("echo", f"{__name__}:ECHO"),
        ]
    )
    assert list(commands) == ["echo"]
    err = capsys.readouterr().err
    assert "'missing' not loaded" in err
    assert "NOT_A_COMMAND is not a command" in err
    assert "duplicate command 'serve'" in err
    args = cli._parser(commands).parse_args(["serve", "--config", "x.yaml"])
    assert args.command == "serve"


def test_the_demo_is_registered_by_the_package_metadata() -> None:
    """pyproject.toml's entry point names a `Command` whose flags are the demo's."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = pyproject["project"]["entry-points"][cli.COMMANDS_GROUP]
    commands = cli.plugin_commands(_entry(name, value) for name, value in group.items())
    assert "demo" in commands
    args = cli._parser(commands).parse_args(["demo", "--replicas", "2", "--requests", "5"])
    assert (args.command, args.replicas, args.requests) == ("demo", 2, 5)
