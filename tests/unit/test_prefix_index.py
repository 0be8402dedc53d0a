"""The prefix index the router keeps of what each backend has cached (sal_core.prefix)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sal_core.prefix import PrefixIndex, PrefixMatch, adapter_keys, chain_hashes


def test_chain_hashes_key_full_blocks_by_their_whole_prefix() -> None:
    a = chain_hashes(list(range(40)), 16)
    assert len(a) == 2  # the trailing 8 tokens are no full block
    b = chain_hashes([*range(16), *range(100, 116)], 16)
    assert a[0] == b[0]  # same first block
    assert a[1] != b[1]  # different second block
    # Same second block after a different first one: a different key (chained).
    c = chain_hashes([*range(50, 66), *range(16, 32)], 16)
    assert c[1] != a[1]
    assert chain_hashes(list(range(15)), 16) == []
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes([1], 0)


def test_match_counts_leading_blocks_and_held_ones_without_touching_lru() -> None:
    index = PrefixIndex()
    keys = chain_hashes(list(range(64)), 16)
    index.insert("a", keys[:3])
    assert index.match("a", keys) == PrefixMatch(3, 3)
    assert index.match("b", keys) == PrefixMatch(0, 0)
    index.release("a", keys[:3])
    assert index.match("a", keys) == PrefixMatch(3, 0)  # still cached, evictable now
    other = chain_hashes(list(range(1000, 1064)), 16)
    assert index.match("a", other) == PrefixMatch(0, 0)


def test_capacity_evicts_a_prefix_tail_first_and_never_held_blocks() -> None:
    index = PrefixIndex()
    old = chain_hashes(list(range(64)), 16)
    new = chain_hashes(list(range(500, 564)), 16)
    index.insert("a", old, hold=False)
    index.insert("a", new)  # held
    index.set_capacity("a", 6)
    # Two of `old`'s four blocks went, the tail ones: its head still matches.
    assert index.match("a", old) == PrefixMatch(2, 0)
    assert index.match("a", new) == PrefixMatch(4, 4)
    index.set_capacity("a", 0)  # held blocks survive any capacity
    assert index.match("a", new) == PrefixMatch(4, 4)
    assert index.size("a") == 4
    index.release("a", new)
    index.set_capacity("a", 0)
    assert index.size("a") == 0
    index.remove_backend("a")
    assert index.match("a", new) == PrefixMatch(0, 0)


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), max_size=30),
    st.integers(0, 12),
)
def test_index_never_exceeds_capacity_once_nothing_is_held(
    prompts: list[list[int]], capacity: int
) -> None:
    index = PrefixIndex()
    index.set_capacity("a", capacity)
    for prompt in prompts:
        keys = chain_hashes(prompt, 1)
        index.insert("a", keys)
        found = index.match("a", keys)
        assert found.cached_blocks <= len(keys)
        assert found.held_blocks <= found.cached_blocks
        index.release("a", keys)
        assert index.size("a") <= capacity


def test_an_adapters_keys_match_nothing_of_the_base_or_another_adapter() -> None:
    keys = chain_hashes(list(range(64)), 16)
    a, b = adapter_keys(keys, "lora-a"), adapter_keys(keys, "lora-b")
    assert len(a) == len(keys)
    assert not set(a) & set(keys)
    assert not set(a) & set(b)
    assert adapter_keys(keys, "lora-a") == a
    # Chained like the base keys: a shorter prompt's keys are a prefix of a longer one's.
    assert adapter_keys(chain_hashes(list(range(32)), 16), "lora-a") == a[:2]


def test_adapter_keys_agree_across_processes() -> None:
    # The gateway's workers and its body workers are separate processes with their own
    # string-hash salt; an adapter's keys must not depend on it.
    code = (
        "from sal_core.prefix import adapter_keys, chain_hashes;"
        "print(adapter_keys(chain_hashes(list(range(48)), 16), 'lora-a'))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
