"""Fault handling over real sockets: dead backends, hanging /stats, 5xx, disconnects, broken
streams, stock-vLLM fallback, DNS discovery, and a long tokenization next to small requests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine_sim.fake_vllm import FakeBackend, ServedBackend
from tests.gw_fake_support import DEATH_UNNOTICED, MODEL, gateway_rig, metric, wait_until


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=30.0,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body},
    )


def _answered_by(resp: httpx.Response) -> str:
    return str(resp.json()["backend"])


def test_killed_backend_is_ejected_and_readmitted_when_it_returns() -> None:
    with gateway_rig(2, routing={"policy": "round_robin"}) as rig:
        a_served, _b_served = rig.served
        assert {_answered_by(_complete(rig.url)) for _ in range(4)} == {"a", "b"}
        a_served.stop()
        # Every request keeps succeeding on b, before and after a is noticed as dead.
        for _ in range(10):
            resp = _complete(rig.url)
            assert resp.status_code == 200
            assert _answered_by(resp) == "b"
        wait_until(
            lambda: (
                metric(rig.metrics(), "sal_backend_ejections_total", backend=a_served.url) == 1.0
            )
        )
        assert metric(rig.metrics(), "sal_backend_healthy", backend=a_served.url) == 0.0
        a_served.start()  # same port
        wait_until(
            lambda: metric(rig.metrics(), "sal_backend_healthy", backend=a_served.url) == 1.0
        )
        assert "a" in {_answered_by(_complete(rig.url)) for _ in range(4)}


def test_connect_failure_before_first_byte_is_retried_on_the_other_backend() -> None:
    with gateway_rig(2, routing=DEATH_UNNOTICED) as rig:
        a_served = rig.served[0]
        a_served.stop()  # the pollers will not notice for seconds: the proxy must
        answers = [_complete(rig.url) for _ in range(4)]
        assert all(r.status_code == 200 and _answered_by(r) == "b" for r in answers)
        assert metric(rig.metrics(), "sal_retries_total", backend=a_served.url) == 1.0


def test_hanging_stats_makes_backend_stale_and_not_chosen() -> None:
    # Staleness (1 s) comes before ejection (10 timed-out polls of 0.5 s).
    routing = {
        "policy": "round_robin",
        "stale_after_s": 1.0,
        "poll_timeout_s": 0.5,
        "eject_after_failures": 10,
    }
    with gateway_rig(2, routing=routing) as rig:
        a, _b = rig.fakes
        a.behaviour.stats_hang = True
        a_url = rig.served[0].url
        wait_until(lambda: metric(rig.metrics(), "sal_backend_healthy", backend=a_url) == 0.0)
        before = a.generation_requests
        assert {_answered_by(_complete(rig.url)) for _ in range(6)} == {"b"}
        assert a.generation_requests == before
        age = metric(rig.metrics(), "sal_backend_state_age_seconds", backend=a_url)
        assert age is not None
        assert age > 1.0
        assert metric(rig.metrics(), "sal_backend_ejections_total", backend=a_url) is None
        a.behaviour.stats_hang = False
        wait_until(lambda: metric(rig.metrics(), "sal_backend_healthy", backend=a_url) == 1.0)


def test_all_backends_gone_gives_503_and_not_ready() -> None:
    with gateway_rig(1, routing={"stale_after_s": 0.6, "poll_timeout_s": 0.3}) as rig:
        rig.fakes[0].behaviour.stats_hang = True
        wait_until(lambda: httpx.get(f"{rig.url}/ready").status_code == 503)
        resp = _complete(rig.url)
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable"
        assert metric(rig.metrics(), "sal_requests_total", backend="none", status="503") == 1.0


def test_a_replica_whose_polls_time_out_while_it_streams_is_routed_to_not_503() -> None:
    """a is dead; b's ``/stats`` hangs (a busy host: its polls time out, it is ejected) while a
    stream through b delivers tokens. New requests go to b (degraded routing: its relayed
    content proves it serves) instead of a 503 for a fleet that still answers. Once b's
    content is older than ``stale_after_s``, nothing vouches for it: 503."""
    routing = {
        "policy": "round_robin",
        "stale_after_s": 2.0,  # content 2 s old vouches no more: room for a busy machine
        "poll_timeout_s": 0.3,
        "eject_after_failures": 2,
    }
    with gateway_rig(2, routing=routing) as rig:
        a_served, b_served = rig.served
        b = rig.fakes[1]
        a_served.stop()
        wait_until(lambda: metric(rig.metrics(), "sal_backend_healthy", backend=a_served.url) == 0)
        b.behaviour.chunk_delay_s = 0.05
        chunks: list[bytes] = []
        stop = threading.Event()

        def read_stream() -> None:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
            with httpx.stream("POST", f"{rig.url}/v1/completions", json=body, timeout=30.0) as r:
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    if stop.is_set():
                        return

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        try:
            wait_until(lambda: len(chunks) >= 2)
            b.behaviour.stats_hang = True
            wait_until(
                lambda: (
                    metric(rig.metrics(), "sal_backend_ejections_total", backend=b_served.url)
                    == 1.0
                )
            )
            before = metric(rig.metrics(), "sal_degraded_routes_total", backend=b_served.url)
            answers = [_complete(rig.url) for _ in range(3)]
            assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
            assert {_answered_by(r) for r in answers} == {"b"}
            degraded = metric(rig.metrics(), "sal_degraded_routes_total", backend=b_served.url)
            assert degraded == (before or 0.0) + 3.0
        finally:
            stop.set()
            reader.join(timeout=30.0)
        wait_until(
            lambda: metric(rig.metrics(), "sal_backend_in_flight", backend=b_served.url) == 0
        )
        time.sleep(2.3)  # past stale_after_s: b's last content no longer vouches for it
        resp = _complete(rig.url)
        assert resp.status_code == 503, resp.text


def test_backend_500_is_passed_through_not_retried() -> None:
    with gateway_rig(2) as rig:
        for fake in rig.fakes:
            fake.behaviour.fail_status = 500
        resp = _complete(rig.url)
        assert resp.status_code == 500
        assert resp.json()["error"]["message"] == "fake failure"
        assert sum(f.generation_requests for f in rig.fakes) == 1


def test_backend_4xx_is_passed_through_with_body() -> None:
    with gateway_rig(1) as rig:
        rig.fakes[0].behaviour.fail_status = 422
        resp = _complete(rig.url, stream=True)
        assert resp.status_code == 422
        assert resp.json() == {"error": {"message": "fake failure", "code": 422}}


def test_client_disconnect_cancels_the_upstream_request() -> None:
    with gateway_rig(1) as rig:
        fake = rig.fakes[0]
        fake.behaviour.chunk_delay_s = 0.2
        with httpx.stream(
            "POST",
            f"{rig.url}/v1/completions",
            timeout=30.0,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True},
        ) as resp:
            first = next(resp.iter_bytes())
            assert first.startswith(b"data: ")
        wait_until(lambda: fake.disconnects == 1)
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight") == 0.0)
        cancels = metric(rig.metrics(), "sal_upstream_cancels_total", reason="client_disconnect")
        assert cancels == 1.0


def test_stream_header_timeout_closes_the_hung_upstream_request() -> None:
    with gateway_rig(1, proxy={"stream_header_timeout_s": 1.0}) as rig:
        fake = rig.fakes[0]
        fake.behaviour.hang = True
        resp = _complete(rig.url, stream=True)
        assert resp.status_code == 504  # header timeout, and no other backend to retry on
        assert fake.generation_requests == 1
        wait_until(lambda: fake.disconnects == 1)  # the hung upstream request was abandoned


@pytest.mark.parametrize("stream", [False, True])
def test_client_giving_up_before_first_byte_cancels_upstream(stream: bool) -> None:
    with gateway_rig(1) as rig:
        fake = rig.fakes[0]
        fake.behaviour.hang = True
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{rig.url}/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream},
                timeout=httpx.Timeout(5.0, read=0.5),
            )
        wait_until(lambda: fake.disconnects == 1)
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight") == 0.0)
        assert metric(rig.metrics(), "sal_requests_total", status="499") == 1.0
        cancels = metric(rig.metrics(), "sal_upstream_cancels_total", reason="client_disconnect")
        assert cancels == 1.0


def test_mid_stream_failure_ends_with_error_event_and_no_duplicate() -> None:
    with gateway_rig(2) as rig:
        for fake in rig.fakes:
            fake.behaviour.close_after_chunks = 2
            # Spaced chunks, as from a real engine: aiohttp drops bytes still buffered when a
            # connection breaks, so back-to-back chunks could vanish with the crash.
            fake.behaviour.chunk_delay_s = 0.1
        with httpx.stream(
            "POST",
            f"{rig.url}/v1/completions",
            timeout=30.0,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            body = resp.read()
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 4  # two chunks, the error event, [DONE]
        assert json.loads(events[2][len(b"data: ") :])["error"]["type"] == "upstream_error"
        assert events[3] == b"data: [DONE]"
        assert sum(f.generation_requests for f in rig.fakes) == 1
        assert metric(rig.metrics(), "sal_stream_errors_total") == 1.0


def test_mid_stream_failure_raises_in_the_openai_sdk() -> None:
    with gateway_rig(1) as rig:
        rig.fakes[0].behaviour.close_after_chunks = 1
        with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="x", max_retries=0) as client:
            stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True)
            with pytest.raises(openai.APIError, match="mid-stream"):
                list(stream)
        assert rig.fakes[0].generation_requests == 1


def test_stock_vllm_without_stats_uses_metrics_fallback() -> None:
    relaxed = {"policy": "sal", "stale_after_s": 5.0, "poll_timeout_s": 2.0}
    with gateway_rig(2, routing=relaxed) as rig:
        a, b = rig.fakes
        a.behaviour.stats_status = 404
        b.behaviour.stats_status = 404
        a.metrics_kv_usage = 1.0  # a is full: SAL must prefer b
        a_url, b_url = (s.url for s in rig.served)

        def both_on_metrics() -> bool:
            text = rig.metrics()
            return all(
                metric(text, "sal_backend_stats_source", backend=url, source="metrics") == 1.0
                for url in (a_url, b_url)
            )

        wait_until(both_on_metrics)
        text = rig.metrics()
        assert metric(text, "sal_backend_stats_source", backend=b_url, source="metrics") == 1.0
        assert metric(text, "sal_backend_free_kv_tokens", backend=a_url) == 0.0
        assert {_answered_by(_complete(rig.url)) for _ in range(4)} == {"b"}


def test_dns_discovery_adds_and_removes_backends_live() -> None:
    extra = ServedBackend(FakeBackend(name="x", model=MODEL))
    extra.start()
    addresses: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        assert host == "fake.svc"
        return list(addresses)

    try:
        discovery = {"dns_name": "fake.svc", "port": extra.port, "interval_s": 0.05}
        with gateway_rig(1, resolve=resolve, discovery=discovery) as rig:
            x_url = f"http://127.0.0.1:{extra.port}"
            table = rig.runtime.table
            addresses.append("127.0.0.1")
            wait_until(lambda: table.get(MODEL, x_url) is not None)
            wait_until(lambda: metric(rig.metrics(), "sal_backend_healthy", backend=x_url) == 1.0)
            assert extra.backend.stats_polls > 0
            addresses.clear()
            wait_until(lambda: table.get(MODEL, x_url) is None)
            polls = extra.backend.stats_polls
            assert [b.url for b in table.backends(MODEL)] == [rig.served[0].url]
            assert {_answered_by(_complete(rig.url)) for _ in range(3)} == {"a"}
            assert extra.backend.stats_polls <= polls + 1  # its poller was stopped
    finally:
        extra.stop()


def test_long_tokenization_does_not_stall_small_requests(tiny_model_dir: Path) -> None:
    with gateway_rig(
        1, tokenizer=tiny_model_dir, max_model_len=4096, proxy={"tokenize_in_thread_chars": 10_000}
    ) as rig:
        huge = json.dumps(
            {"model": MODEL, "prompt": "hello world token " * 150_000, "max_tokens": 1}
        ).encode()
        order: list[str] = []

        async def main() -> None:
            async with httpx.AsyncClient(timeout=120.0) as client:

                async def big() -> None:
                    resp = await client.post(f"{rig.url}/v1/completions", content=huge)
                    assert resp.status_code == 400  # far over 4096 tokens, after counting
                    order.append("big")

                async def small(i: int) -> None:
                    await asyncio.sleep(0.05)  # let the big one reach the tokenizer first
                    resp = await client.post(
                        f"{rig.url}/v1/completions",
                        json={"model": MODEL, "prompt": f"hi {i}", "max_tokens": 1},
                    )
                    assert resp.status_code == 200
                    order.append("small")

                await asyncio.gather(big(), *(small(i) for i in range(5)))

        runner = threading.Thread(target=asyncio.run, args=(main(),))
        runner.start()
        runner.join(120)
        assert order[-1] == "big"
        assert order.count("small") == 5


# --- a stream whose backend fails before its first byte (issue 8) ------------------------
# The gateway holds the client's headers until the backend's first body byte
# (proxy.first_byte_hold_s), so a backend that fails after its headers but before any
# content can still be replaced: the client has seen nothing.


def test_stream_failing_before_its_first_byte_is_retried_on_another_backend() -> None:
    with gateway_rig(2, routing={"policy": "round_robin"}) as rig:
        a, b = rig.fakes
        a.behaviour.close_after_chunks = 0  # headers, then the connection dies
        a_url = rig.served[0].url
        with openai.OpenAI(base_url=f"{rig.url}/v1", api_key="x", max_retries=0) as client:
            for _ in range(2):  # round robin: one of them goes to a first
                stream = client.completions.create(
                    model=MODEL, prompt="hi", max_tokens=3, stream=True
                )
                assert "".join(c.choices[0].text for c in stream if c.choices) == " tok" * 3
        assert a.generation_requests >= 1
        assert b.generation_requests == 2  # each answer generated once, by b
        text = rig.metrics()
        failures = metric(text, "sal_first_byte_failures_total", backend=a_url, reason="closed")
        assert failures == a.generation_requests
        assert metric(text, "sal_retries_total", backend=a_url) == a.generation_requests
        assert metric(text, "sal_stream_errors_total") is None
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight", backend=a_url) == 0.0)


def test_stream_failing_before_its_first_byte_everywhere_is_a_502() -> None:
    # Nothing was relayed, so the client gets a plain OpenAI-shaped error, not a broken stream.
    with gateway_rig(2) as rig:
        for fake in rig.fakes:
            fake.behaviour.close_after_chunks = 0
        resp = _complete(rig.url, stream=True)
        assert resp.status_code == 502
        assert resp.json()["error"]["type"] == "upstream_error"
        assert sum(f.generation_requests for f in rig.fakes) == 2


def test_without_the_hold_a_stream_failing_before_its_first_byte_is_not_retried() -> None:
    with gateway_rig(2, proxy={"first_byte_hold_s": 0}) as rig:
        for fake in rig.fakes:
            fake.behaviour.close_after_chunks = 0
        resp = _complete(rig.url, stream=True)
        assert resp.status_code == 200  # headers went out at once
        assert b'"upstream_error"' in resp.content
        assert resp.content.endswith(b"data: [DONE]\n\n")
        assert sum(f.generation_requests for f in rig.fakes) == 1


def test_client_leaving_during_the_hold_cancels_the_upstream_request() -> None:
    with gateway_rig(1) as rig:
        fake = rig.fakes[0]
        fake.behaviour.stall_after_chunks = 0  # headers, then silence (a long prefill)
        with pytest.raises(httpx.ReadTimeout):  # no headers yet: the client gives up
            httpx.post(
                f"{rig.url}/v1/completions",
                timeout=0.5,
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True},
            )
        wait_until(lambda: fake.disconnects == 1)
        wait_until(lambda: metric(rig.metrics(), "sal_backend_in_flight") == 0.0)
        text = rig.metrics()
        assert metric(text, "sal_requests_total", status="499") == 1.0
        assert metric(text, "sal_upstream_cancels_total", reason="client_disconnect") == 1.0


def test_a_replica_serving_another_model_gets_no_request_until_it_serves_this_one() -> None:
    """A replica restarted with another ``--served-model-name`` (or a wrong address in the
    config): vLLM answers each request for our model with a 404. The gateway reads that from
    the replica's ``/v1/models`` and stops sending it anything (measured without this: 10 of
    20 round-robin requests answered 404 "The model `tiny` does not exist.")."""
    refresh = {"models": [{"models_refresh_s": 0.2}]}
    with gateway_rig(2, routing={"policy": "round_robin"}, extra=refresh) as rig:
        a, b = rig.fakes
        b_url = rig.served[1].url
        b.model = "other"
        wait_until(lambda: metric(rig.metrics(), "sal_backend_serves_model", backend=b_url) == 0.0)
        answers = [_complete(rig.url) for _ in range(20)]
        assert [r.status_code for r in answers] == [200] * 20
        assert {_answered_by(r) for r in answers} == {"a"}
        assert metric(rig.metrics(), "sal_backend_healthy", backend=b_url) == 0.0
        # Neither serves it: a 503 that says why (the names stay in the gateway's log).
        a.model = "other"
        wait_until(lambda: _complete(rig.url).status_code == 503)
        refused = _complete(rig.url)
        assert "2 of its 2 backends do not serve it" in refused.json()["error"]["message"]
        assert httpx.get(f"{rig.url}/ready", timeout=5.0).status_code == 503
        # Restarted with the right name: routable again within a re-read (every second).
        a.model = b.model = MODEL
        wait_until(lambda: httpx.get(f"{rig.url}/ready", timeout=5.0).status_code == 200)
        assert {_answered_by(_complete(rig.url)) for _ in range(4)} == {"a", "b"}
