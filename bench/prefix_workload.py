"""A seeded multi-turn chat workload of real token ids, and its replay through an HTTP gateway.

Used by `bench.prefix_real` (the gateway in front of real vLLM-on-CPU replicas). Each
conversation starts at a Poisson arrival time; turn k's prompt is the conversation so far
(a system prompt shared by every conversation, then each earlier message and the tokens
the model actually generated for it, from the stream's ``token_ids``) plus a new user
message; between a reply and the next turn the user thinks (exponential). Lengths are drawn
from lognormal distributions (first message median `FIRST_MEDIAN_TOKENS`, later ones
`NEXT_MEDIAN_TOKENS`), scaled down from ShareGPT's shape to the tiny model's 2k context; a
conversation ends after its turns or when the next prompt would not fit.

`replay()` sends every turn as a streaming ``/v1/completions`` with the prompt as token ids,
``max_tokens`` forced (``ignore_eos``), ``return_token_ids`` (vLLM's extension: the reply's ids
feed the next turn) and usage (``prompt_tokens_details.cached_tokens``: what vLLM's prefix
cache served, with ``--enable-prompt-tokens-details``), and records TTFT per turn.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FIRST_MEDIAN_TOKENS = 300
NEXT_MEDIAN_TOKENS = 90
SYSTEM_TOKENS = 128
"""One CPU KV block: the universal first block every conversation shares."""


@dataclass(frozen=True, slots=True)
class Turn:
    message: tuple[int, ...]
    """The new user message's token ids."""
    output_tokens: int
    think_s: float
    """Pause after the previous reply before this turn is sent (0 for the first)."""


@dataclass(frozen=True, slots=True)
class Conversation:
    cid: int
    start_s: float
    turns: tuple[Turn, ...]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def make_workload(
    seed: int,
    conversations: int,
    *,
    rate_per_s: float,
    think_mean_s: float,
    max_turns: int = 6,
    max_model_len: int = 2048,
    max_output: int = 32,
    vocab: int = 2000,
) -> list[Conversation]:
    """`conversations` conversations, deterministic for `seed`. Token ids are drawn from
    ``[10, vocab)`` so they never hit the tiny model's special tokens."""
    rng = random.Random(seed)
    system = tuple(rng.randrange(10, vocab) for _ in range(SYSTEM_TOKENS))
    result = []
    start = 0.0
    for cid in range(conversations):
        start += rng.expovariate(rate_per_s)
        turns = []
        length = len(system)
        for k in range(rng.randint(3, max_turns)):
            median = FIRST_MEDIAN_TOKENS if k == 0 else NEXT_MEDIAN_TOKENS
            n = _lognormal(rng, median, 0.6, 16, 700)
            output = rng.randint(max_output // 2, max_output)
            if length + n + output > max_model_len:
                break
            message = tuple(rng.randrange(10, vocab) for _ in range(n))
            if k == 0:
                message = system + message
            think = 0.0 if k == 0 else rng.expovariate(1.0 / think_mean_s)
            turns.append(Turn(message, output, think))
            length += n + output
        result.append(Conversation(cid, start, tuple(turns)))
    return result


@dataclass(slots=True)
class TurnResult:
    cid: int
    turn: int
    prompt_tokens: int
    prompt: tuple[int, ...] = ()
    ttft_s: float | None = None
    total_s: float | None = None
    cached_tokens: int | None = None
    """vLLM's ``usage.prompt_tokens_details.cached_tokens`` (None when not reported)."""
    error: str = ""


@dataclass(slots=True)
class Replay:
    results: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0


async def _send(
    client: Any, url: str, prompt: list[int], max_tokens: int, r: TurnResult
) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    sent = time.monotonic()
    output: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return output
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error = f"stream error: {str(event['error'])[:200]}"
                return output
            for choice in event.get("choices") or ():
                ids = choice.get("token_ids") or []
                if r.ttft_s is None and (ids or choice.get("text")):
                    r.ttft_s = time.monotonic() - sent
                output.extend(ids)
            usage = event.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                r.cached_tokens = details.get("cached_tokens")
    r.total_s = time.monotonic() - sent
    return output


async def _converse(
    client: Any, urls: Sequence[str], conv: Conversation, t0: float, out: Replay, seed: int
) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.monotonic()))
    rng = random.Random(f"gateway-{seed}-{conv.cid}")
    history: list[int] = []
    for k, turn in enumerate(conv.turns):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        prompt = [*history, *turn.message]
        r = TurnResult(conv.cid, k, len(prompt), tuple(prompt))
        out.results.append(r)
        url = rng.choice(urls)  # each turn to any gateway, as pooled connections spread
        try:
            reply = await _send(client, url, prompt, turn.output_tokens, r)
        except Exception as exc:  # a transport failure ends the conversation, counted
            r.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        if r.error:
            return
        history = [*prompt, *reply]


async def replay(
    url: str | Sequence[str],
    conversations: Sequence[Conversation],
    timeout_s: float,
    *,
    seed: int = 0,
) -> Replay:
    """Run every conversation against the gateway at `url`; each request bounded by
    `timeout_s`. Several URLs (gateways in front of the same replicas): each turn goes to
    one drawn at random (seeded by `seed` and the conversation)."""
    import httpx

    urls = [url] if isinstance(url, str) else list(url)
    out = Replay()
    limits = httpx.Limits(max_connections=len(conversations) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(_converse(client, urls, c, t0, out, seed) for c in conversations))
        out.wall_s = time.monotonic() - t0
    return out
