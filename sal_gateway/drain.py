"""Draining on SIGTERM: what the gateway does between the signal and its exit.

A rolling update of the gateway (a new configuration, a new version) stops each old process
with SIGTERM. LLM answers stream for minutes, so stopping at once, or after the web server's
usual few seconds, cuts every long answer in flight. The sequence, with
``listen.shutdown_delay_s`` (D) and ``listen.shutdown_grace_s`` (G):

1. At the signal (`Drain.begin`), ``GET /ready`` answers 503 (``"draining": true``), so a
   load balancer or a Kubernetes Service stops sending here; for D seconds everything else is
   served as before (their endpoint updates lag the signal by seconds).
2. Then the server stops accepting connections and closes idle keep-alive ones; requests in
   flight go on for at most G seconds.
3. Whatever still runs after G is cancelled, and `Drain.draining` tells the request path that
   the cancellation is the shutdown (`is_shutdown`): a stream ends with an SSE error event
   (503, ``gateway_shutdown``) and ``data: [DONE]``, a request not answered yet gets that
   503 as its response; both close their upstream connection, so vLLM aborts the generation.
   Nothing ends silently or as a broken connection.

A second SIGTERM or SIGINT during the delay goes to step 2 at once; in step 2, SIGINT exits at
once (the web server's force exit). The signal plumbing is `cli.DrainingServer`; this module
holds the state and the error (pure, no I/O).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sal_gateway.errors import GatewayError


class GatewayShutdown(GatewayError):
    """The request was still running when the gateway's shutdown grace ran out."""

    status = 503
    error_type = "service_unavailable"
    code = "gateway_shutdown"


SHUTDOWN_MESSAGE = (
    "the gateway is shutting down and this request outlasted listen.shutdown_grace_s; "
    "the response is incomplete: retry it"
)


@dataclass(slots=True)
class Drain:
    """Whether this gateway process is draining (set once, from the signal handler)."""

    began_s: float | None = None
    """Monotonic time of the signal; None while serving normally."""

    @property
    def draining(self) -> bool:
        return self.began_s is not None

    def begin(self) -> None:
        """The stop signal came (idempotent: the first one counts)."""
        if self.began_s is None:
            self.began_s = time.monotonic()

    def is_shutdown(self, exc: BaseException) -> bool:
        """Whether `exc`, raised in a request's task, is the shutdown cancelling it: a
        request task is cancelled only by the server's shutdown (a client that goes away
        is noticed by the relay, not by cancellation)."""
        return self.draining and isinstance(exc, asyncio.CancelledError)

    @staticmethod
    def error() -> GatewayShutdown:
        return GatewayShutdown(SHUTDOWN_MESSAGE)


def uncancel_current_task() -> None:
    """Take back the shutdown's cancellation of the running request task once it has been
    handled (the request answered with `Drain.error`), so that the awaits which send that
    answer, and any `asyncio.timeout` around them, behave as in a task never cancelled."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
