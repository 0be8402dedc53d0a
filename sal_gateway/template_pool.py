"""Rendering client-supplied chat templates in killable worker processes, within a budget.

`TemplatePool` keeps ``size`` `template_worker` processes (a `worker_proc.ProcessPool`).
`render()` hands one the raw request body and waits at most ``timeout_s`` for the rendered
text; a worker that overruns is killed (SIGKILL) and replaced in the background, and the
client gets a 400 naming the budget (`TemplateTimeout`). Waiting for a free worker is
bounded too (`TemplateBusy`, 429 with ``Retry-After``). Nothing here blocks the event loop:
the pipes are asyncio streams and the gateway only copies the body bytes it already holds.

Built in the app's lifespan only when some model sets ``trust_request_chat_template``; the
workers start in the background (importing Jinja through transformers takes a second or two).
"""

from __future__ import annotations

import logging
from typing import Any

from sal_gateway.errors import BadRequest, TemplateBusy, TemplateTimeout
from sal_gateway.worker_proc import JobTimeout, PoolBusy, ProcessPool, WorkerDied

logger = logging.getLogger("sal_gateway.template_pool")

ACQUIRE_TIMEOUT_S = 30.0
"""Longest wait for a free worker (covers a replacement's start-up) before a 429."""
MAX_WAITING = 64
"""Requests waiting for a renderer beyond this get a 429 at once."""


class TemplatePool:
    """Killable, memory-capped renderers of request templates (see the module docstring)."""

    def __init__(self, size: int, timeout_s: float, retry_after_s: int) -> None:
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._pool = ProcessPool(
            "sal_gateway.template_worker",
            size,
            max_waiting=MAX_WAITING,
            acquire_timeout_s=ACQUIRE_TIMEOUT_S,
        )
        self.kills = 0
        """Workers killed for overrunning the budget (tests and logs read it)."""

    @property
    def idle_workers(self) -> int:
        """Workers started and waiting for a job."""
        return self._pool.idle_workers

    def start(self) -> None:
        """Start the workers in the background (call in the running loop)."""
        self._pool.start()

    @property
    def ready(self) -> bool:
        """At least one renderer is up (``GET /ready`` reports it)."""
        return self._pool.live_workers > 0

    async def render(self, raw_body: bytes, special: dict[str, Any]) -> str:
        """The request template rendered over the request's messages (raw JSON body)."""
        try:
            answer, data = await self._pool.run({"special": special}, raw_body, self.timeout_s)
        except PoolBusy:
            raise TemplateBusy(
                "every chat-template renderer is busy; retry later", self.retry_after_s
            ) from None
        except JobTimeout:
            self.kills += 1
            raise TemplateTimeout(
                f"the request's chat template did not render within the "
                f"{self.timeout_s:g} s budget (limits.template_timeout_s)",
                param="chat_template",
            ) from None
        except WorkerDied:
            raise BadRequest(
                "the request's chat template crashed its renderer (memory limit?)",
                param="chat_template",
            ) from None
        if not answer.get("ok"):
            raise BadRequest(
                f"chat template rejected the messages: {answer.get('error')}",
                param="chat_template",
            )
        return data.decode("utf-8", "surrogatepass")

    async def aclose(self) -> None:
        """Stop every worker (shutdown)."""
        await self._pool.aclose()
