"""The `GET /stats` contract between a replica and the gateway (schema ``sal-stats/1``).

Pure: no I/O. Replicas (the vLLM patch, the emulator) build a `ReplicaStats` and serve
`ReplicaStats.to_dict()` as JSON; the gateway's poller calls `parse_stats()` on every poll
(10x/s per backend) and gets a `ReplicaStats` or a `StatsSchemaError`.

Readers ignore unknown fields and reject an unknown *major* schema (``sal-stats/2``);
a minor suffix (``sal-stats/1.3``) is accepted.

Minor 1 (``sal-stats/1.1``) added what a router needs to predict prefix-cache hits:
``prefix_caching``, ``prefix_hash_algo``, ``cached_prefill_tokens`` and the engine's own
hit counters ``prefix_cache_hit_tokens`` / ``prefix_cache_query_tokens`` (and made
``queued_prefill_tokens`` net of the tokens the replica's prefix cache already holds). A body
without them (``sal-stats/1``, or stock replicas) reads as prefix caching off.

Minor 2 (``sal-stats/1.2``) added LoRA slots: ``max_loras`` (vLLM's ``--max-loras``, how
many adapters one batch may hold) and ``lora_running`` (the adapters of the running
requests). vLLM does not admit a request whose adapter would make a batch hold more than
``max_loras`` adapters, however much KV is free, so a router that knows them can send an
adapter where it can start now. A body without them reads as "LoRA slots unknown".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA = "sal-stats/1.2"
SCHEMA_MAJOR = "sal-stats/1"


class StatsSchemaError(ValueError):
    """A `/stats` body that does not follow the contract (names the field at fault)."""


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's scheduler state, as written by its engine after a scheduling step."""

    time: float
    """Unix seconds at which the engine wrote the snapshot (not when it was served)."""
    step: int
    """Engine step counter; increases by one per scheduling step."""
    model: str
    """Served model name."""
    scheduler: str
    """``"larry"`` or ``"fcfs"`` (stock order with stats only)."""
    alpha: float | None
    """LARRY's alpha, or None for FCFS."""
    block_size: int
    """KV-cache block size in tokens."""
    kv_blocks_total: int
    """Usable KV blocks (vLLM's null block excluded)."""
    kv_blocks_free: int
    """KV blocks free now."""
    free_kv_tokens: int
    """``kv_blocks_free * block_size``."""
    queued_prefill_tokens: int
    """Uncomputed prompt tokens of waiting requests plus remaining prefill of running ones,
    net of the leading tokens of waiting prompts that the prefix cache holds (they need no
    prefill)."""
    num_waiting: int
    num_running: int
    max_num_batched_tokens: int
    """Per-step token budget (``--max-num-batched-tokens``)."""
    max_num_seqs: int
    prefix_caching: bool = False
    """vLLM's automatic prefix caching is on (``--enable-prefix-caching``): full prompt
    blocks stay cached after their request ends, and `block_size` is the block of its keys."""
    prefix_hash_algo: str | None = None
    """vLLM's ``--prefix-caching-hash-algo`` (``sha256``, ``sha256_cbor``, ``xxhash``, ...),
    the hash of the block keys its KV-cache events carry; None when caching is off."""
    cached_prefill_tokens: int = 0
    """Leading prompt tokens of waiting requests found in the prefix cache (left out of
    `queued_prefill_tokens`)."""
    prefix_cache_query_tokens: int = 0
    """Prompt tokens of the requests admitted since the engine started (preempted ones
    resumed not counted again), as vLLM's ``vllm:prefix_cache_queries`` counter."""
    prefix_cache_hit_tokens: int = 0
    """Of those, the tokens found in the prefix cache (``vllm:prefix_cache_hits``): with
    the query counter, the replica's achieved hit rate."""
    max_loras: int = 0
    """vLLM's ``--max-loras``: how many LoRA adapters one batch may hold (0: LoRA off, or
    not reported)."""
    lora_running: tuple[str, ...] = ()
    """Names of the adapters of the running requests (at most `max_loras` per engine)."""
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        """The JSON object served on `GET /stats` (``schema`` first, as in the contract)."""
        body = asdict(self)
        body["lora_running"] = list(self.lora_running)  # a JSON array, as `parse_stats` reads
        return {"schema": body.pop("schema"), **body}


_MAX_ALGO_CHARS = 32
_INT_FIELDS = (
    "step",
    "block_size",
    "kv_blocks_total",
    "kv_blocks_free",
    "free_kv_tokens",
    "queued_prefill_tokens",
    "num_waiting",
    "num_running",
    "max_num_batched_tokens",
    "max_num_seqs",
)
_OPTIONAL_INT_FIELDS = (
    "cached_prefill_tokens",
    "prefix_cache_query_tokens",
    "prefix_cache_hit_tokens",
    "max_loras",
)
"""Added in minor versions: absent means 0."""

MAX_LORA_NAMES = 256
"""Adapter names `lora_running` may list (vLLM's ``--max-loras`` is a handful per engine)."""
MAX_LORA_NAME_CHARS = 1024


MAX_INT = 2**53
"""The largest integer a `/stats` count may have: every count an engine has is far below it,
and up to it a float holds it exactly. Larger ones (JSON integers have no bound) would make
the routing arithmetic, which mixes them with floats, raise OverflowError on the request
path; a replica that sends one fails its poll instead."""


def _int_field(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise StatsSchemaError(f"/stats field {name!r} must be an integer, got {value!r}")
    if value < 0:
        raise StatsSchemaError(f"/stats field {name!r} must be >= 0, got {value}")
    if value > MAX_INT:
        raise StatsSchemaError(
            f"/stats field {name!r} must be <= 2**53, got {len(str(value))} digits"
        )
    return value


def _finite_number(value: object) -> float | None:
    """`value` as a finite float, or None (not a number, NaN, infinite, too large)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        result = float(value)
    except OverflowError:  # an integer too large for a float is as unusable as inf
        return None
    return result if math.isfinite(result) else None


def parse_stats(obj: object) -> ReplicaStats:
    """Validate a decoded `/stats` JSON body and return it as `ReplicaStats`.

    Raises `StatsSchemaError` naming the first bad field (NaN and infinities included).
    Unknown fields are ignored.
    """
    if not isinstance(obj, dict):
        raise StatsSchemaError(f"/stats body must be a JSON object, got {type(obj).__name__}")
    schema = obj.get("schema")
    if not isinstance(schema, str):
        raise StatsSchemaError(f"/stats field 'schema' must be a string, got {schema!r}")
    if schema != SCHEMA_MAJOR and not schema.startswith(SCHEMA_MAJOR + "."):
        raise StatsSchemaError(
            f"unsupported /stats schema {schema!r} (this gateway reads {SCHEMA})"
        )
    time_s = _finite_number(obj.get("time"))
    if time_s is None:
        raise StatsSchemaError(
            f"/stats field 'time' must be a finite number, got {obj.get('time')!r}"
        )
    raw_alpha = obj.get("alpha")
    alpha = None if raw_alpha is None else _finite_number(raw_alpha)
    if raw_alpha is not None and alpha is None:
        raise StatsSchemaError(
            f"/stats field 'alpha' must be a finite number or null, got {raw_alpha!r}"
        )
    model = obj.get("model")
    scheduler = obj.get("scheduler")
    if not isinstance(model, str):
        raise StatsSchemaError(f"/stats field 'model' must be a string, got {model!r}")
    if not isinstance(scheduler, str):
        raise StatsSchemaError(f"/stats field 'scheduler' must be a string, got {scheduler!r}")
    ints = {name: _int_field(obj, name) for name in _INT_FIELDS}
    for name in _OPTIONAL_INT_FIELDS:
        if name in obj:
            ints[name] = _int_field(obj, name)
    caching = obj.get("prefix_caching", False)
    if not isinstance(caching, bool):
        raise StatsSchemaError(f"/stats field 'prefix_caching' must be a boolean, got {caching!r}")
    algo = obj.get("prefix_hash_algo")
    if algo is not None and (not isinstance(algo, str) or len(algo) > _MAX_ALGO_CHARS):
        raise StatsSchemaError(
            f"/stats field 'prefix_hash_algo' must be a short string or null, got {algo!r:.60}"
        )
    return ReplicaStats(
        time=time_s,
        model=model,
        scheduler=scheduler,
        alpha=alpha,
        schema=schema,
        prefix_caching=caching,
        prefix_hash_algo=algo,
        lora_running=_names_field(obj, "lora_running"),
        **ints,
    )


def _names_field(obj: dict[str, Any], name: str) -> tuple[str, ...]:
    """An optional list of adapter names (absent: none), bounded in count and length."""
    value = obj.get(name, [])
    if (
        not isinstance(value, list)
        or len(value) > MAX_LORA_NAMES
        or not all(isinstance(v, str) and 0 < len(v) <= MAX_LORA_NAME_CHARS for v in value)
    ):
        raise StatsSchemaError(
            f"/stats field {name!r} must be a list of at most {MAX_LORA_NAMES} non-empty "
            f"names of at most {MAX_LORA_NAME_CHARS} characters, got {value!r:.80}"
        )
    return tuple(value)
