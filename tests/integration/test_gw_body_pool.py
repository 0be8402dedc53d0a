"""Large bodies decoded and counted in worker processes (`body_pool`), over real processes.

What a user would notice if it broke: a large request gets a different prompt count (so a
different route or a wrong context-length 400) when handled by a worker than inline; the
bytes reaching the backend differ from what the client sent; a worker killed from outside
leaves requests hanging or failing for good; a flood of large bodies grows the gateway's
memory instead of being refused with a 429 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sal_gateway.api_body import parse_api_body
from sal_gateway.body_pool import BodyPool
from sal_gateway.endpoints import ENDPOINTS
from sal_gateway.errors import TooManyRequests
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import load_model_tokenizer
from sal_gateway.worker_proc import WORKER_NICENESS
from tests.gw_fake_support import MODEL, Rig, gateway_rig, wait_until

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"word{i % 89} of a long prompt" for i in range(4000))


def _models(tiny_model_dir: Path) -> list[dict[str, object]]:
    return [{"name": MODEL, "tokenizer": str(tiny_model_dir), "max_model_len": None}]


async def _ready(pool: BodyPool, n: int) -> None:
    # The workers import transformers: slow on a busy box.
    for _ in range(2400):
        if pool.pool.idle_workers >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the body workers did not start within 120 s")


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:
    with gateway_rig(1, tokenizer=tiny_model_dir, max_model_len=1_000_000) as r:
        bodies = r.runtime.bodies
        assert bodies is not None
        wait_until(lambda: bodies.pool.idle_workers == 2, timeout_s=120.0)
        yield r


def test_large_body_is_counted_as_inline_and_forwarded_untouched(
    rig: Rig, tiny_model_dir: Path
) -> None:
    # Compact separators: a re-encoding (Python's default adds spaces) would show.
    body = {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 2, "stream": True}
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) > 64 * 1024  # beyond the inline decode limit: a worker's job
    counter = load_model_tokenizer(str(tiny_model_dir), None)
    expected = counter.count_sync(parse_body(raw, Endpoint.COMPLETIONS)).total
    seen: list[tuple[bytes, int]] = []
    forward = rig.runtime.forwarder.forward

    def spy(inbound: Any, raw: bytes, headers: Any, prompt_tokens: int, **kw: Any) -> Any:
        seen.append((raw, prompt_tokens))
        return forward(inbound, raw, headers, prompt_tokens, **kw)

    rig.runtime.forwarder.forward = spy  # type: ignore[method-assign]
    try:
        resp = httpx.post(
            f"{rig.url}/v1/completions",
            content=raw,
            headers={"Content-Type": "application/json"},
            timeout=60.0,
        )
    finally:
        rig.runtime.forwarder.forward = forward  # type: ignore[method-assign]
    assert resp.status_code == 200, resp.text
    assert seen == [(raw, expected)]  # the client's own bytes, the inline path's count
    # The stream still had usage requested on the client's behalf (spliced into its bytes).
    assert rig.fakes[0].received[-1]["stream_options"]["include_usage"] is True


def test_large_responses_body_is_counted_as_inline_with_its_api_fields(
    rig: Rig, tiny_model_dir: Path
) -> None:
    # The Responses API through a worker: counted through the chat template like the inline
    # path, streamed without an injected ``stream_options`` (vLLM's Responses API has none).
    body = {"model": MODEL, "input": LONG_TEXT, "instructions": "be brief", "stream": True}
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) > 64 * 1024
    responses = next(e for e in ENDPOINTS if e.path == "/v1/responses")
    inline = parse_api_body(raw, responses, default_model=MODEL)
    expected = load_model_tokenizer(str(tiny_model_dir), None).count_sync(inline).total
    seen: list[tuple[Any, int]] = []
    forward = rig.runtime.forwarder.forward

    def spy(inbound: Any, raw: bytes, headers: Any, prompt_tokens: int, **kw: Any) -> Any:
        seen.append((inbound, prompt_tokens))
        return forward(inbound, raw, headers, prompt_tokens, **kw)

    rig.runtime.forwarder.forward = spy  # type: ignore[method-assign]
    try:
        resp = httpx.post(
            f"{rig.url}/v1/responses",
            content=raw,
            headers={"Content-Type": "application/json"},
            timeout=60.0,
        )
    finally:
        rig.runtime.forwarder.forward = forward  # type: ignore[method-assign]
    assert resp.status_code == 200, resp.text
    [(inbound, tokens)] = seen
    assert tokens == expected > 0
    assert inbound.upstream_path == "/v1/responses"
    assert inbound.counted
    assert not inbound.ask_stream_usage
    assert "stream_options" not in rig.fakes[0].received[-1]


def test_large_invalid_body_is_a_400_naming_the_field(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": "many"}
    resp = httpx.post(f"{rig.url}/v1/completions", json=body, timeout=60.0)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "max_tokens"


def test_killed_worker_is_replaced_and_the_request_served(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        pool = BodyPool(_models(tiny_model_dir), size=1, max_waiting=4, retry_after_s=3)
        pool.start()
        try:
            await _ready(pool, 1)
            (pid,) = pool.pool.pids
            os.kill(pid, signal.SIGKILL)
            raw = json.dumps({"model": MODEL, "prompt": LONG_TEXT}).encode()
            _, count, forwarded = await pool.admit(raw, Endpoint.COMPLETIONS, 16)
            assert count is not None
            assert count.total > 1000
            assert forwarded is raw
            assert pool.pool.replaced == 1
            assert pool.pool.pids
            assert pool.pool.pids != [pid]
        finally:
            await pool.aclose()

    asyncio.run(scenario())


def test_beyond_the_waiting_bound_large_bodies_get_429(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        pool = BodyPool(_models(tiny_model_dir), size=1, max_waiting=1, retry_after_s=3)
        pool.start()
        try:
            await _ready(pool, 1)
            raw = json.dumps({"model": MODEL, "prompt": LONG_TEXT * 20}).encode()
            jobs = [
                asyncio.create_task(pool.admit(raw, Endpoint.COMPLETIONS, 16)) for _ in range(3)
            ]
            results = await asyncio.gather(*jobs, return_exceptions=True)
            refused = [r for r in results if isinstance(r, TooManyRequests)]
            # One runs, one waits, the third is refused at once.
            assert len(refused) == 1, results
            assert refused[0].status == 429
            assert refused[0].headers["Retry-After"] == "3"
            assert sum(isinstance(r, tuple) for r in results) == 2
        finally:
            await pool.aclose()

    asyncio.run(scenario())


def test_not_ready_while_no_request_worker_is_up(tiny_model_dir: Path) -> None:
    # A load balancer must not send traffic to a gateway whose request workers are still
    # loading the tokenizers: a large request would wait seconds for them.
    extra = {"limits": {"body_workers": 1}}
    with gateway_rig(1, tokenizer=tiny_model_dir, max_model_len=1_000_000, extra=extra) as rig:
        bodies = rig.runtime.bodies
        assert bodies is not None
        ready = httpx.get(f"{rig.url}/ready", timeout=10.0)
        assert ready.status_code == 200
        assert ready.json()["workers_ready"] is True
        (pid,) = bodies.pool.pids
        os.kill(pid, signal.SIGKILL)
        raw = json.dumps({"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 1}).encode()
        answers: list[httpx.Response] = []

        def large_request() -> None:
            answers.append(httpx.post(f"{rig.url}/v1/completions", content=raw, timeout=120.0))

        sender = threading.Thread(target=large_request)
        sender.start()
        # The request finds the worker dead, and waits for its replacement: meanwhile the
        # gateway says it is not ready, and why.
        seen: list[dict[str, Any]] = []
        while sender.is_alive():
            answer = httpx.get(f"{rig.url}/ready", timeout=10.0)
            if answer.status_code == 503:
                seen.append(answer.json())
            time.sleep(0.02)
        sender.join()
        assert seen, "/ready never said 503 while the only request worker was replaced"
        assert all(s["workers_ready"] is False and s["ready"] is False for s in seen)
        assert answers[0].status_code == 200
        assert bodies.pool.replaced == 1
        after = httpx.get(f"{rig.url}/ready", timeout=10.0)
        assert after.status_code == 200
        assert after.json()["workers_ready"] is True


def test_request_workers_run_exactly_ten_nicer_than_the_gateway(tiny_model_dir: Path) -> None:
    # Nicer, so the event loop (every client) gets the CPU before one large body; not at 19,
    # where any busy neighbour (a vLLM engine on the same host) starves the workers for
    # seconds. Each replaced worker gets the same.
    async def scenario() -> None:
        pool = BodyPool(_models(tiny_model_dir), size=1, max_waiting=4, retry_after_s=3)
        pool.start()
        try:
            await _ready(pool, 1)
            mine = os.getpriority(os.PRIO_PROCESS, 0)
            (pid,) = pool.pool.pids
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + WORKER_NICENESS)
            os.kill(pid, signal.SIGKILL)
            raw = json.dumps({"model": MODEL, "prompt": LONG_TEXT}).encode()
            await pool.admit(raw, Endpoint.COMPLETIONS, 16)
            (replacement,) = pool.pool.pids
            assert replacement != pid
            await asyncio.sleep(1.0)  # past the replacement's start-up
            assert os.getpriority(os.PRIO_PROCESS, replacement) == min(19, mine + WORKER_NICENESS)
        finally:
            await pool.aclose()

    asyncio.run(scenario())
