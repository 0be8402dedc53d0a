"""Workloads with prefix structure: Mooncake traces, multi-turn chat, one hot prefix (pure
apart from the two file loaders).

A request's prefix structure is a `TokenBlocks`: ids of consecutive chunks of its token
stream, where an id names the *whole prefix* up to and including its chunk (the Mooncake
traces' ``hash_ids`` semantics: two requests share the KV of chunk i exactly when their ids
at i are equal). `TokenBlocks.keys` turns it into chained keys of the engine's full KV blocks
(vLLM's granularity, e.g. 16 tokens), which the engine model's prefix cache and the
simulated router's `sal_core.prefix.PrefixIndex` both use. Reuse is known only at the
chunk granularity: Mooncake's 512-token blocks; the generators here use 16.

* `load_mooncake()` reads a Mooncake FAST'25 trace (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks), with its own bursty timestamps,
  optionally clipped to a context limit (prompt first, as `engine_sim.trace.clip_lengths`;
  the ids of clipped tokens are dropped) and cut to a window.
* `multi_turn_chat()` generates conversations: each turn's prompt is the conversation so far
  (earlier messages and answers) plus a new message; message and answer lengths are drawn
  from the ShareGPT statistics (`load_sharegpt_lengths`); turns arrive a think time apart.
* `hot_prefix()` generates independent requests that all start with one long shared prefix
  (the "cache-miss death spiral" check).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_sim.trace import TraceError, TraceRequest, clip_lengths

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces (their README)."""

GENERATOR_CHUNK_TOKENS = 16
"""Chunk size of the generated workloads (vLLM's default block size: exact reuse)."""

# Tags of the generators' chunk ids: hashes of int tuples are the same in every process
# (str hashes are salted per process), so a seed gives the same ids, routes and results in a
# benchmark's worker processes as in the parent. Conversations use (conversation, chunk).
_SYSTEM, _HOT, _OWN = -1, -2, -3


@dataclass(frozen=True, slots=True)
class TokenBlocks:
    """The prefix structure of the first `num_tokens` tokens of a request's token stream."""

    chunk_ids: Sequence[int]
    """Id per chunk of `chunk_tokens` tokens (the last may be partial); equal ids at
    position i mean equal tokens from the start through chunk i."""
    chunk_tokens: int
    num_tokens: int
    """Tokens covered: the prompt, or prompt and output where a later prompt repeats the
    output (multi-turn chat)."""

    def keys(self, block_size: int) -> list[int]:
        """Chained keys of every full `block_size`-token block of the covered tokens.

        `block_size` must divide `chunk_tokens`: an engine block then lies inside one chunk
        and is named by ``(chunk id, block's place in the chunk)``, which names its whole
        prefix because the chunk id does."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise TraceError(
                f"block size {block_size} must divide the trace's chunk of {self.chunk_tokens}"
            )
        per_chunk = self.chunk_tokens // block_size
        ids = self.chunk_ids
        n = min(self.num_tokens // block_size, len(ids) * per_chunk)
        if per_chunk == 1:
            return [hash((ids[b], 0)) for b in range(n)]
        return [hash((ids[b // per_chunk], b % per_chunk)) for b in range(n)]

    @property
    def first_chunk(self) -> int | None:
        """Id of the first chunk (what `prefix_affinity` hashes without a session)."""
        return self.chunk_ids[0] if self.chunk_ids else None


# --- Mooncake ------------------------------------------------------------------------------


def load_mooncake(
    path: str | Path,
    *,
    context_limit_tokens: int | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace into requests sorted by arrival, with `TokenBlocks`.

    `start_s`/`duration_s` keep ``[start_s, start_s + duration_s)`` of the trace, shifted to
    start at 0. With `context_limit_tokens` each request is clipped by `clip_lengths`.
    `TraceError` names the line of a malformed record."""
    rows: list[TraceRequest] = []
    with Path(path).open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts_s = float(rec["timestamp"]) / 1000.0
                prompt = max(1, int(rec["input_length"]))
                output = max(1, int(rec["output_length"]))
                ids = tuple(int(h) for h in rec["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{line_no}: bad record: {exc}") from None
            if context_limit_tokens is not None:
                prompt, output = clip_lengths(prompt, output, context_limit_tokens)
            kept = -(-prompt // MOONCAKE_BLOCK_TOKENS)
            blocks = TokenBlocks(ids[:kept], MOONCAKE_BLOCK_TOKENS, prompt)
            rows.append(TraceRequest(ts_s, prompt, output, blocks))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r.arrival_s)
    t0 = rows[0].arrival_s + start_s
    end = float("inf") if duration_s is None else t0 + duration_s
    out = [
        TraceRequest(r.arrival_s - t0, r.prompt_tokens, r.output_tokens, r.blocks)
        for r in rows
        if t0 <= r.arrival_s < end
    ]
    if not out:
        raise TraceError(f"{path}: no requests in the window start={start_s}s dur={duration_s}s")
    return out


# --- ShareGPT lengths and multi-turn chat ------------------------------------------------------


def load_sharegpt_lengths(path: str | Path) -> list[tuple[int, int]]:
    """``(prompt_tokens, output_tokens)`` per row of the ShareGPT statistics CSV
    (``num_prefill_tokens,num_decode_tokens,...``); `TraceError` on a malformed file."""
    out: list[tuple[int, int]] = []
    with Path(path).open() as f:
        header = f.readline().strip().split(",")
        try:
            ip, io = header.index("num_prefill_tokens"), header.index("num_decode_tokens")
        except ValueError:
            raise TraceError(f"{path}: expected num_prefill_tokens,num_decode_tokens") from None
        for line_no, line in enumerate(f, start=2):
            cells = line.strip().split(",")
            try:
                out.append((max(1, int(cells[ip])), max(1, int(cells[io]))))
            except (IndexError, ValueError):
                raise TraceError(f"{path}:{line_no}: bad row {line.strip()!r}") from None
    if not out:
        raise TraceError(f"{path}: no rows")
    return out


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """Shape of the multi-turn chat workload (`multi_turn_chat`)."""

    conversations: int
    rate_per_s: float
    """New conversations per second (Poisson); the load factor multiplies it."""
    think_time_s: tuple[float, float] = (5.0, 120.0)
    """A turn arrives uniformly this long after the previous turn *arrived* (the user's
    reading and typing plus the answer's generation; open loop)."""
    turns: tuple[int, int] = (2, 8)
    """Turns per conversation, uniform, inclusive (fewer if the context fills up)."""
    context_limit_tokens: int = 131_072
    """A conversation ends before a turn whose prompt + answer would not fit."""
    message_scale: float = 1.0
    """Multiplies the ShareGPT prompt length drawn for each new message."""
    system_prompt_tokens: int = 0
    """Tokens every conversation starts with (one shared system prompt)."""


def multi_turn_chat(
    spec: ChatSpec, lengths: Sequence[tuple[int, int]], seed: int
) -> list[TraceRequest]:
    """Requests of `spec.conversations` conversations, sorted by arrival (seeded).

    Turn t's prompt = system prompt + messages and answers of turns < t + message t; its
    answer's tokens are part of the next prompt, so its blocks cover prompt and answer.
    Each new message/answer pair takes the lengths of a random ShareGPT row (the message
    scaled by `message_scale`)."""
    if spec.conversations < 1 or not spec.rate_per_s > 0:
        raise TraceError("need at least one conversation and a rate > 0")
    lo, hi = spec.think_time_s
    if not 0 <= lo <= hi:
        raise TraceError(f"bad think time range {spec.think_time_s}")
    rng = random.Random(seed)
    system = [hash((_SYSTEM, i)) for i in range(-(-spec.system_prompt_tokens // 16))]
    out: list[TraceRequest] = []
    start_s = 0.0
    for conv in range(spec.conversations):
        start_s += rng.expovariate(spec.rate_per_s)
        out.extend(_conversation(spec, lengths, rng, conv, start_s, system))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _conversation(
    spec: ChatSpec,
    lengths: Sequence[tuple[int, int]],
    rng: random.Random,
    conv: int,
    start_s: float,
    system: list[int],
) -> list[TraceRequest]:
    turns = rng.randint(*spec.turns)
    pairs = [rng.choice(lengths) for _ in range(turns)]
    context = spec.system_prompt_tokens
    total = context + sum(max(1, round(m * spec.message_scale)) + a for m, a in pairs)
    n_chunks = -(-total // GENERATOR_CHUNK_TOKENS)
    # One id list per conversation, shared by its turns; the system prompt's chunks are
    # shared by every conversation (its last chunk only if it is full).
    full_system = spec.system_prompt_tokens // GENERATOR_CHUNK_TOKENS
    ids = system[:full_system] + [
        hash((conv, i)) for i in range(full_system, max(full_system, n_chunks))
    ]
    session = f"conv-{conv}"
    out: list[TraceRequest] = []
    arrival_s = start_s
    for turn, (message, answer) in enumerate(pairs):
        prompt = context + max(1, round(message * spec.message_scale))
        if prompt + answer > spec.context_limit_tokens:
            break
        if turn:
            arrival_s += rng.uniform(*spec.think_time_s)
        blocks = TokenBlocks(ids, GENERATOR_CHUNK_TOKENS, prompt + answer)
        out.append(TraceRequest(arrival_s, prompt, answer, blocks, session))
        context = prompt + answer
    return out


def hot_prefix(
    n: int,
    rate_per_s: float,
    prefix_tokens: int,
    suffix_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int,
) -> list[TraceRequest]:
    """`n` independent requests (Poisson arrivals, seeded), each `prefix_tokens` of one
    shared document followed by its own suffix; no sessions."""
    if n < 1 or not rate_per_s > 0 or prefix_tokens < 0:
        raise TraceError("need n >= 1, rate > 0, prefix >= 0")
    rng = random.Random(seed)
    shared = [hash((_HOT, i)) for i in range(prefix_tokens // GENERATOR_CHUNK_TOKENS)]
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        prompt = prefix_tokens + rng.randint(*suffix_tokens)
        n_chunks = -(-prompt // GENERATOR_CHUNK_TOKENS)
        ids = shared + [hash((_OWN, i, c)) for c in range(len(shared), n_chunks)]
        blocks = TokenBlocks(ids, GENERATOR_CHUNK_TOKENS, prompt)
        out.append(TraceRequest(t, prompt, rng.randint(*output_tokens), blocks))
    return out
