"""``GET /stats`` on every vLLM API server, served from the engines' shared-memory snapshots.

Wired in with ``--middleware engine_patch.stats_route.StatsMiddleware`` (the launcher adds
it). A pure ASGI middleware: it answers ``/stats`` itself and passes every other request
through untouched (no `BaseHTTPMiddleware` wrapping, so streaming responses are unaffected).
Each API server process (``--api-server-count N``) builds its own instance and reads the
same files; no engine round-trip, no lock (the snapshot's seqlock makes reads safe).

With data parallelism the body aggregates the local engines (`engine_patch.aggregate`).
Until every local engine has published, or when no consistent snapshot could be read without
waiting (`engine_patch.snapshot`: readers never sleep on the API server's event loop),
``/stats`` answers 503 with an OpenAI-style error body whose ``code`` names the reason
(``missing``, ``foreign``, ``torn``, ``partial``); the gateway then treats the replica's state
as unknown for that poll.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from engine_patch import patch_config
from engine_patch.aggregate import stats_body
from engine_patch.snapshot import SnapshotError, SnapshotReader, SnapshotRecord

STATS_PATH = "/stats"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class SnapshotSource:
    """Finds and reads the snapshot files under one prefix (one per data-parallel engine)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._readers: dict[Path, SnapshotReader] = {}

    def _discover(self) -> None:
        pattern = glob.escape(self.prefix) + ".dp*"
        found = {Path(p) for p in glob.glob(pattern) if not p.endswith(".tmp")}
        for path in set(self._readers) - found:
            self._readers.pop(path).close()
        for path in found - set(self._readers):
            self._readers[path] = SnapshotReader(path)

    def _read_all(self) -> list[SnapshotRecord]:
        records = []
        for reader in self._readers.values():
            record = reader.read()
            if record is not None:
                records.append(record)
        return records

    def records(self) -> list[SnapshotRecord]:
        """Every local engine's latest record; raises `SnapshotError` if any is missing."""
        try:
            records = self._read_all() if self._readers else []
        except SnapshotError:
            records = []
        expected = max((r.dp_local_count for r in records), default=1)
        if len(records) < expected or len(records) < len(self._readers) or not records:
            # New or restarted engines: look at the directory again (rare; a glob costs
            # a directory listing, so it is not done on every poll).
            self._discover()
            records = self._read_all()
            expected = max((r.dp_local_count for r in records), default=1)
        if not records:
            raise SnapshotError(f"no engine has published a snapshot under {self.prefix}")
        if len(records) < expected:
            raise SnapshotError(
                f"{len(records)} of {expected} data-parallel engines have published a snapshot",
                "partial",
            )
        return records

    def body(self) -> tuple[int, bytes]:
        """HTTP status and JSON body for one ``GET /stats``."""
        try:
            payload: dict[str, Any] = stats_body(self.records())
            status = 200
        except SnapshotError as exc:
            payload = {
                "error": {
                    "message": str(exc),
                    "type": "stats_unavailable",
                    "param": None,
                    "code": exc.reason,
                }
            }
            status = 503
        return status, json.dumps(payload).encode()


class StatsMiddleware:
    """ASGI middleware answering ``GET /stats``; everything else goes to vLLM's app."""

    def __init__(self, app: ASGIApp, prefix: str | None = None) -> None:
        self.app = app
        self.source = SnapshotSource(prefix or patch_config.stats_prefix())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != STATS_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            status, body = (
                405,
                json.dumps(
                    {
                        "error": {
                            "message": "use GET /stats",
                            "type": "method_not_allowed",
                            "code": 405,
                        }
                    }
                ).encode(),
            )
        else:
            status, body = self.source.body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )
