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

from bench import (
    capacity,
    experiments,
    fuzz_bench,
    gateways,
    larry_tail,
    lora_bench,
    lora_real,
    prefix_bench,
    prefix_real,
    real_path,
    sensitivity,
    simulate_cmd,
    soak,
)


@dataclass(frozen=True, slots=True)
class Command:
    """One ``sal-bench`` subcommand."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _remainder(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", help="passed on unchanged (see its --help)")


def _run_gateway_bench(args: argparse.Namespace) -> int:
    from bench import gateway_bench

    return gateway_bench.main(list(args.args))


def _run_larry_vllm_bench(args: argparse.Namespace) -> int:
    from bench import larry_vllm_bench

    return larry_vllm_bench.main(list(args.args))


_PASSTHROUGH: dict[str, Callable[[argparse.Namespace], int]] = {
    "gateway": _run_gateway_bench,
    "larry-vllm": _run_larry_vllm_bench,
}
"""Commands with a parser of their own: everything after the name goes to it unparsed
(argparse cannot forward ``--options`` through a subparser reliably)."""


COMMANDS: tuple[Command, ...] = (
    Command("simulate", simulate_cmd.HELP, simulate_cmd.configure, simulate_cmd.run),
    Command("experiments", experiments.HELP, experiments.configure, experiments.run),
    Command("capacity", capacity.HELP, capacity.configure, capacity.run),
    Command("gateways", gateways.HELP, gateways.configure, gateways.run),
    Command("sensitivity", sensitivity.HELP, sensitivity.configure, sensitivity.run),
    Command("larry-tail", larry_tail.HELP, larry_tail.configure, larry_tail.run),
    Command("real-path", real_path.HELP, real_path.configure, real_path.run),
    Command("prefix-real", prefix_real.HELP, prefix_real.configure, prefix_real.run),
    Command("soak", soak.HELP, soak.configure, soak.run),
    Command(
        "gateway",
        "gateway overhead vs direct, throughput, decision and tokenization time "
        "(= python -m bench.gateway_bench)",
        _remainder,
        _run_gateway_bench,
    ),
    Command(
        "larry-vllm",
        "FCFS vs LARRY vs larry_tail on one real vLLM-on-CPU replica "
        "(= python -m bench.larry_vllm_bench)",
        _remainder,
        _run_larry_vllm_bench,
    ),
    Command("fuzz", fuzz_bench.HELP, fuzz_bench.configure, fuzz_bench.run),
    Command("prefix", prefix_bench.HELP, prefix_bench.configure, prefix_bench.run),
    Command("lora", lora_bench.HELP, lora_bench.configure, lora_bench.run),
    Command("lora-real", lora_real.HELP, lora_real.configure, lora_real.run),
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
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw and raw[0] in _PASSTHROUGH:
        return _PASSTHROUGH[raw[0]](argparse.Namespace(args=raw[1:]))
    parser = build_parser()
    args = parser.parse_args(raw)
    run: Callable[[argparse.Namespace], int] = args._run
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
