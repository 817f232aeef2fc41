"""AsyncClient: the same behaviour as Client, awaited. FakeWorker runs in a thread where the
test needs it to act while the client waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import pytest
import redis

from producer.async_client import AsyncClient
from producer.jobs import JobFailed, JobNotFound
from producer.protocol import CANCEL_FLAG_TTL_S, JobStatus, Keys
from producer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conftest import FakeWorker

KEYS = Keys()


@pytest.fixture
async def aclient(redis_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(redis_url) as c:
        yield c


async def test_submit_and_concurrent_idempotency(
    aclient: AsyncClient, redis_url: str, redis_conn: redis.Redis, worker: FakeWorker
) -> None:
    others = [AsyncClient(redis_url) for _ in range(3)]
    clients = [aclient, *others] * 3
    handles = await asyncio.gather(*(c.submit("hi", job_id="same") for c in clients))
    assert sum(h.enqueued for h in handles) == 1
    assert redis_conn.xlen(KEYS.requests) == 1
    for other in others:
        await other.aclose()
    await aclient.submit([{"role": "user", "content": "yo"}], {"max_tokens": 3}, deadline_s=5)
    worker.take()
    chat = worker.take()
    assert chat.messages == [{"role": "user", "content": "yo"}]
    assert chat.sampling_params.max_tokens == 3 and chat.deadline is not None


async def test_submit_rejects_bad_input(aclient: AsyncClient) -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        await aclient.submit({"prompt": None})  # type: ignore[dict-item]


class AsyncSubscribeHookClient(AsyncClient):
    def __init__(self, url: str, hook: Callable[[], None]) -> None:
        super().__init__(url)
        self.hook = hook

    async def _on_subscribed(self, job_ids: list[str]) -> None:
        self.hook()


async def test_stream_is_exactly_once_across_subscribe_replay_window(
    redis_url: str, worker: FakeWorker
) -> None:
    events = worker.token_events(list("abcdef"))
    async with AsyncSubscribeHookClient(redis_url, lambda: worker.emit(job_id, events[2:4])) as c:
        handle = await c.submit("hi")
        job_id = handle.id
        worker.emit(job_id, events[:2])
        seen = []
        async for delta in handle.stream(timeout_s=5.0):
            seen.append(delta)
            if delta.seq == 3:
                worker.emit(job_id, events[4:])
    assert [d.seq for d in seen] == list(range(6))
    assert "".join(d.text for d in seen) == "abcdef"


@pytest.mark.parametrize("loss", ["connection", "message"])
async def test_stream_reads_from_the_log_what_the_channel_lost(
    aclient: AsyncClient, worker: FakeWorker, loss: str
) -> None:
    """As the blocking client's: a lost pub/sub connection, or an event stored but never relayed."""
    handle = await aclient.submit("hi")
    events = worker.token_events(list("abcdef"))
    worker.emit(handle.id, events[:2])
    seen = []
    async for delta in handle.stream(timeout_s=5.0):
        seen.append(delta.seq)
        if delta.seq == 1:
            worker.lose(handle.id, events[2], loss)
            worker.emit(handle.id, events[2 if loss == "connection" else 3 :])
    assert seen == list(range(6))


async def test_stream_and_result_of_a_live_job(aclient: AsyncClient, worker: FakeWorker) -> None:
    handle = await aclient.submit("hi", SamplingParams(n=2))

    def serve() -> None:
        job = worker.take()
        worker.wait_subscribed(job.id)
        worker.serve(job, ["a", "b"])

    start = time.monotonic()
    served = asyncio.create_task(asyncio.to_thread(serve))
    deltas = [d async for d in handle.stream(timeout_s=5.0)]
    await served
    assert sorted((d.index, d.seq, d.text) for d in deltas) == [
        (0, 0, "a"), (0, 1, "b"), (1, 0, "a"), (1, 1, "b")
    ]
    result = await handle.result(timeout_s=5.0)
    assert [o.text for o in result.outputs] == ["ab", "ab"] and result.status == JobStatus.FINISHED
    assert time.monotonic() - start < 2.0


async def test_result_timeout_and_failure(aclient: AsyncClient, worker: FakeWorker) -> None:
    handle = await aclient.submit("hi")
    with pytest.raises(TimeoutError):
        await handle.result(timeout_s=0.2)
    with pytest.raises(TimeoutError):
        [d async for d in handle.stream(timeout_s=0.2)]
    worker.fail(handle.id, "boom")
    with pytest.raises(JobFailed, match="boom"):
        await handle.result(timeout_s=5.0)
    with pytest.raises(JobFailed, match="boom"):
        [d async for d in handle.stream(timeout_s=5.0)]


async def test_status_cancel_and_unknown(
    aclient: AsyncClient, redis_conn: redis.Redis
) -> None:
    pubsub = redis_conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(KEYS.cancel_channel)
    assert pubsub.get_message(timeout=1.0) is None  # the confirmation
    handle = await aclient.submit("hi")
    assert await handle.status() == JobStatus.QUEUED
    await handle.cancel()
    assert 0 < redis_conn.ttl(KEYS.cancel_flag(handle.id)) <= CANCEL_FLAG_TTL_S
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and message["data"] == handle.id.encode()
    pubsub.close()
    with pytest.raises(JobNotFound):
        await aclient.job("nope").status()
    with pytest.raises(JobNotFound):
        await aclient.job("nope").result(timeout_s=1.0)


async def test_generate_and_inspect(aclient: AsyncClient, worker: FakeWorker) -> None:
    prompts = ["p0", {"prompt_token_ids": [5]}, [{"role": "user", "content": "p2"}]]

    def serve_all() -> None:
        for i in range(len(prompts)):
            worker.serve(worker.take(), [f"r{i}"])

    served = asyncio.create_task(asyncio.to_thread(serve_all))
    results = await aclient.generate(prompts, use_tqdm=False, timeout_s=10.0)
    await served
    assert [r.text for r in results] == ["r0", "r1", "r2"]  # served in submit order
    view = await aclient.inspect(results[1].id)
    assert view["job"]["prompt_token_ids"] == [5]
    assert view["record"]["status"] == "finished" and len(view["events"]) == 1
