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
TRIES = 5


def _stream(url: str, max_tokens: int) -> tuple[float | None, float | None, int]:
    """(seconds to the first comment, seconds to the first data event, comments seen)."""
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first_comment = first_data = None
    comments = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120.0) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            now = time.perf_counter() - start
            if line.startswith(":"):
                comments += 1
                if first_comment is None:
                    first_comment = now
            elif line.startswith("data: {") and first_data is None:
                first_data = now
    return first_comment, first_data, comments


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
    seen: list[tuple[float | None, float | None, int]] = []
    with run_gateway(config) as url:
        for _ in range(TRIES):
            before = scrape_metrics(url)
            blocker = threading.Thread(target=_stream, args=(url, BLOCKER_TOKENS))
            blocker.start()
            time.sleep(0.5)  # the blocker holds the only slot
            first_comment, first_data, comments = _stream(url, 4)
            blocker.join(timeout=120.0)
            after = scrape_metrics(url)
            seen.append((first_comment, first_data, comments))
            if comments and (hold_s > 0 or _comment_well_before_token(first_comment, first_data)):
                break
    # On this CPU-starved box vLLM's API server has, rarely, sent a queued stream's headers
    # only with its first token (no comment at all), or its first comment only shortly before
    # that token (a clean-clone run: 3.45 s and 4.19 s), when a TTFT booked at the comment
    # could not be told from one booked at the token: try again, a few times at most.
    assert comments >= 1, f"vLLM sent no keep-alive comment in {TRIES} tries: {seen}"
    assert first_comment is not None
    assert first_data is not None
    assert first_data > 3.0, "the stream did not queue behind the blocker"
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


def _comment_well_before_token(first_comment: float | None, first_data: float | None) -> bool:
    """Whether the client saw the first keep-alive comment over a second before the first
    token (vLLM sends it 1 s after it has the request), so that where the gateway booked the
    TTFT shows."""
    return (
        first_comment is not None and first_data is not None and (first_comment < first_data - 1.0)
    )
