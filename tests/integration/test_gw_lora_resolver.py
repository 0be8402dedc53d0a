"""LoRA adapters the replicas load on first use (vLLM's LoRA resolvers), through the gateway
(fake backends, real sockets).

``models[].resolvable_adapters: ["team-*"]``. What a user would notice if it broke: a
request for an adapter no replica has loaded yet is the gateway's 404 (as it was before
this option) instead of reaching a replica that loads it; such an adapter stays pinned to
the one replica that loaded it first; a made-up name matching the pattern is sent to every
replica in turn, or a name like ``../x`` reaches a replica's resolver at all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

RELAXED = {"stale_after_s": 5.0, "poll_timeout_s": 2.0, "eject_after_failures": 5}
RESOLVABLE = {"models": [{"resolvable_adapters": ["team-*", "*/*"]}]}


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:
    with gateway_rig(
        2,
        tokenizer=tiny_model_dir,
        routing={**RELAXED, "policy": "round_robin"},
        extra=RESOLVABLE,
    ) as r:
        for fake in r.fakes:
            fake.resolvable = ("team-sql", "org/../x")
        yield r


def _ask(rig: Rig, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    return httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30.0)


def _received(rig: Rig, model: str) -> list[int]:
    return [[b.get("model") for b in f.received].count(model) for f in rig.fakes]


def test_an_adapter_no_replica_lists_is_loaded_wherever_it_is_sent(rig: Rig) -> None:
    reads = [f.models_reads for f in rig.fakes]
    answers = [_ask(rig, "team-sql") for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4, answers[0].text
    assert answers[0].json()["model"] == "team-sql"
    # Both replicas loaded it (round robin, over the whole pool), and no request waited for
    # a re-read of the replicas' model lists first.
    assert _received(rig, "team-sql") == [2, 2]
    assert all("team-sql" in f.adapters for f in rig.fakes)
    assert [f.models_reads for f in rig.fakes] == reads


def test_a_name_no_replica_can_load_is_one_replicas_404(rig: Rig) -> None:
    answer = _ask(rig, "team-nope")
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == "The model `team-nope` does not exist."
    # One replica asked: the other's resolver would have said the same.
    assert sum(_received(rig, "team-nope")) == 1
    text = rig.metrics()
    assert metric(text, "sal_adapter_requests_total", adapter="team-nope") is None
    assert metric(text, "sal_requests_total", model=MODEL, status="404") is not None


@pytest.mark.parametrize("name", ["org/../x", "../team-x", "/team-x"])
def test_a_name_that_could_leave_the_resolvers_directory_never_reaches_a_replica(
    rig: Rig, name: str
) -> None:
    answer = _ask(rig, name)
    assert answer.status_code == 404
    assert sum(_received(rig, name)) == 0


def test_a_replica_that_cannot_load_an_adapter_another_lists_passes_it_on_quietly(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replica a has loaded team-a; b's resolver cannot load it. Requests that round robin
    sends to b are answered by a, and b's 404 is no warning (b never listed it). When a
    unloads it, a's 404 is one: its last ``/v1/models`` listed the adapter."""
    with gateway_rig(
        2,
        tokenizer=tiny_model_dir,
        routing={**RELAXED, "policy": "round_robin"},
        extra={"models": [{"resolvable_adapters": ["team-*"], "models_refresh_s": 60.0}]},
    ) as rig:
        a, b = rig.fakes
        a.adapters = ("team-a",)

        def listed() -> bool:
            models = httpx.get(f"{rig.url}/v1/models", timeout=5.0).json()["data"]
            return "team-a" in {m["id"] for m in models}

        # A name no pattern matches makes the gateway re-read the replicas' model lists
        # (no periodic read comes for a minute: what a lists below stays what it read).
        wait_until(lambda: _ask(rig, "other").status_code == 404 and listed())
        caplog.set_level(logging.WARNING, logger="sal_gateway")
        answers = [_ask(rig, "team-a") for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4, answers[0].text
        assert {a.json()["backend"] for a in answers} == {"a"}
        assert _received(rig, "team-a")[1] >= 1  # b was tried, and said it does not exist
        assert not [r for r in caplog.records if "no longer serves" in r.getMessage()]

        a.adapters = ()  # unloaded: a's next 404 contradicts its last /v1/models
        answer = _ask(rig, "team-a")
        assert answer.status_code == 404
        warned = [r.getMessage() for r in caplog.records if "no longer serves" in r.getMessage()]
        assert len(warned) == 1, warned
        assert rig.served[0].url in warned[0]
        assert b.resolvable == ()
