"""Admitting one generation request: read, decode, validate and count it, within bounds.

`admit()` is called once per generation request by the app's handler, before routing. It
reads the body within ``listen.body_timeout_s`` (plus `BODY_GRACE_S`; 408) and
``proxy.max_body_bytes`` (413); decodes and validates it on the loop up to
`INLINE_BODY_BYTES`, and counts its prompt there when short (``proxy.tokenize_in_thread_chars``
characters, `INLINE_MESSAGES`); anything larger or longer goes to a worker process
(`body_pool`), so that no work that grows with the request holds the loop's GIL; reads at
most `LARGE_BODY_SLOTS` very large bodies at a time; refuses a request chat template unless
the model trusts them and then renders it in `template_pool`; counts prompt tokens and
checks the context length. A `model` that is no configured model but a name its replicas
serve besides one (a LoRA adapter, another served name: `model_catalog`) is resolved to that
model (`resolve_served`); a name nobody serves is a 404, after one bounded re-read of the
replicas' ``/v1/models`` in case it was loaded a moment ago.
`forward_headers()` builds what goes upstream; `request_id_of()` reads `FrontDoor`'s id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from typing import TYPE_CHECKING

from starlette.requests import Request

from sal_gateway.adapter_patterns import resolvable_owner
from sal_gateway.api_body import parse_api_body
from sal_gateway.endpoints import ApiEndpoint, serves
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
from sal_gateway.model_catalog import ServedName
from sal_gateway.proxy import upstream_headers
from sal_gateway.request_body import Endpoint, InboundRequest, parse_body
from sal_gateway.tokenizer import PromptCount, PromptCounter, check_length, text_size
from sal_gateway.trace_hooks import trace_of

if TYPE_CHECKING:
    from sal_gateway.app import Runtime

BODY_GRACE_S = 1.0
"""The handler's own body deadline is this much later than ``listen.body_timeout_s``: under
``sal-gateway serve`` the HTTP protocol cuts first (`http_protocol`); this one serves other
ASGI servers."""
INLINE_BODY_BYTES = 64 * 1024
"""Bodies up to this are decoded and validated on the loop (the C decoder takes well under a
millisecond); larger ones in a `body_pool` worker process, with their counting."""
INLINE_MESSAGES = 32
"""Chat requests with more messages than this are rendered and counted in a worker."""
LARGE_BODY_SLOTS = 4
"""Requests with a body over `LARGE_BODY_BYTES` (declared, or chunked) are read and
admitted at most this many at a time: bounds their memory (slots x
``proxy.max_body_bytes``). Others wait, within their body deadline."""
LARGE_BODY_BYTES = 256 * 1024
SERVED_REFRESH_S = 2.0
"""A request naming a model the gateway does not know waits at most this long for its
replicas' ``/v1/models`` to be read again (an adapter loaded a moment ago) before its 404."""


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


def _parse_inline(raw: bytes, endpoint: Endpoint | ApiEndpoint, rt: Runtime) -> InboundRequest:
    """Decode and validate a small body on the loop (`INLINE_BODY_BYTES`)."""
    if isinstance(endpoint, ApiEndpoint):
        return parse_api_body(raw, endpoint, default_model=default_model(rt))
    return parse_body(raw, endpoint, max_n=rt.config.limits.max_n)


def default_model(rt: Runtime) -> str | None:
    """The model a request without ``model`` goes to: the only one configured, else none."""
    models = rt.config.models
    return models[0].name if len(models) == 1 else None


def _check_runner(endpoint: Endpoint | ApiEndpoint, inbound: InboundRequest, rt: Runtime) -> None:
    """A pooling endpoint for a generation model (or the reverse) would only meet vLLM's
    404 for a route it did not mount: refuse it here, saying why."""
    model = rt.config.model(inbound.model)
    if (
        isinstance(endpoint, ApiEndpoint)
        and model is not None
        and not serves(endpoint, model.runner)
    ):
        raise BadRequest(
            f"model `{model.name}` runs as `{model.runner}` (models[].runner): "
            f"{endpoint.path} needs a `{endpoint.family.value}` model",
            param="model",
        )
    if isinstance(endpoint, Endpoint) and model is not None and model.runner != "generate":
        raise BadRequest(
            f"model `{model.name}` is a pooling model (models[].runner): "
            f"{endpoint.value} needs a `generate` model",
            param="model",
        )


def _truncated(count: PromptCount, inbound: InboundRequest, max_len: int | None) -> PromptCount:
    """The count after vLLM's ``truncate_prompt_tokens`` (-1: to the context length)."""
    limit = max_len if inbound.truncate_to == -1 else inbound.truncate_to
    if limit is None:
        return count
    # vLLM keeps the prompt's last tokens: the block keys of its start no longer apply.
    return PromptCount(tuple(min(n, limit) for n in count.per_prompt), count.estimated)


async def _count(
    rt: Runtime,
    counter: PromptCounter,
    inbound: InboundRequest,
    raw: bytes,
    count: PromptCount | None,
) -> PromptCount:
    """Prompt tokens (`count` when a worker counted them already); a request template is
    refused unless trusted, then rendered in a killable worker process (`template_pool`)
    and its output counted on the loop when short, in a body worker when long."""
    if inbound.chat_template is None:
        return count if count is not None else counter.count_sync(inbound, _block_size(rt, inbound))
    model = rt.config.model(inbound.model)
    if model is None or not model.trust_request_chat_template or rt.templates is None:
        raise TemplateRefused(
            "request-supplied chat templates are not accepted for this model (the operator "
            "can allow them with models[].trust_request_chat_template)",
            param="chat_template",
        )
    if not counter.has_tokenizer:  # the estimate needs no rendering
        return count if count is not None else counter.count_sync(inbound, _block_size(rt, inbound))
    text = await rt.templates.render(raw, counter.special_tokens)
    add_special = bool(inbound.body.get("add_special_tokens", False))
    if len(text) <= rt.config.proxy.tokenize_in_thread_chars or rt.bodies is None:
        return PromptCount((counter.encode_len(text, add_special),), False)
    return PromptCount((await rt.bodies.count_text(inbound.model, text, add_special),), False)


def _block_size(rt: Runtime, inbound: InboundRequest) -> int | None:
    """The KV block size to key `inbound`'s prompt blocks by (None: no cache tracking)."""
    return None if rt.prefix is None else rt.prefix.block_size(inbound.model)


def _block_sizes(rt: Runtime) -> dict[str, int] | None:
    return None if rt.prefix is None else rt.prefix.block_sizes()


async def resolve_served(
    rt: Runtime, inbound: InboundRequest
) -> tuple[InboundRequest, ServedName | None]:
    """`inbound` routed by configured model: unchanged for a configured model's name; for a
    name its replicas serve besides one, that model (`InboundRequest.served_model` keeps the
    name) and where the name is served; for a name a model's ``resolvable_adapters`` match,
    that model and all its backends, at once. Raises `ModelNotFound` for a name nobody
    serves, after at most one re-read of the replicas' model lists (`SERVED_REFRESH_S`)."""
    name = inbound.model
    if name in rt.counters:
        return inbound, None
    served = rt.catalog.served(name)
    patterns = ((m.name, m.resolvable_adapters) for m in rt.config.models)
    owner = resolvable_owner(patterns, name)
    if owner is not None and owner in rt.counters and (served is None or served.model == owner):
        # Any of the owner's replicas can load it (vLLM's LoRA resolvers): no re-read to
        # wait for, and not only where it is loaded already (SAL weighs those replicas and
        # their LoRA slots).
        pool = frozenset(b.url for b in rt.table.backends(owner))
        resolvable = ServedName(owner, pool, adapter=True, listed=served is not None)
        return dataclasses.replace(inbound, model=owner, served_model=name), resolvable
    if served is None:
        served = await rt.catalog.find(name, SERVED_REFRESH_S)
    if served is None or served.model not in rt.counters:
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
    return dataclasses.replace(inbound, model=served.model, served_model=name), served


def count_rejection(rt: Runtime, exc: GatewayError) -> None:
    if isinstance(exc, RequestTimeout):
        rt.metrics.rejected.labels(reason="body_timeout").inc()
    elif isinstance(exc, TemplateRefused | TemplateTimeout):
        rt.metrics.rejected.labels(reason="template").inc()


def _costly_to_count(inbound: InboundRequest, max_inline_chars: int) -> bool:
    """Whether counting `inbound`'s prompt (template rendering, tokenization: a few
    microseconds per character) belongs in a worker process rather than on the loop."""
    if inbound.chat_template is not None:
        return False  # rendered in `template_pool`, then counted by `_count`
    return text_size(inbound) > max_inline_chars or len(inbound.messages) > INLINE_MESSAGES


def _is_large(request: Request) -> bool:
    declared = request.headers.get("content-length")
    if declared is None:
        return True  # chunked: could be anything up to the limit
    return not declared.isdigit() or int(declared) > LARGE_BODY_BYTES


async def admit(
    request: Request, endpoint: Endpoint | ApiEndpoint, rt: Runtime
) -> tuple[InboundRequest, bytes, PromptCount, ServedName | None]:
    """Read, validate and count one request (large ones within `LARGE_BODY_SLOTS`): the
    request, the body to forward, its prompt tokens and, for a name served besides a
    configured model (`resolve_served`), where it is served."""
    deadline_s = rt.config.listen.body_timeout_s + BODY_GRACE_S
    max_n = rt.config.limits.max_n
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
        count: PromptCount | None = None
        bodies = rt.bodies
        sent: dict[str, str] | None = None  # the served names a body worker counted with
        if bodies is not None and len(raw) > INLINE_BODY_BYTES:
            sent = rt.catalog.aliases()
            inbound, count, raw = await bodies.admit(
                raw, endpoint, max_n, default_model(rt), _block_sizes(rt), sent
            )
        else:
            inbound = _parse_inline(raw, endpoint, rt)
            inline_chars = rt.config.proxy.tokenize_in_thread_chars
            if bodies is not None and _costly_to_count(inbound, inline_chars):
                sent = rt.catalog.aliases()
                inbound, count, raw = await bodies.admit(
                    raw, endpoint, max_n, default_model(rt), _block_sizes(rt), sent
                )
        asked = inbound.model
        inbound, served = await resolve_served(rt, inbound)
        recount = sent is not None and served is not None and sent.get(asked) != served.model
        if bodies is not None and served is not None and recount:
            # The worker did not know the name (learnt since) or counted it as another
            # model's: count it there again, as this one.
            again, count, raw = await bodies.admit(
                raw, endpoint, max_n, default_model(rt), _block_sizes(rt), {asked: served.model}
            )
            inbound = dataclasses.replace(again, model=served.model, served_model=asked)
        counter = rt.counters[inbound.model]
        _check_runner(endpoint, inbound, rt)
        trace = trace_of(request)
        with trace.tokenize() as span:
            count = await _count(rt, counter, inbound, raw, count)
            if inbound.truncate_to is not None:
                count = _truncated(count, inbound, counter.max_model_len)
            span.counted(count)
        check_length(count, inbound.max_tokens, counter.max_model_len)
        trace.admitted(inbound, count)
        return inbound, raw, count, served
    raise AssertionError("unreachable")  # mypy: AsyncExitStack may swallow exceptions
