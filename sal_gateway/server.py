"""The gateway's HTTP server: uvicorn, stopping by the drain sequence of `sal_gateway.drain`.

`DrainingServer` changes only what a stop signal does. The first SIGTERM (or SIGINT) starts
the drain (``/ready`` answers 503) and, after ``listen.shutdown_delay_s``, uvicorn's own
graceful shutdown, whose ``timeout_graceful_shutdown`` is ``listen.shutdown_grace_s``. A
second signal during the delay starts the shutdown at once; in the shutdown a second SIGINT
forces the exit (uvicorn's behaviour).
"""

from __future__ import annotations

import logging
import threading
from types import FrameType

import uvicorn

from sal_gateway.drain import Drain

logger = logging.getLogger("sal_gateway.server")


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` whose stop signal first drains (`sal_gateway.drain`)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, delay_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._delay_s = delay_s
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Called by uvicorn's signal handler on the main thread."""
        if self._drain.draining or self._delay_s <= 0:
            self._drain.begin()
            if self._timer is not None:
                self._timer.cancel()
            super().handle_exit(sig, frame)
            return
        self._drain.begin()
        logger.warning(
            "draining: /ready answers 503; serving %.1f s more, then requests in flight get "
            "up to %s s to finish",
            self._delay_s,
            self.config.timeout_graceful_shutdown,
        )
        stop = super().handle_exit
        self._timer = threading.Timer(self._delay_s, stop, (sig, frame))
        self._timer.daemon = True
        self._timer.start()
