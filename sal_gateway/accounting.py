"""Response accounting: what one upstream exchange leaves behind once it is answered.

`Accounting` is the relay's `relay.Settler`: the forwarder and the relays report to it how an
exchange went, and it keeps the books:

* the state-table ticket (in-flight count, pending prompt tokens) is marked at the first
  body byte and released exactly once, when the exchange ends (`finish`), on every path;
  content of a 200 answer marks its backend alive (`StateTable.relayed`, for degraded
  routing);
* metrics: time to first byte, generation time, requests by status, stream errors and
  timeouts, upstream connections the gateway closed (``sal_upstream_cancels_total``); for a
  LoRA adapter's request (`Exchange.adapter_label`) its own requests, TTFT and output tokens too;
* ``usage`` (prompt and completion tokens) of answered requests feeds the model's
  `BetaEstimator` and ``sal_output_tokens_total``.

One instance per app (built with the `proxy.Forwarder`); called once or a few times per
exchange, never blocking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import aiohttp

from sal_core.beta import BetaEstimator
from sal_gateway.errors import GatewayError
from sal_gateway.metrics import GatewayMetrics
from sal_gateway.relay import Exchange, stream_error
from sal_gateway.state import StateTable

__all__ = ["Accounting"]


class Accounting:
    """Books of the exchanges of one app (see the module docstring)."""

    def __init__(
        self,
        *,
        metrics: GatewayMetrics,
        betas: Mapping[str, BetaEstimator],
        policy_name: str,
        stream_idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        self._betas = betas
        self._policy_name = policy_name
        self._idle_timeout_s = stream_idle_timeout_s

    def first_byte(self, ex: Exchange) -> None:
        """The backend started answering: prefill is done, time to first token known."""
        StateTable.first_byte(ex.ticket)
        ttft_s = time.perf_counter() - ex.start_s
        self._metrics.series(ex.model, ex.backend, self._policy_name).ttft.observe(ttft_s)
        if ex.adapter_label is not None:
            self._metrics.adapter_ttft.labels(ex.model, ex.adapter_label).observe(ttft_s)

    def content(self, ex: Exchange) -> None:
        """Content of a 200 answer reached us: the backend serves (`StateTable.relayed`)."""
        StateTable.relayed(ex.ticket, self._clock())

    def upstream_cancelled(self, ex: Exchange, reason: str) -> None:
        """The gateway closed the connection of an unfinished upstream exchange."""
        self._metrics.upstream_cancels.labels(ex.model, ex.backend, reason).inc()
        ex.span.outcome(reason)

    def count_timeout(self, ex: Exchange, kind: str) -> None:
        """A stream bound expired (``header`` or ``idle``); its connection was closed."""
        self._metrics.stream_timeouts.labels(ex.model, ex.backend, kind).inc()
        self.upstream_cancelled(ex, f"{kind}_timeout")

    def stream_failed(self, ex: Exchange, exc: BaseException) -> GatewayError:
        """Count a stream broken after its headers; the error event the client gets."""
        self._metrics.stream_errors.labels(model=ex.model, backend=ex.backend).inc()
        ex.span.outcome(type(exc).__name__)  # a timeout below names itself more precisely
        if isinstance(exc, aiohttp.SocketTimeoutError):  # the relay's idle bound (IdleWatch)
            self.count_timeout(ex, "idle")
        elif isinstance(exc, TimeoutError):  # aiohttp's total bound
            self.upstream_cancelled(ex, "total_timeout")
        return stream_error(ex, exc, self._idle_timeout_s)

    def finish(self, ex: Exchange, status: int, usage: tuple[int, int] | None) -> None:
        """The exchange is over: release its ticket, record its metrics (once per exchange)."""
        StateTable.release(ex.ticket)
        elapsed_s = time.perf_counter() - ex.start_s
        series = self._metrics.series(ex.model, ex.backend, self._policy_name)
        if status == 200:
            series.ok_requests.inc()
        else:
            self._metrics.requests.labels(ex.model, ex.backend, str(status)).inc()
        adapter = ex.adapter_label
        self._metrics.count_adapter_request(ex.model, adapter, status)
        if status < 400:
            series.generation.observe(elapsed_s)
        if usage is not None:
            prompt, completion = usage
            self._metrics.output_tokens.labels(model=ex.model).inc(completion)
            if adapter is not None:
                self._metrics.adapter_output_tokens.labels(ex.model, adapter).inc(completion)
            beta = self._betas.get(ex.model)
            if beta is not None:
                beta.observe(prompt, completion)
        ex.span.end(status, None, usage)
