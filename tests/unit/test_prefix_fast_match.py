"""`PrefixIndex.match_prefix_closed` (the gateway's per-request lookup over every replica)
answers exactly what the linear `match` answers on every index built by the index's own
operations (routing, releasing, capacity eviction)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sal_core.prefix import PrefixIndex, chain_hashes

BS = 4
_prompts = st.lists(st.integers(0, 3), min_size=0, max_size=40)
"""Small alphabets: prompts share prefixes often."""
_ops = st.lists(
    st.tuples(st.sampled_from(["route", "release", "capacity"]), _prompts, st.integers(0, 30)),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, query=_prompts)
def test_fast_match_equals_linear_match(
    ops: list[tuple[str, list[int], int]], query: list[int]
) -> None:
    index = PrefixIndex()
    held: list[list[int]] = []
    for op, prompt, n in ops:
        keys = chain_hashes(prompt, BS)
        if op == "route":
            index.insert("a", keys, hold=n % 2 == 0)
            if n % 2 == 0:
                held.append(keys)
        elif op == "release" and held:
            index.release("a", held.pop(n % len(held)))
        elif op == "capacity":
            index.set_capacity("a", n)
    keys = chain_hashes(query, BS)
    assert index.match_prefix_closed("a", keys) == index.match("a", keys)
    assert index.match_prefix_closed("nobody", keys) == index.match("nobody", keys)
