"""`producer.aio`: waits with a time limit that return, time out, and let every cancellation
through, including one that lands in the loop turn where the awaited thing completes (where
`asyncio.wait_for` before Python 3.12 returns its result instead)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from producer.aio import unless_set, wait_for_event, wait_within


async def test_wait_within_returns_the_result_or_times_out() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    queue.put_nowait(7)
    assert await wait_within(queue.get(), 1.0) == 7
    assert await wait_within(asyncio.sleep(0, "no limit"), None) == "no limit"
    with pytest.raises(TimeoutError):
        await wait_within(queue.get(), 0.01)
    with pytest.raises(TimeoutError):  # a deadline already passed
        await wait_within(queue.get(), -1.0)
    queue.put_nowait(8)  # the timed-out get was cancelled: it took nothing
    assert queue.get_nowait() == 8


async def test_wait_for_event_says_whether_it_was_set() -> None:
    event = asyncio.Event()
    assert not await wait_for_event(event, 0.01)
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_for_event(event, 5.0)


async def test_unless_set_cuts_a_wait_short_and_cancels_it() -> None:
    """A stop cuts a blocking read short: the read is cancelled (and awaited, its cleanup run)
    and None comes back; a read that finishes first gives its result."""
    stop, cleaned = asyncio.Event(), []

    async def read() -> str:
        try:
            await asyncio.sleep(30)
            return "data"
        finally:
            cleaned.append(True)

    asyncio.get_running_loop().call_later(0.01, stop.set)
    assert await wait_within(unless_set(read(), stop), 5.0) is None
    assert cleaned == [True]
    assert await unless_set(asyncio.sleep(0, "data"), asyncio.Event()) == "data"


async def _cancelled_as_it_completes(wait) -> str:
    """Cancel a task waiting on an event in the same loop turn as the event is set: what the
    task then does ("cancelled", or "returned" when the cancellation was lost)."""
    event = asyncio.Event()
    returned = False

    async def waiter() -> None:
        nonlocal returned
        await wait(event.wait(), 10.0)
        returned = True

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)  # the task is waiting now
    event.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return "returned" if returned else "cancelled" if task.cancelled() else "other"


async def test_a_cancel_that_lands_as_the_wait_completes_is_not_lost() -> None:
    assert await _cancelled_as_it_completes(wait_within) == "cancelled"


async def test_the_race_is_real_for_the_wait_this_replaces() -> None:
    """The same race with `asyncio.wait_for` on this Python: lost before 3.12 (the reason for
    `wait_within`), kept from 3.12. Shows the test above can fail."""
    expected = "returned" if sys.version_info < (3, 12) else "cancelled"
    assert await _cancelled_as_it_completes(asyncio.wait_for) == expected
