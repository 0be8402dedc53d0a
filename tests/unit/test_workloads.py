"""Workloads with prefix structure: Mooncake traces, multi-turn chat, hot prefix."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from engine_sim.data import MOONCAKE_CONVERSATION, SHAREGPT_STATS, data_dir
from engine_sim.trace import TraceError
from engine_sim.workloads import (
    ChatSpec,
    TokenBlocks,
    hot_prefix,
    load_mooncake,
    load_sharegpt_lengths,
    multi_turn_chat,
)


def test_engine_block_keys_match_exactly_where_the_chunk_ids_do() -> None:
    a = TokenBlocks((7, 8, 9), 512, 3 * 512)
    b = TokenBlocks((7, 8, 4), 512, 2 * 512 + 100)
    ka, kb = a.keys(16), b.keys(16)
    assert len(ka) == 96
    assert len(kb) == 64 + 6  # full 16-token blocks of 1,124 tokens
    assert ka[:64] == kb[:64]
    assert ka[64] != kb[64]
    assert len(set(ka)) == 96
    with pytest.raises(TraceError, match="must divide"):
        a.keys(24)


def test_mooncake_conversation_trace_loads_with_its_own_bursty_timestamps(tmp_path: Path) -> None:
    reqs = load_mooncake(data_dir() / MOONCAKE_CONVERSATION, duration_s=60.0)
    assert reqs[0].arrival_s == 0.0
    assert all(r.arrival_s < 60.0 for r in reqs)
    # ~10 requests share each timestamp: bursts.
    assert len(reqs) / len({r.arrival_s for r in reqs}) > 5
    assert all(r.blocks is not None and r.blocks.chunk_tokens == 512 for r in reqs)
    # Every conversation request starts with the same block (the universal opening).
    assert len({r.blocks.first_chunk for r in reqs if r.blocks is not None}) == 1


def test_mooncake_clipping_keeps_the_prompt_first_and_drops_clipped_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = {
        "timestamp": 1500,
        "input_length": 5000,
        "output_length": 300,
        "hash_ids": list(range(10)),
    }
    path.write_text(json.dumps(rec) + "\n")
    (req,) = load_mooncake(path, context_limit_tokens=2048)
    assert (req.prompt_tokens, req.output_tokens) == (2047, 1)
    assert req.blocks is not None
    assert list(req.blocks.chunk_ids) == [0, 1, 2, 3]
    assert len(req.blocks.keys(16)) == 2047 // 16


def test_a_malformed_mooncake_record_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"x": 1}\n'
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        load_mooncake(path)


def test_each_chat_turn_repeats_the_conversation_so_far() -> None:
    lengths = load_sharegpt_lengths(data_dir() / SHAREGPT_STATS)
    reqs = multi_turn_chat(
        ChatSpec(conversations=30, rate_per_s=0.5, think_time_s=(5, 120)), lengths, 4
    )
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s)
    by_session: dict[str, list] = {}
    for r in reqs:
        assert r.session is not None
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 30
    for turns in by_session.values():
        for prev, cur in itertools.pairwise(turns):
            assert 5.0 <= cur.arrival_s - prev.arrival_s <= 120.0
            assert cur.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert prev.blocks is not None
            assert cur.blocks is not None
            # The earlier prompt *and answer* are a prefix of the later prompt.
            shared = prev.blocks.keys(16)
            assert cur.blocks.keys(16)[: len(shared)] == shared
    first = [turns[0] for turns in by_session.values()]
    assert len({r.blocks.keys(16)[0] for r in first if r.blocks is not None}) == 30


def test_chat_generator_is_seeded() -> None:
    lengths = [(100, 20), (400, 50)]
    spec = ChatSpec(conversations=10, rate_per_s=1.0)
    assert multi_turn_chat(spec, lengths, 1) == multi_turn_chat(spec, lengths, 1)
    assert multi_turn_chat(spec, lengths, 1) != multi_turn_chat(spec, lengths, 2)


def test_hot_prefix_requests_share_exactly_the_document() -> None:
    reqs = hot_prefix(20, 5.0, 1_600, (10, 200), (5, 10), seed=0)
    keys = [r.blocks.keys(16) for r in reqs if r.blocks is not None]
    assert all(k[:100] == keys[0][:100] for k in keys)
    assert len({k[100] for k in keys if len(k) > 100}) == sum(1 for k in keys if len(k) > 100)
