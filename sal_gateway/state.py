"""The per-backend state table: what the gateway believes about each backend right now.

Pure (no I/O, no asyncio): the pollers write poll results into it, the request path reads
`BackendView`s from it for the policy and records what it routed. All times are the gateway's
monotonic clock (``now_s`` passed in), so a backend's clock skew never makes state look fresh.

Rules:

* A backend is *eligible* when it has a successful poll no older than ``stale_after_s``, is
  not ejected and not suspect. Unknown or stale state is never treated as idle.
* ``eject_after_failures`` consecutive failed polls eject it; one good poll re-admits it.
* A connect failure seen by the proxy marks it *suspect* (not eligible) until its next good
  poll, so retries and the next requests avoid it without waiting for N poll failures.
* Local accounting between polls: each routed request's prompt tokens are added to the
  backend's queued prefill tokens and subtracted from its free KV tokens (floored at 0) until
  the next poll replaces both numbers (the engine then counts that request itself).
* Backends read through stock vLLM ``/metrics`` (no queued-token count there) use the prompt
  tokens of the gateway's own in-flight requests that have not received a first byte yet as
  their queued prefill tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sal_gateway.policies import BackendView
from sal_gateway.stats import ReplicaStats

SOURCES = ("stats", "metrics", "none")
"""Where a backend's state comes from: sal-stats/1 ``/stats``, vLLM ``/metrics``, nothing."""


@dataclass(slots=True)
class BackendState:
    """Mutable state of one backend (owned by `StateTable`)."""

    url: str
    fallback_max_num_batched_tokens: int = 2048
    stats: ReplicaStats | None = None
    source: str = "none"
    last_ok_s: float | None = None
    """Monotonic time of the last successful poll."""
    consecutive_failures: int = 0
    ejected: bool = False
    suspect: bool = False
    in_flight: int = 0
    routed_tokens_since_poll: int = 0
    prefill_pending_tokens: int = 0
    """Prompt tokens of in-flight requests still waiting for their first byte."""
    removed: bool = False

    def age_s(self, now_s: float) -> float | None:
        return None if self.last_ok_s is None else max(0.0, now_s - self.last_ok_s)

    def is_eligible(self, now_s: float, stale_after_s: float) -> bool:
        age = self.age_s(now_s)
        return (
            age is not None
            and age <= stale_after_s
            and not self.ejected
            and not self.suspect
            and not self.removed
        )

    def free_kv_tokens(self) -> int:
        if self.stats is None:
            return 0
        return max(0, self.stats.free_kv_tokens - self.routed_tokens_since_poll)

    def queued_prefill_tokens(self) -> int:
        if self.stats is None:
            return 0
        if self.source == "metrics":
            return self.prefill_pending_tokens
        return self.stats.queued_prefill_tokens + self.routed_tokens_since_poll

    def max_num_batched_tokens(self) -> int:
        if self.stats is None or self.stats.max_num_batched_tokens <= 0:
            return self.fallback_max_num_batched_tokens
        return self.stats.max_num_batched_tokens


@dataclass(slots=True)
class Ticket:
    """One routed request's hold on a backend's accounting; `StateTable.release` frees it."""

    backend: BackendState
    prompt_tokens: int
    first_byte_seen: bool = False
    released: bool = False


@dataclass(slots=True)
class StateTable:
    """Backends per model, in configuration/discovery order (the policies' tie-break order)."""

    stale_after_s: float
    eject_after_failures: int
    _pools: dict[str, dict[str, BackendState]] = field(default_factory=dict)

    # --- membership ---------------------------------------------------------------------

    def add_model(self, model: str) -> None:
        self._pools.setdefault(model, {})

    def add_backend(
        self, model: str, url: str, fallback_max_num_batched_tokens: int = 2048
    ) -> bool:
        """Add `url` to `model`'s pool; False when it was already there."""
        pool = self._pools.setdefault(model, {})
        if url in pool:
            return False
        pool[url] = BackendState(url, fallback_max_num_batched_tokens)
        return True

    def remove_backend(self, model: str, url: str) -> BackendState | None:
        """Remove `url`; its in-flight requests keep their tickets and finish normally."""
        backend = self._pools.get(model, {}).pop(url, None)
        if backend is not None:
            backend.removed = True
        return backend

    def models(self) -> list[str]:
        return list(self._pools)

    def backends(self, model: str) -> list[BackendState]:
        return list(self._pools.get(model, {}).values())

    def get(self, model: str, url: str) -> BackendState | None:
        return self._pools.get(model, {}).get(url)

    # --- poll results -------------------------------------------------------------------

    def record_poll_success(
        self, model: str, url: str, stats: ReplicaStats, source: str, now_s: float
    ) -> bool:
        """A good poll: replace the numbers, reset local accounting, re-admit.

        Returns True when this re-admitted an ejected or suspect backend."""
        backend = self.get(model, url)
        if backend is None:
            return False
        readmitted = backend.ejected or backend.suspect
        backend.stats = stats
        backend.source = source
        backend.last_ok_s = now_s
        backend.consecutive_failures = 0
        backend.ejected = False
        backend.suspect = False
        backend.routed_tokens_since_poll = 0
        return readmitted

    def record_poll_failure(self, model: str, url: str) -> bool:
        """A failed poll; returns True when this failure ejected the backend."""
        backend = self.get(model, url)
        if backend is None:
            return False
        backend.consecutive_failures += 1
        if not backend.ejected and backend.consecutive_failures >= self.eject_after_failures:
            backend.ejected = True
            return True
        return False

    def mark_suspect(self, model: str, url: str) -> None:
        """The proxy could not connect: avoid the backend until its next good poll."""
        backend = self.get(model, url)
        if backend is not None:
            backend.suspect = True

    # --- the request path ---------------------------------------------------------------

    def views(self, model: str, now_s: float) -> list[BackendView]:
        """What the policy sees for `model`'s pool now (same order as `backends()`)."""
        return [
            BackendView(
                url=b.url,
                eligible=b.is_eligible(now_s, self.stale_after_s),
                in_flight=b.in_flight,
                free_kv_tokens=b.free_kv_tokens(),
                queued_prefill_tokens=b.queued_prefill_tokens(),
                max_num_batched_tokens=b.max_num_batched_tokens(),
            )
            for b in self._pools.get(model, {}).values()
        ]

    def is_ready(self, now_s: float) -> bool:
        """Every model has at least one eligible backend."""
        return all(
            any(b.is_eligible(now_s, self.stale_after_s) for b in pool.values())
            for pool in self._pools.values()
        )

    def route(self, model: str, url: str, prompt_tokens: int) -> Ticket:
        """Account a request just routed to `url` (raises KeyError for an unknown backend)."""
        backend = self._pools[model][url]
        backend.in_flight += 1
        backend.routed_tokens_since_poll += prompt_tokens
        backend.prefill_pending_tokens += prompt_tokens
        return Ticket(backend, prompt_tokens)

    @staticmethod
    def first_byte(ticket: Ticket) -> None:
        """The backend started answering: its prompt is no longer pending prefill for us."""
        if not ticket.first_byte_seen and not ticket.released:
            ticket.first_byte_seen = True
            ticket.backend.prefill_pending_tokens -= ticket.prompt_tokens

    @staticmethod
    def release(ticket: Ticket) -> None:
        """The request is over (any outcome). Idempotent."""
        if ticket.released:
            return
        StateTable.first_byte(ticket)
        ticket.released = True
        ticket.backend.in_flight -= 1
