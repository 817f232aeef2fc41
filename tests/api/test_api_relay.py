"""The relay against a real Redis, with this test playing the worker's part: it writes events
and records exactly as the protocol tells a worker to (APPEND_EVENTS_LUA, encode_record)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest
import redis.asyncio

from api.relay import Relay
from producer.async_client import AsyncClient
from producer.jobs import JobNotFound
from producer.protocol import (
    APPEND_EVENTS_LUA,
    EVENT_FIELD,
    EVENTS_TTL_S,
    Event,
    JobStatus,
    encode_event,
)
from producer.records import CompletionOutput, JobRecord, encode_record

TIMEOUT_S = 10.0


class Peer:
    """The worker's side of the protocol, written by hand."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._append = client.redis.register_script(APPEND_EVENTS_LUA)

    async def emit(self, job_id: str, *events: Event) -> None:
        args = [EVENTS_TTL_S, *(encode_event(e) for e in events)]
        await self._append(keys=[self.client.keys.events(job_id)], args=args)

    async def end(self, job_id: str, status: JobStatus) -> None:
        record = encode_record(JobRecord(status=status))
        await self.client.redis.hset(self.client.keys.job(job_id), mapping=record)


def token(seq: int, index: int = 0, finished: bool = False) -> Event:
    return Event(seq=seq, token_ids=[10 + seq], text=f"t{seq} ", index=index, finished=finished,
                 finish_reason="length" if finished else None)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(redis_url) as c:
        yield c


@pytest.fixture
async def relay(client: AsyncClient) -> AsyncIterator[Relay]:
    r = Relay(client.redis, client.keys)
    await r.start()
    yield r
    await r.aclose()


async def follow_all(relay: Relay, job_ids: list[str], **kwargs) -> list[tuple[str, int, int]]:
    out = []
    async with aclosing(relay.follow(job_ids, timeout_s=TIMEOUT_S, **kwargs)) as events:
        async for job_id, event in events:
            out.append((job_id, event.index, event.seq))
    return out


async def subscribed(client: AsyncClient, job_id: str) -> None:
    """Until the relay listens on the job's channel."""
    channel = client.keys.events(job_id)
    async with asyncio.timeout(TIMEOUT_S):
        while (await client.redis.pubsub_numsub(channel))[0][1] == 0:
            await asyncio.sleep(0.005)


async def test_replay_then_live_events_without_doubles(client: AsyncClient, relay: Relay) -> None:
    await client.submit("hi", job_id="j1")
    peer = Peer(client)
    await peer.emit("j1", token(0), token(1))
    task = asyncio.create_task(follow_all(relay, ["j1"]))
    await subscribed(client, "j1")
    await peer.emit("j1", token(1), token(2))  # seq 1 again, as a reclaiming worker may send
    await peer.emit("j1", token(3, finished=True))
    assert [seq for _, _, seq in await task] == [0, 1, 2, 3]
    assert relay.num_channels == 0


async def test_resume_skips_through_the_last_seen_event_of_any_index(
    client: AsyncClient, relay: Relay
) -> None:
    await client.submit("hi", {"n": 2}, job_id="j2")
    peer = Peer(client)
    await peer.emit("j2", token(0, 0), token(0, 1), token(1, 0), token(1, 1, finished=True))
    await peer.emit("j2", token(2, 0, finished=True))
    await peer.end("j2", JobStatus.FINISHED)
    after = await follow_all(relay, ["j2"], resume=(0, 1))
    assert after == [("j2", 1, 1), ("j2", 0, 2)]
    assert await follow_all(relay, ["j2"], resume=(0, 2)) == []


async def test_many_followers_share_one_subscription(client: AsyncClient, relay: Relay) -> None:
    await client.submit("hi", job_id="j3")
    tasks = [asyncio.create_task(follow_all(relay, ["j3"])) for _ in range(5)]
    await subscribed(client, "j3")  # followers joining later replay what they missed
    assert (await client.redis.pubsub_numsub(client.keys.events("j3")))[0][1] == 1
    await Peer(client).emit("j3", token(0), token(1, finished=True))
    results = await asyncio.gather(*tasks)
    assert all(r == [("j3", 0, 0), ("j3", 0, 1)] for r in results)


async def test_reconnect_replays_what_was_published_meanwhile(
    client: AsyncClient, relay: Relay, redis_url: str
) -> None:
    await client.submit("hi", job_id="j4")
    peer = Peer(client)
    task = asyncio.create_task(follow_all(relay, ["j4"]))
    await subscribed(client, "j4")
    await peer.emit("j4", token(0))
    admin = redis.asyncio.Redis.from_url(redis_url)
    await admin.client_kill_filter(_type="pubsub")  # the relay's shared connection
    await peer.emit("j4", token(1))  # nobody subscribed: only the stream has it
    await subscribed(client, "j4")  # the relay reconnected and re-subscribed
    await peer.emit("j4", token(2, finished=True))
    assert [seq for _, _, seq in await task] == [0, 1, 2]
    await admin.aclose()


async def test_an_event_whose_message_was_lost_is_read_from_the_stream(client: AsyncClient, relay: Relay) -> None:
    """Stored but never relayed (its Redis node died between the two, the replica having it):
    the next message skips its seq, and the relay reads the job's stream first."""
    await client.submit("hi", job_id="j9")
    peer = Peer(client)
    task = asyncio.create_task(follow_all(relay, ["j9"]))
    await subscribed(client, "j9")
    await peer.emit("j9", token(0))
    await client.redis.xadd(client.keys.events("j9"), {EVENT_FIELD: encode_event(token(1))})  # (no PUBLISH)
    await peer.emit("j9", token(2, finished=True))
    assert [seq for _, _, seq in await task] == [0, 1, 2]


async def test_terminal_job_with_expired_events_ends_the_follow(
    client: AsyncClient, relay: Relay
) -> None:
    await client.submit("hi", job_id="j5")
    await Peer(client).end("j5", JobStatus.FINISHED)
    assert await follow_all(relay, ["j5"]) == []


async def test_late_follow_of_a_job_whose_events_expired_gets_the_record_outputs(
    client: AsyncClient, relay: Relay
) -> None:
    """Events expire soon after the end (GENQ_EVENTS_RETENTION_S); the record keeps each
    completion's text and token ids, which a follower that came later gets as the last events."""
    await client.submit("hi", job_id="j7", sampling_params={"n": 2})
    outputs = [CompletionOutput(0, "t0 t1 ", [10, 11], "length"), CompletionOutput(1, "u", [5], "stop", 7)]
    record = JobRecord(status=JobStatus.FINISHED, n=2, text="t0 t1 ", outputs=outputs, prompt_tokens=2,
                       completion_tokens=3)
    await client.redis.hset(client.keys.job("j7"), mapping=encode_record(record))
    got = []
    async with aclosing(relay.follow(["j7"], timeout_s=TIMEOUT_S)) as events:
        async for _, event in events:
            got.append(event)
    assert [(e.index, e.seq, e.text, e.token_ids, e.finished, e.finish_reason, e.stop_reason) for e in got] == [
        (0, 0, "t0 t1 ", [10, 11], True, "length", None), (1, 0, "u", [5], True, "stop", 7)]
    assert got[0].usage == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    # a client resuming after event 0:0 it saw before they expired: the end, with nothing repeated
    resumed = []
    async with aclosing(relay.follow(["j7"], resume=(0, 0), timeout_s=TIMEOUT_S)) as events:
        async for _, event in events:
            resumed.append((event.index, event.seq, event.text, event.finished))
    assert resumed == [(0, 1, "", True), (1, 0, "u", True)]


async def test_unknown_job_and_timeout(client: AsyncClient, relay: Relay) -> None:
    with pytest.raises(JobNotFound):
        await follow_all(relay, ["nope"])
    await client.submit("hi", job_id="j6")
    with pytest.raises(TimeoutError):
        async with aclosing(relay.follow(["j6"], timeout_s=0.2)) as events:
            async for _ in events:
                pass
    assert relay.num_channels == 0
