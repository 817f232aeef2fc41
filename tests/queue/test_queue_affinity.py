"""Prefix-cache affinity between two workers of one stream (worker.queue.affinity): the turns
of a conversation, and the jobs of one prompt_cache_key, run on the worker that ran the
first, whichever worker reads them, and are served from its prefix cache; an entry handed to a
worker that stopped is reclaimed by the other. Then the handing itself, against a real Redis
and heartbeat hashes the test writes: how many a worker is handed (its max_num_seqs less the
entries pending under its name), and nothing to one draining, asleep, paused or on another stream."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from collections.abc import Callable

import pytest
import redis
import redis.asyncio
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.jobs import build_job
from producer.pooling_params import PoolingParams
from producer.protocol import JobStatus, Keys, encode_job
from producer.records import WorkerInfo, decode_worker_info
from producer.redis_server import RedisServer, free_port
from producer.sampling_params import SamplingParams
from worker.queue.affinity import HEAD_CHARS, Affinity, affinity_digest
from worker.queue.config import WorkerConfig
from worker.queue.scripts import Scripts

TIMEOUT_S = 60.0
NAMES = ("aa", "ab")
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# a start longer than HEAD_CHARS, one per conversation; each turn adds to the last
FILLER = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
def metrics_ports() -> dict[str, int]:
    return {name: free_port() for name in NAMES}


@pytest.fixture(scope="module")
def workers(spawn: Callable[..., WorkerProcess], conn: redis.Redis, metrics_ports: dict[str, int]) -> dict[str, WorkerProcess]:
    procs = {name: spawn(name, GENQ_MAX_NUM_SEQS="4", GENQ_METRICS_PORT=str(metrics_ports[name]),
                         GENQ_METRICS_HOST="127.0.0.1") for name in NAMES}
    for proc in procs.values():
        proc.wait_ready(conn)
    return procs


@pytest.fixture
def keys(workers: dict[str, WorkerProcess]) -> Keys:
    return workers["aa"].keys


def ran_on(conn: redis.Redis, keys: Keys, job_id: str) -> str:
    return conn.hget(keys.job(job_id), "worker").decode()


def handoffs(port: int) -> dict[str, float]:
    """A worker's affinity counters, from its Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("genq:affinity_handoffs_") and "_total" in line.split("{")[0]}


def test_turns_of_a_conversation_run_where_it_began(
    client: Client, conn: redis.Redis, keys: Keys, workers: dict[str, WorkerProcess], metrics_ports: dict[str, int]
) -> None:
    """Eight conversations of three turns each, a turn submitted once the one before ended,
    each round of turns in another order (idle workers take entries in turns, so the same order
    would put each turn where its first went anyway): each turn runs on its first turn's
    worker, read from that worker's prefix cache, some by a handoff."""
    assert len(f"conversation 0: {FILLER}") > HEAD_CHARS
    texts = {c: f"conversation {c}: {FILLER}" for c in range(8)}
    first: dict[int, str] = {}
    for turn in range(3):
        for c in [*range(turn, 8), *range(turn)]:
            result = client.submit(texts[c], PARAMS).result(TIMEOUT_S)
            assert result.status == JobStatus.FINISHED
            worker = ran_on(conn, keys, result.id)
            first.setdefault(c, worker)
            assert worker == first[c], (c, turn)
            if turn:
                assert result.usage is not None and result.usage["cached_tokens"] > 0, (c, turn)
            texts[c] += result.text + f" and then turn {turn + 1}"
    assert set(first.values()) == set(NAMES)  # both began conversations: both read jobs
    assert any("whose prefix cache holds their start" in w.log() for w in workers.values())
    counts = [handoffs(port) for port in metrics_ports.values()]
    sent = sum(c["genq:affinity_handoffs_sent_total"] for c in counts)
    assert sent > 0 and sent == sum(c["genq:affinity_handoffs_taken_total"] for c in counts)

    def beats() -> list[WorkerInfo] | None:  # what genq status shows: handoffs taken, the cache's hits
        infos = [decode_worker_info(conn.hgetall(keys.worker(name)), name) for name in NAMES]
        return infos if sum(i.affinity_handoffs_taken_total for i in infos) == sent else None

    infos = wait_for(beats, TIMEOUT_S, "heartbeats counting the handoffs")
    assert all(0 < i.prefix_cache_hits_total < i.prefix_cache_queries_total for i in infos)


def test_jobs_of_one_prompt_cache_key_run_on_one_worker_while_it_has_room(
    client: Client, conn: redis.Redis, keys: Keys
) -> None:
    """Prompts with nothing in common, one prompt_cache_key, one at a time: one worker runs
    them all. Twelve at once (three times its max_num_seqs): the other worker runs some."""
    key = {"prompt_cache_key": "tenant-7"}
    ids = [client.submit({"prompt": f"{i} unrelated", **key}, PARAMS).result(TIMEOUT_S).id for i in range(6)]
    assert len({ran_on(conn, keys, job_id) for job_id in ids}) == 1
    burst = [client.submit({"prompt": f"{i} at once", **key}, PARAMS).id for i in range(12)]
    assert all(client.result(job_id, TIMEOUT_S).status == JobStatus.FINISHED for job_id in burst)
    assert {ran_on(conn, keys, job_id) for job_id in burst} == set(NAMES)


def test_a_handoff_to_a_stopped_worker_is_reclaimed(
    client: Client, conn: redis.Redis, keys: Keys, workers: dict[str, WorkerProcess]
) -> None:
    """The owner of a conversation stops (SIGSTOP: its heartbeat hash lives on, so the other
    worker still hands it the next turns): those turns wait out the claim timeout in its
    pending list, and the other worker reclaims and runs them."""
    owner_id = client.submit({"prompt": "stop me", "prompt_cache_key": "stalled"}, PARAMS).id
    assert client.result(owner_id, TIMEOUT_S).status == JobStatus.FINISHED
    owner = workers[ran_on(conn, keys, owner_id)]
    other = next(n for n in NAMES if workers[n] is not owner)
    os.kill(owner.pid, signal.SIGSTOP)
    try:
        ids = [client.submit({"prompt": f"next {i}", "prompt_cache_key": "stalled"}, PARAMS).id for i in range(3)]
        results = [client.result(job_id, TIMEOUT_S) for job_id in ids]
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    assert all(r.status == JobStatus.FINISHED for r in results)
    assert {ran_on(conn, keys, job_id) for job_id in ids} == {other}
    assert f"to worker {owner.name}" in workers[other].log()  # they were handed over first


def test_a_paused_worker_hands_back_what_it_is_handed(client: Client, conn: redis.Redis, keys: Keys,
                                                       redis_server: RedisServer) -> None:
    """The model's workers paused (genq:pause:<model>, written by hand as docs/queue.md says), an
    entry handed to one (by a reader that had not heard) goes back, claimable by a worker that
    takes jobs, rather than into its engine: the job stays queued, and runs after the resume."""
    pause = keys.pause(decode_worker_info(conn.hgetall(keys.worker("aa"))).model)

    def infos() -> list[WorkerInfo]:
        return [decode_worker_info(conn.hgetall(keys.worker(name)), name) for name in NAMES]

    def idle_ms(entry: str) -> int:
        return int(conn.xpending_range(keys.requests, keys.group, entry, entry, 1)[0]["time_since_delivered"])

    conn.hset(pause, mapping={"paused": 1, "mode": "keep"})
    conn.hincrby(pause, "count", 1)
    try:
        wait_for(lambda: all(i.paused and not i.free_slots for i in infos()), TIMEOUT_S, "both workers paused")
        job = client.submit("handed while paused", PARAMS)
        ((entry_id, _),) = conn.xrevrange(keys.requests, count=1)
        entry = entry_id.decode()
        # the reader's: a worker's read that was waiting when the pause came may have taken it
        # (and handed it back), so it is claimed as well as read
        conn.xreadgroup(keys.group, "reader", {keys.requests: ">"})
        conn.xclaim(keys.requests, keys.group, "reader", 0, [entry])
        assert asyncio.run(hand_off(redis_server.url, keys, "aa", entry)) == [entry]
        wait_for(lambda: idle_ms(entry) > 10**9, TIMEOUT_S, "the entry handed back")
        beat = infos()[0].heartbeat_at
        wait_for(lambda: infos()[0].heartbeat_at > beat, TIMEOUT_S, "a beat after")
        assert client.status(job.id) == JobStatus.QUEUED
    finally:
        conn.hset(pause, "paused", 0)
        conn.hincrby(pause, "count", 1)
    assert client.result(job.id, TIMEOUT_S).status == JobStatus.FINISHED


async def hand_off(url: str, keys: Keys, worker: str, entry: str) -> list[str]:
    """Hand an entry that consumer "reader" holds to `worker`, as a worker's affinity does."""
    conn = redis.asyncio.Redis.from_url(url)
    try:
        return await Scripts(conn, keys, "reader").hand_off(worker, [entry])
    finally:
        await conn.aclose()


# -- the handing, without worker processes ---------------------------------------------------


def test_a_conversations_turns_share_a_key_and_salts_models_and_embeddings_part_them() -> None:
    system = {"role": "system", "content": "You are terse."}
    turn1 = [system, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More"}]
    digest = affinity_digest(build_job(turn1, PARAMS))
    assert digest is not None and affinity_digest(build_job(turn2, PARAMS)) == digest
    other_first = [system, {"role": "user", "content": "Bye"}]
    assert affinity_digest(build_job(other_first, PARAMS)) != digest
    assert affinity_digest(build_job({"messages": turn1, "cache_salt": "s"}, PARAMS)) != digest
    assert affinity_digest(build_job(turn1, PARAMS, model="other")) != digest
    long = "x" * HEAD_CHARS
    assert affinity_digest(build_job(long + " a", PARAMS)) == affinity_digest(build_job(long + " b", PARAMS))
    keyed = [affinity_digest(build_job({"prompt": p, "prompt_cache_key": "k"}, PARAMS)) for p in ("a", "b")]
    assert keyed[0] == keyed[1] != affinity_digest(build_job("a", PARAMS))
    assert affinity_digest(build_job("a", PARAMS, pooling_params=PoolingParams())) is None


def test_a_worker_is_handed_what_its_room_holds(redis_server: RedisServer) -> None:
    asyncio.run(_handing(redis_server.url))


async def _handing(url: str) -> None:
    """The owner may run two: with one entry pending under its name, it is handed one of the
    reader's three; once it acknowledges that, another. With room to spare, it is handed none
    while it holds more than BALANCE_SLACK entries above the reader's."""
    keys = Keys("t-handing:")
    conn = redis.asyncio.Redis.from_url(url)
    scripts = Scripts(conn, keys, "reader")
    await scripts.ensure_group()
    affinity = Affinity(WorkerConfig(name="reader", heartbeat_s=0.5, claim_idle_s=2), scripts)
    jobs = [build_job({"prompt": f"job {i}", "prompt_cache_key": "k"}, PARAMS) for i in range(4)]
    for job in jobs:
        await conn.xadd(keys.requests, encode_job(job))
    reply = await conn.xreadgroup(keys.group, "reader", {keys.requests: ">"})
    entries = [(e.decode(), job) for (e, _), job in zip(reply[0][1], jobs, strict=True)]
    running, entries = entries[0], entries[1:]
    await conn.xclaim(keys.requests, keys.group, "owner", 0, [running[0]])  # the owner runs one
    await conn.set(keys.affinity(affinity_digest(jobs[0]) or ""), "owner")
    owner = keys.worker("owner")

    async def beat(state: str = "serving", queue: str = "", sleep_level: int = 0, paused: int = 0) -> None:
        await conn.hset(owner, mapping={"state": state, "queue": queue, "max_num_seqs": 2, "sleep_level": sleep_level,
                                        "paused": paused})

    async def pending(consumer: str) -> list[str]:
        rows = await conn.xpending_range(keys.requests, keys.group, "-", "+", 10, consumername=consumer)
        return [r["message_id"].decode() for r in rows]

    try:
        for state, queue, sleep_level, paused in (("draining", "", 0, 0), ("serving", "other", 0, 0),
                                                  ("serving", "", 1, 0), ("serving", "", 0, 1)):
            await beat(state, queue, sleep_level, paused)  # (asleep or paused: it takes no jobs)
            assert await affinity.hand_off(entries) == set(), (state, queue, sleep_level, paused)
        await conn.delete(owner)  # gone
        assert await affinity.hand_off(entries) == set()
        await beat()
        pubsub = conn.pubsub()
        await pubsub.subscribe(keys.handoff_channel("owner"))
        handed = await affinity.hand_off(entries)
        assert handed == {entries[0][0]} and set(await pending("owner")) == {running[0], entries[0][0]}
        message = await wait_message(pubsub)
        assert message["data"].decode() == entries[0][0]
        assert await affinity.hand_off(entries[1:]) == set()  # its two are spoken for
        await conn.xack(keys.requests, keys.group, running[0])  # one ended
        assert await affinity.hand_off(entries[1:]) == {entries[1][0]}
        assert await pending("reader") == [entries[2][0]]
        await conn.hset(owner, "max_num_seqs", 100)  # room to spare, but 4 more than the reader's 1 ...
        for i in range(3):
            entry = await conn.xadd(keys.requests, encode_job(build_job(f"filler {i}", PARAMS)))
            await conn.xreadgroup(keys.group, "owner", {keys.requests: ">"})
        assert len(await pending("owner")) == 5 and entry
        assert await affinity.hand_off(entries[2:]) == set()  # ... is as many as a prefix-cache hit is worth
        await conn.xgroup_destroy(keys.requests, keys.group)  # (a FLUSHALL, say): nothing handed, no error
        assert await affinity.hand_off(entries[2:]) == set()
        await pubsub.aclose()
        await affinity.own([jobs[0]])
        assert await conn.get(keys.affinity(affinity_digest(jobs[0]) or "")) == b"reader"
        assert 0 < await conn.pttl(keys.affinity(affinity_digest(jobs[0]) or "")) <= 600_000
    finally:
        for key in await conn.keys(f"{keys.prefix}*"):
            await conn.delete(key)
        await conn.aclose()


async def wait_message(pubsub: redis.asyncio.client.PubSub) -> dict:
    deadline = asyncio.get_running_loop().time() + TIMEOUT_S
    while asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        if message is not None:
            return message
    raise AssertionError("no handoff notice")

