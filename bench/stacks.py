"""Serving stacks: a router in front of replicas running an engine scheduler, by name.

A *stack* is what a platform team deploys and what the capacity, many-gateway and
sensitivity benchmarks compare: a routing policy (a name in `sal_core.policies.POLICIES`) in
front of engine replicas with one engine scheduler (a name in
`engine_sim.schedulers.ENGINE_SCHEDULERS`) and its parameters. `STACKS` is the registry;
adding a stack is one line::

    Stack("sal+larry_tf", "sal", {"scheduler": "larry_tf", "aging_margin_s": 1.0}),

`engine` holds `engine_sim.engine.EngineConfig` fields (``scheduler``, ``alpha`` and any field
a new scheduler adds), passed through unchanged, so a stack needs no code of its own. A
stack whose router only differs from another on workloads with prefix reuse (``sal_paper``:
cache-blind Eq. 2) says so with ``needs_reuse=True`` and is skipped on workloads without it.

`run_stack` replays requests through N replicas of a stack on the simulator; `tpot_s` is the
time per output token of one finished request, as DistServe defines TPOT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine_sim.cost_model import get_profile
from engine_sim.engine import EngineConfig, EngineModel
from engine_sim.results import RequestOutcome
from engine_sim.simulator import (
    LateAbort,
    RouterConfig,
    SimResult,
    Simulation,
    submit_to_engine_model,
)
from engine_sim.trace import TraceRequest
from sal_core.policies import PREFIX_AWARE_POLICIES, Policy


@dataclass(frozen=True, slots=True)
class Stack:
    """One deployable combination of gateway policy and engine scheduler."""

    name: str
    """Label in every table (``router+scheduler`` by convention)."""
    router: str
    """Routing policy name (`sal_core.policies.POLICIES`)."""
    engine: Mapping[str, Any] = field(default_factory=lambda: {"scheduler": "fcfs"})
    """`EngineConfig` fields of every replica (at least ``scheduler``)."""
    needs_reuse: bool = False
    """Only differs from another stack on workloads with prefix reuse; skipped elsewhere."""
    what: str = ""
    """One line for the reports: what a team runs when it runs this."""


BASELINE = "p2c+fcfs"
"""The stack every capacity ratio is relative to (what many teams run today)."""

STACKS: tuple[Stack, ...] = (
    Stack("round_robin+fcfs", "round_robin", what="a plain Kubernetes Service, stock vLLM"),
    Stack("p2c+fcfs", "p2c", what="power of two choices (fewer in-flight), stock vLLM"),
    Stack("least_requests+fcfs", "least_requests", what="least requests (Envoy), stock vLLM"),
    Stack("sal+fcfs", "sal", what="the SAL gateway, stock vLLM order (+ /stats)"),
    Stack("sal+larry", "sal", {"scheduler": "larry", "alpha": 1.0}, what="SAL + paper LARRY"),
    Stack("sal+larry_tail", "sal", {"scheduler": "larry_tail"}, what="SAL + tail-guarded LARRY"),
    Stack(
        "sal+larry_tail margin 2 s",
        "sal",
        {"scheduler": "larry_tail", "tail_margin_s": 2.0},
        what='SAL + tail-guarded LARRY, {"larry_tail": {"margin_s": 2.0}}',
    ),
    Stack("sal_paper+fcfs", "sal_paper", needs_reuse=True, what="SAL's Eq. 2 blind to caches"),
    Stack("llm_d+fcfs", "llm_d", needs_reuse=True, what="llm-d's default prefix/queue/KV scorers"),
    Stack("cache_aware+fcfs", "cache_aware", needs_reuse=True, what="SGLang router's cache_aware"),
)
"""Every stack, in table order. ``sal`` is cache-aware wherever the workload has reuse (the
router's approximate prefix index, `run_stack`'s ``prefix_caching``), so ``sal+fcfs`` there is
the cache-aware SAL and ``sal_paper+fcfs`` the paper's Eq. 2 beside it; ``llm_d`` and
``cache_aware`` only differ from least-loaded routing with reuse, so they run only there."""


def stacks_by_name(names: Sequence[str] | None = None) -> list[Stack]:
    """The stacks called `names` (all of `STACKS` for None); `KeyError` names an unknown one."""
    if names is None:
        return list(STACKS)
    known = {s.name: s for s in STACKS}
    out = []
    for name in names:
        if name not in known:
            raise KeyError(f"unknown stack {name!r} (known: {', '.join(known)})")
        out.append(known[name])
    return out


def for_workload(stacks: Sequence[Stack], has_reuse: bool) -> list[Stack]:
    """The stacks worth running on a workload (`needs_reuse` ones only where it has reuse)."""
    return [s for s in stacks if has_reuse or not s.needs_reuse]


def engine_config(stack: Stack, profile: str, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` of one replica of `stack` on `profile` (vLLM's defaults otherwise)."""
    cost = get_profile(profile)
    base = EngineConfig(num_kv_blocks=cost.num_kv_blocks(16), model_name=profile)
    return replace(base, **{**dict(stack.engine), **overrides})


def run_stack(
    requests: Sequence[TraceRequest],
    stack: Stack,
    *,
    profile: str,
    replicas: int,
    router: RouterConfig | None = None,
    policy: Policy | None = None,
    prefix_caching: bool = False,
    abort: LateAbort | None = None,
) -> SimResult:
    """Replay `requests` through `replicas` replicas of `stack` (simulator, virtual clock).

    `router` sets everything but the policy (poll period, stats delay, gateways, seed); its
    ``policy`` is replaced by the stack's router. `policy` (what-if studies, one gateway)
    stands in for the stack's router object. `prefix_caching` (workloads with reuse): every
    replica runs vLLM's automatic prefix caching and a prefix-aware router reads the
    router's approximate index of the blocks it routed (as the gateway's default
    ``routing.prefix_cache: approximate``); a prefix-blind router sees no cache. `abort`:
    stop once the TTFT objective is certainly missed (`LateAbort`).
    """
    config = engine_config(stack, profile, enable_prefix_caching=prefix_caching)
    cost = get_profile(profile)
    engines = [EngineModel(config, cost) for _ in range(replicas)]
    router_cfg = replace(router or RouterConfig(), policy=stack.router)
    if prefix_caching and stack.router in PREFIX_AWARE_POLICIES:
        router_cfg = replace(router_cfg, cache_source="approximate")
    sim = Simulation(
        requests, engines, submit_to_engine_model, router_cfg, policy=policy, abort=abort
    )
    return sim.run()


def tpot_s(outcome: RequestOutcome) -> float | None:
    """Time per output token after the first: ``(finish - first token) / (outputs - 1)``.

    None for a one-token answer (it has no decode phase, so no TPOT to miss).
    """
    if outcome.output_tokens <= 1:
        return None
    return (outcome.finish_s - outcome.first_token_s) / (outcome.output_tokens - 1)


def tpots_s(outcomes: Sequence[RequestOutcome]) -> list[float]:
    """`tpot_s` of every request that has one."""
    return [t for t in (tpot_s(o) for o in outcomes) if t is not None]
