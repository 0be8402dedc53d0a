"""Diagnostic routing variants for what-if runs of the simulator (never used by the gateway).

`SalPositionTies` is SAL with the plainest stable tie-break, the one the paper implies:
among backends with the same SAL load, the earliest position wins. The product's SAL
(`sal_core.policies.SAL`) breaks ties by fewest in-flight requests first. When every
queue is empty and memory is plentiful, all SAL loads are equal (the queue term is just the
request's own prompt), so the tie-break alone decides where work goes; this variant measures
what the product's choice is worth.
"""

from __future__ import annotations

from collections.abc import Sequence

from sal_core.policies import SAL, BackendView, Decision, RouteRequest, sal_load


class SalPositionTies(SAL):
    """SAL's load first, then position (the paper-literal stable tie-break)."""

    name = "sal_position_ties"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        best: tuple[float, int] | None = None
        for i, b in enumerate(backends):
            if not b.eligible:
                continue
            load = sal_load(
                request.prompt_tokens,
                b.free_kv_tokens,
                b.queued_prefill_tokens,
                b.max_num_batched_tokens,
                request.beta,
                num_running=b.num_running,
            )
            if best is None or (load, i) < best:
                best = (load, i)
        if best is None:
            return super().select(request, backends)  # raises NoEligibleBackend
        return Decision(index=best[1], url=backends[best[1]].url, score=best[0])
