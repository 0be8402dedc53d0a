"""Prompt token counting per model, matching vLLM 0.32's ``usage.prompt_tokens``.

Built once per model at start-up (`load_model_tokenizer`, offline: a local directory or the
local Hugging Face cache, never the network); the app calls `PromptCounter.count()` once per
request. Rules, mirrored from vLLM 0.32 (`entrypoints/openai/*/protocol.py`,
`renderers/hf.py`, `renderers/chat_utils.py`):

* token-ID prompts (``[int]`` or ``[[int]]``) count as their length;
* completions text is encoded with ``add_special_tokens`` from the request (default **True**,
  so a BOS is counted when the tokenizer adds one);
* chat messages are rendered with the chat template (``tokenize=False``,
  ``add_generation_prompt`` default True, ``continue_final_message``, ``tools``,
  ``chat_template_kwargs`` passed through; a request's own ``chat_template`` is rendered by
  `template_pool` in a killable process, then counted by `count_rendered`), list-of-parts
  content joined with ``"\\n"`` as vLLM's "string" content format does, then encoded with
  ``add_special_tokens`` from the request (default **False**: the template adds BOS);
* batched prompts count each prompt; the request's total is the sum.

Given a block size (`count_sync`'s ``block_size``: the replicas' KV block, when a prefix-cache
source is configured), the count also carries the prompt's chained block keys
(`sal_core.prefix.chain_hashes` over the very token ids vLLM will see), for single-prompt
requests whose ids the gateway knows (not estimated, not truncated).

Without a tokenizer the count is an estimate: ``ceil(utf8_bytes / 4)`` per text prompt and,
for chat, ``ceil(utf8_bytes_of_all_contents / 4) + 4 * messages + 3``; such requests are
flagged (`PromptCount.estimated`) and counted in ``sal_prompt_tokens_estimated_total``.

The gateway counts long prompts in a `body_worker` process (`admission`), never on the
event loop; `count()` with an executor remains for embedding the counter elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sal_core.prefix import chain_hashes
from sal_gateway.errors import BadRequest
from sal_gateway.request_body import Endpoint, InboundRequest

ESTIMATE_BYTES_PER_TOKEN = 4
ESTIMATE_CHAT_TOKENS_PER_MESSAGE = 4
ESTIMATE_CHAT_TOKENS_FIXED = 3
# HF's "no limit" sentinel is ~1e30; anything this large is not a real context length.
_UNSET_MODEL_MAX_LENGTH = 10**9


class TokenizerLoadError(RuntimeError):
    """A configured tokenizer could not be loaded offline."""


@dataclass(frozen=True, slots=True)
class PromptCount:
    """Prompt tokens of one request."""

    per_prompt: tuple[int, ...]
    """One count per prompt (batched completions have several)."""
    estimated: bool
    """True when no tokenizer was available and the documented estimate was used."""
    block_keys: tuple[int, ...] = ()
    """Chained keys of the prompt's full KV blocks (`chain_hashes`), when asked for and
    known (one prompt, token ids known); empty otherwise."""

    @property
    def total(self) -> int:
        return sum(self.per_prompt)


def _content_text(content: object) -> str:
    """vLLM's "string" content format: text parts joined with a newline."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return "\n".join(texts)
    return str(content)


def conversation(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template (contents flattened to text)."""
    result = []
    for msg in messages:
        converted = dict(msg)
        converted["content"] = _content_text(msg.get("content"))
        result.append(converted)
    return result


def text_size(req: InboundRequest) -> int:
    """Characters of prompt text in `req` (what tokenizing it costs grows with)."""
    if req.endpoint is Endpoint.CHAT:
        return sum(len(_content_text(m.get("content"))) for m in req.messages)
    return sum(len(p) for p in req.prompts if isinstance(p, str))


def _utf8_len(text: str) -> int:
    # "replace": lone surrogates (legal in JSON escapes) must not crash the estimate.
    return len(text.encode("utf-8", "replace"))


def estimate(req: InboundRequest) -> PromptCount:
    """The documented estimate used when the model has no tokenizer."""
    if req.endpoint is Endpoint.CHAT:
        n_bytes = sum(_utf8_len(_content_text(m.get("content"))) for m in req.messages)
        tokens = (
            math.ceil(n_bytes / ESTIMATE_BYTES_PER_TOKEN)
            + ESTIMATE_CHAT_TOKENS_PER_MESSAGE * len(req.messages)
            + ESTIMATE_CHAT_TOKENS_FIXED
        )
        return PromptCount((tokens,), estimated=True)
    counts = tuple(
        math.ceil(_utf8_len(p) / ESTIMATE_BYTES_PER_TOKEN) if isinstance(p, str) else len(p)
        for p in req.prompts
    )
    return PromptCount(counts, estimated=any(isinstance(p, str) for p in req.prompts))


class PromptCounter:
    """Counts one model's prompt tokens; wraps a Hugging Face tokenizer (or none)."""

    def __init__(self, hf_tokenizer: Any | None, max_model_len: int | None) -> None:
        self.hf_tokenizer: Any = hf_tokenizer
        self.max_model_len = max_model_len
        # A fast tokenizer's Rust backend gives the same ids as calling the Python wrapper
        # (which only adds padding/tensor options and list conversion around it) at ~1/3 of
        # the CPU time per short prompt: tokenization was ~20% of the gateway's CPU in a
        # py-spy profile.
        # `split_special_tokens` changes the backend's behaviour, so keep the wrapper then.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        fast = bool(getattr(hf_tokenizer, "is_fast", False))
        split = bool(getattr(hf_tokenizer, "split_special_tokens", False))
        self._backend: Any = backend if fast and not split else None

    @property
    def has_tokenizer(self) -> bool:
        return self.hf_tokenizer is not None

    def encode_len(self, text: str, add_special_tokens: bool) -> int:
        """Tokens of `text` (`BadRequest` when it cannot be tokenized)."""
        return len(self.encode_ids(text, add_special_tokens))

    def encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, as vLLM's tokenizer makes them (`BadRequest` when it cannot
        be tokenized)."""
        try:
            if self._backend is not None:
                # `encode_batch`, not `encode`: only the batch call releases the GIL, so a long
                # prompt tokenized in a worker thread does not stall the event loop (and for one
                # short text it costs the same).
                batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
                return list(batch[0].ids)
            ids = self.hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as exc:  # e.g. lone surrogates from JSON escapes: the client's input
            raise BadRequest(_untokenizable(text, exc), param="prompt") from None
        return list(ids)

    @property
    def special_tokens(self) -> dict[str, Any]:
        """The template variables HF adds for special tokens (``bos_token``, ...)."""
        mapping = getattr(self.hf_tokenizer, "special_tokens_map", None) or {}
        return {str(k): v for k, v in mapping.items() if isinstance(v, str)}

    def _render_chat(self, req: InboundRequest) -> str:
        """The model's own template (trusted: configured by the operator) over `req`. A
        request-supplied template is never rendered here (`template_pool` does, if trusted)."""
        body = req.count_body
        extra = body.get("chat_template_kwargs") or {}
        kwargs: dict[str, Any] = {k: v for k, v in extra.items() if k != "chat_template"}
        kwargs["add_generation_prompt"] = body.get("add_generation_prompt", True)
        kwargs["continue_final_message"] = body.get("continue_final_message", False)
        if body.get("documents") is not None:
            kwargs["documents"] = body["documents"]
        tools = body.get("tools")
        try:
            text = self.hf_tokenizer.apply_chat_template(
                conversation(req.messages), tools=tools, tokenize=False, **kwargs
            )
        except Exception as exc:  # the template itself rejects bad input (vLLM answers 400)
            raise BadRequest(
                f"chat template rejected the messages: {str(exc)[:500]}", param="messages"
            ) from None
        return str(text)

    async def count_rendered(
        self, text: str, req: InboundRequest, executor: Executor | None, thread_above_chars: int
    ) -> PromptCount:
        """Count an already rendered chat prompt (a request template's output)."""
        add_special = bool(req.count_body.get("add_special_tokens", False))
        if executor is None or len(text) <= thread_above_chars:
            return PromptCount((self.encode_len(text, add_special),), False)
        loop = asyncio.get_running_loop()
        n = await loop.run_in_executor(executor, self.encode_len, text, add_special)
        return PromptCount((n,), False)

    def count_sync(self, req: InboundRequest, block_size: int | None = None) -> PromptCount:
        """Count `req`'s prompt tokens on the calling thread; with `block_size`, also its
        block keys (see `PromptCount.block_keys`)."""
        if self.hf_tokenizer is None:
            count = estimate(req)
            if block_size is None or count.estimated or len(req.prompts) != 1:
                return count
            ids = req.prompts[0]
            assert not isinstance(ids, str)  # not estimated: token ids
            return PromptCount(count.per_prompt, False, _keys(ids, block_size))
        if req.endpoint is Endpoint.CHAT:
            add_special = bool(req.count_body.get("add_special_tokens", False))
            chat_ids = self.encode_ids(self._render_chat(req), add_special)
            return PromptCount((len(chat_ids),), False, _keys(chat_ids, block_size))
        add_special = bool(req.count_body.get("add_special_tokens", True))
        if block_size is not None and len(req.prompts) == 1:
            prompt = req.prompts[0]
            one = self.encode_ids(prompt, add_special) if isinstance(prompt, str) else prompt
            return PromptCount((len(one),), False, _keys(one, block_size))
        counts = tuple(
            self.encode_len(p, add_special) if isinstance(p, str) else len(p) for p in req.prompts
        )
        return PromptCount(counts, estimated=False)

    async def count(
        self, req: InboundRequest, executor: Executor | None, thread_above_chars: int
    ) -> PromptCount:
        """Count on the loop for short prompts, in `executor` above `thread_above_chars`."""
        if self.hf_tokenizer is None or executor is None or text_size(req) <= thread_above_chars:
            return self.count_sync(req)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self.count_sync, req)


def _keys(ids: list[int], block_size: int | None) -> tuple[int, ...]:
    return () if block_size is None else tuple(chain_hashes(ids, block_size))


def check_length(count: PromptCount, max_tokens: int | None, max_model_len: int | None) -> None:
    """Reject what vLLM 0.32 rejects: a prompt longer than the context, or ``max_tokens``
    larger than the context. (A prompt that fits but leaves less room than ``max_tokens`` is
    not rejected by vLLM: it clamps ``max_tokens``; so the gateway forwards it.)"""
    if max_model_len is None:
        return
    for n in count.per_prompt:
        if n > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt contains {n} input tokens, which exceeds this limit even without any "
                f"output tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
            )
    if max_tokens is not None and max_tokens > max_model_len:
        raise BadRequest(
            f"max_tokens={max_tokens} cannot be greater than the model's maximum context "
            f"length {max_model_len}. Please request fewer output tokens.",
            param="max_tokens",
        )


def _context_len_from_dir(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def load_model_tokenizer(tokenizer: str | None, max_model_len: int | None) -> PromptCounter:
    """Load a model's tokenizer offline (slow: call once at start-up, off the event loop).

    ``max_model_len`` when not configured: the model dir's ``config.json``
    ``max_position_embeddings`` (what vLLM uses), else the tokenizer's ``model_max_length``.
    """
    if tokenizer is None:
        return PromptCounter(None, max_model_len)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, ... here
        raise TokenizerLoadError(
            f"cannot load tokenizer {tokenizer!r} offline (local dir or local HF cache): {exc}"
        ) from exc
    if max_model_len is None:
        max_model_len = _context_len_from_dir(Path(tokenizer))
    if max_model_len is None:
        length = getattr(hf, "model_max_length", None)
        if isinstance(length, int) and 0 < length < _UNSET_MODEL_MAX_LENGTH:
            max_model_len = length
    return PromptCounter(hf, max_model_len)


def _untokenizable(text: str, exc: Exception) -> str:
    """The client's error for a `text` the tokenizer refused with `exc`: where it is not valid
    Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes can carry) the character
    and its position, which the tokenizer library's own message does not say."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return (
            f"the prompt cannot be tokenized: it is not valid Unicode (a lone surrogate, "
            f"U+{ord(text[bad.start]):04X}, at character {bad.start})"
        )
    return f"the prompt cannot be tokenized: {str(exc)[:200]}"
