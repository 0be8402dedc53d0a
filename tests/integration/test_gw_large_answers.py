"""Non-streamed answers too large to hold, through the real gateway process.

A fake vLLM replica (a process of its own) answers non-streamed completions with bodies of
tens of MB, as vLLM does for long outputs with logprobs or a large embeddings batch. The
gateway reads an answer whole only up to `sal_gateway.relay.BUFFERED_BODY_BYTES`; a larger
one is passed through as it arrives. What a user would notice if it broke: the gateway's
memory growing by the size of every large answer in flight (an OOM kill takes the whole
fleet's front door down), a large answer altered or its usage not counted, a replica that
dies while sending one leaving the client with a body that looks complete, or a client that
goes away leaving the replica generating.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from bench.processes import PortAllocator
from sal_gateway.relay import BUFFERED_BODY_BYTES
from tests.fault_support import FakeProc, fake_procs, wait_for
from tests.gateway_support import gateway_config, metric, run_gateway_process, scrape_metrics

pytestmark = pytest.mark.slow

TOKENS = 12_500_000
"""Output tokens of a large answer: the fake writes 4 bytes per token, 50 MB."""


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _body(max_tokens: int, user: str = "-") -> dict[str, object]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens, "user": user}


class Rig:
    def __init__(self, url: str, pid: int, fake: FakeProc) -> None:
        self.url, self.pid, self.fake = url, pid, fake


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    ports = PortAllocator(22600, 22700)
    with ExitStack() as stack:
        (fake,) = stack.enter_context(fake_procs(tmp_path, [ports.take()]))
        config = gateway_config(
            ports.take(), [fake.url], tokenizer=None, extra={"log_level": "warning"}
        )
        url, proc = stack.enter_context(run_gateway_process(config))
        yield Rig(url, proc.pid, fake)


def test_large_answers_pass_through_whole_in_bounded_memory(rig: Rig) -> None:
    assert TOKENS * 4 > 10 * BUFFERED_BODY_BYTES
    before_kib = _peak_rss_kib(rig.pid)
    answers: list[bytes] = []
    lock = threading.Lock()

    def one() -> None:
        resp = httpx.post(f"{rig.url}/v1/completions", json=_body(TOKENS), timeout=120.0)
        assert resp.status_code == 200
        with lock:
            answers.append(resp.content)

    clients = [threading.Thread(target=one) for _ in range(2)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=120.0)
    grown_mib = (_peak_rss_kib(rig.pid) - before_kib) / 1024
    print(f"\ngateway peak RSS grew {grown_mib:.0f} MiB relaying 2 x {TOKENS * 4 / 1e6:.0f} MB")
    assert len(answers) == 2
    for raw in answers:
        answer = json.loads(raw)  # whole and well-formed
        assert answer["choices"][0]["text"] == " tok" * TOKENS
        assert answer["usage"]["completion_tokens"] == TOKENS
    # Each answer held whole cost ~2x its size (measured before: +398 MiB for 2 x 100 MB).
    assert grown_mib < 40, grown_mib
    samples = scrape_metrics(rig.url)
    assert metric(samples, "sal_output_tokens_total") == 2 * TOKENS  # usage read from the tail


def test_a_replica_dying_while_sending_a_large_answer_leaves_no_complete_looking_body(
    rig: Rig,
) -> None:
    rig.fake.fault(close_after_chunks=8)  # 8 MB sent, then the replica's connection drops
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{rig.url}/v1/completions", json=_body(TOKENS), timeout=60.0)
    samples = scrape_metrics(rig.url)
    assert metric(samples, "sal_stream_errors_total") == 1.0
    rig.fake.fault(close_after_chunks=None)
    small = httpx.post(f"{rig.url}/v1/completions", json=_body(4), timeout=30.0)
    assert small.status_code == 200
    assert small.json()["usage"]["completion_tokens"] == 4


def test_a_client_leaving_a_large_answer_stops_the_replica(rig: Rig) -> None:
    rig.fake.fault(chunk_delay_s=0.2)  # 50 pieces of 1 MB over 10 s
    with httpx.stream(
        "POST", f"{rig.url}/v1/completions", json=_body(TOKENS, user="leaver"), timeout=60.0
    ) as resp:
        assert resp.status_code == 200
        received = 0
        for chunk in resp.iter_bytes():
            received += len(chunk)
            if received > 2 * BUFFERED_BODY_BYTES:
                break  # the client goes away mid-answer
    wait_for(lambda: rig.fake.records()[("abort", "leaver")] == 1, 10.0, "the replica's abort")
    samples = scrape_metrics(rig.url)
    assert metric(samples, "sal_upstream_cancels_total", reason="client_disconnect") == 1.0
    assert metric(samples, "sal_requests_total", status="499") == 1.0
