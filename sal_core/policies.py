"""Routing policies, registered by name: ``sal``, ``sal_paper``, ``sal_near``, ``round_robin``,
``random``, ``p2c``, ``least_requests``, and the prefix-cache-aware baselines
``prefix_affinity``, ``llm_d`` and ``cache_aware``.

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

import hashlib
import math
import random as _random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    cached_tokens: int = 0
    """Leading prompt tokens of the request being routed that this backend is predicted to
    hold in its prefix cache (`sal_core.prefix`; 0: none, or no cache source configured).
    They need no prefill there."""
    cached_held_tokens: int = 0
    """Of `cached_tokens`, those in blocks an in-flight request on this backend holds: they
    need no new KV memory either (unheld cached blocks are evictable, and vLLM counts them
    in `free_kv_tokens`, so reusing them still consumes free KV)."""
    num_waiting: int = 0
    """Requests waiting in the backend's engine at the last poll (0 when unknown)."""
    kv_tokens_total: int = 0
    """The backend's whole KV cache in tokens (0 when unknown)."""
    indexed_tokens: int = 0
    """Tokens the router's prefix index holds for this backend (its size; `cache_aware`
    sends a poor match to the smallest, as SGLang's router does; 0 when unknown)."""
    num_running: int = 0
    """Requests running (scheduled, holding KV) in the backend's engine at the last poll
    (0 when unknown): `SAL`'s memory term divides by the rate they free memory at."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about the request being routed."""

    prompt_tokens: int
    """Prompt tokens (= KV tokens the prompt needs)."""
    beta: float = 2.0
    """SAL's beta at decision time (from `BetaEstimator`)."""
    affinity_key: str | None = None
    """What affinity policies hash (a session header, or the prompt's first block); None:
    nothing to stick to."""
    mean_output_tokens: float = 0.0
    """Mean output tokens of finished requests (`BetaEstimator.mean_output_tokens`; the
    simulator fills it, the gateway leaves it 0.0: unknown). `SAL` reads it only with
    `PolicySettings.decode_reserve`."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen backend, with the score that chose it (lower is better for every policy)."""

    index: int
    url: str
    score: float


def memory_wait_steps(shortfall_tokens: float, beta: float, num_running: int) -> float:
    """Engine steps until `shortfall_tokens` of KV memory free up on a server running
    `num_running` requests (negative when none is missing): ``shortfall / (beta *
    max(1, num_running))``.

    The paper's reading of beta, made consistent with its formula's other term: each running
    request produces one output token per step, and every output token frees beta tokens of
    KV on average (a request of ``in + out`` tokens frees them all after ``out`` steps; beta
    = ``(mean_in + mean_out) / mean_out``). So a server frees ``beta * running`` tokens per
    step, in the same unit (steps) as the queue term's ``queued / budget``. The paper's Eq. 2
    multiplies instead (``beta * shortfall``, `sal_load` with ``num_running=None``): as soon
    as every server lacks memory, that term is thousands of steps wherever it is positive,
    dwarfs every queue, and SAL sends each request to the server with the most free KV at the
    last poll whatever queue waits there (measured: one of four replicas built a 3-minute
    queue, `docs/gateway.md#sals-memory-term`)."""
    return shortfall_tokens / (beta * (num_running if num_running > 1 else 1))


def sal_load(
    prompt_tokens: int,
    free_kv_tokens: float,
    queued_prefill_tokens: int,
    max_num_batched_tokens: int,
    beta: float,
    *,
    cached_tokens: int = 0,
    cached_held_tokens: int = 0,
    in_flight: int = 0,
    best_cached_tokens: int = 0,
    num_running: int | None = None,
) -> float:
    """SAL's expected wait of a request on one server, in engine steps; lower is better.

    ``max(memory_term, queued_tokens(s, r) / max_tokens_per_batch(s))`` where
    ``queued_tokens(s, r)`` includes the request's own prompt tokens. The memory term is
    `memory_wait_steps` of the request's missing KV (``memory(r) - free_mem(s)``) on a server
    running `num_running` requests; with `num_running` None it is the paper's literal
    ``beta * (memory(r) - free_mem(s))`` (Kossmann et al., Eq. 2). With a prefix cache, the
    request's own tokens are its *uncached* ones (``prompt - cached``) in the queue term,
    plus the wait it imposes on the server's other requests by prefilling tokens another
    server holds cached: ``in_flight * (best_cached - cached)`` (see `SAL`); its memory is
    ``prompt - cached_held`` (only blocks a running request holds are free of charge). Every
    cached argument 0 and `num_running` None: the paper's Eq. 2.
    """
    shortfall = prompt_tokens - cached_held_tokens - free_kv_tokens
    if num_running is None:
        memory_term = beta * shortfall
    else:
        memory_term = memory_wait_steps(shortfall, beta, num_running)
    avoidable = best_cached_tokens - cached_tokens if best_cached_tokens > cached_tokens else 0
    queue_term = (
        queued_prefill_tokens + prompt_tokens - cached_tokens + in_flight * avoidable
    ) / max(1, max_num_batched_tokens)
    return max(memory_term, queue_term)


DEFAULT_MIN_MATCH_TOKENS = 1024
"""`PolicySettings.min_match_tokens` by default: two Mooncake blocks, 64 vLLM blocks."""


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """Tunables a policy may read, from the gateway's ``routing`` config (validated there),
    and what-ifs the benchmarks set (`decode_reserve`)."""

    min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS
    """`SAL` ignores a predicted cache hit shorter than this many tokens (config key
    ``routing.prefix_min_match_tokens``). A short match is usually an opening block every
    prompt shares (a system prompt, Mooncake's universal first block); crediting it makes a
    replica that happens to miss it lose every tie, so it never gets the block: starved.
    Ignoring it costs at most that many tokens of prefill once per replica. 0: count all."""

    decode_reserve: float = 0.0
    """`SAL` counts ``decode_reserve * mean_output_tokens`` tokens of each running request's
    KV as already taken (>= 0; `RouteRequest.mean_output_tokens`). vLLM's free KV is what
    the running requests hold *now*; each still grows by its remaining output, and when KV
    runs out vLLM preempts one. On a backend running n > 0 requests this adds
    ``decode_reserve * mean_output / beta`` steps to the memory term, so it rules over the
    queue term sooner. Not a gateway config key: measured as a what-if (`sal-bench prefix`,
    "decode-reserve"), 0.5 and 1.0 came out ties with 0 on every scenario (preemption
    medians down 24 % where KV binds most, up 29 % at a lower load; README, "Known weak
    spots"). 0.0: the free KV as reported."""

    def __post_init__(self) -> None:
        if self.min_match_tokens < 0:
            raise ValueError(f"min_match_tokens must be >= 0, got {self.min_match_tokens}")
        if not self.decode_reserve >= 0.0 or not math.isfinite(self.decode_reserve):
            raise ValueError(
                f"decode_reserve must be a finite number >= 0, got {self.decode_reserve}"
            )


class Policy(ABC):
    """A routing policy. Instances may keep small private state (a cursor, a seeded RNG)."""

    name: ClassVar[str]

    def __init__(self, seed: int | None = None, settings: PolicySettings | None = None) -> None:
        self._rng = _random.Random(seed)
        self.settings = settings or PolicySettings()

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
    """Server-Aware Load balancing: argmin of `sal_load` over eligible backends, with what
    each backend holds of the prompt in its prefix cache (`BackendView.cached_tokens`):

    ``max((prompt - held - free_kv) / (beta * running), (queued + prompt - cached +
    in_flight * (cmax - cached)) / budget)`` with ``cmax`` the most any eligible backend
    holds and ``running`` its `BackendView.num_running` (at least 1).

    Both terms are engine steps. The memory term is the paper's, with beta read as the rate
    the paper's prose gives it (`memory_wait_steps`): the paper's formula multiplies by beta,
    which made the term dominate every queue whenever KV memory was short everywhere
    (`PaperSAL` keeps it). Cached tokens need no prefill (queue term); only those in blocks a
    running request holds need no new KV (memory term: vLLM counts unheld cached blocks as
    free, so reusing them still consumes free KV). A match shorter than
    ``settings.min_match_tokens`` counts as none (`PolicySettings`). With no cache source
    every cached field is 0. With ``settings.decode_reserve`` > 0 (a what-if, never set by
    the gateway), ``free_kv`` is net of ``decode_reserve * mean_output_tokens`` per running
    request (`PolicySettings.decode_reserve`).

    The ``in_flight * (cmax - cached)`` term is the wait the request imposes on others: on a
    backend that holds less of its prompt than the best one does, it prefills ``cmax -
    cached`` tokens that could have been skipped, in the same steps as the backend's
    ``in_flight`` requests, each of which waits that much longer (a decoder in time per
    output token, a queued prompt in TTFT). Eq. 2 alone prices only the request's own wait,
    so near capacity it moved conversations off the replica holding them whenever that one
    had a slightly longer queue: hit rate fell and TPOT bound first (measured: 0.92x the
    capacity of SGLang's `cache_aware` on multi-turn chat; with the term, a tie). No weight:
    both parts are tokens over the same budget. It is 0 on the best holder, on an idle
    backend and without a cache. A hot prefix cannot pile onto one backend: a backend
    without it that has nothing in flight pays nothing for the miss, while every request
    routed to the holder lengthens the queue all later ones wait behind.

    Ties (equal load) go to the backend with fewer in-flight requests, then to the earlier
    position. The paper only asks for a stable tie-break; breaking ties by position piles
    decode work onto the first backends, because on an unsaturated fleet every queue is empty
    between polls and all loads are equal (the queue term is just the request's own prompt).
    In the simulator that cost SAL 1.1-2.3x in total generation time against P2C; the
    in-flight tie-break removes it (docs/simulator.md, "SAL's tie-break").
    """

    name = "sal"
    literal_memory_term: ClassVar[bool] = False
    """True: the paper's ``beta * shortfall`` memory term (`PaperSAL`)."""

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        # `sal_load` inlined into one pass: this runs once per request over the whole pool
        # (64 backends: ~3x faster than a scored list plus a keyed min).
        prompt = request.prompt_tokens
        beta = request.beta
        min_match = self.settings.min_match_tokens
        cmax = 0
        for b in backends:
            if b.eligible and b.cached_tokens > cmax and b.cached_tokens >= min_match:
                cmax = b.cached_tokens
        best_i = -1
        best = math.inf
        best_in_flight = 0
        literal = self.literal_memory_term
        reserve = 0.0 if literal else self.settings.decode_reserve * request.mean_output_tokens
        for i, b in enumerate(backends):
            if not b.eligible:
                continue
            cached = b.cached_tokens
            if cached >= min_match:
                held = b.cached_held_tokens
            else:
                cached = held = 0
            if literal:
                memory_term = beta * (prompt - held - b.free_kv_tokens)
            else:
                running = b.num_running if b.num_running > 1 else 1
                short: float = prompt - held - b.free_kv_tokens
                if reserve:  # a what-if only (`PolicySettings.decode_reserve`)
                    short += reserve * b.num_running
                memory_term = short / (beta * running)
            budget = b.max_num_batched_tokens if b.max_num_batched_tokens > 1 else 1
            queue_term = (
                b.queued_prefill_tokens + prompt - cached + b.in_flight * (cmax - cached)
            ) / budget
            load = memory_term if memory_term > queue_term else queue_term
            # Strict comparisons: a full tie keeps the earlier index.
            if load < best or (load == best and b.in_flight < best_in_flight):
                best, best_i, best_in_flight = load, i, b.in_flight
        if best_i < 0:
            raise NoEligibleBackend("no eligible backend")
        return Decision(index=best_i, url=backends[best_i].url, score=best)

    def loads(
        self, request: RouteRequest, backends: Sequence[BackendView]
    ) -> list[tuple[int, float]]:
        """(index, `sal_load`) of every eligible backend, as `select` weighs them (`select`
        is this list's argmin with its tie-break, computed in one inlined pass)."""
        min_match = self.settings.min_match_tokens
        literal = self.literal_memory_term
        reserve = 0.0 if literal else self.settings.decode_reserve * request.mean_output_tokens
        eligible = [(i, b) for i, b in enumerate(backends) if b.eligible]
        cmax = max(
            (b.cached_tokens for _, b in eligible if b.cached_tokens >= min_match), default=0
        )
        out: list[tuple[int, float]] = []
        for i, b in eligible:
            cached, held = (
                (b.cached_tokens, b.cached_held_tokens) if b.cached_tokens >= min_match else (0, 0)
            )
            load = sal_load(
                request.prompt_tokens,
                b.free_kv_tokens - reserve * b.num_running,
                b.queued_prefill_tokens,
                b.max_num_batched_tokens,
                request.beta,
                cached_tokens=cached,
                cached_held_tokens=held,
                in_flight=b.in_flight,
                best_cached_tokens=cmax,
                num_running=None if literal else b.num_running,
            )
            out.append((i, load))
        return out


class PaperSAL(SAL):
    """The paper's Eq. 2 taken literally: every prompt token counts as work and memory on
    every backend, whatever it has cached, and the memory term is ``beta * (prompt -
    free_kv)`` (kept for comparison with `SAL`)."""

    name = "sal_paper"
    literal_memory_term = True

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        if any(b.cached_tokens or b.cached_held_tokens for b in backends):
            backends = [
                replace(b, cached_tokens=0, cached_held_tokens=0) if b.cached_tokens else b
                for b in backends
            ]
        return super().select(request, backends)


class SALNearBest(SAL):
    """SAL for several gateways: uniformly random among the eligible backends whose SAL load
    is within `tolerance` of the best one's (the best itself included).

    K gateways that poll the same replicas see the same snapshot; each knows only what it
    routed itself, so after every poll all K send their next request to the same argmin
    (measured: with 8 gateways half the decisions land on a replica another gateway had just
    picked, against 30 % for random routing; docs/results/gateways.md). Choosing at random
    among near-equals decorrelates them. With one gateway prefer `SAL`: the randomization
    only costs there. Loads come from `SAL.loads`, so the cache-aware formula (with its
    best-holder term, which needs the whole pool) is the one `SAL` uses.
    """

    name = "sal_near"
    tolerance: ClassVar[float] = 0.25
    """In SAL's load units (queued prefill in steps of the token budget): a quarter step."""

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        best = super().select(request, backends)  # raises NoEligibleBackend
        near = [
            (i, load)
            for i, load in self.loads(request, backends)
            if load <= best.score + self.tolerance
        ]
        if len(near) < 2:
            return best
        i, load = near[self._rng.randrange(len(near))]
        return Decision(index=i, url=backends[i].url, score=load)


class RoundRobin(Policy):
    """Cycle through the pool by position, skipping backends that are not eligible. Each
    pool (the backends' URLs, in order) keeps its own place, so requests choosing among a
    subset (a LoRA adapter's replicas) do not pull the full pool's rotation onto one."""

    name = "round_robin"
    MAX_POOLS = 1024
    """Places kept at most (pools change with discovery and adapters); then all restart."""

    def __init__(self, seed: int | None = None, settings: PolicySettings | None = None) -> None:
        super().__init__(seed, settings)
        self._next: dict[tuple[str, ...], int] = {}

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        _eligible(backends)
        pool = tuple(b.url for b in backends)
        start = self._next.get(pool, 0)
        n = len(backends)
        for step in range(n):
            i = (start + step) % n
            if backends[i].eligible:
                if pool not in self._next and len(self._next) >= self.MAX_POOLS:
                    self._next.clear()
                self._next[pool] = (i + 1) % n
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


class PrefixAffinity(Policy):
    """Sticky routing: a consistent (rendezvous) hash of `RouteRequest.affinity_key` (a
    session header, or the prompt's first block) over the eligible backends; without a key,
    fewest in-flight requests.

    Rendezvous hashing (highest ``blake2b(key, url)`` wins) moves only the keys of a backend
    that leaves the pool, and agrees across gateway processes and restarts (no salted
    hash). Load-blind by design: the baseline other gateways' "session affinity" is."""

    name = "prefix_affinity"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        indices = _eligible(backends)
        key = request.affinity_key
        if key is None:
            return _argmin(backends, indices, [float(backends[i].in_flight) for i in indices])
        prefix = key.encode() + b"\0"
        best_i, best = -1, -1
        for i in indices:
            digest = hashlib.blake2b(prefix + backends[i].url.encode(), digest_size=8).digest()
            weight = int.from_bytes(digest, "big")
            if weight > best:
                best_i, best = i, weight
        return Decision(index=best_i, url=backends[best_i].url, score=0.0)


LLM_D_WEIGHTS = {"queue": 2.0, "kv_cache_utilization": 2.0, "prefix_cache": 3.0}
"""Weights of llm-d's default scheduling profile: ``queue-scorer`` 2,
``kv-cache-utilization-scorer`` 2, ``prefix-cache-scorer`` 3 — the ``default-plugins.yaml``
of the Gateway API Inference Extension's inferencepool chart
(kubernetes-sigs/gateway-api-inference-extension,
``config/charts/inferencepool/templates/epp-config.yaml``, which llm-d's EPP chart mounts as
its ``pluginsConfigFile``)."""


class LlmDWeighted(Policy):
    """llm-d's default endpoint picker: the weighted sum of three scorers in [0, 1], highest
    wins (its ``max-score-picker``; ties broken at random, seeded). Scorers as in the
    Inference Extension's ``pkg/epp/scheduling/framework/plugins``:

    * queue (``queuescorer/queue.go``): ``(max_waiting - waiting) / (max_waiting -
      min_waiting)`` over the candidates, 1 for all when equal (`BackendView.num_waiting`,
      as polled: no between-poll accounting, like llm-d's scraped metrics);
    * KV-cache utilization (``kvcacheutilizationscorer``): ``1 - used / total`` KV;
    * prefix cache (``prefixcachescorer/plugin.go``): matched / total blocks of the prompt,
      here `BackendView.cached_tokens` / prompt tokens.

    Weights: `LLM_D_WEIGHTS`. The score is returned negated (lower is better)."""

    name = "llm_d"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        indices = _eligible(backends)
        waiting = [backends[i].num_waiting for i in indices]
        lo, hi = min(waiting), max(waiting)
        prompt = request.prompt_tokens
        w = LLM_D_WEIGHTS
        best: list[int] = []
        best_score = -math.inf
        for k, i in enumerate(indices):
            b = backends[i]
            queue = 1.0 if hi == lo else (hi - waiting[k]) / (hi - lo)
            total = b.kv_tokens_total
            kv = min(1.0, max(0.0, b.free_kv_tokens / total)) if total > 0 else 0.0
            prefix = min(1.0, b.cached_tokens / prompt) if prompt > 0 else 0.0
            score = w["queue"] * queue + w["kv_cache_utilization"] * kv + w["prefix_cache"] * prefix
            if score > best_score:
                best, best_score = [i], score
            elif score == best_score:
                best.append(i)
        i = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        return Decision(index=i, url=backends[i].url, score=-best_score)


SGLANG_CACHE_AWARE = {
    "cache_threshold": 0.3,
    "balance_abs_threshold": 64,
    "balance_rel_threshold": 1.5,
}
"""sgl-router's defaults for ``cache_aware`` (its default policy): sgl-project/sglang,
``sgl-router/py_src/sglang_router/router_args.py`` (``RouterArgs``: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5)."""


class CacheAware(Policy):
    """SGLang router's ``cache_aware`` (``sgl-router/src/policies/cache_aware.rs``):

    * load imbalanced — ``max - min > balance_abs_threshold`` and ``max > min *
      balance_rel_threshold`` over the backends' in-flight requests — routes to the least
      loaded (shortest queue);
    * otherwise, if the best prefix match covers more than ``cache_threshold`` of the prompt,
      to the backend with that match; else to the backend whose approximate tree is
      smallest (`BackendView.indexed_tokens`: most room for new cache).

    Defaults: `SGLANG_CACHE_AWARE`. SGLang matches characters in a radix tree of routed
    text; here `BackendView.cached_tokens` from the configured cache source stands in for
    it. Ties: fewer in-flight requests, then position."""

    name = "cache_aware"

    def select(self, request: RouteRequest, backends: Sequence[BackendView]) -> Decision:
        indices = _eligible(backends)
        cfg = SGLANG_CACHE_AWARE
        loads = [backends[i].in_flight for i in indices]
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg["balance_abs_threshold"] and hi > lo * cfg["balance_rel_threshold"]:
            return _argmin(backends, indices, [float(x) for x in loads])
        best = max(indices, key=lambda i: (backends[i].cached_tokens, -backends[i].in_flight, -i))
        prompt = request.prompt_tokens
        rate = backends[best].cached_tokens / prompt if prompt > 0 else 0.0
        if rate > cfg["cache_threshold"]:
            return Decision(index=best, url=backends[best].url, score=-rate)
        sizes = [float(backends[i].indexed_tokens) for i in indices]
        smallest = min(sizes)
        tied = [i for i, size in zip(indices, sizes, strict=True) if size == smallest]
        return _argmin(backends, tied, [float(backends[i].in_flight) for i in tied])


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        SAL,
        PaperSAL,
        SALNearBest,
        RoundRobin,
        Random,
        PowerOfTwoChoices,
        LeastRequests,
        PrefixAffinity,
        LlmDWeighted,
        CacheAware,
    )
}
"""Every routing policy by its config name."""

PREFIX_AWARE_POLICIES = frozenset({"sal", "sal_near", "prefix_affinity", "llm_d", "cache_aware"})
"""Policies that read the cache fields of `BackendView` / `RouteRequest.affinity_key`."""


def make_policy(
    name: str, seed: int | None = None, settings: PolicySettings | None = None
) -> Policy:
    """Build the policy registered as `name`; `ValueError` lists the known names otherwise."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r} (known: {known})") from None
    return cls(seed, settings)
