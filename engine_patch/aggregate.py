"""Combine the snapshots of several data-parallel engines into one `/stats` body (pure).

A replica started with ``--data-parallel-size N`` is one HTTP endpoint in front of N engines
(vLLM's API server balances requests across them), so the gateway must see it as one server:
capacities and loads are summed, ``time`` is the oldest engine's (staleness is judged by the
least recently updated engine), ``step`` is the sum of the engines' step counters (it still
increases with every step). LoRA slots: ``max_loras`` is summed (each engine holds its own
batch of adapters) and ``lora_running`` is the sorted union of the engines' adapter names
(at most ``MAX_LORA_NAMES``, the first in sorted order, so that the body still parses).
The per-engine records are listed under ``dp_ranks`` (an extra field that readers of
``sal-stats/1`` ignore) when there is more than one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine_patch.snapshot import SnapshotRecord
from sal_core.stats import MAX_LORA_NAMES, ReplicaStats


def combine_ranks(records: Sequence[SnapshotRecord]) -> ReplicaStats:
    """One `ReplicaStats` for all `records` (sorted by rank; at least one)."""
    if not records:
        raise ValueError("combine_ranks needs at least one snapshot record")
    ordered = sorted(records, key=lambda r: r.dp_rank)
    stats = [r.stats for r in ordered]
    if len(stats) == 1:
        return stats[0]
    return replace(
        stats[0],
        time=min(s.time for s in stats),
        step=sum(s.step for s in stats),
        kv_blocks_total=sum(s.kv_blocks_total for s in stats),
        kv_blocks_free=sum(s.kv_blocks_free for s in stats),
        free_kv_tokens=sum(s.free_kv_tokens for s in stats),
        queued_prefill_tokens=sum(s.queued_prefill_tokens for s in stats),
        cached_prefill_tokens=sum(s.cached_prefill_tokens for s in stats),
        prefix_cache_query_tokens=sum(s.prefix_cache_query_tokens for s in stats),
        prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_running=sum(s.num_running for s in stats),
        max_num_batched_tokens=sum(s.max_num_batched_tokens for s in stats),
        max_num_seqs=sum(s.max_num_seqs for s in stats),
        max_loras=sum(s.max_loras for s in stats),
        lora_running=tuple(sorted({name for s in stats for name in s.lora_running}))[
            :MAX_LORA_NAMES
        ],
    )


def stats_body(records: Sequence[SnapshotRecord]) -> dict[str, Any]:
    """The JSON object served on `GET /stats` for these engines' records."""
    body = combine_ranks(records).to_dict()
    if len(records) > 1:
        body["dp_ranks"] = [
            {"dp_rank": r.dp_rank, **r.stats.to_dict()}
            for r in sorted(records, key=lambda r: r.dp_rank)
        ]
    return body
