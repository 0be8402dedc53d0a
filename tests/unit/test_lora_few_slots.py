"""`bench.lora_few_slots`: the README's fewer-slots-than-adapters numbers stay reproducible."""

from __future__ import annotations

from bench.lora_few_slots import VARIANTS, run


def test_with_as_many_slots_as_adapters_the_rule_beats_routing_blind_to_slots() -> None:
    # 2 replicas x 2 slots for 4 adapters: every adapter can find a slot, and sending it
    # there saves the queueing a blind router causes (README: p95 about 34x lower).
    res = run(0.7, 2, 4, windows=1)
    assert set(res) == set(VARIANTS)
    assert all(len(rows) == 1 for rows in res.values())
    (blind,), (rule,) = res["blind"], res["rule"]
    assert rule[1] * 5 < blind[1]
