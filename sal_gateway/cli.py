"""Command line: ``sal-gateway serve --config PATH [--host H] [--port P]``, ``--version``.

The config is validated and every tokenizer loaded *before* the server binds; a bad config or
a tokenizer that cannot be loaded offline exits with status 2 and one line on stderr naming
the problem. The server is uvicorn with uvloop and httptools (the fastest pair measured for
this workload) and one worker process; its HTTP protocol is uvicorn's httptools one plus the
header and body deadlines uvicorn lacks (`http_protocol`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import sys
from collections.abc import Sequence

from sal_gateway import __version__
from sal_gateway.auth import AuthConfigError
from sal_gateway.config import ConfigError, GatewayConfig, load_config
from sal_gateway.tokenizer import TokenizerLoadError

EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
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
    demo = sub.add_parser(
        "demo",
        help="run the gateway in front of N emulated vLLM replicas (no GPU needed)",
        description="The gateway in front of emulated vLLM replicas in one process; "
        "optionally drives a built-in load and prints a summary.",
    )
    from sal_gateway import demo as demo_module

    demo_module.add_arguments(demo)
    return parser


def _with_listen(config: GatewayConfig, host: str | None, port: int | None) -> GatewayConfig:
    listen = dataclasses.replace(
        config.listen,
        host=config.listen.host if host is None else host,
        port=config.listen.port if port is None else port,
    )
    return dataclasses.replace(config, listen=listen)


def serve(config: GatewayConfig) -> None:
    """Load tokenizers, then run uvicorn until interrupted (raises `TokenizerLoadError`)."""
    import uvicorn

    from sal_gateway.app import Runtime, create_app, load_counters
    from sal_gateway.http_protocol import deadline_protocol

    counters = load_counters(config)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config, counters=counters)

    def on_timeout(reason: str) -> None:
        runtime: Runtime | None = getattr(app.state, "runtime", None)
        if runtime is not None:
            runtime.metrics.rejected.labels(reason=reason).inc()

    listen = config.listen
    # Tokenizers and transformers leave ~10^5 long-lived objects; every full garbage collection
    # would scan them all on the event loop's thread. Frozen, they are skipped.
    gc.freeze()
    uvicorn.run(
        app,
        host=config.listen.host,
        port=config.listen.port,
        loop="uvloop",
        http=deadline_protocol(listen.header_timeout_s, listen.body_timeout_s, on_timeout),
        log_level=config.log_level,
        access_log=False,  # one line per request costs ~10% throughput; metrics cover it
        timeout_graceful_shutdown=5,
        timeout_keep_alive=max(1, round(config.listen.keep_alive_s)),
    )


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sal-gateway`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from sal_gateway import demo as demo_module

        return demo_module.main(args)
    try:
        config = _with_listen(load_config(args.config), args.host, args.port)
        if not 0 <= config.listen.port <= 65535:
            raise ConfigError(f"--port: must be in 0..65535, got {config.listen.port}")
    except ConfigError as exc:
        print(f"sal-gateway: bad config: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        serve(config)
    except (TokenizerLoadError, AuthConfigError) as exc:
        print(f"sal-gateway: bad config: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
