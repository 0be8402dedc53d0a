"""Admitting one generation request: read, decode, validate and count it, within bounds.

`admit()` is called once per generation request by the app's handler, before routing. It
reads the body within ``listen.body_timeout_s`` (plus `BODY_GRACE_S`; 408) and
``proxy.max_body_bytes`` (413); decodes it on the loop when small, in the worker thread pool
(yielding the GIL, see `request_body.decode_json`) when large, at most `LARGE_BODY_SLOTS`
large requests at a time; refuses a request chat template unless the model trusts them and
then renders it in `template_pool`; counts prompt tokens and checks the context length.
`forward_headers()` builds what goes upstream; `request_id_of()` reads `FrontDoor`'s id.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from typing import TYPE_CHECKING

from starlette.requests import Request

from sal_gateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    ModelNotFound,
    RequestTimeout,
    TemplateRefused,
    TemplateTimeout,
)
from sal_gateway.front_door import new_request_id
from sal_gateway.proxy import upstream_headers
from sal_gateway.request_body import Endpoint, InboundRequest, parse_body
from sal_gateway.tokenizer import PromptCount, PromptCounter, check_length

if TYPE_CHECKING:
    from sal_gateway.app import Runtime

BODY_GRACE_S = 1.0
"""The handler's own body deadline is this much later than ``listen.body_timeout_s``: under
``sal-gateway serve`` the HTTP protocol cuts first (`http_protocol`); this one serves other
ASGI servers."""
PARSE_IN_THREAD_BYTES = 256 * 1024
"""Bodies larger than this are JSON-decoded and validated in the worker pool, not on the loop."""
LARGE_BODY_SLOTS = 4
"""Requests with a body over `PARSE_IN_THREAD_BYTES` (declared, or chunked) read, decode and
count at most this many at a time: bounds their memory (slots x ``proxy.max_body_bytes``)
and the GIL time their decoding takes from the event loop. Others wait, within their body
deadline."""


async def read_body(request: Request, max_body_bytes: int, timeout_s: float | None = None) -> bytes:
    """The request body, refusing more than `max_body_bytes` (header or actual size) and a
    body not complete within `timeout_s` (`RequestTimeout`: a slow client is cut)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, max_body_bytes)
    except TimeoutError:
        raise RequestTimeout(
            f"request body not received within {timeout_s:g} s (listen.body_timeout_s + 1)"
        ) from None


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest("invalid Content-Length header") from None
        if size > max_body_bytes:
            raise BodyTooLarge(
                f"request body of {size} bytes exceeds the limit of {max_body_bytes} bytes"
            )
    chunks = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_body_bytes:
            raise BodyTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_NOT_FORWARDED = frozenset({"authorization", "x-request-id", "content-encoding", "expect"})
# RFC 9110 token: a name our HTTP parser let through but the upstream client refuses (or the
# backend chokes on) would fail the request as if the backend were down, and mark it suspect.
_FORWARDABLE_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _clean(value: str) -> bool:
    return all(c == "\t" or " " <= c != "\x7f" for c in value)


def request_id_of(request: Request) -> str:
    """The id `FrontDoor` gave this request (a fresh one if it did not run)."""
    rid = request.scope.get("state", {}).get("request_id")
    return rid if isinstance(rid, str) else new_request_id()


def forward_headers(request: Request, rt: Runtime, request_id: str) -> dict[str, str]:
    """Headers sent upstream: the client's minus hop-by-hop ones, its credentials and what
    described the body as it arrived (it was validated as plain JSON: a forwarded
    ``Content-Encoding: gzip`` or ``Expect`` would make the backend fail the request, and the
    gateway would blame the backend); our request id; the configured backend key, if any."""
    headers = {
        k: v
        for k, v in upstream_headers(request.headers).items()
        if k.lower() not in _NOT_FORWARDED and _FORWARDABLE_NAME.fullmatch(k) and _clean(v)
    }
    headers["X-Request-Id"] = request_id
    if rt.backend_key is not None:
        headers["Authorization"] = f"Bearer {rt.backend_key}"
    return headers


async def _parse(raw: bytes, endpoint: Endpoint, rt: Runtime) -> InboundRequest:
    max_n = rt.config.limits.max_n
    if len(raw) <= PARSE_IN_THREAD_BYTES:
        return parse_body(raw, endpoint, max_n=max_n)
    parse = functools.partial(parse_body, raw, endpoint, max_n=max_n, yielding=True)
    return await asyncio.get_running_loop().run_in_executor(rt.executor, parse)


async def _count(
    rt: Runtime, counter: PromptCounter, inbound: InboundRequest, raw: bytes
) -> PromptCount:
    """Prompt tokens; a request template is refused unless trusted, then rendered in a
    killable worker process (`template_pool`)."""
    thread_above = rt.config.proxy.tokenize_in_thread_chars
    if inbound.chat_template is None:
        return await counter.count(inbound, rt.executor, thread_above)
    model = rt.config.model(inbound.model)
    if model is None or not model.trust_request_chat_template or rt.templates is None:
        raise TemplateRefused(
            "request-supplied chat templates are not accepted for this model (the operator "
            "can allow them with models[].trust_request_chat_template)",
            param="chat_template",
        )
    if not counter.has_tokenizer:
        return counter.count_sync(inbound)  # the estimate needs no rendering
    text = await rt.templates.render(raw, counter.special_tokens)
    return await counter.count_rendered(text, inbound, rt.executor, thread_above)


def count_rejection(rt: Runtime, exc: GatewayError) -> None:
    if isinstance(exc, RequestTimeout):
        rt.metrics.rejected.labels(reason="body_timeout").inc()
    elif isinstance(exc, TemplateRefused | TemplateTimeout):
        rt.metrics.rejected.labels(reason="template").inc()


def _is_large(request: Request) -> bool:
    declared = request.headers.get("content-length")
    if declared is None:
        return True  # chunked: could be anything up to the limit
    return not declared.isdigit() or int(declared) > PARSE_IN_THREAD_BYTES


async def admit(
    request: Request, endpoint: Endpoint, rt: Runtime
) -> tuple[InboundRequest, bytes, PromptCount]:
    """Read, validate and count one request (large ones within `LARGE_BODY_SLOTS`)."""
    deadline_s = rt.config.listen.body_timeout_s + BODY_GRACE_S
    async with contextlib.AsyncExitStack() as stack:
        if _is_large(request):
            try:
                async with asyncio.timeout(deadline_s):
                    await stack.enter_async_context(rt.large_bodies)
            except TimeoutError:
                raise RequestTimeout(
                    f"request body not received within {deadline_s:g} s (waiting for a slot "
                    "among the large requests in progress)"
                ) from None
        raw = await read_body(request, rt.config.proxy.max_body_bytes, deadline_s)
        inbound = await _parse(raw, endpoint, rt)
        counter = rt.counters.get(inbound.model)
        if counter is None:
            raise ModelNotFound(f"The model `{inbound.model}` does not exist.", param="model")
        count = await _count(rt, counter, inbound, raw)
        check_length(count, inbound.max_tokens, counter.max_model_len)
        return inbound, raw, count
    raise AssertionError("unreachable")  # mypy: AsyncExitStack may swallow exceptions
