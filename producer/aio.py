"""asyncio waits with a time limit that never lose a cancellation, for the worker and the API.

`asyncio.wait_for` before Python 3.12 returns the result when the task is cancelled in the
same loop turn as its awaitable completes, and the cancellation is gone (CPython gh-86296).
A request cancelled on a client disconnect then kept following its job to the end instead of
cancelling it. These helpers wait with `asyncio.wait`, which always lets a cancellation
through; the awaitable's result is dropped then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`await awaitable`, raising TimeoutError once `timeout_s` passed (None: no limit)."""
    if timeout_s is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout_s))
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError(f"not done within {timeout_s} s")
    return task.result()


async def wait_for_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event` at most `timeout_s`; returns whether it is set."""
    try:
        await wait_within(event.wait(), timeout_s)
    except TimeoutError:
        pass
    return event.is_set()


async def unless_set(awaitable: Awaitable[T], event: asyncio.Event) -> T | None:
    """`await awaitable`, unless `event` is set first: then the awaitable is cancelled (and
    awaited, so that a Redis connection it held is closed) and None is returned. For a wait
    that a stop makes moot, such as a blocking read, which would otherwise hold the stop up."""
    task = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        stop.cancel()
        raise
    stop.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
