"""The gateway's prefix-cache tracking over real sockets, in front of fake replicas whose
``/stats`` reports prefix caching on: a conversation's next turn follows its prefix under
cache-aware SAL, while the paper's Eq. 2 sends it to the less loaded replica."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest

from sal_core.prefix import chain_hashes
from sal_gateway.state import StateTable
from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

BS = 16


def _cache_on(rig: Rig) -> None:
    for fake in rig.fakes:
        fake.stats = replace(fake.stats, prefix_caching=True, prefix_hash_algo="sha256")
    # The tracker learns each replica's caching from that replica's next poll: wait for all
    # of them, not for the model's block size (the first one's), or a request routed to a
    # replica not polled yet is not indexed (a clean-clone run: the follow-up turn went to b).
    prefix = rig.runtime.prefix
    assert prefix is not None
    backends = [b.url for b in rig.runtime.table.backends(MODEL)]
    wait_until(
        lambda: prefix.block_size(MODEL) == BS and all(prefix.tracking(MODEL, u) for u in backends)
    )


def _send(rig: Rig, prompt: list[int], headers: dict[str, str] | None = None) -> str:
    """Send one completion; the name of the fake that served it."""
    before = [f.generation_requests for f in rig.fakes]
    resp = httpx.post(
        f"{rig.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers=headers or {},
        timeout=10.0,
    )
    assert resp.status_code == 200, resp.text
    served = [f.name for f, n in zip(rig.fakes, before, strict=True) if f.generation_requests > n]
    assert len(served) == 1
    # Until a later poll covers it, the request counts in its replica's queue: wait, so the
    # next decision sees only the queues the test sets.
    backends = rig.runtime.table.backends(MODEL)
    wait_until(lambda: all(b.routed_tokens_since_poll == 0 for b in backends))
    return served[0]


TURN1 = list(range(1000, 1000 + 40 * BS + 3))
TURN2 = [*TURN1, *range(50, 90)]  # the conversation so far plus a new message
COLD = list(range(5000, 5000 + len(TURN2)))


@pytest.mark.parametrize(("policy", "follows"), [("sal", True), ("sal_paper", False)])
def test_a_follow_up_turn_goes_where_its_prefix_is_only_when_sal_is_cache_aware(
    policy: str, follows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every hit counts (the default ignores matches under 1,024 tokens; these are 640).
    routing = {"policy": policy, "prefix_cache": "approximate", "prefix_min_match_tokens": 0}
    with gateway_rig(2, routing=routing) as rig:
        _cache_on(rig)
        booked: list[tuple[str, int, int | None]] = []
        route = StateTable.route

        def recording_route(
            self: StateTable, model: str, url: str, tokens: int, *args: Any, **kw: Any
        ) -> Any:
            booked.append((url, tokens, kw.get("kv_tokens")))
            return route(self, model, url, tokens, *args, **kw)

        monkeypatch.setattr(StateTable, "route", recording_route)
        first = _send(rig, TURN1)
        assert first == "a"  # both idle: the tie goes to the first replica
        # Replica a now has a queue: a cold prompt goes to b under either policy ...
        a = rig.fakes[0]
        a.stats = replace(a.stats, queued_prefill_tokens=600)
        wait_until(lambda: rig.runtime.table.backends(MODEL)[0].queued_prefill_tokens() == 600)
        assert _send(rig, COLD) == "b"
        # ... but the follow-up turn's 640 cached tokens outweigh a's 600 queued ones.
        assert _send(rig, TURN2) == ("a" if follows else "b")
        # Between polls the chosen replica's books hold what the decision assumed: the
        # uncached tokens for cache-aware SAL, the whole prompt for the paper's Eq. 2.
        url, queued, kv = booked[-1]
        assert url == rig.served[0 if follows else 1].url
        if follows:
            assert (queued, kv) == (len(TURN2) - 40 * BS, len(TURN2))  # cached, not held
        else:
            assert (queued, kv) == (len(TURN2), len(TURN2))
        text = rig.metrics()
        predicted = metric(text, "sal_prefix_predicted_hit_tokens_total", backend=rig.served[0].url)
        lookups = metric(text, "sal_prefix_lookup_prompt_tokens_total", backend=rig.served[0].url)
        if follows:
            assert predicted == 40 * BS
            assert lookups == len(TURN1) + len(TURN2)


def test_off_keeps_sal_cache_blind_and_tracks_nothing() -> None:
    with gateway_rig(2, routing={"policy": "sal", "prefix_cache": "off"}) as rig:
        for fake in rig.fakes:
            fake.stats = replace(fake.stats, prefix_caching=True)
        assert rig.runtime.prefix is None
        assert _send(rig, TURN1) == "a"
        a = rig.fakes[0]
        a.stats = replace(a.stats, queued_prefill_tokens=600)
        wait_until(lambda: rig.runtime.table.backends(MODEL)[0].queued_prefill_tokens() == 600)
        assert _send(rig, TURN2) == "b"
        assert metric(rig.metrics(), "sal_prefix_lookup_prompt_tokens_total") is None


def test_engine_hit_counters_from_stats_become_gateway_counters() -> None:
    with gateway_rig(1, routing={"prefix_cache": "approximate"}) as rig:
        _cache_on(rig)
        fake = rig.fakes[0]
        fake.stats = replace(
            fake.stats, prefix_cache_query_tokens=1000, prefix_cache_hit_tokens=250
        )

        def counted() -> bool:
            text = rig.metrics()
            return metric(text, "sal_prefix_engine_hit_tokens_total") == 250.0

        wait_until(counted)
        assert metric(rig.metrics(), "sal_prefix_engine_query_tokens_total") == 1000.0


def _reuse(text: str, name: str, **labels: str) -> float:
    return metric(text, f"sal_prefix_fleet_reuse_{name}", model=MODEL, **labels) or 0.0


def test_the_fleet_reuse_estimate_sees_each_routed_prompt_once_even_when_retried() -> None:
    """What a pooled cache of the fleet's KV would hold (kv_scale 1, 2, 4), counted once per
    request: a repeated prompt's sampled blocks (each standing for the blocks it samples) are
    found at every scale, and a request retried on a second replica is not counted twice."""
    with gateway_rig(2, routing={"prefix_cache": "approximate"}) as rig:
        _cache_on(rig)
        fleet = sum(f.stats.kv_blocks_total for f in rig.fakes)
        wait_until(lambda: _reuse(rig.metrics(), "kv_blocks") == fleet)
        shift = rig.runtime.prefix.fleet_sample_shift(MODEL)
        assert shift is not None
        # A prompt of 40 full blocks whose chained keys include sampled ones.
        for start in range(100):
            prompt = list(range(2000 + start, 2000 + start + 40 * BS + 3))
            sampled = sum(1 for k in chain_hashes(prompt, BS) if not k & ((1 << shift) - 1))
            if sampled:
                break
        assert sampled
        # The first try (a: the tie goes to it) dies before its first byte; b serves it.
        rig.fakes[0].behaviour.close_after_chunks = 0
        resp = httpx.post(
            f"{rig.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True},
            timeout=10.0,
        )
        assert resp.status_code == 200, resp.text
        assert "[DONE]" in resp.text
        assert rig.fakes[1].generation_requests == 1
        rig.fakes[0].behaviour.close_after_chunks = None
        text = rig.metrics()
        assert metric(text, "sal_retries_total", model=MODEL) == 1.0
        assert _reuse(text, "prompt_tokens_total") == len(prompt)
        assert _reuse(text, "hit_tokens_total", kv_scale="1") == 0.0
        _send(rig, prompt)
        text = rig.metrics()
        assert _reuse(text, "prompt_tokens_total") == 2 * len(prompt)
        for scale in ("1", "2", "4"):
            assert _reuse(text, "hit_tokens_total", kv_scale=scale) == (sampled << shift) * BS
