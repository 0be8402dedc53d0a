"""The emulator's generation endpoints: validate an OpenAI body, run it, answer.

`generate()` serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` for one
emulated replica (`engine_sim.emulator` routes to it): the body is parsed and its prompt
counted by the gateway's own code (`sal_gateway.request_body`, `sal_gateway.tokenizer`), each
prompt becomes one engine request on the replica's `ReplicaRuntime`, and the answer is JSON
or SSE (`engine_sim.openai_bodies`). A client that goes away aborts its engine requests.
`metrics_text()` renders the stock-vLLM ``/metrics`` subset.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from engine_sim import openai_bodies as bodies
from engine_sim.prompt_blocks import prompt_block_keys
from engine_sim.replica import ReplicaRuntime, TokenEvent
from sal_core.prefix import adapter_keys
from sal_gateway.errors import BadRequest, GatewayError, ModelNotFound, error_body
from sal_gateway.request_body import Endpoint, parse_body
from sal_gateway.tokenizer import PromptCounter, check_length

_TOKENIZE_IN_THREAD_ABOVE_BYTES = 16_384


@dataclass
class ReplicaState:
    """What the endpoints of one emulated replica share (built in the app's lifespan)."""

    model_name: str
    runtime: ReplicaRuntime
    counter: PromptCounter
    max_model_len: int
    default_max_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: tuple[str, ...] = ()
    """LoRA adapters served besides `model_name` (``--lora-modules``)."""


def metrics_text(runtime: ReplicaRuntime, model_name: str) -> str:
    """The stock vLLM ``/metrics`` series the gateway's fallback reads, plus counters (and,
    with LoRA slots, ``vllm:lora_requests_info``)."""
    engine = runtime.engine
    cfg = engine.config
    labels = f'engine="0",model_name="{model_name}"'
    used = 1.0 - engine.free_blocks / cfg.num_kv_blocks
    c = runtime.counters
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(engine.num_running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(engine.num_waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {used}",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{cfg.block_size}",engine="0",'
        f'num_gpu_blocks="{cfg.num_kv_blocks}"}} 1.0',
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{labels}}} {float(engine.num_preemptions)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{labels}}} {float(c.prompt_tokens)}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of "
        "queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{labels}}} {float(engine.prefix_queries_tokens)}",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached "
        "tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{labels}}} {float(engine.prefix_hits_tokens)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {float(c.generation_tokens)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{labels},finished_reason="length"}} '
        f"{float(c.requests_finished)}",
    ]
    if cfg.max_loras > 0:
        # vLLM sets one series per label set to the time it was set (the newest is now's).
        running, waiting = engine.lora_adapters()
        lines += [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            f'vllm:lora_requests_info{{max_lora="{cfg.max_loras}",'
            f'running_lora_adapters="{",".join(running)}",'
            f'waiting_lora_adapters="{",".join(waiting)}"}} {time.time()}',
        ]
    return "\n".join(lines) + "\n"


@dataclass
class _Generation:
    """One HTTP generation request after validation."""

    response_id: str
    chat: bool
    stream: bool
    include_usage: bool
    prompt_counts: tuple[int, ...]
    max_tokens: int
    block_keys: tuple[list[int], ...] = ()
    """Per prompt, its full blocks' keys (empty without prefix caching)."""
    model: str = ""
    """The name the request asked for (the model's, or an adapter's): echoed in answers."""
    adapter: str | None = None
    """Its LoRA adapter (None: the base model)."""


def _error(exc: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def _validate(replica: ReplicaState, raw: bytes, endpoint: Endpoint) -> _Generation:
    inbound = parse_body(raw, endpoint)
    if inbound.model != replica.model_name and inbound.model not in replica.adapters:
        raise ModelNotFound(f"The model `{inbound.model}` does not exist.", param="model")
    adapter = None if inbound.model == replica.model_name else inbound.model
    n = inbound.body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("the emulator supports only n=1", param="n")
    count = replica.counter.count_sync(inbound)
    check_length(count, inbound.max_tokens, replica.max_model_len)
    default = replica.default_max_tokens
    max_tokens = default if inbound.max_tokens is None else inbound.max_tokens
    if max_tokens < 1:
        raise BadRequest("`max_tokens` must be at least 1", param="max_tokens")
    # vLLM clamps max_tokens to what is left of the context (it does not reject).
    longest = max(count.per_prompt)
    max_tokens = max(1, min(max_tokens, replica.max_model_len - longest))
    options = inbound.body.get("stream_options") or {}
    chat = endpoint is Endpoint.CHAT
    engine = replica.runtime.engine
    keys: tuple[list[int], ...] = ()
    if engine.cache is not None:
        keys = tuple(
            prompt_block_keys(inbound, replica.counter.hf_tokenizer, engine.config.block_size)
        )
        if adapter is not None:  # vLLM puts the adapter in every block's hash
            keys = tuple(list(adapter_keys(k, adapter)) for k in keys)
    return _Generation(
        response_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        chat=chat,
        stream=inbound.stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        prompt_counts=tuple(max(1, c) for c in count.per_prompt),
        max_tokens=max_tokens,
        block_keys=keys,
        model=inbound.model,
        adapter=adapter,
    )


async def generate(request: Request, endpoint: Endpoint, replica: ReplicaState) -> Response:
    """Serve one `/v1/completions` or `/v1/chat/completions` request on `replica`."""
    raw = await request.body()
    try:
        if replica.counter.has_tokenizer and len(raw) > _TOKENIZE_IN_THREAD_ABOVE_BYTES:
            # Tokenizing a long prompt would stall every other stream of this process.
            gen = await asyncio.to_thread(_validate, replica, raw, endpoint)
        else:
            gen = _validate(replica, raw, endpoint)
    except GatewayError as exc:
        return _error(exc)
    queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
    request_ids: list[str] = []
    try:
        for index, prompt_tokens in enumerate(gen.prompt_counts):
            keys = gen.block_keys[index] if gen.block_keys else ()
            request_ids.append(
                replica.runtime.submit(
                    prompt_tokens, gen.max_tokens, queue, index, keys, adapter=gen.adapter
                )
            )
    except ValueError as exc:
        _abort_all(replica, request_ids)
        return _error(BadRequest(str(exc), param="max_tokens"))
    if gen.stream:
        return StreamingResponse(
            _stream(replica, gen, queue, request_ids), media_type="text/event-stream"
        )
    return await _complete(request, replica, gen, queue, request_ids)


def _abort_all(replica: ReplicaState, request_ids: Sequence[str]) -> None:
    for request_id in request_ids:
        replica.runtime.abort(request_id)


async def _collect(queue: asyncio.Queue[TokenEvent], choices: int) -> list[int]:
    outputs = [0] * choices
    remaining = choices
    while remaining:
        event = await queue.get()
        outputs[event.index] += event.tokens
        remaining -= event.finished
    return outputs


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(
    request: Request,
    replica: ReplicaState,
    gen: _Generation,
    queue: asyncio.Queue[TokenEvent],
    request_ids: list[str],
) -> Response:
    """Non-streaming: wait for every choice, or abort them all if the client leaves."""
    collect = asyncio.ensure_future(_collect(queue, len(request_ids)))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():
            collect.cancel()
            _abort_all(replica, request_ids)
    if collect.cancelled():
        return Response(status_code=499)
    body = bodies.completion_body(
        gen.response_id,
        replica.created,
        gen.model,
        collect.result(),
        sum(gen.prompt_counts),
        chat=gen.chat,
    )
    return JSONResponse(body)


async def _stream(
    replica: ReplicaState,
    gen: _Generation,
    queue: asyncio.Queue[TokenEvent],
    request_ids: list[str],
) -> AsyncIterator[bytes]:
    """SSE: one chunk per engine step per choice; aborts the engine side when closed early."""
    model = gen.model
    outputs = [0] * len(request_ids)
    remaining = len(request_ids)
    try:
        while remaining:
            event = await queue.get()
            first = outputs[event.index] == 0
            outputs[event.index] += event.tokens
            remaining -= event.finished
            yield bodies.sse(
                bodies.chunk(
                    gen.response_id,
                    replica.created,
                    model,
                    chat=gen.chat,
                    index=event.index,
                    tokens=event.tokens,
                    finished=event.finished,
                    first=first,
                )
            )
        if gen.include_usage:
            usage_body = bodies.usage(sum(gen.prompt_counts), sum(outputs))
            yield bodies.sse(
                bodies.usage_chunk(
                    gen.response_id, replica.created, model, chat=gen.chat, usage_body=usage_body
                )
            )
        yield bodies.SSE_DONE
    finally:
        if remaining:
            _abort_all(replica, request_ids)
