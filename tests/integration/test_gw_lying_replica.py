"""A replica whose ``/stats`` lies about its queue, against the real gateway process.

Two fake vLLM replicas, each a process of its own, behind the gateway (SAL, polls every
100 ms). Replica a reports an idle engine (no queue) on every poll while each request it gets
waits 1.5 s for its first token, as a replica whose ``/stats`` under-reports would (a bug in a
patch, a snapshot of the wrong engine). Replica b reports an honest, moderately busy queue
(3,000 tokens) and answers at once. Streams of 500-token prompts arrive at 10 per second.

Trusting a's numbers alone, SAL sends a almost every request: at each poll a's queue is 0
and b's 3,000 tokens, and a's tickets are acknowledged by every new snapshot. The gateway
floors a replica's queue by the prompt tokens of its own streams still waiting there for a
first byte (`sal_gateway.state`), so once a few are waiting on a, b gets its share.

A replica can also lie about its per-step token budget, by which SAL divides its queue: one
claiming 10^12 tokens would look idle under any queue. The gateway counts a budget at most
``routing.budget_spread_max`` times the pool's smallest (`sal_gateway.state.cap_budgets`).
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from bench.processes import PortAllocator
from tests.fault_support import fake_procs
from tests.gateway_support import gateway_config, run_gateway_process

pytestmark = pytest.mark.slow

REQUESTS = 30
RATE_PER_S = 10.0
LIAR_FIRST_TOKEN_S = 1.5
PROMPT = "word " * 400  # 2,000 bytes: 500 tokens by the gateway's estimate (no tokenizer)


def _stream(url: str, out: list[tuple[str, float]], lock: threading.Lock) -> None:
    """One streamed completion: (backend that answered, seconds to its first chunk)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30.0) as resp:
        assert resp.status_code == 200, resp.read()
        first: float | None = None
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
        backend = resp.headers.get("x-fake-backend", "?")
    assert first is not None
    with lock:
        out.append((backend, first))


def _wait_both_eligible(url: str) -> None:
    """Until the gateway has polled both replicas and finds them eligible (readiness
    needs only one)."""
    deadline = time.monotonic() + 30.0
    while True:
        ready = httpx.get(f"{url}/ready", timeout=5.0)
        if ready.status_code == 200 and ready.json()["eligible_backends"].get("tiny") == 2:
            return
        assert time.monotonic() < deadline, ready.text
        time.sleep(0.05)


def test_a_replica_that_reports_no_queue_does_not_draw_every_stream(tmp_path: Path) -> None:
    ports = PortAllocator(22300, 22400)
    with ExitStack() as stack:
        liar, honest = stack.enter_context(fake_procs(tmp_path, [ports.take(), ports.take()]))
        liar.fault(first_byte_delay_s=LIAR_FIRST_TOKEN_S, stats={"queued_prefill_tokens": 0})
        honest.fault(stats={"queued_prefill_tokens": 3000, "num_waiting": 2, "num_running": 6})
        config = gateway_config(
            ports.take(),
            [liar.url, honest.url],
            tokenizer=None,
            extra={"log_level": "warning"},
        )
        url, _proc = stack.enter_context(run_gateway_process(config))
        _wait_both_eligible(url)
        answers: list[tuple[str, float]] = []
        lock = threading.Lock()
        senders = []
        for _ in range(REQUESTS):
            sender = threading.Thread(target=_stream, args=(url, answers, lock))
            sender.start()
            senders.append(sender)
            time.sleep(1.0 / RATE_PER_S)
        for sender in senders:
            sender.join(timeout=30.0)
    assert len(answers) == REQUESTS
    by_backend = {name: [t for b, t in answers if b == name] for name in ("a", "b")}
    share_b = len(by_backend["b"]) / REQUESTS
    ttft_p50 = statistics.median(t for _, t in answers)
    print(
        f"\nlying replica: b served {share_b:.0%} of {REQUESTS}, a {len(by_backend['a'])}; "
        f"TTFT p50 {ttft_p50:.2f} s"
    )
    # Trusting a's report, b got at most the few requests that arrived while a's tickets
    # were unacknowledged (measured before the floor: 0 of 30, every TTFT >= 1.5 s).
    assert share_b >= 0.4, answers
    assert ttft_p50 < LIAR_FIRST_TOKEN_S, answers


@pytest.mark.parametrize("spread", [4.0, 0.0], ids=["capped", "uncapped"])
def test_a_replica_that_claims_a_huge_step_budget_does_not_draw_every_request(
    tmp_path: Path, spread: float
) -> None:
    """Replica a reports a deep queue (50,000 tokens) but a per-step budget of 10^12 tokens,
    so its queue divided by its budget is about 0; honest b reports 3,000 queued tokens and
    a budget of 2,048. With ``routing.budget_spread_max`` 4 (the default) a's budget counts
    as 4 x 2,048 at most, its queue as 6 steps against b's 1.5, and every request goes to b;
    with the cap off (0) every request goes to the liar."""
    ports = PortAllocator(22300, 22400)
    with ExitStack() as stack:
        liar, honest = stack.enter_context(fake_procs(tmp_path, [ports.take(), ports.take()]))
        liar.fault(stats={"queued_prefill_tokens": 50_000, "max_num_batched_tokens": 10**12})
        honest.fault(stats={"queued_prefill_tokens": 3000, "max_num_batched_tokens": 2048})
        config = gateway_config(
            ports.take(),
            [liar.url, honest.url],
            tokenizer=None,
            extra={"log_level": "warning", "routing": {"budget_spread_max": spread}},
        )
        url, _proc = stack.enter_context(run_gateway_process(config))
        _wait_both_eligible(url)
        chosen = []
        with httpx.Client(timeout=30.0) as client:
            for _ in range(20):
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
                resp = client.post(f"{url}/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                chosen.append(resp.headers.get("x-fake-backend"))
    assert chosen == ["b" if spread else "a"] * 20, chosen
