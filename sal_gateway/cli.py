"""Command line: ``sal-gateway serve --config PATH [--host H] [--port P]``, ``--version``.

Other installed packages add subcommands through the entry-point group
``sal_gateway.commands`` (see `Command`): ``sal-gateway demo`` is `engine_sim.demo`'s, so the
gateway package never imports the simulator.

The config is validated and every tokenizer loaded *before* the server binds; a bad config or
a tokenizer that cannot be loaded offline exits with status 2 and one line on stderr naming
the problem. The server is uvicorn with uvloop and httptools (the fastest pair measured for
this workload), one process, or ``listen.workers`` processes sharing the port
(`sal_gateway.workers`); its HTTP protocol is uvicorn's httptools one plus the header and
body deadlines uvicorn lacks (`http_protocol`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import socket
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sal_gateway import __version__
from sal_gateway.auth import AuthConfigError
from sal_gateway.config import ConfigError, GatewayConfig, load_config
from sal_gateway.peers import PeersError
from sal_gateway.tokenizer import TokenizerLoadError
from sal_gateway.tracing import TracingError

if TYPE_CHECKING:
    from sal_gateway.prefix_share import ShareSpec
    from sal_gateway.shared_accounting import SharedAccounting

EXIT_BAD_CONFIG = 2
EXIT_STARTUP_FAILURE = 3
"""uvicorn's own status when the server could not start (address in use, ...)."""
COMMANDS_GROUP = "sal_gateway.commands"
"""Entry-point group of the subcommands other packages contribute (name = subcommand)."""
BUILTIN_COMMANDS = frozenset({"serve"})


@runtime_checkable
class Command(Protocol):
    """A ``sal-gateway`` subcommand contributed by another package.

    Registered in ``pyproject.toml`` as
    ``[project.entry-points."sal_gateway.commands"] NAME = "module:OBJECT"``; the object has
    the subcommand's one-line `help`, its `description`, adds its flags in `add_arguments`
    and runs in `run`, whose return value is the process's exit status.
    """

    @property
    def help(self) -> str:
        """One line for ``sal-gateway --help``."""

    @property
    def description(self) -> str:
        """The subcommand's own ``--help`` text."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's flags to its (sub)parser."""

    def run(self, args: argparse.Namespace) -> int:
        """Run with the parsed flags; return the exit status."""


def plugin_commands(found: Iterable[EntryPoint] | None = None) -> dict[str, Command]:
    """The contributed subcommands by name, from `found` (default: the installed entry points).

    An entry that cannot be loaded, is not a `Command`, repeats an earlier name or shadows a
    built-in one is left out with one line on stderr: a broken add-on must not stop
    ``sal-gateway serve``.
    """
    if found is None:
        found = entry_points(group=COMMANDS_GROUP)
    commands: dict[str, Command] = {}
    for entry in found:
        if entry.name in BUILTIN_COMMANDS or entry.name in commands:
            print(f"sal-gateway: ignoring duplicate command {entry.name!r}", file=sys.stderr)
            continue
        try:
            command = entry.load()
        except Exception as exc:  # any import-time failure of an add-on, reported and skipped
            print(f"sal-gateway: command {entry.name!r} not loaded: {exc!r}", file=sys.stderr)
            continue
        if not isinstance(command, Command):
            print(f"sal-gateway: {entry.value} is not a command", file=sys.stderr)
            continue
        commands[entry.name] = command
    return commands


def _parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sal-gateway",
        description="SAL: a server-aware, token-aware OpenAI-compatible gateway for vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"sal-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", required=True, help="path to config.yaml")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    for name, command in sorted(commands.items()):
        command.add_arguments(
            sub.add_parser(name, help=command.help, description=command.description)
        )
    return parser


def _with_listen(config: GatewayConfig, host: str | None, port: int | None) -> GatewayConfig:
    listen = dataclasses.replace(
        config.listen,
        host=config.listen.host if host is None else host,
        port=config.listen.port if port is None else port,
    )
    return dataclasses.replace(config, listen=listen)


def serve(
    config: GatewayConfig,
    sockets: list[socket.socket] | None = None,
    accounting: SharedAccounting | None = None,
    prefix_share: ShareSpec | None = None,
) -> None:
    """Load tokenizers, then run uvicorn until interrupted (raises `TokenizerLoadError`).

    With `sockets` (a `sal_gateway.workers` worker) uvicorn serves on those bound sockets
    instead of binding ``listen.host:listen.port`` itself; `accounting` is the workers'
    shared between-poll accounting (`sal_gateway.shared_accounting`), `prefix_share` this
    worker's end of their prefix-index exchange (`sal_gateway.prefix_share`).
    """
    import uvicorn

    from sal_gateway.app import Runtime, create_app, load_counters
    from sal_gateway.http_protocol import deadline_protocol
    from sal_gateway.server import DrainingServer

    counters = load_counters(config)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config, counters=counters, accounting=accounting, prefix_share=prefix_share)

    def on_timeout(reason: str) -> None:
        runtime: Runtime | None = getattr(app.state, "runtime", None)
        if runtime is not None:
            runtime.metrics.rejected.labels(reason=reason).inc()

    listen = config.listen
    # Tokenizers and transformers leave ~10^5 long-lived objects; every full garbage collection
    # would scan them all on the event loop's thread. Frozen, they are skipped.
    gc.freeze()
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=listen.host,
            port=listen.port,
            loop="uvloop",
            http=deadline_protocol(listen.header_timeout_s, listen.body_timeout_s, on_timeout),
            log_level=config.log_level,
            access_log=False,  # one line per request costs ~10% throughput; metrics cover it
            # uvicorn passes it to asyncio.timeout: seconds as a float work (typed int).
            timeout_graceful_shutdown=listen.shutdown_grace_s,  # type: ignore[arg-type]
            timeout_keep_alive=max(1, round(listen.keep_alive_s)),
        ),
        app.state.drain,
        listen.shutdown_delay_s,
    )
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        server.run(sockets=sockets)
    if not server.started:
        sys.exit(EXIT_STARTUP_FAILURE)  # the bind failed; uvicorn logged why


def serve_worker(
    config: GatewayConfig,
    sockets: list[socket.socket],
    accounting: SharedAccounting | None,
    prefix_share: ShareSpec | None,
) -> None:
    """`serve` in a worker process (spawned: it does not inherit the parent's modules) without
    PyTorch, as `console_main`; a config error exits 2 with one line, as `main` does."""
    from sal_gateway.torch_free import keep_torch_out

    keep_torch_out()
    try:
        serve(config, sockets, accounting, prefix_share)
    except (TokenizerLoadError, AuthConfigError, TracingError, PeersError) as exc:
        print(f"sal-gateway: bad config: {_one_line(exc)}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sal-gateway`` console script."""
    commands = plugin_commands()
    args = _parser(commands).parse_args(argv)
    if args.command in commands:
        return commands[args.command].run(args)
    try:
        config = _with_listen(load_config(args.config), args.host, args.port)
        if not 0 <= config.listen.port <= 65535:
            raise ConfigError(f"--port: must be in 0..65535, got {config.listen.port}")
    except ConfigError as exc:
        print(f"sal-gateway: bad config: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if config.listen.workers > 1:
        from sal_gateway.workers import WorkersError, run_workers

        try:
            return run_workers(config, serve_worker)
        except WorkersError as exc:
            print(f"sal-gateway: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
    try:
        serve(config)
    except (TokenizerLoadError, AuthConfigError, TracingError, PeersError) as exc:
        print(f"sal-gateway: bad config: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return 0


def console_main() -> int:
    """The ``sal-gateway`` console script: `main` in a process without PyTorch
    (`sal_gateway.torch_free`). `main` itself leaves the caller's imports alone."""
    from sal_gateway.torch_free import keep_torch_out

    keep_torch_out()
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
