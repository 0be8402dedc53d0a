"""DNS discovery: URL building (pure) and the watch loop driven by a scripted fake resolver."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from sal_gateway.discovery import backend_urls, resolve_addresses, watch_dns

# --- backend_urls ------------------------------------------------------------------------


def test_backend_urls_sorted_and_deduplicated() -> None:
    urls = backend_urls(["10.0.0.2", "10.0.0.1", "10.0.0.2"], 8000, "http")
    assert urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_backend_urls_brackets_ipv6_and_escapes_zone() -> None:
    urls = backend_urls(["fd00::0:1", "fe80::1%eth0", "10.1.2.3"], 8443, "https")
    assert urls == [
        "https://10.1.2.3:8443",
        "https://[fd00::1]:8443",
        "https://[fe80::1%25eth0]:8443",
    ]


def test_backend_urls_passes_hostnames_through() -> None:
    assert backend_urls(["vllm-0.vllm-headless"], 8000, "http") == [
        "http://vllm-0.vllm-headless:8000"
    ]


def test_backend_urls_equal_sets_give_equal_lists() -> None:
    a = backend_urls(["10.0.0.3", "10.0.0.1", "::1"], 8000, "http")
    b = backend_urls(["::1", "10.0.0.1", "10.0.0.3", "10.0.0.1"], 8000, "http")
    assert a == b


@pytest.mark.parametrize(("port", "scheme"), [(0, "http"), (65536, "http"), (8000, "")])
def test_backend_urls_rejects_bad_port_or_scheme(port: int, scheme: str) -> None:
    with pytest.raises(ValueError, match="discovery"):
        backend_urls(["10.0.0.1"], port, scheme)


# --- watch_dns with a fake resolver ------------------------------------------------------


class ScriptedResolver:
    """A fake DNS: each resolution takes the next scripted answer (a list or an exception).

    Resolutions block until the test supplies an answer, so the test decides exactly when each
    round happens — no sleeps or timing assumptions.
    """

    def __init__(self) -> None:
        self._answers: asyncio.Queue[list[str] | Exception] = asyncio.Queue()
        self.queries: list[tuple[str, int]] = []
        self._queried = asyncio.Event()

    def answer(self, value: list[str] | Exception) -> None:
        self._answers.put_nowait(value)

    async def wait_queries(self, rounds: int) -> None:
        """Wait until the watcher has issued ``rounds`` resolutions in total."""
        async with asyncio.timeout(5):
            while len(self.queries) < rounds:
                self._queried.clear()
                await self._queried.wait()

    async def __call__(self, host: str, port: int) -> list[str]:
        self.queries.append((host, port))
        self._queried.set()
        value = await self._answers.get()
        if isinstance(value, Exception):
            raise value
        return value


class ChangeLog:
    """Collects ``on_change`` calls and lets a test await the next one."""

    def __init__(self, fail_first: int = 0) -> None:
        self.calls: list[list[str]] = []
        self._fail_left = fail_first
        self._event = asyncio.Event()

    def __call__(self, urls: list[str]) -> None:
        self.calls.append(urls)
        self._event.set()
        if self._fail_left:
            self._fail_left -= 1
            raise RuntimeError("state table rejected the update")

    async def next_call(self) -> list[str]:
        async with asyncio.timeout(5):
            await self._event.wait()
        self._event.clear()
        return self.calls[-1]


def _start(
    resolver: ScriptedResolver,
    on_change: Callable[[list[str]], None],
    *,
    resolve_timeout_s: float = 5.0,
) -> asyncio.Task[None]:
    return asyncio.create_task(
        watch_dns(
            "vllm-headless.default.svc.cluster.local",
            8000,
            "http",
            0.001,
            on_change,
            resolver,
            resolve_timeout_s=resolve_timeout_s,
        )
    )


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_first_resolution_is_reported_with_name_and_port() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog()
    task = _start(resolver, changes)
    resolver.answer(["10.0.0.2", "10.0.0.1"])
    assert await changes.next_call() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert resolver.queries[0] == ("vllm-headless.default.svc.cluster.local", 8000)
    await _stop(task)


async def test_only_changes_are_reported() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog()
    task = _start(resolver, changes)
    resolver.answer(["10.0.0.1", "10.0.0.2"])
    await changes.next_call()
    # Same set in a different order and with duplicates: not a change.
    resolver.answer(["10.0.0.2", "10.0.0.1", "10.0.0.1"])
    # A pod is added (scale-up), then one goes away (scale-down / not ready).
    resolver.answer(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert await changes.next_call() == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ]
    resolver.answer(["10.0.0.3", "10.0.0.1"])
    assert await changes.next_call() == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    await resolver.wait_queries(5)  # the watcher keeps polling
    await _stop(task)
    assert len(changes.calls) == 3


async def test_failed_resolution_keeps_last_good_set() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog()
    task = _start(resolver, changes)
    resolver.answer(["10.0.0.1"])
    await changes.next_call()
    resolver.answer(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    resolver.answer(RuntimeError("resolver bug"))
    resolver.answer(["10.0.0.1"])  # back, unchanged: nothing to report
    resolver.answer(["10.0.0.1", "10.0.0.9"])
    assert await changes.next_call() == ["http://10.0.0.1:8000", "http://10.0.0.9:8000"]
    await _stop(task)
    assert changes.calls == [
        ["http://10.0.0.1:8000"],
        ["http://10.0.0.1:8000", "http://10.0.0.9:8000"],
    ]


async def test_failure_before_any_success_reports_nothing_until_success() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog()
    task = _start(resolver, changes)
    resolver.answer(OSError("network unreachable"))
    await resolver.wait_queries(2)
    assert changes.calls == []
    resolver.answer(["10.0.0.5"])
    assert await changes.next_call() == ["http://10.0.0.5:8000"]
    await _stop(task)


async def test_successful_empty_answer_is_a_change() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog()
    task = _start(resolver, changes)
    resolver.answer(["10.0.0.1"])
    await changes.next_call()
    resolver.answer([])
    assert await changes.next_call() == []
    await _stop(task)


async def test_hung_resolver_times_out_and_loop_continues() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog()
    task = _start(resolver, changes, resolve_timeout_s=0.01)
    # No answer for the first query: it times out; the second query gets an answer.
    await resolver.wait_queries(2)
    resolver.answer(["10.0.0.7"])
    assert await changes.next_call() == ["http://10.0.0.7:8000"]
    await _stop(task)


async def test_on_change_failure_is_retried_next_round() -> None:
    resolver, changes = ScriptedResolver(), ChangeLog(fail_first=1)
    task = _start(resolver, changes)
    resolver.answer(["10.0.0.1"])
    await changes.next_call()  # raised inside on_change
    resolver.answer(["10.0.0.1"])  # same set is offered again because it was never accepted
    assert await changes.next_call() == ["http://10.0.0.1:8000"]
    await _stop(task)
    assert changes.calls == [["http://10.0.0.1:8000"], ["http://10.0.0.1:8000"]]


@pytest.mark.parametrize("interval_s", [0.0, -1.0])
async def test_rejects_non_positive_interval(interval_s: float) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        await watch_dns("x", 8000, "http", interval_s, lambda urls: None)


async def test_default_resolver_resolves_localhost_literal() -> None:
    # An IP literal resolves without any DNS server, so this exercises getaddrinfo offline.
    assert set(await resolve_addresses("127.0.0.1", 8000)) == {"127.0.0.1"}


async def test_default_resolver_raises_for_unknown_name() -> None:
    with pytest.raises(socket.gaierror):
        await resolve_addresses("no-such-host.invalid", 8000)
