"""Prompt token counting (vLLM 0.32 rules) and the context-length check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sal_gateway.errors import BadRequest
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import (
    PromptCount,
    PromptCounter,
    TokenizerLoadError,
    check_length,
    conversation,
    estimate,
    load_model_tokenizer,
)


def _req(endpoint: Endpoint, **body: Any) -> Any:
    return parse_body(json.dumps({"model": "tiny", **body}).encode(), endpoint)


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path) -> PromptCounter:
    return load_model_tokenizer(str(tiny_model_dir), None)


def test_max_model_len_comes_from_model_dir(counter: PromptCounter) -> None:
    assert counter.max_model_len == 4096


def test_text_prompt_counts_bos_like_vllm_completions(counter: PromptCounter) -> None:
    hf = counter.hf_tokenizer
    text = "hello world, the token cache of a gpu"
    with_bos = len(hf(text)["input_ids"])
    assert counter.count_sync(_req(Endpoint.COMPLETIONS, prompt=text)).per_prompt == (with_bos,)
    without = _req(Endpoint.COMPLETIONS, prompt=text, add_special_tokens=False)
    assert counter.count_sync(without).total == with_bos - 1


def test_token_id_prompts_count_as_their_length(counter: PromptCounter) -> None:
    single = counter.count_sync(_req(Endpoint.COMPLETIONS, prompt=[5, 17, 99, 300]))
    assert single == PromptCount((4,), estimated=False)
    batched = counter.count_sync(_req(Endpoint.COMPLETIONS, prompt=[[5, 6, 7], [8, 9]]))
    assert batched.per_prompt == (3, 2)
    assert batched.total == 5


def test_batched_text_prompts_count_each(counter: PromptCounter) -> None:
    prompts = ["hello world", "a much longer prompt about the request cache"]
    count = counter.count_sync(_req(Endpoint.COMPLETIONS, prompt=prompts))
    hf = counter.hf_tokenizer
    assert count.per_prompt == tuple(len(hf(p)["input_ids"]) for p in prompts)


def test_chat_renders_template_without_extra_bos(counter: PromptCounter) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        },
    ]
    hf = counter.hf_tokenizer
    rendered = hf.apply_chat_template(
        conversation(messages), tokenize=False, add_generation_prompt=True
    )
    assert "hello\nworld" in rendered  # list-of-parts content joined with a newline
    expected = len(hf(rendered, add_special_tokens=False)["input_ids"])
    assert rendered.startswith("<s>")  # the template adds BOS; vLLM does not add another
    assert counter.count_sync(_req(Endpoint.CHAT, messages=messages)).total == expected
    no_prompt = _req(Endpoint.CHAT, messages=messages, add_generation_prompt=False)
    assert counter.count_sync(no_prompt).total < expected


def test_estimate_without_tokenizer_is_flagged() -> None:
    plain = PromptCounter(None, None)
    count = plain.count_sync(_req(Endpoint.COMPLETIONS, prompt="x" * 40))
    assert count == PromptCount((10,), estimated=True)
    ids = plain.count_sync(_req(Endpoint.COMPLETIONS, prompt=[1, 2, 3]))
    assert ids == PromptCount((3,), estimated=False)  # token IDs need no tokenizer
    surrogate = plain.count_sync(_req(Endpoint.COMPLETIONS, prompt="a\ud800b"))
    assert surrogate == PromptCount((1,), estimated=True)
    chat = estimate(_req(Endpoint.CHAT, messages=[{"role": "user", "content": "y" * 8}]))
    assert chat == PromptCount((2 + 4 + 3,), estimated=True)


async def test_long_prompt_is_counted_in_the_executor(counter: PromptCounter) -> None:
    from concurrent.futures import ThreadPoolExecutor

    req = _req(Endpoint.COMPLETIONS, prompt="hello world " * 1000)
    with ThreadPoolExecutor(1) as pool:
        threaded = await counter.count(req, pool, thread_above_chars=100)
    assert threaded == counter.count_sync(req)


def test_check_length_mirrors_vllm() -> None:
    check_length(PromptCount((100,), False), max_tokens=50, max_model_len=128)
    # prompt + max_tokens over the context is clamped by vLLM, not rejected
    check_length(PromptCount((100,), False), max_tokens=100, max_model_len=128)
    check_length(PromptCount((128,), False), max_tokens=None, max_model_len=128)
    with pytest.raises(BadRequest, match="maximum context length is 128") as exc:
        check_length(PromptCount((10, 129), False), max_tokens=None, max_model_len=128)
    assert exc.value.status == 400
    with pytest.raises(BadRequest, match="max_tokens=200"):
        check_length(PromptCount((1,), False), max_tokens=200, max_model_len=128)
    check_length(PromptCount((10**6,), False), max_tokens=None, max_model_len=None)


def test_missing_tokenizer_dir_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="offline"):
        load_model_tokenizer(str(tmp_path / "absent"), None)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_fast_backend_path_counts_like_the_transformers_wrapper(
    counter: PromptCounter, add_special_tokens: bool
) -> None:
    """The gateway encodes with the Rust backend directly; it must agree with the wrapper
    (what vLLM calls) on awkward text: unicode, whitespace runs, special-token strings."""
    hf = counter.hf_tokenizer
    texts = [
        "",
        " ",
        "plain words of a prompt",
        "  leading and trailing  \n\n\t spaces ",
        "ünïcödé — 漢字 and emoji 🚀🚀",
        "<s> literal special tokens </s> inside <|user|> text",
        "x" * 5000,
    ]
    for text in texts:
        expected = len(hf(text, add_special_tokens=add_special_tokens)["input_ids"])
        req = _req(Endpoint.COMPLETIONS, prompt=text, add_special_tokens=add_special_tokens)
        assert counter.count_sync(req).total == expected, text
