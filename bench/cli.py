"""``sal-bench``: simulator and benchmark commands, one subcommand per registered `Command`.

Adding a subcommand is one `Command` in `COMMANDS`: a name, a help line, a function that adds
its arguments to an `argparse` parser, and a function that runs it and returns an exit code.
Heavy imports happen inside the run functions so ``sal-bench --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench import experiments, real_path, simulate_cmd


@dataclass(frozen=True, slots=True)
class Command:
    """One ``sal-bench`` subcommand."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: tuple[Command, ...] = (
    Command("simulate", simulate_cmd.HELP, simulate_cmd.configure, simulate_cmd.run),
    Command("experiments", experiments.HELP, experiments.configure, experiments.run),
    Command("real-path", real_path.HELP, real_path.configure, real_path.run),
)
"""Every subcommand, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sal-bench", description="Simulate SAL/LARRY fleets and reproduce the paper."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sal-bench`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    run: Callable[[argparse.Namespace], int] = args._run
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
