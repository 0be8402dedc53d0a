"""The sal-stats/1 contract: what replicas write is what the gateway reads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sal_core.policies import BackendView, RouteRequest, make_policy
from sal_core.stats import (
    MAX_LORA_NAME_CHARS,
    MAX_LORA_NAMES,
    ReplicaStats,
    StatsSchemaError,
    parse_stats,
)


def _sample() -> ReplicaStats:
    return ReplicaStats(
        time=1_700_000_000.5,
        step=42,
        model="tiny",
        scheduler="larry",
        alpha=1.0,
        block_size=16,
        kv_blocks_total=100,
        kv_blocks_free=60,
        free_kv_tokens=960,
        queued_prefill_tokens=300,
        num_waiting=2,
        num_running=3,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
    )


def test_round_trip_through_json() -> None:
    stats = _sample()
    body = json.loads(json.dumps(stats.to_dict()))
    assert next(iter(body)) == "schema"
    assert body["schema"] == "sal-stats/1.2"
    assert parse_stats(body) == stats


def test_prefix_cache_fields_round_trip_and_default_when_absent() -> None:
    """sal-stats/1.1 added the prefix-cache fields; a sal-stats/1 body reads as caching off."""
    cached = replace(
        _sample(), prefix_caching=True, prefix_hash_algo="sha256", cached_prefill_tokens=64
    )
    assert parse_stats(json.loads(json.dumps(cached.to_dict()))) == cached
    old = {
        k: v
        for k, v in _sample().to_dict().items()
        if k not in ("prefix_caching", "prefix_hash_algo", "cached_prefill_tokens")
    }
    old["schema"] = "sal-stats/1"
    parsed = parse_stats(old)
    assert (parsed.prefix_caching, parsed.prefix_hash_algo, parsed.cached_prefill_tokens) == (
        False,
        None,
        0,
    )


def test_lora_slot_fields_round_trip_and_default_when_absent() -> None:
    """sal-stats/1.2 added max_loras and lora_running; a body without them (sal-stats/1.1 or
    older) reads as LoRA slots unknown: 0 and no adapters."""
    lora = replace(_sample(), max_loras=4, lora_running=("chat", "sql-v2"))
    body = json.loads(json.dumps(lora.to_dict()))
    assert (body["max_loras"], body["lora_running"]) == (4, ["chat", "sql-v2"])
    assert parse_stats(body) == lora
    old = {k: v for k, v in lora.to_dict().items() if k not in ("max_loras", "lora_running")}
    old["schema"] = "sal-stats/1.1"
    parsed = parse_stats(old)
    assert (parsed.max_loras, parsed.lora_running) == (0, ())
    assert parsed == replace(_sample(), schema="sal-stats/1.1")


@pytest.mark.parametrize(
    "bad",
    [
        "chat",  # not a list
        {"chat": 1},
        ["chat", 7],  # a non-string entry
        ["chat", None],
        ["chat", ""],  # an empty name
        ["x" * (MAX_LORA_NAME_CHARS + 1)],  # a name too long
        [f"a{i}" for i in range(MAX_LORA_NAMES + 1)],  # too many
    ],
)
def test_bad_lora_running_is_rejected(bad: object) -> None:
    with pytest.raises(StatsSchemaError, match="'lora_running' must be a list"):
        parse_stats({**_sample().to_dict(), "max_loras": 2, "lora_running": bad})


def test_bad_max_loras_is_rejected() -> None:
    for bad, message in (
        (-1, "must be >= 0"),
        ("2", "must be an integer"),
        (True, "must be an integer"),
    ):
        with pytest.raises(StatsSchemaError, match=f"'max_loras' {message}"):
            parse_stats({**_sample().to_dict(), "max_loras": bad})


def test_unknown_fields_are_ignored_and_minor_versions_accepted() -> None:
    body = {**_sample().to_dict(), "schema": "sal-stats/1.4", "gpu_temp_c": 61}
    assert parse_stats(body).num_running == 3


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"schema": "sal-stats/2"}, "unsupported /stats schema 'sal-stats/2'"),
        ({"num_waiting": -1}, "'num_waiting' must be >= 0"),
        ({"free_kv_tokens": "12"}, "'free_kv_tokens' must be an integer"),
        ({"step": True}, "'step' must be an integer"),
        ({"time": None}, "'time' must be a finite number"),
        ({"time": float("nan")}, "'time' must be a finite number"),
        ({"time": float("inf")}, "'time' must be a finite number"),
        ({"time": 10**400}, "'time' must be a finite number"),
        ({"alpha": "one"}, "'alpha' must be a finite number or null"),
        ({"alpha": float("-inf")}, "'alpha' must be a finite number or null"),
        ({"prefix_caching": "yes"}, "'prefix_caching' must be a boolean"),
        ({"prefix_hash_algo": 7}, "'prefix_hash_algo' must be a short string or null"),
        ({"prefix_hash_algo": "x" * 1000}, "'prefix_hash_algo' must be a short string"),
        ({"cached_prefill_tokens": -3}, "'cached_prefill_tokens' must be >= 0"),
        # Unbounded JSON integers would overflow SAL's float arithmetic on the request path.
        ({"free_kv_tokens": 10**400}, r"'free_kv_tokens' must be <= 2\*\*53, got 401 digits"),
        ({"num_running": 2**53 + 1}, r"'num_running' must be <= 2\*\*53"),
        ({"queued_prefill_tokens": 10**30}, r"'queued_prefill_tokens' must be <= 2\*\*53"),
    ],
)
def test_bad_bodies_are_rejected_naming_the_field(patch: dict[str, object], message: str) -> None:
    with pytest.raises(StatsSchemaError, match=message):
        parse_stats({**_sample().to_dict(), **patch})


def test_the_largest_accepted_counts_route_without_overflow() -> None:
    # At the bound every SAL term is a finite float: the request path cannot raise.
    big = parse_stats({**_sample().to_dict(), "free_kv_tokens": 2**53, "num_running": 2**53})
    view = BackendView("a", True, 1, big.free_kv_tokens, 2**53, 2048, num_running=big.num_running)
    for name in ("sal", "sal_paper"):
        assert make_policy(name).select(RouteRequest(1_000, beta=50.0), [view]).index == 0


def test_missing_field_is_named() -> None:
    body = _sample().to_dict()
    del body["max_num_batched_tokens"]
    with pytest.raises(StatsSchemaError, match="max_num_batched_tokens"):
        parse_stats(body)


def test_non_object_body() -> None:
    with pytest.raises(StatsSchemaError, match="JSON object"):
        parse_stats([1, 2])
