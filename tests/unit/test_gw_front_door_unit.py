"""Pure pieces of the front door: template-field validation, keys, request ids, lag math.

What a user would notice if it broke: a malformed field reaches the chat template and the
client gets a 500 instead of a 400 naming the field; a wrong key is accepted, or a key from
the file or environment is ignored; a hostile request id ends up in logs and upstream headers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.fuzz_bench import lag_quantile
from sal_gateway.auth import AuthConfigError, KeyChecker, backend_key, is_loopback, load_keys
from sal_gateway.config import AuthConfig, ConfigError, build_config
from sal_gateway.errors import BadRequest, TooManyRequests, Unauthorized, error_body
from sal_gateway.front_door import sanitize_request_id
from sal_gateway.request_body import Endpoint, parse_body

CHAT = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": CHAT, **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"chat_template": 7}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": ["x"]}}, "chat_template_kwargs.chat_template"),
        ({"tools": "f"}, "tools"),
        ({"tools": [1]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools"),
        ({"documents": {"title": "t"}}, "documents"),
        ({"documents": ["t"]}, "documents"),
        ({"add_generation_prompt": 1}, "add_generation_prompt"),
        ({"continue_final_message": "no"}, "continue_final_message"),
        ({"add_special_tokens": "no"}, "add_special_tokens"),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"stream_options": "usage"}, "stream_options"),
        ({"n": True}, "n"),
        ({"n": 17}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": 1}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": {"id": 1}}]}, "messages"),
    ],
)
def test_template_facing_fields_are_checked(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_body(_chat(**fields), Endpoint.CHAT)
    assert exc.value.status == 400
    assert exc.value.param == param


def test_error_messages_do_not_echo_megabytes() -> None:
    with pytest.raises(BadRequest) as exc:
        parse_body(_chat(stream="x" * 1_000_000), Endpoint.CHAT)
    assert len(exc.value.message) < 200
    with pytest.raises(BadRequest) as exc:
        parse_body(_chat(n=[1] * 100_000), Endpoint.CHAT)
    assert len(exc.value.message) < 200


def test_huge_integers_and_bad_encodings_are_400() -> None:
    for raw in (b'{"model": "m", "prompt": ' + b"9" * 5000 + b"}", b"\xff\xfe{}"):
        with pytest.raises(BadRequest, match="not valid JSON"):
            parse_body(raw, Endpoint.COMPLETIONS)


def test_valid_requests_pass_and_carry_fan_out_and_template() -> None:
    ok = parse_body(
        _chat(
            n=2,
            best_of=5,
            tools=[{"type": "function", "function": {"name": "f"}}],
            documents=[{"title": "t", "text": "x"}],
            chat_template_kwargs={"enable_thinking": False},
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            ],
        ),
        Endpoint.CHAT,
    )
    assert ok.fan_out == 5
    assert ok.chat_template is None
    templated = parse_body(_chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}), Endpoint.CHAT)
    assert templated.chat_template == "{{ 1 }}"
    assert parse_body(_chat(chat_template="{{ 2 }}"), Endpoint.CHAT).chat_template == "{{ 2 }}"
    big = b'{"model": "m", "prompt": [' + b"1," * 100_000 + b'1], "n": 3}'
    parsed = parse_body(big, Endpoint.COMPLETIONS)
    assert parsed.fan_out == 3
    assert len(parsed.prompts[0]) == 100_001


def test_keys_from_config_file_and_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nfile-key  # with a comment\n\n  other  \n")
    auth = AuthConfig(api_keys=("cfg",), api_keys_file=str(keys), api_keys_env="MY_KEYS")
    assert load_keys(auth, {"MY_KEYS": "env-1, env-2 cfg"}) == (
        "cfg", "file-key", "other", "env-1", "env-2",
    )  # fmt: skip
    assert load_keys(AuthConfig(), {}) == ()
    with pytest.raises(AuthConfigError, match="nope"):
        load_keys(AuthConfig(api_keys_file=str(tmp_path / "nope")), {})


def test_backend_key_precedence(tmp_path: Path) -> None:
    path = tmp_path / "backend"
    path.write_text("# vLLM --api-key\nfrom-file\n")
    env = {"SAL_GATEWAY_BACKEND_API_KEY": "from-env"}
    assert backend_key(AuthConfig(backend_api_key="cfg"), env) == "cfg"
    assert backend_key(AuthConfig(backend_api_key_file=str(path)), env) == "from-file"
    assert backend_key(AuthConfig(), env) == "from-env"
    assert backend_key(AuthConfig(), {}) is None


def test_key_checker() -> None:
    checker = KeyChecker(["k1", "k2"])
    assert checker.accepts(b"Bearer k1")
    assert checker.accepts(b"bearer  k2 ")
    for bad in (None, b"", b"k1", b"Bearer", b"Bearer k3", b"Basic k1", b"Bearer k1k1"):
        assert not checker.accepts(bad)
    assert KeyChecker([]).accepts(None)
    assert not KeyChecker([]).enabled


def test_loopback() -> None:
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("example.com")


def test_request_ids_are_sanitized() -> None:
    assert sanitize_request_id(b"abc-123_X.y") == "abc-123_X.y"
    for bad in (None, b"", b"a" * 129, b"has space", b"tab\t", b"\xc3\xa9", b"nl\n"):
        assert sanitize_request_id(bad) is None


def test_error_shapes() -> None:
    unauthorized = Unauthorized("no key")
    assert error_body(unauthorized)["error"]["code"] == "invalid_api_key"
    assert unauthorized.headers == {"WWW-Authenticate": "Bearer"}
    busy = TooManyRequests("busy", 3)
    assert busy.status == 429
    assert busy.headers == {"Retry-After": "3"}


def test_config_sections_and_defaults() -> None:
    base: dict[str, Any] = {"models": [{"name": "m", "backends": ["http://h:1"]}]}
    config = build_config(base)
    assert config.listen.header_timeout_s == 10.0
    assert config.listen.body_timeout_s == 30.0
    assert config.limits.max_concurrent_requests == 1024
    assert config.limits.max_n == 16
    assert config.limits.template_timeout_s == 2.0
    assert config.auth.open_paths == ("/health", "/ready", "/metrics")
    assert config.models[0].trust_request_chat_template is False
    for bad, where in (
        ({"limits": {"max_n": 0}}, "limits.max_n"),
        ({"limits": {"template_timeout_s": 0}}, "limits.template_timeout_s"),
        ({"limits": {"max_concurrent_requests": -1}}, "limits.max_concurrent_requests"),
        ({"auth": {"api_keys": "k"}}, "auth.api_keys"),
        ({"auth": {"open_paths": ["health"]}}, "auth.open_paths[0]"),
        ({"auth": {"api_key": ["k"]}}, "auth.api_key"),
        ({"listen": {"header_timeout_s": -1}}, "listen.header_timeout_s"),
        (
            {
                "models": [
                    {"name": "m", "backends": ["http://h:1"], "trust_request_chat_template": 1}
                ]
            },
            "trust_request_chat_template",
        ),
    ):
        with pytest.raises(ConfigError, match=where.replace("[", r"\[").replace(".", r"\.")):
            build_config({**base, **bad})


def test_lag_quantile_from_cumulative_buckets() -> None:
    inf = float("inf")
    before = {0.001: 10.0, 0.01: 10.0, 0.1: 10.0, inf: 10.0}
    after = {0.001: 100.0, 0.01: 109.0, 0.1: 110.0, inf: 110.0}
    assert lag_quantile(before, after, 0.5) == 0.001
    assert lag_quantile(before, after, 0.99) == 0.01
    assert lag_quantile(before, after, 1.0) == 0.1
