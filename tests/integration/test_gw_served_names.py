"""LoRA adapters and other served names through the gateway (fake backends, real sockets, the
OpenAI SDK as client).

What a user would notice if it broke: a request for an adapter that some replicas serve
reaches only those replicas (the others would answer vLLM's 404), including an adapter loaded
a moment ago; an unknown name is a prompt 404 however many clients send one, and never makes
the gateway hammer the replicas' ``/v1/models``; a long prompt for an adapter is counted with
the base model's tokenizer; an adapter whose replicas are down is a 503, not a request sent
to a replica without it; an adapter unloaded from one replica moves to the others unseen,
and is the gateway's 404 once no replica has it.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_sim.fake_vllm import default_stats
from sal_gateway.model_catalog import RETRY_S
from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

RELAXED = {"stale_after_s": 5.0, "poll_timeout_s": 2.0, "eject_after_failures": 5}


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:
    with gateway_rig(2, tokenizer=tiny_model_dir, max_model_len=200_000, routing=RELAXED) as r:
        yield r


@pytest.fixture
def client(rig: Rig) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _models_of(rig: Rig, index: int) -> list[str]:
    return [b.get("model") for b in rig.fakes[index].received]


def test_an_adapter_loaded_on_one_replica_is_served_by_that_replica_only(
    rig: Rig, client: openai.OpenAI
) -> None:
    a = rig.fakes[0]
    # Loaded after the gateway read the replicas' model lists: found on the first request.
    a.adapters = ("lora-a",)
    out = client.completions.create(model="lora-a", prompt="hello world", max_tokens=3)
    assert out.model == "lora-a"
    for i in range(3):
        stream = client.chat.completions.create(
            model="lora-a",
            messages=[{"role": "user", "content": f"hi {i}"}],
            max_tokens=2,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        client.completions.create(model="lora-a", prompt=f"p {i}", max_tokens=1)
    assert _models_of(rig, 0).count("lora-a") == 7
    assert "lora-a" not in _models_of(rig, 1)
    listed = {m["id"]: m for m in httpx.get(f"{rig.url}/v1/models").json()["data"]}
    assert listed["lora-a"]["parent"] == MODEL
    assert listed["lora-a"]["sal_replicas"] == 1
    assert listed[MODEL]["sal_replicas"] == 2


def test_an_adapters_prompts_are_matched_against_its_own_cached_blocks(rig: Rig) -> None:
    # vLLM keys an adapter's KV blocks by the adapter: a repeated adapter prompt is a hit on
    # the replica that ran it, and the same text for the base model matches nothing there.
    for fake in rig.fakes:
        fake.stats = dataclasses.replace(default_stats(), prefix_caching=True)
    rig.fakes[0].adapters = ("lora-a",)

    def predicted() -> float:
        text = rig.metrics()
        return sum(
            metric(text, "sal_prefix_predicted_hit_tokens_total", backend=s.url) or 0.0
            for s in rig.served
        )

    def send(model: str) -> None:
        body = {"model": model, "prompt": "the same long prompt " * 40, "max_tokens": 1}
        r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text

    def repeated_adapter_prompt_hits() -> bool:
        send("lora-a")  # until the gateway has seen the replicas' caching switched on
        return predicted() > 0

    wait_until(repeated_adapter_prompt_hits)
    before = predicted()
    # The same text for the base model (sent where the adapter's blocks are, replica a, the
    # first of two idle replicas): none of its blocks is cached anywhere.
    send(MODEL)
    assert predicted() == before
    send(MODEL)
    assert predicted() > before  # now they are


def test_unknown_names_are_prompt_404s_that_do_not_hammer_the_replicas(rig: Rig) -> None:
    reads_before = [f.models_reads for f in rig.fakes]

    def ask(_: int) -> httpx.Response:
        body = {"model": f"nope-{uuid.uuid4().hex}", "prompt": "x", "max_tokens": 1}
        return httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30.0)

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(64)))
    elapsed_s = time.monotonic() - started
    assert {r.status_code for r in answers} == {404}
    assert all("does not exist" in r.json()["error"]["message"] for r in answers)
    # One re-read per RETRY_S at most, whatever the clients send (plus, rarely, a periodic
    # one), where one per request would be 64.
    extra = [f.models_reads - n for f, n in zip(rig.fakes, reads_before, strict=True)]
    assert max(extra) <= elapsed_s / RETRY_S + 2, (extra, elapsed_s)
    assert max(extra) < 16
    assert not any(str(m).startswith("nope-") for i in (0, 1) for m in _models_of(rig, i))


def test_a_long_prompt_for_a_new_adapter_is_counted_with_the_base_tokenizer(rig: Rig) -> None:
    b = rig.fakes[1]
    b.adapters = ("lora-b",)
    # Right after another test's unknown names: this one waits for the next re-read.
    # Over 64 KiB: decoded and counted in a body worker, which has not heard of lora-b yet.
    prompt = " ".join(f"word{i % 500}" for i in range(12_000))

    def counted(model: str) -> float:
        before = metric(rig.metrics(), "sal_prompt_tokens_total", model=MODEL) or 0.0
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1}
        r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=60.0)
        assert r.status_code == 200, r.text
        after = metric(rig.metrics(), "sal_prompt_tokens_total", model=MODEL) or 0.0
        return after - before

    by_adapter = counted("lora-b")
    assert _models_of(rig, 1)[-1] == "lora-b"
    by_base = counted(MODEL)
    assert by_adapter == by_base > 12_000


def test_an_adapter_whose_replicas_are_down_is_a_503_not_a_replica_without_it(
    tiny_model_dir: Path,
) -> None:
    fast = {**RELAXED, "poll_interval_s": 0.05, "eject_after_failures": 2}
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=fast) as rig:
        a, b = rig.fakes
        a.adapters = ("lora-a",)
        body = {"model": "lora-a", "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30).status_code == 200
        rig.served[0].stop()
        wait_until(
            lambda: (
                httpx.get(f"{rig.url}/ready", timeout=5).json()["eligible_backends"] == {MODEL: 1}
            )
        )
        # Degraded routing may still try the replica that answered moments ago (a 502 when
        # its connect fails); once it has not for `stale_after_s`, the answer is the 503.
        r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)
        assert r.status_code in (502, 503), r.text
        time.sleep(RELAXED["stale_after_s"] + 0.5)
        r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert "serve the requested name" in r.json()["error"]["message"]
        refused = metric(
            rig.metrics(), "sal_adapter_requests_total", adapter="lora-a", status="503"
        )
        assert (refused or 0) >= 1  # this 503, and the one before if it was not a 502
        assert "lora-a" not in [m.get("model") for m in b.received]
        # The base model still serves from the survivor.
        body["model"] = MODEL
        assert httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30).status_code == 200


def test_an_adapter_unloaded_from_a_replica_is_served_by_the_others_then_404(
    tiny_model_dir: Path,
) -> None:
    # The gateway's last /v1/models read still lists lora-u on both replicas (the periodic
    # read is 15 s away): a replica's 404 moves the request to the other one, unseen by the
    # client, and the gateway stops sending it there; once no replica has it, the client
    # gets the gateway's 404 (not a 502 for a healthy fleet).
    with gateway_rig(
        2, tokenizer=tiny_model_dir, routing={**RELAXED, "policy": "round_robin"}
    ) as rig:
        a, b = rig.fakes
        a.adapters = b.adapters = ("lora-u",)
        body = {"model": "lora-u", "prompt": "x", "max_tokens": 1}

        def ask() -> httpx.Response:
            return httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)

        assert ask().status_code == 200
        wait_until(lambda: all(f.models_reads >= 2 for f in rig.fakes))  # both listed it
        a.adapters = ()  # unloaded (or a restart without it)
        for _ in range(6):
            r = ask()
            assert r.status_code == 200, r.text
        assert sum(m == "lora-u" for m in _models_of(rig, 0)) <= 2  # at most one 404 there
        b.adapters = ()
        r = ask()
        assert r.status_code == 404, r.text
        assert r.json()["error"]["message"] == "The model `lora-u` does not exist."
        healthy = [metric(rig.metrics(), "sal_backend_healthy", backend=s.url) for s in rig.served]
        assert healthy == [1.0, 1.0]  # a 404 for an adapter is not held against a replica


def test_a_404_not_about_the_model_is_relayed_and_the_replica_keeps_the_adapter(
    tiny_model_dir: Path,
) -> None:
    # vLLM also answers 404 for other reasons (a stored response another replica holds, a
    # route its version lacks): that answer reaches the client as it is, and says nothing
    # about the adapter.
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=RELAXED) as rig:
        a = rig.fakes[0]
        a.adapters = ("lora-r",)
        body = {"model": "lora-r", "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30).status_code == 200
        a.behaviour.fail_status = 404
        r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "fake failure"
        a.behaviour.fail_status = None
        assert httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30).status_code == 200
        assert _models_of(rig, 0).count("lora-r") == 3
        assert "lora-r" not in _models_of(rig, 1)


def test_round_robin_keeps_its_rotation_beside_adapter_requests(tiny_model_dir: Path) -> None:
    # Adapter requests choose among fewer replicas; the base model's rotation must not
    # collapse onto one replica when the two kinds alternate.
    routing = {**RELAXED, "policy": "round_robin"}
    with gateway_rig(4, tokenizer=tiny_model_dir, routing=routing) as rig:
        rig.fakes[2].adapters = rig.fakes[3].adapters = ("lora-rr",)
        for i in range(8):
            for model in (MODEL, "lora-rr"):
                body = {"model": model, "prompt": f"p {i}", "max_tokens": 1}
                r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
        base = [_models_of(rig, i).count(MODEL) for i in range(4)]
        adapter = [_models_of(rig, i).count("lora-rr") for i in range(4)]
        assert sum(1 for n in base if n) >= 3, base
        assert adapter[:2] == [0, 0]
        assert min(adapter[2:]) >= 1, adapter


def test_an_adapter_gone_from_the_reachable_replica_is_a_503_while_another_may_have_it(
    tiny_model_dir: Path,
) -> None:
    # lora-g was listed by both replicas; b is down (not tried), a answers vLLM's 404. The
    # client gets a 503 (retry later: b may come back with it), not a 404 (it does not exist).
    fast = {**RELAXED, "poll_interval_s": 0.05, "eject_after_failures": 2}
    with gateway_rig(2, tokenizer=tiny_model_dir, routing=fast) as rig:
        a, b = rig.fakes
        a.adapters = b.adapters = ("lora-g",)
        body = {"model": "lora-g", "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30).status_code == 200
        rig.served[1].stop()
        wait_until(
            lambda: (
                httpx.get(f"{rig.url}/ready", timeout=5).json()["eligible_backends"] == {MODEL: 1}
            )
        )
        time.sleep(RELAXED["stale_after_s"] + 0.5)  # b is no degraded candidate any more
        a.adapters = ()
        r = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
