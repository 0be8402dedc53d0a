"""Rendering client-supplied chat templates in killable worker processes, within a budget.

`TemplatePool` keeps ``size`` `template_worker` processes. `render()` hands one the raw request
body and waits at most ``timeout_s`` for the rendered text; a worker that overruns is killed
(SIGKILL) and replaced in the background, and the client gets a 400 naming the budget
(`TemplateTimeout`). Waiting for a free worker is bounded too (`TemplateBusy`, 429 with
``Retry-After``). Nothing here blocks the event loop: the pipes are asyncio streams and the
gateway only copies the body bytes it already holds.

Built in the app's lifespan only when some model sets ``trust_request_chat_template``; the
workers start in the background (importing Jinja through transformers takes a second or two).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from sal_gateway.errors import BadRequest, TemplateBusy, TemplateTimeout

logger = logging.getLogger("sal_gateway.template_pool")

ACQUIRE_TIMEOUT_S = 30.0
"""Longest wait for a free worker (covers a replacement's start-up) before a 429."""
START_TIMEOUT_S = 120.0
"""A worker that does not report ready within this is killed and retried."""
_READ_LIMIT_BYTES = 128 * 1024 * 1024
# The worker imports this package: make it importable whatever the gateway's cwd.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class _WorkerDied(Exception):
    pass


class _Worker:
    """One child process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sal_gateway.template_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=_READ_LIMIT_BYTES,
        )
        worker = cls(proc)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                header = await worker._read_header()
        except BaseException:  # cancelled (shutdown) or failed: reap it, never leave a zombie
            await worker.reap()
            raise
        if not header.get("ready"):
            await worker.reap()
            raise _WorkerDied(f"template worker did not start: {header}")
        return worker

    async def _read_header(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise _WorkerDied("template worker exited")
        header: dict[str, Any] = json.loads(line)
        return header

    async def call(self, raw_body: bytes, special: dict[str, Any]) -> str:
        """Render one job; `BadRequest` when the template itself failed."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        header = json.dumps({"len": len(raw_body), "special": special}).encode()
        try:
            self.proc.stdin.write(header + b"\n")
            self.proc.stdin.write(raw_body)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _WorkerDied(str(exc)) from None
        answer = await self._read_header()
        if not answer.get("ok"):
            raise BadRequest(
                f"chat template rejected the messages: {answer.get('error')}",
                param="chat_template",
            )
        data = await self.proc.stdout.readexactly(int(answer["len"]))
        return data.decode("utf-8", "surrogatepass")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def reap(self) -> None:
        """Kill the process and wait for it (closes its pipes)."""
        self.kill()
        with contextlib.suppress(ProcessLookupError, TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)


class TemplatePool:
    """Killable, memory-capped renderers of request templates (see the module docstring)."""

    def __init__(self, size: int, timeout_s: float, retry_after_s: int) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False
        self.kills = 0
        """Workers killed for overrunning the budget (tests and logs read it)."""

    @property
    def idle_workers(self) -> int:
        """Workers started and waiting for a job."""
        return self._idle.qsize()

    def start(self) -> None:
        """Start the workers in the background (call in the running loop)."""
        for _ in range(self.size):
            self._replace()

    def _replace(self) -> None:
        if self._closed:
            return
        task = asyncio.create_task(self._start_one(), name="template worker start")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        delay_s = 0.5
        while True:
            try:
                worker = await _Worker.spawn()
            except (OSError, _WorkerDied, TimeoutError, ValueError) as exc:
                logger.error("cannot start a template worker (retrying): %s", exc)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 30.0)
                continue
            self._all.add(worker)
            self._idle.put_nowait(worker)
            return

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)
        reaping = asyncio.create_task(worker.reap(), name="template worker reap")
        self._starting.add(reaping)
        reaping.add_done_callback(self._starting.discard)
        self._replace()

    async def render(self, raw_body: bytes, special: dict[str, Any]) -> str:
        """The request template rendered over the request's messages (raw JSON body)."""
        try:
            async with asyncio.timeout(ACQUIRE_TIMEOUT_S):
                worker = await self._idle.get()
        except TimeoutError:
            raise TemplateBusy(
                "every chat-template renderer is busy; retry later", self.retry_after_s
            ) from None
        try:
            async with asyncio.timeout(self.timeout_s):
                text = await worker.call(raw_body, special)
        except TimeoutError:
            self.kills += 1
            logger.warning("request chat template overran %.1f s: worker killed", self.timeout_s)
            self._discard(worker)
            raise TemplateTimeout(
                f"the request's chat template did not render within the "
                f"{self.timeout_s:g} s budget (limits.template_timeout_s)",
                param="chat_template",
            ) from None
        except (_WorkerDied, asyncio.IncompleteReadError, ValueError) as exc:
            logger.warning("template worker died while rendering: %s", exc)
            self._discard(worker)
            raise BadRequest(
                "the request's chat template crashed its renderer (memory limit?)",
                param="chat_template",
            ) from None
        except BadRequest:
            self._idle.put_nowait(worker)
            raise
        except BaseException:  # cancelled (client gone): the worker's state is unknown
            self._discard(worker)
            raise
        self._idle.put_nowait(worker)
        return text

    async def aclose(self) -> None:
        """Stop every worker (shutdown)."""
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        for task in list(self._starting):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for worker in list(self._all):
            await worker.reap()
        self._all.clear()
