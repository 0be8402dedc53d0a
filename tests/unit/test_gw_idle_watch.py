"""The idle bound of a relayed stream (sal_gateway.idle_watch): a silence ends the stream
only when the replica is not demonstrably alive; SSE comments and a slow client do not count."""

from __future__ import annotations

import asyncio

from sal_gateway.idle_watch import IdleWatch

IDLE_S = 0.05


async def _run(
    live: list[bool],
    feed: list[tuple[float, bytes]],
    sending: bool = False,
    idle_s: float = IDLE_S,
) -> float:
    """Start a watch, feed it `(delay_s, chunk)` touches, return when it fired (loop time
    since start, read in its callback: the feed may still be sleeping then; -1 if it never
    fired within 1 s of the feed's end)."""
    loop = asyncio.get_running_loop()
    fired = asyncio.Event()
    fired_at: list[float] = []

    def on_fire() -> None:
        fired_at.append(loop.time())
        fired.set()

    watch = IdleWatch(loop, idle_s, (lambda: live[0]) if live else None, on_fire)
    start = loop.time()
    watch.start()
    watch.sending = sending
    for delay_s, chunk in feed:
        await asyncio.sleep(delay_s)
        watch.touch(chunk)
    try:
        await asyncio.wait_for(fired.wait(), 1.0)
    except TimeoutError:
        watch.stop()
        return -1.0
    assert watch.fired
    return fired_at[0] - start


async def test_silence_on_a_dead_replica_fires_after_the_bound() -> None:
    took = await _run([False], [])
    assert IDLE_S <= took < IDLE_S + 0.5


async def test_literal_bound_fires_without_a_liveness_judge() -> None:
    assert await _run([], []) >= IDLE_S


async def test_content_restarts_the_silence_but_comments_do_not() -> None:
    idle_s = 0.5  # ten times the gap between chunks: room for a busy machine's timers
    content = [(0.05, b"data: {}\n\n")] * 12  # 0.6 s of content, longer than the bound
    assert await _run([False], content, idle_s=idle_s) >= 0.6 + idle_s
    comments = [(0.05, b": keep-alive\n\n")] * 12
    assert await _run([False], comments, idle_s=idle_s) < 0.6 + idle_s


async def test_a_live_engine_keeps_a_silent_stream_waiting_until_it_is_judged_dead() -> None:
    live = [True]
    assert await _run(live, []) == -1.0  # live for the whole second: never cut

    async def dies_later() -> float:
        task = asyncio.ensure_future(_run(live, []))
        await asyncio.sleep(0.3)
        live[0] = False
        return await task

    took = await dies_later()
    assert took >= 0.3  # only once judged not live (rechecked at least once a second)


async def test_a_slow_client_is_not_the_backends_silence() -> None:
    assert await _run([False], [], sending=True) == -1.0
