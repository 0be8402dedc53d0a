"""Pools of killable child processes that do request-sized work off the event loop.

A thread cannot be stopped and holds the GIL the event loop needs: a Python thread decoding
a 10 MiB body or rendering a Jinja template takes the GIL in 5 ms slices, and every time the
loop thread gives the GIL up (each socket call) it waits for the next slice. So work whose
cost grows with the request runs in child processes instead (`template_worker`,
`body_worker`), and the loop only copies bytes to and from their pipes.

`ProcessPool` keeps ``size`` children of one ``python -m MODULE``. Protocol on their
stdin/stdout, one job at a time: at start-up the pool writes one JSON line (the module's
init data; ``{}`` when none) and the child answers ``{"ready": true}\\n``; a job is a JSON
header line with ``"len": N`` followed by N payload bytes; the answer is a JSON header line,
followed by ``answer["len"]`` payload bytes when it has a ``len``; an answer with
``"retire": true`` makes the pool replace that child (it grew too large).

`ProcessPool.run()` bounds everything a flood could grow: waiting for a free child (at most
``max_waiting`` waiters, and ``acquire_timeout_s``: `PoolBusy`), one job's time
(``timeout_s``: the child is killed and replaced, `JobTimeout`), and a child that dies
(`WorkerDied`, replaced in the background). Nothing here blocks the event loop: the pipes
are asyncio streams.
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

logger = logging.getLogger("sal_gateway.worker_proc")

START_TIMEOUT_S = 120.0
"""A child that does not report ready within this is killed and retried."""
WORKER_NICENESS = 10
"""Children run at this niceness above the gateway's: the event loop serves every client, a
child one large request, so on a busy host the loop gets the CPU first (measured: with the
children at the loop's priority a flood of large hostile bodies raised well-formed p99
latency 4.6x; docs/gateway.md, "Fuzz tier"). Set here, as an absolute value, and only here:
a child that also niced itself raced this and often ended at 19, where a host busy with
anything else (a vLLM engine beside the gateway) starved it for seconds."""
_READ_LIMIT_BYTES = 128 * 1024 * 1024
# The child imports this package: make it importable whatever the gateway's cwd.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class WorkerDied(Exception):
    """The child exited (or broke its protocol) during a job."""


class JobTimeout(Exception):
    """The job overran its budget; the child was killed."""


class PoolBusy(Exception):
    """No child became free in time, or too many jobs were already waiting."""


class WorkerProcess:
    """One child process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, module: str, init: dict[str, Any]) -> WorkerProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=_READ_LIMIT_BYTES,
        )
        worker = cls(proc)
        with contextlib.suppress(OSError):  # not permitted, or gone already: run as is
            os.setpriority(
                os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS
            )
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(init).encode() + b"\n")
            async with asyncio.timeout(START_TIMEOUT_S):
                await proc.stdin.drain()
                header = await worker.read_header()
        except BaseException:  # cancelled (shutdown) or failed: reap it, never leave a zombie
            await worker.reap()
            raise
        if not header.get("ready"):
            await worker.reap()
            raise WorkerDied(f"{module} did not start: {header}")
        return worker

    async def read_header(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise WorkerDied("worker process exited")
        try:
            header = json.loads(line)
        except ValueError:
            raise WorkerDied(f"worker process wrote garbage: {line[:100]!r}") from None
        if not isinstance(header, dict):
            raise WorkerDied(f"worker process wrote garbage: {line[:100]!r}")
        return header

    async def call(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """One job: the answer's header and its payload (empty without ``len``)."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        line = json.dumps({**header, "len": len(payload)}).encode() + b"\n"
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.write(payload)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerDied(str(exc)) from None
        answer = await self.read_header()
        size = answer.get("len")
        if size is None:
            return answer, b""
        try:
            data = await self.proc.stdout.readexactly(int(size))
        except asyncio.IncompleteReadError:
            raise WorkerDied("worker process exited mid-answer") from None
        return answer, data

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def reap(self) -> None:
        """Kill the process and wait for it (closes its pipes)."""
        self.kill()
        with contextlib.suppress(ProcessLookupError, TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)


class ProcessPool:
    """``size`` children of ``python -m module`` (see the module docstring)."""

    def __init__(
        self,
        module: str,
        size: int,
        *,
        init: dict[str, Any] | None = None,
        max_waiting: int = 64,
        acquire_timeout_s: float = 30.0,
    ) -> None:
        self.module = module
        self.size = size
        self.init = init or {}
        self.max_waiting = max_waiting
        self.acquire_timeout_s = acquire_timeout_s
        self._idle: asyncio.Queue[WorkerProcess] = asyncio.Queue()
        self._all: set[WorkerProcess] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting = 0
        self._closed = False
        self.replaced = 0
        """Children killed or lost and replaced (tests and logs read it)."""

    @property
    def idle_workers(self) -> int:
        """Children started and waiting for a job."""
        return self._idle.qsize()

    @property
    def live_workers(self) -> int:
        """Children started and not lost (idle or busy)."""
        return len(self._all)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live children (tests kill them)."""
        return [w.proc.pid for w in self._all]

    def start(self) -> None:
        """Start the children in the background (call in the running loop)."""
        for _ in range(self.size):
            self._replace()

    def _background(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replace(self) -> None:
        if not self._closed:
            self._background(self._start_one(), f"{self.module} start")

    async def _start_one(self) -> None:
        delay_s = 0.5
        while True:
            try:
                worker = await WorkerProcess.spawn(self.module, self.init)
            except (OSError, WorkerDied, TimeoutError, ValueError) as exc:
                logger.error("cannot start a %s process (retrying): %s", self.module, exc)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 30.0)
                continue
            self._all.add(worker)
            self._idle.put_nowait(worker)
            return

    def _discard(self, worker: WorkerProcess) -> None:
        worker.kill()
        self._all.discard(worker)
        self.replaced += 1
        self._background(worker.reap(), f"{self.module} reap")
        self._replace()

    async def _acquire(self) -> WorkerProcess:
        if self._idle.empty() and self._waiting >= self.max_waiting:
            raise PoolBusy(f"{self._waiting} jobs already wait for a {self.module} process")
        self._waiting += 1
        try:
            async with asyncio.timeout(self.acquire_timeout_s):
                return await self._idle.get()
        except TimeoutError:
            wait_s = self.acquire_timeout_s
            raise PoolBusy(f"no {self.module} process free in {wait_s:g} s") from None
        finally:
            self._waiting -= 1

    async def run(
        self, header: dict[str, Any], payload: bytes, timeout_s: float
    ) -> tuple[dict[str, Any], bytes]:
        """Run one job on a free child; see the module docstring for what it raises."""
        worker = await self._acquire()
        try:
            async with asyncio.timeout(timeout_s):
                answer = await worker.call(header, payload)
        except TimeoutError:
            logger.warning("%s job overran %.1f s: process killed", self.module, timeout_s)
            self._discard(worker)
            raise JobTimeout(f"job overran {timeout_s:g} s") from None
        except WorkerDied as exc:
            logger.warning("%s process died during a job: %s", self.module, exc)
            self._discard(worker)
            raise
        except BaseException:  # cancelled (client gone): the child's state is unknown
            self._discard(worker)
            raise
        if answer[0].get("retire"):  # it grew too large: a fresh one keeps memory bounded
            self._discard(worker)
        else:
            self._idle.put_nowait(worker)
        return answer

    async def aclose(self) -> None:
        """Stop every child (shutdown)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for worker in list(self._all):
            await worker.reap()
        self._all.clear()
