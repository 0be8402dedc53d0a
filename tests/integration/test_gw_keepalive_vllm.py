"""vLLM's SSE keep-alive comments before a stream's first token, through the gateway.

One real vLLM-on-CPU replica (the tiny model) started with ``--sse-keep-alive-interval 1``
and ``--max-num-seqs 1``, so a second stream waits in its queue behind a long first one and
vLLM sends it ``: keep-alive`` comments until its first token. What a user would notice if it
broke: the gateway's ``sal_ttft_seconds`` (and its books: the prompt stays queued there) would
end at the first comment instead of the first token, and the client's stream would not carry
the comments through.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway_support import free_port, gateway_config, metric, run_gateway, scrape_metrics
from tests.vllm_support import run_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
BLOCKER_TOKENS = 2000
"""Output tokens of the stream that holds the only sequence slot (~5 s on CPU; with its
prompt within the replica's 2,048-token context)."""
TRIES = 8


@dataclass
class StreamTimes:
    """When one stream's lines reached the client, in seconds after `sent`."""

    sent: float
    """`time.perf_counter()` when the request was sent."""
    first_comment: float | None = None
    first_data: float | None = None
    last_data: float | None = None
    comments: int = 0

    def data_ended_at(self) -> float | None:
        """`time.perf_counter()` of the last data event (None if there was none)."""
        return None if self.last_data is None else self.sent + self.last_data


def _stream(url: str, max_tokens: int, out: list[StreamTimes] | None = None) -> StreamTimes:
    """Stream a completion through `url` and time its lines (also appended to `out`)."""
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    times = StreamTimes(sent=time.perf_counter())
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120.0) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            now = time.perf_counter() - times.sent
            if line.startswith(":"):
                times.comments += 1
                if times.first_comment is None:
                    times.first_comment = now
            elif line.startswith("data: {"):
                if times.first_data is None:
                    times.first_data = now
                times.last_data = now
    if out is not None:
        out.append(times)
    return times


def _queued_behind(queued: StreamTimes, blocker: StreamTimes) -> bool:
    """Whether `queued` waited in vLLM's queue for the blocker: the blocker was still sending
    tokens for over a second after `queued` was sent (time for a keep-alive comment), and
    `queued`'s first token came only at the blocker's end (0.5 s for the two connections'
    relays to differ)."""
    blocker_end = blocker.data_ended_at()
    if blocker_end is None or queued.first_data is None:
        return False
    return blocker_end > queued.sent + 1.0 and queued.sent + queued.first_data >= blocker_end - 0.5


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path) -> Iterator[str]:
    extra = (
        "--served-model-name", MODEL, "--sse-keep-alive-interval", "1", "--max-num-seqs", "1",
    )  # fmt: skip
    with run_replica(
        tiny_model_dir, free_port(19950, 20000), scheduler="fcfs", extra_args=extra
    ) as url:
        yield url


@pytest.mark.parametrize("hold_s", [0.0, 10.0])
def test_ttft_of_a_queued_stream_runs_to_its_first_token_past_keep_alive_comments(
    replica: str, tiny_model_dir: Path, hold_s: float
) -> None:
    """`proxy.first_byte_hold_s` 0: the headers and each comment go out as they come; 10 s
    (the default): the headers wait for the first token, and the comments go with it (a
    replica that dies before then is replaced: `test_gw_timeouts.py`)."""
    config = gateway_config(
        free_port(19900, 19950),
        [replica],
        tokenizer=tiny_model_dir,
        extra={"proxy": {"first_byte_hold_s": hold_s}},
    )
    seen: list[str] = []
    with run_gateway(config) as url:
        for _ in range(TRIES):
            before = scrape_metrics(url)
            blockers: list[StreamTimes] = []
            blocker = threading.Thread(target=_stream, args=(url, BLOCKER_TOKENS, blockers))
            blocker.start()
            time.sleep(0.5)  # the blocker holds the only slot
            queued = _stream(url, 4)
            blocker.join(timeout=120.0)
            after = scrape_metrics(url)
            assert blockers, "the blocker's stream did not end"
            queued_ok = _queued_behind(queued, blockers[0])
            seen.append(f"{queued} behind {blockers[0]}: queued {queued_ok}")
            if queued.comments and queued_ok and (hold_s > 0 or _comment_well_before_token(queued)):
                break
    # On this CPU-starved box vLLM's API server has, rarely, sent a queued stream's headers
    # only with its first token (no comment at all), or its first comment only shortly before
    # that token (a clean-clone run: 3.45 s and 4.19 s), when a TTFT booked at the comment
    # could not be told from one booked at the token; and on a quiet box the blocker has
    # ended before the queued stream had waited long enough to show anything (first token at
    # 2.8 s in a CI run), or vLLM has started the blocker only after the queued stream (a
    # clean-clone run where 3 of 5 tries went so and 2 got no comment): try again, 8 times
    # at most.
    assert queued.comments >= 1, f"vLLM sent no keep-alive comment in {TRIES} tries: {seen}"
    assert _queued_behind(queued, blockers[0]), f"no stream queued behind the blocker: {seen}"
    first_comment, first_data = queued.first_comment, queued.first_data
    assert first_comment is not None
    assert first_data is not None
    count = metric(after, "sal_ttft_seconds_count", model=MODEL)
    assert count - metric(before, "sal_ttft_seconds_count", model=MODEL) == 2.0
    # The two streams' TTFTs on the gateway's clock (which starts later than the client's:
    # up to 1.4 s on this busy box); the blocker's is short.
    total = metric(after, "sal_ttft_seconds_sum", model=MODEL)
    total -= metric(before, "sal_ttft_seconds_sum", model=MODEL)
    if hold_s == 0.0:
        # Relayed as they came, before the first token; vLLM sends its first comment 1 s
        # after it has the request, so the queued stream's TTFT is at least the time from
        # that comment to the first token, plus most of that second (counting the first
        # comment had booked about 1 s).
        assert first_comment < first_data - 1.0, (first_comment, first_data)
        assert total >= first_data - first_comment + 0.5, (total, first_comment, first_data)
    else:  # held with the headers until the first token, then relayed with it
        assert first_comment >= first_data - 0.2, (first_comment, first_data)


def _comment_well_before_token(times: StreamTimes) -> bool:
    """Whether the client saw the first keep-alive comment over a second before the first
    token (vLLM sends it 1 s after it has the request), so that where the gateway booked the
    TTFT shows."""
    first_comment, first_data = times.first_comment, times.first_data
    return first_comment is not None and first_data is not None and first_comment < first_data - 1.0
