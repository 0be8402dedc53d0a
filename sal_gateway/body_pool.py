"""Large request bodies decoded, validated and counted in worker processes (`body_worker`).

`BodyPool` keeps `body_worker` processes (a `worker_proc.ProcessPool`, started in the app's
lifespan). `admit()` hands one the raw body and gets back an `InboundRequest` carrying only
what the gateway reads after admission (model, stream, limits, the request's chat template,
``stream_options``) and the prompt's `PromptCount` (None when a request template must be
rendered first); `count_text()` counts an already rendered prompt. The bytes forwarded
upstream stay the client's own (re-encoded only for a streaming body in UTF-16/32, as the
inline path does).

Bounds, so that a flood of large bodies cannot grow memory or stall anything: at most
``max_waiting`` requests wait for a worker and none longer than `ACQUIRE_TIMEOUT_S`
(beyond: 429 with ``Retry-After``); one job may take `JOB_TIMEOUT_S` (then its worker is
killed and replaced). A worker lost during a job (killed from outside, crashed) is replaced
and the job retried once on another; a second loss answers 503 with ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sal_gateway.endpoints import ApiEndpoint
from sal_gateway.errors import BadRequest, NoBackendAvailable, TooManyRequests
from sal_gateway.request_body import Endpoint, InboundRequest
from sal_gateway.tokenizer import PromptCount
from sal_gateway.worker_proc import JobTimeout, PoolBusy, ProcessPool, WorkerDied

ACQUIRE_TIMEOUT_S = 30.0
"""Longest wait for a free worker (a replacement starts in a few seconds) before a 429."""
JOB_TIMEOUT_S = 60.0
"""One body's decoding and counting (a 10 MiB text prompt takes seconds)."""


class WorkerUnavailable(NoBackendAvailable):
    """The gateway's own request worker was lost twice in a row (503)."""


class BodyPool:
    """See the module docstring. `models`: each model's name, tokenizer and context length,
    as the workers load them."""

    def __init__(
        self, models: Sequence[dict[str, Any]], size: int, max_waiting: int, retry_after_s: int
    ) -> None:
        self.retry_after_s = retry_after_s
        self.pool = ProcessPool(
            "sal_gateway.body_worker",
            size,
            init={"models": list(models)},
            max_waiting=max_waiting,
            acquire_timeout_s=ACQUIRE_TIMEOUT_S,
        )

    def start(self) -> None:
        """Start the workers in the background (call in the running loop)."""
        self.pool.start()

    @property
    def ready(self) -> bool:
        """At least one worker is up: a large request would not wait for a cold start
        (loading the tokenizers takes seconds). ``GET /ready`` reports it."""
        return self.pool.live_workers > 0

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def _run(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        for attempt in (1, 2):
            try:
                answer, data = await self.pool.run(header, payload, JOB_TIMEOUT_S)
            except PoolBusy:
                raise TooManyRequests(
                    "the gateway is busy with other large requests; retry later",
                    self.retry_after_s,
                ) from None
            except JobTimeout:
                raise BadRequest(
                    f"the request could not be processed within {JOB_TIMEOUT_S:g} s"
                ) from None
            except WorkerDied:
                if attempt == 2:
                    raise WorkerUnavailable(
                        "the gateway lost its request worker twice; retry later",
                        headers={"Retry-After": str(self.retry_after_s)},
                    ) from None
                continue
            error = answer.get("error")
            if isinstance(error, dict):
                raise BadRequest(str(error.get("message")), param=error.get("param"))
            return answer, data
        raise AssertionError("unreachable")

    async def admit(
        self,
        raw: bytes,
        endpoint: Endpoint | ApiEndpoint,
        max_n: int,
        default_model: str | None = None,
        block_sizes: dict[str, int] | None = None,
        aliases: dict[str, str] | None = None,
    ) -> tuple[InboundRequest, PromptCount | None, bytes]:
        """Validate and count `raw` sent to `endpoint` (`default_model`: the model of a body
        without one, API endpoints only; `aliases`: names served besides a configured model
        -> that model, whose tokenizer counts them): the request, its count (None: a request
        template must be rendered first, or its model is unknown; with block keys when
        `block_sizes` names its model) and the body to forward (`raw`, unless re-encoded)."""
        path = endpoint.path if isinstance(endpoint, ApiEndpoint) else endpoint.value
        header = {
            "op": "admit",
            "endpoint": path,
            "max_n": max_n,
            "default_model": default_model,
            "block_sizes": block_sizes or {},
            "aliases": aliases or {},
        }
        answer, reencoded = await self._run(header, raw)
        s = answer["summary"]
        inbound = InboundRequest(
            endpoint=Endpoint(s["endpoint"]),
            path=s["path"],
            count_options=s["count_options"],
            counted=s["counted"],
            ask_stream_usage=s["ask_stream_usage"],
            truncate_to=s["truncate_to"],
            body=s["body"],
            model=s["model"],
            stream=s["stream"],
            max_tokens=s["max_tokens"],
            fan_out=s["fan_out"],
            chat_template=s["chat_template"],
        )
        c = s["count"]
        count = None
        if c is not None:
            keys = tuple(c.get("block_keys", ()))
            count = PromptCount(tuple(c["per_prompt"]), c["estimated"], keys)
        return inbound, count, reencoded or raw

    async def count_text(self, model: str, text: str, add_special_tokens: bool) -> int:
        """Tokens of an already rendered prompt of `model`."""
        header = {"op": "count", "model": model, "add_special_tokens": add_special_tokens}
        answer, _ = await self._run(header, text.encode("utf-8", "surrogatepass"))
        return int(answer["tokens"])
