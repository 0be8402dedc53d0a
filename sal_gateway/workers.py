"""Several gateway processes on one host sharing one port (``listen.workers``).

One gateway process serves from one event loop, so one core. With ``listen.workers: N`` the
CLI starts N worker processes (`run_workers`); each binds ``listen.host:listen.port`` with
``SO_REUSEPORT``, so the kernel spreads incoming connections over them, and each is a whole
gateway: its own tokenizers, pollers, beta estimate and metrics. What they share
(``listen.share_accounting``, on by default) is the between-poll accounting: the parent
creates one shared-memory block (`sal_gateway.shared_accounting`) and every worker publishes
there what it routed to each backend since its last snapshot, and reads the others', so the
workers route as one gateway rather than herding like independent ones. With
``routing.prefix_cache: approximate`` they also tell each other the prompt blocks they route
(``listen.share_prefix_index``, on by default; `sal_gateway.prefix_share`), so each worker's
prefix index holds every worker's routing.

Metrics: a scrape of the shared port reaches one worker chosen by the kernel, so it sees
only that worker's counters. Each worker therefore also listens alone on its own port
(``listen.worker_ports_from`` + i, default ``listen.port`` + 1 + i); scrape every worker
there (one Prometheus target per worker; sum over them). Prometheus' multiprocess mode was
not used: it cannot carry the per-backend gauges each worker keeps (every worker has its
own picture of each backend) nor the process collectors.

Lifecycle: the parent only supervises. SIGTERM / SIGINT are forwarded to every worker (each
shuts down gracefully, as one gateway does); if a worker exits on its own, the others are
stopped and the parent exits with that worker's status, so the supervisor (Kubernetes,
systemd) restarts the whole set. Linux only (``SO_REUSEPORT`` load balancing).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import wait
from types import FrameType

from sal_gateway.config import GatewayConfig
from sal_gateway.prefix_share import ShareSpec, create_folder, remove_folder
from sal_gateway.shared_accounting import SharedAccounting, SharedAccountingError

log = logging.getLogger("sal_gateway.workers")

WorkerServe = Callable[
    [GatewayConfig, list[socket.socket], SharedAccounting | None, ShareSpec | None], None
]
"""Runs one gateway on already-bound sockets, with the workers' shared accounting and its
end of the prefix-index exchange (None: not shared), until it is told to stop
(`cli.serve`)."""


class WorkersError(RuntimeError):
    """The worker set cannot start (no ``SO_REUSEPORT``, a port already taken)."""


def bind_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A bound, not yet listening TCP socket (uvicorn calls ``listen`` on it).

    `reuse_port` sets ``SO_REUSEPORT`` so every worker can bind the same port; raises
    `WorkersError` naming the address when it cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            if not hasattr(socket, "SO_REUSEPORT"):
                raise WorkersError("listen.workers > 1 needs SO_REUSEPORT (Linux)")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise WorkersError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    except WorkersError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def _worker_main(
    serve: WorkerServe,
    config: GatewayConfig,
    index: int,
    port: int,
    own_port: int,
    accounting_name: str | None,
    share_folder: str | None,
) -> None:
    """Entry point of worker `index` (a spawned process): bind both sockets, attach the
    shared accounting (`accounting_name`; None: not shared), then serve; `share_folder`
    holds the workers' prefix-index sockets (`sal_gateway.prefix_share`; None: not shared)."""
    listen = config.listen
    try:
        shared = bind_socket(listen.host, port, reuse_port=True)
        own = bind_socket(listen.host, own_port, reuse_port=False)
        accounting = (
            None if accounting_name is None else SharedAccounting.attach(accounting_name, index)
        )
    except (WorkersError, SharedAccountingError) as exc:
        print(f"sal-gateway worker {index}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(
        f"sal-gateway worker {index} (pid {os.getpid()}): shared port {port}, "
        f"own port {own.getsockname()[1]} (its /metrics)",
        file=sys.stderr,
        flush=True,
    )
    # Each worker its own UDP port for `peers` (a datagram reaches one socket only).
    config = dataclasses.replace(config, peers=config.peers.for_worker(index, listen.workers))
    try:
        spec = None if share_folder is None else ShareSpec(share_folder, index, listen.workers)
        serve(config, [shared, own], accounting, spec)
    finally:
        if accounting is not None:
            accounting.close()


def run_workers(config: GatewayConfig, serve: WorkerServe) -> int:
    """Start ``config.listen.workers`` gateway processes on one port; supervise until done.

    Returns the exit status: 0 after a SIGTERM / SIGINT when every worker stopped cleanly,
    else the status of the first worker that exited on its own (or failed to stop).
    """
    listen = config.listen
    # With port 0 the first bind picks the port; the placeholder (never listening, so it
    # takes no connections) keeps it reserved for the workers' SO_REUSEPORT binds.
    placeholder = bind_socket(listen.host, listen.port, reuse_port=True)
    port = placeholder.getsockname()[1]
    accounting = None
    if listen.share_accounting:
        try:
            accounting = SharedAccounting.create(listen.workers)
        except OSError as exc:  # no writable /dev/shm nor temporary folder
            print(
                f"sal-gateway: cannot create the shared accounting ({exc}); each worker "
                "counts only its own requests",
                file=sys.stderr,
                flush=True,
            )
    name = None if accounting is None else accounting.name
    share_folder = None
    if listen.share_prefix_index and config.routing.prefix_cache == "approximate":
        try:
            share_folder = create_folder()
        except OSError as exc:  # no writable temporary folder
            print(
                f"sal-gateway: cannot create the prefix-index exchange ({exc}); each worker "
                "knows only the prompt blocks it routed",
                file=sys.stderr,
                flush=True,
            )
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(serve, config, i, port, own_port, name, share_folder),
            name=f"sal-gateway-worker-{i}",
        )
        for i, own_port in enumerate(listen.worker_ports())
    ]
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for proc in procs:
            proc.start()
        sharing = "shared" if accounting is not None else "separate"
        print(
            f"sal-gateway: {len(procs)} workers on {listen.host}:{port} ({sharing} accounting)",
            file=sys.stderr,
            flush=True,
        )
        alive = list(procs)
        while alive:
            wait([p.sentinel for p in alive])
            for proc in [p for p in alive if p.exitcode is not None]:
                alive.remove(proc)
                code = proc.exitcode or 0
                if not stopping:
                    print(
                        f"sal-gateway: {proc.name} exited with status {code}; stopping the "
                        "other workers",
                        file=sys.stderr,
                        flush=True,
                    )
                    status = code or 1
                    stop(signal.SIGTERM, None)
                elif code not in (0, -signal.SIGTERM) and not status:
                    status = code if code > 0 else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in procs:
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        placeholder.close()
        if accounting is not None:
            accounting.close()  # and unlink: every worker has stopped
        if share_folder is not None:
            remove_folder(share_folder)
    return status
