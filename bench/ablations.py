"""Diagnostic routing variants for what-if runs of the simulator (never used by the gateway).

`SalFewestInFlightTies` is SAL with one change: among backends with the same SAL load, the
one with the fewest in-flight requests wins (the product's SAL breaks ties by position).
When every queue is empty and memory is plentiful, all SAL loads are equal (the queue term
is just the request's own prompt), so the tie-break decides where work goes; this variant
measures how much of SAL's result is due to that.
"""

from __future__ import annotations

from collections.abc import Sequence

from sal_gateway.policies import SAL, BackendView, Decision, RouteRequest, sal_load


class SalFewestInFlightTies(SAL):
    """SAL's load first, then fewest in-flight requests, then position."""

    name = "sal_inflight_ties"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        best: tuple[float, int, int] | None = None
        for i, b in enumerate(backends):
            if not b.eligible:
                continue
            load = sal_load(
                request.prompt_tokens,
                b.free_kv_tokens,
                b.queued_prefill_tokens,
                b.max_num_batched_tokens,
                request.beta,
            )
            key = (load, b.in_flight, i)
            if best is None or key < best:
                best = key
        if best is None:
            return super().select(request, backends)  # raises NoEligibleBackend
        return Decision(index=best[2], url=backends[best[2]].url, score=best[0])
