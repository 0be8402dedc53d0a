"""The gateway's front door over real sockets, in front of fake backends (issue 8).

What a user would notice if it broke: a client-supplied chat template is refused unless the
operator trusts them, and a trusted one that loops forever gets a 400 while the gateway keeps
answering everyone else; malformed template fields are 400s naming the field; API keys are
enforced (OpenAI-shaped 401), never leaked upstream, and the backend key is sent instead;
beyond the concurrency limit clients get 429 + Retry-After; every error (404, 405, 422, 500) is
OpenAI-shaped; every response carries an X-Request-Id, forwarded upstream; a client that
trickles its body is cut with a 408 while others are served.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gw_fake_support import MODEL, Rig, gateway_rig, metric, wait_until

NESTED_LOOP_TEMPLATE = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
)
ECHO_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
CHAT = [{"role": "user", "content": "hello"}]


def _chat(url: str, timeout_s: float = 30.0, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)


def _assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in resp.text
    assert resp.headers.get("x-request-id")
    err: dict[str, Any] = error
    return err


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:
    extra = {"listen": {"body_timeout_s": 1.0}}
    with gateway_rig(2, tokenizer=tiny_model_dir, max_model_len=256, extra=extra) as r:
        yield r


@pytest.fixture(scope="module")
def trusted(tiny_model_dir: Path) -> Iterator[Rig]:
    extra = {
        "models": [{"trust_request_chat_template": True}],
        "limits": {"template_timeout_s": 1.0},
    }
    with gateway_rig(1, tokenizer=tiny_model_dir, max_model_len=256, extra=extra) as r:
        templates = r.runtime.templates
        bodies = r.runtime.bodies
        assert templates is not None
        assert bodies is not None
        # The workers start in the background (importing Jinja, niced: slow on a busy box);
        # the timing checks below start once every worker's start-up burst is over.
        wait_until(lambda: templates.idle_workers == 2, timeout_s=120.0)
        wait_until(lambda: bodies.pool.idle_workers == 2, timeout_s=120.0)
        yield r


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[Rig]:
    extra = {
        "auth": {"api_keys": ["key-one", "key-two"], "backend_api_key": "backend-secret"},
        "limits": {"max_concurrent_requests": 2, "retry_after_s": 7},
    }
    with gateway_rig(1, tokenizer=tiny_model_dir, max_model_len=256, extra=extra) as r:
        yield r


# --- templates and untrusted input -----------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template": ECHO_TEMPLATE},
        {"chat_template_kwargs": {"chat_template": ECHO_TEMPLATE}},
    ],
)
def test_request_template_is_refused_by_default(rig: Rig, fields: dict[str, Any]) -> None:
    before = metric(rig.metrics(), "sal_rejected_requests_total", reason="template") or 0
    error = _assert_openai_error(_chat(rig.url, **fields), 400)
    assert error["param"] == "chat_template"
    assert "trust_request_chat_template" in error["message"]
    assert all(not f.received or "chat_template" not in str(f.received[-1]) for f in rig.fakes)
    after = metric(rig.metrics(), "sal_rejected_requests_total", reason="template")
    assert after == before + 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": 3}}, "chat_template_kwargs.chat_template"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": "f"}]}, "tools"),
        ({"documents": "doc"}, "documents"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"continue_final_message": 1}, "continue_final_message"),
        ({"stream_options": []}, "stream_options"),
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
    ],
)
def test_malformed_template_fields_are_400_naming_the_field(
    rig: Rig, fields: dict[str, Any], param: str
) -> None:
    error = _assert_openai_error(_chat(rig.url, **fields), 400)
    assert error["param"] == param


def test_n_multiplies_the_load_estimate(rig: Rig) -> None:
    seen: list[int] = []
    forward = rig.runtime.forwarder.forward

    def spy(
        inbound: Any, raw: bytes, headers: Any, prompt_tokens: int, *rest: Any, **kw: Any
    ) -> Any:
        seen.append(prompt_tokens)
        return forward(inbound, raw, headers, prompt_tokens, *rest, **kw)

    rig.runtime.forwarder.forward = spy  # type: ignore[method-assign]
    try:
        assert _chat(rig.url).status_code == 200
        assert _chat(rig.url, n=3).status_code == 200
        assert _chat(rig.url, n=2, best_of=4).status_code == 200
    finally:
        rig.runtime.forwarder.forward = forward  # type: ignore[method-assign]
    one = seen[0]
    assert seen == [one, 3 * one, 4 * one]


def test_trusted_request_template_renders(trusted: Rig) -> None:
    resp = _chat(trusted.url, chat_template=ECHO_TEMPLATE)
    assert resp.status_code == 200, resp.text
    assert trusted.fakes[0].received[-1]["chat_template"] == ECHO_TEMPLATE


def test_runaway_trusted_template_is_cut_while_the_gateway_keeps_serving(trusted: Rig) -> None:
    assert _chat(trusted.url, chat_template=ECHO_TEMPLATE).status_code == 200  # workers up
    templates = trusted.runtime.templates
    assert templates is not None
    kills = templates.kills
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = pool.submit(_chat, trusted.url, 60.0, chat_template=NESTED_LOOP_TEMPLATE)
        health_answers = 0
        while not pending.done():
            # A frozen loop would time these out: they must keep answering during the render.
            assert httpx.get(f"{trusted.url}/health", timeout=2.0).status_code == 200
            health_answers += 1
            time.sleep(0.05)
        resp = pending.result()
        elapsed_s = time.monotonic() - start
    error = _assert_openai_error(resp, 400)
    assert error["param"] == "chat_template"
    assert "1 s budget" in error["message"]
    assert health_answers >= 3
    assert elapsed_s < 20.0  # the budget is 1 s; generous bound against a hang
    assert templates.kills == kills + 1
    # The killed worker is replaced: trusted templates keep working.
    resp = _chat(trusted.url, 60.0, chat_template=ECHO_TEMPLATE)
    assert resp.status_code == 200, resp.text


def test_template_that_raises_is_a_400(trusted: Rig) -> None:
    error = _assert_openai_error(
        _chat(trusted.url, chat_template="{{ raise_exception('no system role') }}"), 400
    )
    assert "no system role" in error["message"]


# --- keys and limits ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", "key-one", "Basic key-one", "Bearer key-one-x"]
)
def test_missing_or_wrong_key_is_401(keyed: Rig, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    resp = httpx.post(
        f"{keyed.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers=headers,
    )
    error = _assert_openai_error(resp, 401)
    assert error["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{keyed.url}/v1/models", headers=headers).status_code == 401


def test_open_paths_need_no_key(keyed: Rig) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 200


def test_client_key_stays_here_and_backend_key_goes_upstream(keyed: Rig) -> None:
    before = metric(keyed.metrics(), "sal_rejected_requests_total", reason="unauthorized") or 0
    httpx.get(f"{keyed.url}/v1/models")
    for key in ("key-one", "key-two"):
        resp = httpx.post(
            f"{keyed.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert resp.status_code == 200, resp.text
        assert keyed.fakes[0].last_headers["authorization"] == "Bearer backend-secret"
    after = metric(keyed.metrics(), "sal_rejected_requests_total", reason="unauthorized")
    assert after == before + 1


def test_over_the_concurrency_limit_is_429_with_retry_after(keyed: Rig) -> None:
    fake = keyed.fakes[0]
    fake.behaviour.first_byte_delay_s = 2.0
    base = fake.generation_requests
    auth = {"Authorization": "Bearer key-one"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "stream": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = [
                pool.submit(
                    httpx.post, f"{keyed.url}/v1/completions", json=body, headers=auth, timeout=30
                )
                for _ in range(2)
            ]
            wait_until(lambda: fake.generation_requests >= base + 2 or all(f.done() for f in slow))
            resp = httpx.post(f"{keyed.url}/v1/completions", json=body, headers=auth)
            error = _assert_openai_error(resp, 429)
            assert resp.headers["retry-after"] == "7"
            assert error["code"] == "rate_limit_exceeded"
            assert [f.result().status_code for f in slow] == [200, 200]
    finally:
        fake.behaviour.first_byte_delay_s = 0.0
    # The slots are free again once those streams ended.
    assert httpx.post(f"{keyed.url}/v1/completions", json=body, headers=auth).status_code == 200
    assert metric(keyed.metrics(), "sal_rejected_requests_total", reason="over_limit") == 1


# --- errors and request ids ----------------------------------------------------------------


def test_unknown_path_and_wrong_method_are_openai_shaped(rig: Rig) -> None:
    error = _assert_openai_error(httpx.post(f"{rig.url}/v1/nope", json={}), 404)
    assert "/v1/nope" in error["message"]
    resp = httpx.get(f"{rig.url}/v1/chat/completions")
    error = _assert_openai_error(resp, 405)
    assert "POST" in resp.headers["allow"]
    _assert_openai_error(httpx.delete(f"{rig.url}/health"), 405)


def test_framework_validation_errors_are_openai_shaped(rig: Rig) -> None:
    async def typed(x: int) -> dict[str, int]:
        return {"x": x}

    rig.gateway.app.add_api_route("/test-only/typed", typed, methods=["GET"])
    error = _assert_openai_error(httpx.get(f"{rig.url}/test-only/typed?x=abc"), 422)
    assert error["param"] == "query.x"


def test_internal_error_is_500_with_the_logged_request_id(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    forward = rig.runtime.forwarder.forward

    def broken(*args: Any) -> Any:
        raise RuntimeError("secret internal detail")

    rig.runtime.forwarder.forward = broken  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.ERROR, logger="sal_gateway.app"):
            resp = httpx.post(f"{rig.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    finally:
        rig.runtime.forwarder.forward = forward  # type: ignore[method-assign]
    error = _assert_openai_error(resp, 500)
    rid = resp.headers["x-request-id"]
    assert rid in error["message"]
    assert "secret internal detail" not in resp.text
    assert any(rid in r.getMessage() for r in caplog.records)


def test_request_id_is_echoed_generated_and_forwarded(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    resp = httpx.post(f"{rig.url}/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
    assert resp.headers["x-request-id"] == "abc-1"
    answered = next(f for f in rig.fakes if f.name == resp.json()["backend"])
    assert answered.last_headers["x-request-id"] == "abc-1"
    generated = httpx.post(f"{rig.url}/v1/completions", json=body).headers["x-request-id"]
    for bad in ("x" * 500, "has space", "bad\u00e9"):
        rid = httpx.post(
            f"{rig.url}/v1/completions", json=body, headers={"X-Request-Id": bad.encode()}
        ).headers["x-request-id"]
        assert rid != bad
        assert rid.isalnum()
    assert generated
    assert httpx.get(f"{rig.url}/health").headers["x-request-id"]
    assert _assert_openai_error(httpx.get(f"{rig.url}/nope"), 404)


def test_slow_body_is_cut_with_408_others_unaffected(rig: Rig) -> None:
    before = metric(rig.metrics(), "sal_rejected_requests_total", reason="body_timeout") or 0
    with socket.create_connection(("127.0.0.1", rig.gateway.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        start = time.monotonic()
        # Meanwhile other clients are served normally.
        assert httpx.get(f"{rig.url}/health", timeout=2.0).status_code == 200
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        elapsed_s = time.monotonic() - start
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(payload)["error"]["code"] == 408
    assert elapsed_s < 10.0  # body_timeout_s is 1: cut, not left hanging
    after = metric(rig.metrics(), "sal_rejected_requests_total", reason="body_timeout")
    assert after == before + 1
