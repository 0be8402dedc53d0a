"""Routing policies, registered by name: ``sal``, ``round_robin``, ``random``, ``p2c``,
``least_requests``.

Pure decision logic: no I/O, no asyncio, no web framework. The gateway builds one policy
object at start-up with `make_policy()` and calls `Policy.select()` once per request with a
snapshot of the state table; the simulator (`engine_sim`) calls the very same objects.
The registry `POLICIES` drives both dispatch and config validation: adding a policy is one
class and one line.

Contract shared by every policy:

* only backends with ``eligible=True`` are ever chosen (ejected or stale ones never are);
* with no eligible backend, `NoEligibleBackend` is raised;
* for equal inputs and an equal seed the sequence of decisions is identical.
"""

from __future__ import annotations

import math
import random as _random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


class NoEligibleBackend(Exception):
    """Every backend of the pool is ejected, stale or otherwise not eligible."""


@dataclass(slots=True)
class BackendView:
    """What a policy may know about one backend at decision time (built by the state table).

    Treated as immutable by every policy. Not ``frozen``: a frozen dataclass's ``__init__``
    goes through ``object.__setattr__`` per field, which made building 64 views per request
    ~3x slower (measured in `bench/decision_timing.py`).
    """

    url: str
    eligible: bool
    """Healthy, not ejected, and its state is fresh enough to trust."""
    in_flight: int
    """Requests the gateway has sent there that have not finished yet."""
    free_kv_tokens: int
    """Free KV tokens now: last poll minus what was routed there since (floored at 0)."""
    queued_prefill_tokens: int
    """Queued prefill tokens now: last poll plus what was routed there since."""
    max_num_batched_tokens: int
    """The backend's per-step token budget (>= 1)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about the request being routed."""

    prompt_tokens: int
    """Prompt tokens (= KV tokens the prompt needs)."""
    beta: float = 2.0
    """SAL's beta at decision time (from `BetaEstimator`)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen backend, with the score that chose it (lower is better for every policy)."""

    index: int
    url: str
    score: float


def sal_load(
    prompt_tokens: int,
    free_kv_tokens: int,
    queued_prefill_tokens: int,
    max_num_batched_tokens: int,
    beta: float,
) -> float:
    """SAL's expected wait of a request on one server (Kossmann et al.), lower is better.

    ``max(beta * (memory(r) - free_mem(s)), queued_tokens(s, r) / max_tokens_per_batch(s))``
    where ``queued_tokens(s, r)`` includes the request's own prompt tokens.
    """
    memory_term = beta * (prompt_tokens - free_kv_tokens)
    queue_term = (queued_prefill_tokens + prompt_tokens) / max(1, max_num_batched_tokens)
    return max(memory_term, queue_term)


class Policy(ABC):
    """A routing policy. Instances may keep small private state (a cursor, a seeded RNG)."""

    name: ClassVar[str]

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    @abstractmethod
    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        """Choose one eligible backend; raise `NoEligibleBackend` when there is none."""


def _eligible(backends: Sequence[BackendView]) -> list[int]:
    indices = [i for i, b in enumerate(backends) if b.eligible]
    if not indices:
        raise NoEligibleBackend("no eligible backend")
    return indices


def _argmin(
    backends: Sequence[BackendView], indices: Sequence[int], score: list[float]
) -> Decision:
    """Lowest score wins; ties go to the earliest index (stable)."""
    best = min(range(len(indices)), key=lambda k: (score[k], indices[k]))
    i = indices[best]
    return Decision(index=i, url=backends[i].url, score=score[best])


class SAL(Policy):
    """Server-Aware Load balancing: argmin of `sal_load` over eligible backends.

    Ties (equal load) go to the backend with fewer in-flight requests, then to the earlier
    position. The paper only asks for a stable tie-break; breaking ties by position piles
    decode work onto the first backends, because on an unsaturated fleet every queue is empty
    between polls and all loads are equal (the queue term is just the request's own prompt).
    In the simulator that cost SAL 1.1-2.3x in total generation time against P2C; the
    in-flight tie-break removes it (docs/simulator.md, "SAL's tie-break").
    """

    name = "sal"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        # `sal_load` inlined into one pass: this runs once per request over the whole pool
        # (64 backends: ~3x faster than a scored list plus a keyed min).
        prompt = request.prompt_tokens
        beta = request.beta
        best_i = -1
        best = math.inf
        best_in_flight = 0
        for i, b in enumerate(backends):
            if not b.eligible:
                continue
            memory_term = beta * (prompt - b.free_kv_tokens)
            budget = b.max_num_batched_tokens if b.max_num_batched_tokens > 1 else 1
            queue_term = (b.queued_prefill_tokens + prompt) / budget
            load = memory_term if memory_term > queue_term else queue_term
            # Strict comparisons: a full tie keeps the earlier index.
            if load < best or (load == best and b.in_flight < best_in_flight):
                best, best_i, best_in_flight = load, i, b.in_flight
        if best_i < 0:
            raise NoEligibleBackend("no eligible backend")
        return Decision(index=best_i, url=backends[best_i].url, score=best)


class RoundRobin(Policy):
    """Cycle through the pool by position, skipping backends that are not eligible."""

    name = "round_robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._next = 0

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        _eligible(backends)
        n = len(backends)
        for step in range(n):
            i = (self._next + step) % n
            if backends[i].eligible:
                self._next = (i + 1) % n
                return Decision(index=i, url=backends[i].url, score=0.0)
        raise NoEligibleBackend("no eligible backend")  # pragma: no cover - guarded above


class Random(Policy):
    """Uniformly random eligible backend (seeded)."""

    name = "random"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        indices = _eligible(backends)
        i = indices[self._rng.randrange(len(indices))]
        return Decision(index=i, url=backends[i].url, score=0.0)


class LeastRequests(Policy):
    """Fewest in-flight requests (ties: earliest index)."""

    name = "least_requests"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        indices = _eligible(backends)
        return _argmin(backends, indices, [float(backends[i].in_flight) for i in indices])


class PowerOfTwoChoices(Policy):
    """Two distinct random eligible backends; the one with fewer in-flight requests wins."""

    name = "p2c"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        indices = _eligible(backends)
        pair = indices if len(indices) == 1 else sorted(self._rng.sample(indices, 2))
        return _argmin(backends, pair, [float(backends[i].in_flight) for i in pair])


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SAL, RoundRobin, Random, PowerOfTwoChoices, LeastRequests)
}
"""Every routing policy by its config name."""


def make_policy(name: str, seed: int | None = None) -> Policy:
    """Build the policy registered as `name`; `ValueError` lists the known names otherwise."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r} (known: {known})") from None
    return cls(seed)
