"""Hostile HTTP requests for the fuzz tier and ``sal-bench fuzz`` (deterministic per seed).

`hostile_requests(seed, n, ...)` yields `Hostile` raw HTTP/1.1 requests (bytes, each on its
own connection with ``Connection: close``) of many kinds: broken JSON structure, wrong types
in every field the gateway reads, sizes up to the body limit and over it, bad encodings
(invalid UTF-8, lone surrogates, UTF-16, NUL), odd methods and paths, request chat templates
(refused, runaway, raising, escaping the sandbox) and odd headers (huge, many, bad
``Content-Length``, chunked garbage, bad request ids and keys). About one in twenty is a
well-formed request (``well_formed``), which must succeed. `send_raw()` sends one and returns
the response's status (None: the connection closed without an answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 10 * 1024 * 1024
NESTED_LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


@dataclass(frozen=True, slots=True)
class Hostile:
    """One raw request and what kind of hostility it carries."""

    kind: str
    data: bytes
    well_formed: bool = False


@dataclass(frozen=True, slots=True)
class Models:
    """Model names served by the gateway under test."""

    plain: str = "tiny"
    """Request templates refused (the default)."""
    trusted: str = "tiny-trusted"
    """Request templates trusted (rendered in the killable worker)."""


def http(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    content_length: str | None = None,
) -> bytes:
    """A raw request; `content_length` overrides the true length (None: the true one)."""
    lines = [f"{method} {path} HTTP/1.1".encode("latin-1", "replace"), b"Host: 127.0.0.1"]
    hdrs = {"Connection": "close", "Content-Type": "application/json"}
    hdrs.update(headers or {})
    if "Transfer-Encoding" not in hdrs:
        hdrs["Content-Length"] = str(len(body)) if content_length is None else content_length
    lines.extend(f"{k}: {v}".encode("latin-1", "replace") for k, v in hdrs.items())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _post(path: str, obj: Any, headers: dict[str, str] | None = None) -> bytes:
    return http("POST", path, json.dumps(obj).encode(), headers)


_CHAT = "/v1/chat/completions"
_COMP = "/v1/completions"
_WEIRD: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, -1e308, 1e308, 2**63, -(2**63), "", "x", "\u0000",
    [], [1], [[]], {}, {"a": 1}, [None], ["x", 1], [{"role": "user"}],
)  # fmt: skip
_COMMON_FIELDS = (
    "model", "max_tokens", "stream", "n", "best_of", "add_special_tokens", "stream_options",
    "temperature", "logprobs", "stop", "seed",
)  # fmt: skip
_CHAT_FIELDS = (
    *_COMMON_FIELDS, "messages", "max_completion_tokens", "chat_template",
    "chat_template_kwargs", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tool_choice", "response_format",
)  # fmt: skip
_COMPLETION_FIELDS = (*_COMMON_FIELDS, "prompt", "echo")
"""Fields of each endpoint (a field of the other endpoint is ignored by vLLM, and our fake
backend, standing in for vLLM, does not validate them)."""


_WEIGHTS = {"sizes": 0.3}
"""Relative frequency of each kind (default 1): the large bodies are a few per hundred."""


class Generator:
    """The kinds of hostile request, each a method; `next()` draws one."""

    def __init__(self, seed: int, models: Models) -> None:
        self.rng = random.Random(seed)
        self.m = models
        self._big_cache: dict[str, bytes] = {}
        self.kinds: list[tuple[str, Callable[[], Hostile]]] = [
            (name[5:], getattr(self, name))
            for name in sorted(dir(self))
            if name.startswith("kind_")
        ]

    def next(self) -> Hostile:
        if self.rng.random() < 0.05:
            return self.well_formed()
        weights = [_WEIGHTS.get(name, 1.0) for name, _ in self.kinds]
        name, make = self.rng.choices(self.kinds, weights)[0]
        hostile = make()
        return Hostile(name, hostile.data, hostile.well_formed)

    def _text(self, n: int) -> str:
        return "".join(self.rng.choices(string.printable, k=n))

    def well_formed(self) -> Hostile:
        i = self.rng.randrange(1_000_000)
        if self.rng.random() < 0.5:
            body: dict[str, Any] = {"model": self.m.plain, "prompt": f"hi {i}", "max_tokens": 2}
            return Hostile("well_formed", _post(_COMP, body), well_formed=True)
        msgs = [{"role": "user", "content": f"hi {i}"}]
        body = {"model": self.m.plain, "messages": msgs, "max_tokens": 2}
        return Hostile("well_formed", _post(_CHAT, body), well_formed=True)

    # --- structure ---------------------------------------------------------------------
    def kind_structure(self) -> Hostile:
        choices: list[bytes] = [
            b"", b"{", b"}", b"null", b"[]", b"[1,2]", b'"str"', b"1e999", b"NaN", b"-Infinity",
            b'{"model": "tiny", "prompt": "x"', b'{"model": "tiny",,}', b"{'model': 'tiny'}",
            b"[" * self.rng.randrange(10, 50_000), b'{"a":' * 2000 + b"1" + b"}" * 2000,
            b'{"model": "tiny", "prompt": ' + b"9" * 5000 + b"}",
            b'{"model": "tiny", "model": 3, "prompt": "x"}',
        ]  # fmt: skip
        return Hostile("", http("POST", self.rng.choice((_CHAT, _COMP)), self.rng.choice(choices)))

    def kind_types(self) -> Hostile:
        chat = self.rng.random() < 0.5
        body: dict[str, Any] = {"model": self.m.plain, "max_tokens": 2}
        if chat:
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = "hi"
        fields = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
        for _ in range(self.rng.randrange(1, 4)):
            body[self.rng.choice(fields)] = self.rng.choice(_WEIRD)
        return Hostile("", _post(_CHAT if chat else _COMP, body))

    def kind_messages(self) -> Hostile:
        part: Any = self.rng.choice(
            (
                {"type": "text", "text": self.rng.choice(_WEIRD)},
                {"type": self.rng.choice(_WEIRD)},
                {"type": "image_url", "image_url": {"url": "data:,x"}},
                self.rng.choice(_WEIRD),
            )
        )
        msg: dict[str, Any] = {"role": self.rng.choice(("user", "system", "tool", "", 5, None))}
        msg[self.rng.choice(("content", "name", "tool_calls", "tool_call_id"))] = self.rng.choice(
            ([part], [part, part], self.rng.choice(_WEIRD))
        )
        n = self.rng.choice((1, 2, 100))
        body = {"model": self.m.plain, "messages": [msg] * n, "max_tokens": 2}
        return Hostile("", _post(_CHAT, body))

    # --- sizes -------------------------------------------------------------------------
    def _big(self, name: str, make: Callable[[], bytes]) -> bytes:
        if name not in self._big_cache:
            self._big_cache[name] = make()
        return self._big_cache[name]

    def kind_sizes(self) -> Hostile:
        which = self.rng.randrange(6)
        if which == 0:  # a long prompt (tokenized in a thread)
            n = self.rng.choice((10_000, 100_000, 400_000))
            body: Any = {"model": self.m.plain, "prompt": self._text(n), "max_tokens": 1}
            return Hostile("", _post(_COMP, body))
        if which == 1:  # many messages
            msgs = [{"role": "user", "content": "x"}] * self.rng.choice((1000, 20_000))
            return Hostile("", _post(_CHAT, {"model": self.m.plain, "messages": msgs}))
        if which == 2:  # just under the body limit: decoded off the loop
            data = self._big(
                "near-limit",
                lambda: json.dumps(
                    {"model": self.m.plain, "prompt": [1] * (MAX_BODY_BYTES // 3 - 100)}
                ).encode(),
            )
            return Hostile("", http("POST", _COMP, data))
        if which == 3:  # over the limit (declared)
            return Hostile("", http("POST", _COMP, b"{}", content_length=str(MAX_BODY_BYTES + 1)))
        if which == 4:  # over the limit (actual, chunked)
            chunk = b"x" * 65536
            data = (
                b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(170)) + b"0\r\n\r\n"
            )
            return Hostile("", http("POST", _COMP, data, {"Transfer-Encoding": "chunked"}))
        numbers = {"model": self.m.plain, "prompt": [[2**31] * 1000] * 50, "max_tokens": 10**18}
        return Hostile("", _post(_COMP, numbers))

    # --- encodings ---------------------------------------------------------------------
    def kind_encodings(self) -> Hostile:
        choices = [
            b'{"model": "tiny", "prompt": "\xff\xfe\x80"}',
            b'{"model": "tiny", "prompt": "\\ud800"}',
            b'{"model": "tiny", "prompt": "\\udfff\\ud800x", "max_tokens": 1}',
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
            '{"model": "tiny", "prompt": "x"}'.encode("utf-16"),
            b'\xef\xbb\xbf{"model": "tiny", "prompt": "x", "max_tokens": 1}',
            b'{"model": "tiny\x00", "prompt": "x"}',
            b'{"model": "tiny", "prompt": "\x00\x01\x02"}',
            b'{"model": "\xc0\xaf", "prompt": "x"}',
        ]
        path = self.rng.choice((_CHAT, _COMP))
        headers = self.rng.choice(
            ({}, {"Content-Encoding": "gzip"}, {"Content-Type": "text/plain; charset=utf-16"})
        )
        return Hostile("", http("POST", path, self.rng.choice(choices), headers))

    # --- methods and paths -------------------------------------------------------------
    def kind_methods(self) -> Hostile:
        method = self.rng.choice(
            ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "CONNECT", "FOO",
             "get", "P\x00ST", "POST POST")
        )  # fmt: skip
        path = self.rng.choice((_CHAT, _COMP, "/health", "/metrics", "/v1/models", "/"))
        return Hostile("", http(method, path, b'{"model": "tiny"}'))

    def kind_paths(self) -> Hostile:
        path = self.rng.choice(
            (
                "/v1/" + self._text(self.rng.choice((5, 500, 7000))).replace(" ", "%20"),
                "/%ff%fe", "/..%2f..%2fetc/passwd", "/v1/completions/", "//v1//completions",
                "/v1/completions?x=" + "a" * 10000, "/v1/chat/completions#frag", "*",
                "http://evil/v1/completions", "/v1/completions;x", "/\u00e9\u4e2d",
            )
        )  # fmt: skip
        method = self.rng.choice(("GET", "POST"))
        return Hostile("", http(method, path, b'{"model": "tiny", "prompt": "x"}'))

    # --- templates ---------------------------------------------------------------------
    def kind_templates(self) -> Hostile:
        template = self.rng.choice(
            (
                "{{ messages[0].content }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
                NESTED_LOOP, "{{ raise_exception('nope') }}", "{{ ''.__class__.__mro__ }}",
                "{% for x in range(99999) %}{{ 'x' * 99999 }}{% endfor %}", "{{", "{% if %}",
                "{{ cycler.__init__.__globals__ }}", "{{ messages|tojson }}" * 100,
            )
        )  # fmt: skip
        # Runaway templates cost a worker its full budget: keep them rare, as in a real attack
        # they would be one client among many.
        if template == NESTED_LOOP and self.rng.random() < 0.8:
            template = "{{ messages|length }}"
        model = self.rng.choice((self.m.plain, self.m.trusted))
        body: dict[str, Any] = {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        }  # fmt: skip
        if self.rng.random() < 0.5:
            body["chat_template"] = template
        else:
            body["chat_template_kwargs"] = {"chat_template": template, "x": [1, {"y": None}]}
        return Hostile("", _post(_CHAT, body))

    # --- headers -----------------------------------------------------------------------
    def kind_headers(self) -> Hostile:
        ok = json.dumps({"model": self.m.plain, "prompt": "x", "max_tokens": 1}).encode()
        which = self.rng.randrange(10)
        if which == 0:
            return Hostile("", http("POST", _COMP, ok, {"X-Huge": "a" * 100_000}))
        if which == 1:
            many = {f"X-H{i}": "v" for i in range(self.rng.choice((100, 1000)))}
            return Hostile("", http("POST", _COMP, ok, many))
        if which == 2:
            bad = self.rng.choice(("-1", "abc", "1e3", " 5", "99999999999999999999", "0x10"))
            return Hostile("", http("POST", _COMP, ok, content_length=bad))
        if which == 3:
            return Hostile("", http("POST", _COMP, ok, content_length=str(len(ok) - 5)))
        if which == 4:
            garbage = b"zz\r\nxx\r\n0\r\n\r\n"
            return Hostile("", http("POST", _COMP, garbage, {"Transfer-Encoding": "chunked"}))
        if which == 5:
            rid = self.rng.choice(("\u00ff" * 50, "a" * 5000, "", " ", "x\ty"))
            return Hostile("", http("POST", _COMP, ok, {"X-Request-Id": rid}), well_formed=True)
        if which == 6:
            auth = self.rng.choice(("Bearer", "Bearer " + "k" * 9000, "Basic Zm9v", "\u00e9"))
            return Hostile("", http("POST", _COMP, ok, {"Authorization": auth}), well_formed=True)
        if which == 7:
            return Hostile("", http("POST", _COMP, ok, {"Expect": "100-continue"}))
        if which == 8:
            data = http("POST", _COMP, ok).replace(b"Host: 127.0.0.1", b"Host: a\r\nX-\x01: \x7f")
            return Hostile("", data)
        doubled = http("POST", _COMP, ok).replace(
            b"Content-Type", b"Content-Length: 3\r\nContent-Type", 1
        )
        return Hostile("", doubled)


def hostile_requests(seed: int, n: int, models: Models | None = None) -> Iterator[Hostile]:
    """`n` requests drawn deterministically from `seed`."""
    gen = Generator(seed, models or Models())
    for _ in range(n):
        yield gen.next()


async def send_raw(host: str, port: int, data: bytes, timeout_s: float = 60.0) -> int | None:
    """Send one raw request on a fresh connection; the response status, or None when the
    server closed (or reset) without a status line."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(data)
                # The server may answer (413, 431) before reading everything.
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                line = await reader.readline()
                while line.startswith(b"HTTP/1.1 1"):  # interim (100 Continue): skip it
                    while (await reader.readline()).strip():
                        pass
                    line = await reader.readline()
                await reader.read()  # to the end (Connection: close)
            finally:
                writer.close()
    except (ConnectionError, TimeoutError, OSError):
        return None
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1])
