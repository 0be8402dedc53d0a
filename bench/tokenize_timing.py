"""Time the gateway's prompt counting (`sal_gateway.tokenizer`) on the tiny model's tokenizer.

Inputs: a ~1k-token completions prompt, a ~10k-token one (to show how it scales), a token-ID
prompt (no tokenizer work) and a chat request of four messages rendered through the chat
template. Each is parsed once with `parse_body` and then counted ``reps`` times with
`PromptCounter.count_sync` on the calling thread, i.e. the CPU time one request costs the
gateway, whichever thread pays it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sal_core.percentile import percentile
from sal_gateway.request_body import Endpoint, InboundRequest, parse_body
from sal_gateway.tokenizer import PromptCounter, load_model_tokenizer


@dataclass(frozen=True)
class TokenizeTiming:
    """Wall time of counting one request's prompt tokens."""

    name: str
    tokens: int
    reps: int
    p50_ms: float
    p99_ms: float


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "the",
        "token",
        "request",
        "gpu",
        "cache",
        "hello",
        "world",
        "prompt",
        "kalo",
        "minesa",
        "vozu",
        "orel",
        "tirusa",
        "x7",
        "42",
        "and",
        "of",
        "a",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _words_per_token(counter: PromptCounter) -> float:
    """How many generated words make one token with this tokenizer (measured on 2,000 words)."""
    n_words = 2000
    req = _request({"model": "tiny", "prompt": _words(n_words, 0)}, Endpoint.COMPLETIONS)
    return n_words / max(1, counter.count_sync(req).total)


def _text_of_tokens(counter: PromptCounter, target_tokens: int, seed: int) -> str:
    """Text whose completions-prompt count is close to ``target_tokens``."""
    return _words(max(1, round(target_tokens * _words_per_token(counter))), seed)


def _request(body: Mapping[str, object], endpoint: Endpoint) -> InboundRequest:
    return parse_body(json.dumps(body).encode(), endpoint)


def _time(counter: PromptCounter, name: str, req: InboundRequest, reps: int) -> TokenizeTiming:
    tokens = counter.count_sync(req).total  # warm-up, and the count to report
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        counter.count_sync(req)
        samples.append(time.perf_counter() - start)
    return TokenizeTiming(
        name=name,
        tokens=tokens,
        reps=reps,
        p50_ms=percentile(samples, 50) * 1e3,
        p99_ms=percentile(samples, 99) * 1e3,
    )


def time_tokenization(model_dir: Path, reps: int) -> list[TokenizeTiming]:
    """Time the four inputs described in the module docstring, ``reps`` counts each."""
    counter = load_model_tokenizer(str(model_dir), None)
    prompt_1k = _text_of_tokens(counter, 1000, seed=1)
    prompt_10k = _text_of_tokens(counter, 10_000, seed=2)
    chat = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " + _words(40, 3)},
            {"role": "user", "content": _words(120, 4)},
            {"role": "assistant", "content": _words(80, 5)},
            {"role": "user", "content": _words(60, 6)},
        ],
    }
    ids_prompt = {"model": "tiny", "prompt": list(range(3, 1003))}
    return [
        _time(
            counter,
            "completions text ~1k tokens",
            _request({"model": "tiny", "prompt": prompt_1k}, Endpoint.COMPLETIONS),
            reps,
        ),
        _time(
            counter,
            "completions text ~10k tokens",
            _request({"model": "tiny", "prompt": prompt_10k}, Endpoint.COMPLETIONS),
            max(1, reps // 5),
        ),
        _time(
            counter, "completions token IDs (1k)", _request(ids_prompt, Endpoint.COMPLETIONS), reps
        ),
        _time(counter, "chat, 4 messages (template + encode)", _request(chat, Endpoint.CHAT), reps),
    ]
