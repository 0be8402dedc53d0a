"""Block keys of an HTTP request's prompt(s), for the emulator's prefix cache (pure).

The emulator (`engine_sim.generation`) hands each engine request the chained keys of its
full blocks (`sal_core.prefix.chain_hashes`), from the tokens it can see:

* token-ID prompts (``"prompt": [1, 2, ...]``): the ids themselves, exactly as vLLM hashes them;
* text prompts with a tokenizer directory: the tokenizer's ids (the same ``add_special_tokens``
  rule the count uses);
* otherwise (text without a tokenizer, and chat messages): pseudo-tokens of 4 UTF-8 bytes
  each, from the text or from the messages' JSON, matching the documented count estimate
  (``ceil(utf8_bytes / 4)``). Two prompts then share blocks exactly when they share a
  byte prefix, which is what a multi-turn conversation does.

Called once per HTTP request, before the prompt reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from sal_core.prefix import chain_hashes
from sal_gateway.request_body import Endpoint, InboundRequest

_BYTES_PER_PSEUDO_TOKEN = 4


def pseudo_token_ids(text: str) -> list[int]:
    """One id per 4 UTF-8 bytes of `text` (the last group may be shorter)."""
    data = text.encode("utf-8", "surrogatepass")
    step = _BYTES_PER_PSEUDO_TOKEN
    return [int.from_bytes(data[i : i + step], "little") for i in range(0, len(data), step)]


def prompt_block_keys(
    req: InboundRequest, tokenizer: Any | None, block_size: int
) -> list[list[int]]:
    """Block keys of each prompt of `req` (one list per engine request)."""
    if req.endpoint is Endpoint.CHAT:
        text = json.dumps(list(req.messages), separators=(",", ":"), sort_keys=True)
        return [chain_hashes(pseudo_token_ids(text), block_size)]
    add_special = bool(req.count_body.get("add_special_tokens", True))
    out: list[list[int]] = []
    for prompt in req.prompts:
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
        elif tokenizer is not None:
            ids = list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
        else:
            ids = pseudo_token_ids(prompt)
        out.append(chain_hashes(ids, block_size))
    return out
