"""The fuzz benchmark's control flood (``sal-bench fuzz --benign``).

What a user would notice if it broke: the control run, which tells what a flood of requests
costs well-formed latency apart from what hostile content costs, would itself carry
malformed requests (and so measure hostility again), or a different number of them.
"""

from __future__ import annotations

from bench.fuzz_bench import benign_requests
from bench.hostile import Models
from sal_gateway.request_body import Endpoint, parse_body


def test_benign_flood_is_n_well_formed_completions() -> None:
    flood = list(benign_requests(200, Models()))
    assert len(flood) == 200
    for item in flood:
        assert item.well_formed
        head, _, body = item.data.partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/completions HTTP/1.1")
        inbound = parse_body(body, Endpoint.COMPLETIONS)
        assert inbound.model == Models().plain
        assert inbound.max_tokens == 2
