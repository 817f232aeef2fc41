"""The worker's delivery rules without a model: the Lua scripts against the real Redis (each
test under its own prefix), and the plain-Python bookkeeping and capacity rule."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio

from producer.jobs import build_job
from producer.protocol import (
    DEFAULT_EVENTS_RETENTION_S,
    EVENT_FIELD,
    FINISH_ABORT,
    LANE_HIGH,
    LANE_LOW,
    LANE_NORMAL,
    LANES,
    Event,
    JobStatus,
    Keys,
    decode_event,
    encode_event,
    encode_job,
    entry_ref,
    split_ref,
)
from producer.records import decode_record
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams
from worker.queue.config import WorkerConfig
from worker.queue.engine_thread import EngineStats, intake_capacity
from worker.queue.intake import LaneReader
from worker.queue.jobs import (
    HeldJob,
    Meter,
    ShardTurns,
    TenantTokens,
    TokenRate,
    abort_events,
    coalescing_interval_s,
    completion_event,
    final_record,
    hold_delta,
    new_completions,
    progress_from_events,
    publish_due,
    unsent_events,
)
from worker.queue.scripts import RELEASED_IDLE_MS, DeadLetter, Forward, JobWrite, NameTaken, Scripts


@pytest.fixture
async def scripts(redis_server: RedisServer) -> AsyncIterator[Scripts]:
    conn = redis.asyncio.Redis.from_url(redis_server.url)
    s = Scripts(conn, Keys(f"unit-{uuid.uuid4().hex[:8]}:"), "me")
    await s.ensure_group()
    yield s
    await conn.aclose()


async def deliver(s: Scripts, job_id: str, consumer: str = "me") -> str:
    """Enqueue a job and deliver it to `consumer`; returns the entry id."""
    job = build_job("hi", SamplingParams(max_tokens=4), job_id=job_id)
    await s.conn.xadd(s.keys.requests, encode_job(job))
    reply = await s.conn.xreadgroup(s.keys.group, consumer, {s.keys.requests: ">"}, count=1)
    return reply[0][1][0][0].decode()


async def pending(s: Scripts, entry_id: str) -> dict:
    [row] = await s.conn.xpending_range(s.keys.requests, s.keys.group, entry_id, entry_id, 1)
    return row


async def test_publish_writes_only_entries_it_still_owns(scripts: Scripts) -> None:
    mine, stolen = await deliver(scripts, "a"), await deliver(scripts, "b")
    await scripts.conn.xclaim(scripts.keys.requests, scripts.keys.group, "other", 0, [stolen])
    event = encode_event(Event(seq=0, token_ids=[7], text="x"))
    held = held_job("a")
    abort_events(held)
    record = final_record(held, "me", time.time())
    lost = await scripts.publish([
        JobWrite("a", mine, [event], record), JobWrite("b", stolen, [event], record),
    ])
    assert lost == {stolen}
    assert await scripts.conn.xlen(scripts.keys.events("a")) == 1
    assert not await scripts.conn.exists(scripts.keys.events("b"), scripts.keys.job("b"))
    rec = decode_record(await scripts.conn.hgetall(scripts.keys.job("a")))
    assert rec.status == JobStatus.CANCELLED  # every completion aborted
    assert 0 < await scripts.conn.ttl(scripts.keys.job("a"))
    info = await scripts.conn.xpending(scripts.keys.requests, scripts.keys.group)
    assert info["pending"] == 1  # a acked, b still the other worker's
    # what the log of a lost entry says about its holder
    holders = await scripts.holders([stolen, mine])
    assert holders[stolen] == "worker other (delivered 2 times)"
    assert holders[mine].startswith("nobody: it is no longer pending")


async def test_an_ended_jobs_events_expire_after_the_retention_not_a_day(scripts: Scripts) -> None:
    """While a job runs its events live a day from the last append; the write that ends it
    cuts them to the retention (0: gone at once), the record keeping its outputs."""
    running = await deliver(scripts, "run")
    event = encode_event(Event(seq=0, token_ids=[7], text="x"))
    await scripts.publish([JobWrite("run", running, [event])])
    assert await scripts.conn.ttl(scripts.keys.events("run")) > 3600
    held = held_job("run")
    completion_event(held, 0, "x", [7], None)
    completion_event(held, 0, "y", [8], "length")
    await scripts.publish([JobWrite("run", running, [event], final_record(held, "me", time.time()))])
    assert 0 < await scripts.conn.ttl(scripts.keys.events("run")) <= DEFAULT_EVENTS_RETENTION_S
    assert await scripts.conn.ttl(scripts.keys.job("run")) > 3600
    assert decode_record(await scripts.conn.hgetall(scripts.keys.job("run"))).outputs[0].token_ids == [7, 8]
    gone = Scripts(scripts.conn, scripts.keys, "me", events_retention_s=0)
    entry = await deliver(scripts, "now")
    await gone.publish([JobWrite("now", entry, [event], final_record(held, "me", time.time()))])
    assert not await scripts.conn.exists(scripts.keys.events("now"))
    assert await scripts.conn.exists(scripts.keys.job("now"))


async def test_a_finishing_write_meters_its_tokens_once(scripts: Scripts) -> None:
    mine, stolen, running = await deliver(scripts, "a"), await deliver(scripts, "b"), await deliver(scripts, "c")
    await scripts.conn.xclaim(scripts.keys.requests, scripts.keys.group, "other", 0, [stolen])
    meter = Meter("2026-11-30", "key1", "smol", 7, 3, cached_tokens=4)
    record = {"status": "finished"}
    lost = await scripts.publish([
        JobWrite("a", mine, [], record, meter), JobWrite("b", stolen, [], record, meter),
        JobWrite("c", running, [encode_event(Event(seq=0, token_ids=[1]))], None, meter),  # not ending
    ])
    assert lost == {stolen}
    usage = scripts.keys.usage("2026-11-30")
    assert await scripts.conn.hgetall(usage) == {
        b"key1\tsmol\trequests": b"1", b"key1\tsmol\tprompt_tokens": b"7", b"key1\tsmol\tcompletion_tokens": b"3",
        b"key1\tsmol\tcached_tokens": b"4"}
    assert await scripts.conn.ttl(usage) > 300 * 24 * 3600
    await scripts.publish([JobWrite("a", mine, [], record, meter)])  # acked already: not ours
    assert await scripts.conn.hget(usage, "key1\tsmol\trequests") == b"1"


async def test_every_write_adds_its_tokens_to_the_tenants_minute(scripts: Scripts) -> None:
    """For GENQ_RATE_LIMIT_TPM: a running job's tokens count as they are written, in the
    minute they are written; a lost entry's do not (its new owner counts its own)."""
    running, stolen = await deliver(scripts, "a"), await deliver(scripts, "b")
    await scripts.conn.xclaim(scripts.keys.requests, scripts.keys.group, "other", 0, [stolen])
    event = [encode_event(Event(seq=0, token_ids=[1]))]
    await scripts.publish([JobWrite("a", running, event, tenant_tokens=TenantTokens("key1", 29_000_000, 9)),
                           JobWrite("b", stolen, event, tenant_tokens=TenantTokens("key1", 29_000_000, 5))])
    minute = scripts.keys.tokens("key1", 29_000_000)
    assert await scripts.conn.get(minute) == b"9" and 0 < await scripts.conn.ttl(minute) <= 120
    await scripts.publish([JobWrite("a", running, event, tenant_tokens=TenantTokens("key1", 29_000_000, 1)),
                           JobWrite("a", running, event, tenant_tokens=TenantTokens("key1", 29_000_001, 2))])
    assert await scripts.conn.get(minute) == b"10"
    assert await scripts.conn.get(scripts.keys.tokens("key1", 29_000_001)) == b"2"
    assert await scripts.conn.hgetall(scripts.keys.usage("2026-11-30")) == {}  # not ending: no usage yet


async def test_start_codes(scripts: Scripts) -> None:
    entries = [await deliver(scripts, j) for j in ("run", "cancelled", "ended", "dup", "lost")]
    conn, keys = scripts.conn, scripts.keys
    await conn.set(keys.cancel_flag("cancelled"), 1)
    await conn.hset(keys.job("ended"), "status", "finished")
    await conn.hset(keys.job("dup"), "entry_id", "1-1")
    await conn.xclaim(keys.requests, keys.group, "other", 0, [entries[-1]])
    jobs = [build_job("hi", None, job_id=j) for j in ("run", "cancelled", "ended", "dup", "lost")]
    codes = await scripts.start(jobs, entries, now=123.0)
    assert codes == ["run", "cancelled", "ended", "duplicate", "lost"]
    run = decode_record(await conn.hgetall(keys.job("run")))
    assert (run.status, run.worker, run.entry_id, run.started_at, run.n) == (
        JobStatus.RUNNING, "me", entries[0], 123.0, 1)
    assert await conn.hget(keys.job("cancelled"), "status") is None  # only `run` writes


async def test_forward_moves_entries_to_their_models_queue(scripts: Scripts) -> None:
    entries = [await deliver(scripts, j) for j in ("fresh", "known", "dup", "lost")]
    conn, keys = scripts.conn, scripts.keys
    await conn.hset(keys.job("known"), mapping={"entry_id": entries[1], "status": "queued"})
    await conn.hset(keys.job("dup"), "entry_id", "1-1")
    await conn.xclaim(keys.requests, keys.group, "other", 0, [entries[-1]])
    fields = [(await conn.xrange(keys.requests, e, e))[0][1] for e in entries]
    moves = [Forward(e, j, "b", f) for e, j, f in zip(entries, ("fresh", "known", "dup", "lost"), fields, strict=True)]
    assert await scripts.forward(moves) == ["moved", "moved", "duplicate", "lost"]
    target = keys.on_queue("b").requests
    copies = await conn.xrange(target)
    assert [f for _, f in copies] == fields[:2]  # the entries whole, in order
    for (copy_id, _), job_id in zip(copies, ("fresh", "known"), strict=True):
        record = decode_record(await conn.hgetall(keys.job(job_id)))
        assert (record.entry_id, record.queue) == (copy_id.decode(), "b")
    assert (await conn.hget(keys.job("known"), "status")) == b"queued"  # the rest is kept
    # workers of b read the copies (the group was made at 0); here only dup is left pending
    reply = await conn.xreadgroup(keys.group, "b-worker", {target: ">"}, count=10)
    assert [e for e, _ in reply[0][1]] == [c for c, _ in copies]
    assert [r["message_id"].decode() for r in await conn.xpending_range(keys.requests, keys.group, "-", "+", 10,
                                                                          consumername="me")] == [entries[2]]
    # routes: what workers advertise, for as long as they beat
    await scripts.advertise(["m1", "/models/m1"], ttl_s=5)
    assert await scripts.routes(["m1", "/models/m1", "nobody"]) == {"m1": "", "/models/m1": ""}
    assert 0 < await conn.ttl(keys.route("m1")) <= 5


async def test_heartbeat_keeps_entries_owned_without_counting_deliveries(scripts: Scripts) -> None:
    mine, stolen = await deliver(scripts, "a"), await deliver(scripts, "b")
    await scripts.conn.xclaim(scripts.keys.requests, scripts.keys.group, "other", 0, [stolen])
    await scripts.conn.set(scripts.keys.cancel_flag("a"), 1)
    await scripts.conn.xclaim(scripts.keys.requests, scripts.keys.group, "me", 0, [mine],
                              idle=60_000, justid=True)
    lost, cancelled = await scripts.heartbeat(
        scripts.keys.worker("me"), {"model": "m"}, [("a", mine), ("b", stolen)], ttl_s=5
    )
    assert (lost, cancelled) == ({stolen}, {mine})
    row = await pending(scripts, mine)
    assert row["time_since_delivered"] < 60_000 and row["times_delivered"] == 1
    assert (await pending(scripts, stolen))["consumer"] == b"other"  # not taken back
    assert 0 < await scripts.conn.ttl(scripts.keys.worker("me")) <= 30


async def test_reclaim_and_release(scripts: Scripts) -> None:
    idle, busy, gone = [await deliver(scripts, j, "dead") for j in ("idle", "busy", "gone")]
    conn, keys = scripts.conn, scripts.keys
    await conn.xdel(keys.requests, gone)
    await conn.xclaim(keys.requests, keys.group, "dead", 0, [idle, gone], idle=10_000, justid=True)
    claimed = await scripts.reclaim(min_idle_ms=5_000, count=10)
    assert [(c.entry_id, c.delivery_count, c.fields is None) for c in claimed] == [
        (idle, 2, False), (gone, 2, True)]  # busy is not idle enough
    assert claimed[0].fields is not None and claimed[0].fields[b"id"] == b"idle"
    assert (await pending(scripts, busy))["consumer"] == b"dead"
    assert await scripts.release([idle, busy]) == 1  # busy is not ours
    row = await pending(scripts, idle)
    assert row["time_since_delivered"] >= RELEASED_IDLE_MS // 2 and row["times_delivered"] == 1
    assert await scripts.own_pending() == [idle, gone]


async def test_every_rule_tells_lanes_apart_by_the_entrys_ref(scripts: Scripts) -> None:
    """Two lanes' streams can hold entries with one id: the ref (`<id>@<lane>`) says which
    stream each script touches."""
    conn, keys = scripts.conn, scripts.keys
    refs = {}
    for lane in (LANE_HIGH, LANE_NORMAL):
        for job_id, entry_id in ((f"a-{lane}", "5-1"), (f"b-{lane}", "5-2")):
            job = build_job("hi", SamplingParams(max_tokens=4), job_id=job_id)
            await conn.xadd(keys.on_lane(lane).requests, encode_job(job), id=entry_id)
            refs[job_id] = entry_ref(entry_id, lane)
        await conn.xreadgroup(keys.group, "dead", {keys.on_lane(lane).requests: ">"}, count=2)
    assert refs["a-high"] == "5-1@high" and refs["a-"] == "5-1"
    for stream in keys.lane_streams[:2]:
        await conn.xclaim(stream, keys.group, "dead", 0, ["5-1", "5-2"], idle=10_000, justid=True)
    claimed = await scripts.reclaim(min_idle_ms=5_000, count=3)  # the high lane first
    assert [c.entry_id for c in claimed] == ["5-1@high", "5-2@high", "5-1"]
    assert claimed[0].fields is not None and claimed[0].fields[b"id"] == b"a-high"
    assert sorted(await scripts.own_pending()) == ["5-1", "5-1@high", "5-2@high"]
    # a finishing write acks its own lane's entry only
    held = held_job("a-high")
    abort_events(held)
    assert await scripts.publish([JobWrite("a-high", "5-1@high", [], final_record(held, "me", time.time()))]) == set()
    assert sorted(await scripts.own_pending()) == ["5-1", "5-2@high"]
    # the heartbeat re-owns, the release hands back, the dead-letter acks, each in its lane
    await conn.xclaim(keys.on_lane(LANE_HIGH).requests, keys.group, "me", 0, ["5-2"], idle=60_000, justid=True)
    lost, _ = await scripts.heartbeat(keys.worker("me"), {"model": "m"}, [("b-high", "5-2@high"), ("a-", "5-1")], 5)
    assert lost == set()
    [row] = await conn.xpending_range(keys.on_lane(LANE_HIGH).requests, keys.group, "5-2", "5-2", 1)
    assert row["time_since_delivered"] < 60_000
    assert await scripts.holders(["5-2@high", "5-2"]) == {
        "5-2@high": "worker me (delivered 2 times)", "5-2": "worker dead (delivered 1 times)"}
    assert await scripts.release(["5-2@high"]) == 1
    [row] = await conn.xpending_range(keys.on_lane(LANE_HIGH).requests, keys.group, "5-2", "5-2", 1)
    assert row["time_since_delivered"] >= RELEASED_IDLE_MS // 2
    assert await scripts.dead_letter([DeadLetter("5-1", {"entry_id": b"5-1", "reason": b"test"})]) == 1
    assert await scripts.own_pending() == ["5-2@high"]
    assert [r["message_id"] for r in await conn.xpending_range(keys.requests, keys.group, "-", "+", 10)] == [b"5-2"]
    # a handoff names the ref; the receiver takes it from its lane
    assert await scripts.hand_off("other", ["5-2@high"]) == ["5-2@high"]
    other = Scripts(conn, keys, "other")
    [taken] = await other.take(["5-2@high"])
    assert (taken.entry_id, taken.fields is not None and taken.fields[b"id"]) == ("5-2@high", b"b-high")


async def queue_lanes(s: Scripts, lanes: str, waited_s: float) -> None:
    """One job per letter of `lanes` (h, n, l: the lane), each XADDed to its lane's stream;
    the low lane's with ids `waited_s` in the past."""
    now_ms = int(time.time() * 1000)
    for i, letter in enumerate(lanes):
        lane = {"h": LANE_HIGH, "n": LANE_NORMAL, "l": LANE_LOW}[letter]
        job = build_job("hi", SamplingParams(max_tokens=4), job_id=f"{letter}{i}")
        entry_id = f"{now_ms - int(waited_s * 1000)}-{i}" if lane == LANE_LOW else "*"
        await s.conn.xadd(s.keys.on_lane(lane).requests, encode_job(job), id=entry_id)


def lanes_read(deliveries: list) -> str:
    return "".join({LANE_HIGH: "h", LANE_NORMAL: "n", LANE_LOW: "l"}[split_ref(d.entry_id)[1]] for d in deliveries)


async def test_lane_waits_are_the_age_of_each_lanes_oldest_unread_entry(scripts: Scripts) -> None:
    assert await scripts.lane_waits(list(LANES)) == dict.fromkeys(LANES)  # empty lanes
    await queue_lanes(scripts, "hl", waited_s=50)
    waits = await scripts.lane_waits(list(LANES))
    assert waits[LANE_NORMAL] is None
    assert 0 <= waits[LANE_HIGH] < 5 and 50 <= waits[LANE_LOW] < 55
    await scripts.conn.xreadgroup(scripts.keys.group, "me", {scripts.keys.on_lane(LANE_LOW).requests: ">"}, count=1)
    assert (await scripts.lane_waits([LANE_LOW]))[LANE_LOW] is None  # read: no longer waiting


@pytest.mark.parametrize(("aging_s", "waited_s", "order"), [
    (30, 40, "hhhl" * 3),  # the low jobs waited past the aging: one read in four is theirs
    (30, 0, "h" * 12),  # not yet: the high lane goes strictly first
    (0, 40, "h" * 12),  # no aging: strict lanes
])
async def test_a_lane_waiting_past_the_aging_gets_a_share_of_the_reads(
    scripts: Scripts, aging_s: float, waited_s: float, order: str
) -> None:
    await queue_lanes(scripts, "llll" + "h" * 12, waited_s)
    reader = LaneReader(scripts, WorkerConfig(lane_aging_s=aging_s, lane_aged_every=4))
    assert "".join([lanes_read(await reader.read(1)) for _ in range(12)]) == order


async def test_a_larger_read_takes_what_an_aged_lane_is_owed_first(scripts: Scripts) -> None:
    await queue_lanes(scripts, "l" * 5 + "h" * 20, waited_s=40)
    reader = LaneReader(scripts, WorkerConfig(lane_aging_s=30, lane_aged_every=4))
    # 6 read ahead of the low lane: it is owed 2 (and 4 more read ahead: 1 owed, 1 over)
    assert [lanes_read(await reader.read(6)) for _ in range(3)] == ["hhhhhh", "llhhhh", "lhhhhh"]


async def test_a_lane_read_in_its_turn_is_owed_nothing(scripts: Scripts) -> None:
    await queue_lanes(scripts, "llllhh", waited_s=40)
    reader = LaneReader(scripts, WorkerConfig(lane_aging_s=30, lane_aged_every=4))
    assert "".join([lanes_read(await reader.read(1)) for _ in range(3)]) == "hhl"  # the high lane ran out
    await queue_lanes(scripts, "hhhh", waited_s=40)
    assert "".join([lanes_read(await reader.read(1)) for _ in range(4)]) == "hhhl"  # counting from 0 again


async def test_heartbeat_claims_the_name_for_the_first_process_only(scripts: Scripts) -> None:
    """A worker's first heartbeat claims its name: a hash naming another process is left as it
    is, and the beat raises naming that process."""
    key = scripts.keys.worker("twin")

    async def beat(host: str, pid: str, model: str = "m") -> tuple[str, int] | None:
        try:
            await scripts.heartbeat(key, {"host": host, "pid": pid, "model": model}, [], ttl_s=30)
        except NameTaken as taken:
            return taken.host, taken.pid
        return None

    assert await beat("h1", "10") is None
    assert await beat("h1", "11") == ("h1", 10)
    assert await beat("h2", "10") == ("h1", 10)
    assert await beat("h1", "10", model="n") is None  # itself again
    assert await scripts.conn.hget(key, "model") == b"n"
    assert 0 < await scripts.conn.ttl(key) <= 30
    await scripts.conn.delete(key)  # expired: the next process may take the name
    assert await beat("h2", "12") is None


async def test_heartbeat_stops_at_a_namesakes_hash(scripts: Scripts) -> None:
    """A worker that stalled past its heartbeat TTL while a namesake took the name must not
    overwrite the namesake's hash: the beat writes nothing and raises."""
    key = scripts.keys.worker("me")
    await scripts.heartbeat(key, {"host": "h2", "pid": "20", "model": "m"}, [], ttl_s=30)
    with pytest.raises(NameTaken, match="host h2, pid 20"):
        await scripts.heartbeat(key, {"host": "h1", "pid": "10", "model": "stale"}, [], ttl_s=5)
    assert await scripts.conn.hget(key, "model") == b"m"
    lost, cancelled = await scripts.heartbeat(key, {"host": "h2", "pid": "20", "model": "n"}, [], ttl_s=5)
    assert (lost, cancelled) == (set(), set()) and await scripts.conn.hget(key, "model") == b"n"


async def test_trim_keeps_what_a_group_still_needs(scripts: Scripts) -> None:
    """With no retention every entry is old enough: only the groups' positions hold entries."""
    conn, keys = scripts.conn, scripts.keys

    async def left() -> list[bytes]:
        return [entry_id for entry_id, _ in await conn.xrange(keys.requests)]

    ids = [await conn.xadd(keys.requests, {"i": i}) for i in range(6)]
    await conn.xreadgroup(keys.group, "me", {keys.requests: ">"}, count=4)  # 0-3 delivered
    await conn.xack(keys.requests, keys.group, ids[0], ids[1], ids[3])  # 2 still pending
    assert await scripts.trim(keys.requests, retention_s=3600) == 0  # all younger than an hour
    assert await scripts.trim(keys.requests, retention_s=0) == 2
    assert await left() == ids[2:]  # from the oldest pending on
    await conn.xack(keys.requests, keys.group, ids[2])
    assert await scripts.trim(keys.requests, retention_s=0) == 2
    assert await left() == ids[4:]  # 4 and 5 were never delivered
    await conn.xgroup_create(keys.requests, "other", id="0")  # a group that has read nothing
    await conn.xreadgroup(keys.group, "me", {keys.requests: ">"})
    await conn.xack(keys.requests, keys.group, *ids[4:])
    assert await scripts.trim(keys.requests, retention_s=0) == 0
    await conn.xgroup_destroy(keys.requests, "other")
    assert await scripts.trim(keys.requests, retention_s=0) == 2
    assert await conn.xlen(keys.requests) == 0
    await conn.delete(keys.requests)
    assert await scripts.trim(keys.requests, retention_s=0) == 0  # no stream: nothing to do


async def test_trim_dead_goes_by_age_alone(scripts: Scripts) -> None:
    conn, keys = scripts.conn, scripts.keys
    assert await scripts.trim(keys.dead, retention_s=0) == 0  # no dead letters yet
    for i in range(3):
        await conn.xadd(keys.dead, {"reason": f"bad {i}"})
    assert await scripts.trim(keys.dead, retention_s=3600) == 0  # all younger than an hour
    assert await scripts.trim(keys.dead, retention_s=0) == 3
    assert await conn.xlen(keys.dead) == 0


def held_job(job_id: str, n: int = 1) -> HeldJob:
    job = build_job("hi", SamplingParams(n=n), job_id=job_id)
    return HeldJob(job, "1-0", new_completions(n))


def test_progress_from_events_continues_numbering() -> None:
    events = [
        Event(seq=0, token_ids=[1], text="a"),
        Event(seq=0, token_ids=[1], text="a"),  # a repeat: dropped, as readers drop it
        Event(seq=0, token_ids=[5], text="x", index=1),
        Event(seq=1, token_ids=[2], text="b"),
        Event(seq=1, token_ids=[6], text="y", index=1, finished=True, finish_reason="stop"),
    ]
    entries = [(b"0-0", {EVENT_FIELD.encode(): encode_event(e)}) for e in events]
    first, second = progress_from_events(2, entries)
    assert (first.next_seq, first.token_ids, "".join(first.text), first.finished) == (2, [1, 2], "ab", False)
    assert (second.next_seq, second.token_ids, second.finish_reason) == (2, [5, 6], "stop")


def test_events_record_and_abort() -> None:
    held = held_job("j", n=2)
    held.prompt_tokens = 3
    first = completion_event(held, 0, "hi", [4], None)
    assert first is not None and first.seq == 0  # event 0 counts the prompt (and the tokens so far)
    assert first.usage == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "cached_tokens": 0}
    assert completion_event(held, 0, "", [], None) is None  # nothing new: no event
    middle = completion_event(held, 0, " ", [6], None)
    assert middle is not None and middle.usage is None
    last = completion_event(held, 0, "!", [5], "length")
    assert last is not None
    assert last.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "cached_tokens": 0}
    [abort] = abort_events(held)  # completion 1 never ran
    assert (abort.index, abort.seq, abort.finish_reason) == (1, 0, FINISH_ABORT)
    rec = decode_record(final_record(held, "w", 1.0))
    assert (rec.status, rec.text, rec.finish_reason, rec.n) == (JobStatus.FINISHED, "hi !", "length", 2)
    assert [o.token_ids for o in rec.outputs or []] == [[4, 6, 5], []]
    assert decode_event(encode_event(last)).finished


STEP_S, INTERVAL_S = 1 / 64, 6 / 64  # (an H200's 10 ms steps and 60 ms interval, in times floats hold exactly)


def test_coalescing_holds_steps_while_the_next_still_ends_within_the_interval() -> None:
    """publish_due's timing on its shard's turns, steps of a sixth of the interval, and what a
    publish of held steps sends: one event, the pieces concatenated."""
    held, turns = held_job("c"), ShardTurns()
    published = []
    for step in range(1, 21):
        now = step * STEP_S
        hold_delta(held, 0, f"t{step} ", [step], None, None, [{"logprob": -step}])
        if not publish_due(held, INTERVAL_S):
            turns.holding(0, now - STEP_S, INTERVAL_S)
        due = turns.due(now, INTERVAL_S, STEP_S)
        if publish_due(held, INTERVAL_S) or 0 in due:
            published.append((step, unsent_events(held)))
        turns.keep([0] if held.unsent else [], due)
    assert [step for step, _ in published] == [1, 7, 13, 19]  # the first step at once, then every 6
    [(_, [event])] = [p for p in published if p[0] == 7]
    assert (event.seq, event.token_ids, event.text) == (1, [2, 3, 4, 5, 6, 7], "t2 t3 t4 t5 t6 t7 ")
    assert [lp["logprob"] for lp in event.logprobs or []] == [-2, -3, -4, -5, -6, -7]
    hold_delta(held, 0, "end", [21], "stop", "end")  # a final delta goes out at once, off its turn
    assert publish_due(held, INTERVAL_S)
    [last] = unsent_events(held)
    assert (last.token_ids, last.finish_reason, last.stop_reason, last.finished) == ([20, 21], "stop", "end", True)
    assert held.completions[0].token_ids == list(range(1, 22)) and held.finished
    assert not publish_due(held_job("e"), INTERVAL_S)  # nothing held, nothing to send


def test_a_shards_held_tokens_go_out_together_on_its_turn_and_the_turns_are_spread() -> None:
    """ShardTurns: the jobs of a shard publish on the same steps, so a step writes to the few
    shards whose turn it is; each shard still publishes every interval while it holds tokens;
    six shards' turns fall on different steps; a shard that held nothing for a step starts a
    fresh interval when it holds again."""
    turns = ShardTurns(6)
    jobs = {shard: [held_job(f"j{shard}-{n}") for n in range(3)] for shard in range(6)}
    for shard_jobs in jobs.values():
        for held in shard_jobs:  # (their first events went out at step 0: the rest is held)
            hold_delta(held, 0, "a", [1], None)
            unsent_events(held)
    written: list[set[int]] = []
    for step in range(1, 61):
        now = step * STEP_S
        for shard, shard_jobs in jobs.items():
            for held in shard_jobs:
                hold_delta(held, 0, "b", [2], None)
                assert not publish_due(held, INTERVAL_S)  # (neither a first nor a final)
                turns.holding(shard, now - STEP_S, INTERVAL_S)
        due = turns.due(now, INTERVAL_S, STEP_S)
        shards = set()
        for shard in due:
            for held in jobs[shard]:
                unsent_events(held)
                shards.add(shard)
        turns.keep([s for s, shard_jobs in jobs.items() if any(h.unsent for h in shard_jobs)], due)
        written.append(shards)
    assert max(len(s) for s in written) == 1  # one shard a step at most: the turns are spread
    for shard in range(6):
        steps = [0] + [n + 1 for n, s in enumerate(written) if shard in s]
        assert steps[1] == 6 - shard and all(b - a == 6 for a, b in zip(steps[1:], steps[2:], strict=False))
    for held in jobs[2]:
        unsent_events(held)  # shard 2 holds nothing after this step: its clock stops ...
    turns.keep([s for s in range(6) if s != 2], set())
    turns.holding(2, 1.0, INTERVAL_S)  # ... and starts again where it holds again (2/6 ahead)
    assert 2 not in turns.due(1.0 + 2 * STEP_S, INTERVAL_S, STEP_S)
    assert 2 in turns.due(1.0 + 4 * STEP_S, INTERVAL_S, STEP_S)
    turns.keep([], set())
    assert turns.next_at(INTERVAL_S) is None  # nothing held: no timer


def test_tokens_are_held_only_while_the_worker_makes_them_at_the_rate_where_merging_pays() -> None:
    """Below the rate, or with steps of over half the interval, every step publishes: a CPU
    worker's streams keep one step's gaps."""
    rate = TokenRate(window_s=1.0)
    for step in range(10):  # 64 rows a step, 10 steps in 0.1 s: an H200's pace
        rate.add(step * 0.010, 64)
    assert rate.per_s == 640 and coalescing_interval_s(0.060, rate, 500) == 0.060
    assert coalescing_interval_s(0.060, rate, 1000) == 0.0  # below 1000 a second
    rate.add(2.0, 4)  # two seconds later: only this step's tokens are in the window
    assert rate.per_s == 4 and coalescing_interval_s(0.060, rate, 0) == 0.060  # 0: at any rate
    # steps longer than half the interval (a CPU's 40 ms) would merge nothing: every step publishes
    assert coalescing_interval_s(0.060, rate, 0, step_s=0.040) == 0.0
    assert coalescing_interval_s(0.060, rate, 0, step_s=0.030) == 0.060


@pytest.mark.parametrize(
    ("stats", "in_flight", "expected"),
    [
        (EngineStats(num_free_blocks=1000, num_blocks=1000), 0, 8),  # seats bound
        (EngineStats(num_running=6, num_waiting=1, num_free_blocks=1000, num_blocks=1000), 0, 1),
        (EngineStats(num_free_blocks=1000, num_blocks=1000), 8, 0),  # on their way in
        # blocks bound: 100 free, 1 watermark, 30 for the waiting prompt -> 69 // 10
        (EngineStats(num_waiting=1, num_free_blocks=100, num_blocks=100, num_waiting_blocks=30,
                     blocks_per_request=10), 0, 6),
        (EngineStats(num_running=2, num_free_blocks=5, num_blocks=100, blocks_per_request=10), 0, 0),
        # an idle engine takes one job whatever its size estimate
        (EngineStats(num_free_blocks=5, num_blocks=100, blocks_per_request=10), 0, 1),
    ],
)
def test_intake_capacity(stats: EngineStats, in_flight: int, expected: int) -> None:
    assert intake_capacity(stats, max_num_seqs=8, num_in_flight=in_flight) == expected


def test_worker_config_from_env() -> None:
    from worker.queue.config import DEFAULT_SERVING_MAX_STEP_MS, config_from_env

    config = config_from_env({
        "GENQ_MODEL": "/models/Foo-1B", "GENQ_MAX_NUM_SEQS": "4", "GENQ_CLAIM_IDLE_S": "2",
        "GENQ_HEARTBEAT_S": "0.5", "GENQ_WORKER_NAME": "w9",
    })
    assert (config.name, config.engine.max_num_seqs, config.claim_idle_s) == ("w9", 4, 2.0)
    assert config.model_name == "Foo-1B" and config.serves("Foo-1B") and config.serves(None)
    assert config.serves("/models/Foo-1B") and not config.serves("Bar")
    with pytest.raises(ValueError, match="GENQ_MAX_NUM_SEQS must be an integer"):
        config_from_env({"GENQ_MAX_NUM_SEQS": "many"})
    aliased = config_from_env({"GENQ_SERVED_MODEL_NAME": "qwen3-8b, qwen, ", "GENQ_MODEL": "/m/Qwen3-8B"})
    assert (aliased.model_name, aliased.aliases) == ("qwen3-8b", ("qwen",)) and aliased.serves("qwen")
    assert aliased.base_names == {"qwen3-8b", "qwen", "/m/Qwen3-8B"}
    memory = config_from_env({"GENQ_GPU_MEMORY_UTILIZATION": "0.45", "GENQ_KV_CACHE_MEMORY_GB": "0.5"}).engine
    assert (memory.gpu_memory_utilization, memory.kv_cache_memory_gb) == (0.45, 0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        config_from_env({"GENQ_GPU_MEMORY_UTILIZATION": "1.5"})
    assert config_from_env({"GENQ_ENFORCE_EAGER": "true"}).engine.enforce_eager
    assert config_from_env({"GENQ_ASYNC_SCHEDULING": "1"}).engine.async_scheduling
    assert not config_from_env({}).engine.async_scheduling
    # a serving worker chunks prompts to a step-time target unless told otherwise; 0 turns it off
    assert config_from_env({}).engine.max_step_ms == DEFAULT_SERVING_MAX_STEP_MS > 0
    assert config_from_env({"GENQ_MAX_STEP_MS": "80"}).engine.max_step_ms == 80.0
    assert config_from_env({"GENQ_MAX_STEP_MS": "0"}).engine.max_step_ms == 0.0
    with pytest.raises(ValueError, match="max_step_ms must be >= 0"):
        config_from_env({"GENQ_MAX_STEP_MS": "-5"})
    assert config_from_env({"GENQ_SCHEDULING_POLICY": "priority"}).engine.scheduling_policy == "priority"
    assert config_from_env({"GENQ_EVENTS_RETENTION_S": "60"}).events_retention_s == 60.0
    with pytest.raises(ValueError, match="events_retention_s must be >= 0, got -1.0"):
        config_from_env({"GENQ_EVENTS_RETENTION_S": "-1"})
    assert config_from_env({"GENQ_STREAM_INTERVAL_MS": "0"}).stream_interval_ms == 0.0
    assert config_from_env({}).stream_coalesce_min_tokens_per_s == 1000.0
    assert config_from_env({"GENQ_STREAM_COALESCE_MIN_TOKENS_PER_S": "0"}).stream_coalesce_min_tokens_per_s == 0.0
    with pytest.raises(ValueError, match="stream_coalesce_min_tokens_per_s must be >= 0, got -1.0"):
        config_from_env({"GENQ_STREAM_COALESCE_MIN_TOKENS_PER_S": "-1"})
    with pytest.raises(ValueError, match="stream_interval_ms must be >= 0, got -5.0"):
        config_from_env({"GENQ_STREAM_INTERVAL_MS": "-5"})
    with pytest.raises(ValueError, match="GENQ_STREAM_INTERVAL_MS must be a number, got 'often'"):
        config_from_env({"GENQ_STREAM_INTERVAL_MS": "often"})
    assert config_from_env({}).engine.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        config_from_env({"GENQ_SCHEDULING_POLICY": "lifo"})
    assert not config_from_env({"GENQ_ENFORCE_EAGER": "0"}).engine.enforce_eager
    markers = '{"think_start_str": "<think>", "think_end_str": "</think>"}'
    assert config_from_env({"GENQ_REASONING_CONFIG": markers}).engine.reasoning_config["think_end_str"] == "</think>"
    assert config_from_env({"GENQ_CHAT_TEMPLATE": "/t/tools.jinja"}).engine.chat_template == "/t/tools.jinja"
    override = config_from_env({"GENQ_OVERRIDE_GENERATION_CONFIG": '{"temperature": 0.5}'}).engine.override_generation_config
    assert override == {"temperature": 0.5}
    assert config_from_env({"GENQ_DISABLE_HYBRID_KV_CACHE_MANAGER": "1"}).engine.disable_hybrid_kv_cache_manager
    with pytest.raises(ValueError, match="GENQ_ENFORCE_EAGER must be 1 or 0"):
        config_from_env({"GENQ_ENFORCE_EAGER": "maybe"})
    with pytest.raises(ValueError, match="two heartbeats"):
        config_from_env({"GENQ_CLAIM_IDLE_S": "1", "GENQ_HEARTBEAT_S": "1"})
    assert config_from_env({"GENQ_QUANTIZATION": "fp8"}).engine.quantization == "fp8"
    assert config_from_env({"GENQ_KV_CACHE_DTYPE": "fp8"}).engine.kv_cache_dtype == "fp8"
    assert config_from_env({"GENQ_QUANTIZATION": "awq_marlin"}).engine.quantization == "awq_marlin"  # vLLM's name
    assert config_from_env({"GENQ_MAX_IMAGES_PER_PROMPT": "2"}).engine.max_images_per_prompt == 2
    assert config.engine.max_images_per_prompt == 16
    assert config_from_env({"GENQ_TENSOR_PARALLEL_SIZE": "2"}).engine.tensor_parallel_size == 2
    assert config.engine.tensor_parallel_size == 1
    states = config_from_env({"GENQ_MAMBA_BLOCK_SIZE": "256", "GENQ_NUM_STATE_SNAPSHOTS": "0"}).engine
    assert (states.state_interval, states.num_state_snapshots, config.engine.state_interval) == (256, 0, 512)
    with pytest.raises(ValueError, match=r"mamba_block_size must be a positive multiple of block_size \(16\), got 100"):
        config_from_env({"GENQ_MAMBA_BLOCK_SIZE": "100"})
    mm = config_from_env({"GENQ_MM_PROCESSOR_KWARGS": '{"max_pixels": 1003520}'}).engine.mm_processor_kwargs
    assert mm == {"max_pixels": 1003520}
    with pytest.raises(ValueError, match="GENQ_MM_PROCESSOR_KWARGS must be a JSON object"):
        config_from_env({"GENQ_MM_PROCESSOR_KWARGS": "max_pixels=3"})
    with pytest.raises(ValueError, match="quantization must be one of fp8, gptq, .* or None, got 'int4'"):
        config_from_env({"GENQ_QUANTIZATION": "int4"})
    assert config.keys.requests == "genq:requests"  # no queue: the shared stream
    queued = config_from_env({"GENQ_QUEUE": "big-1", "GENQ_PREFIX": "p:"})
    assert (queued.queue, queued.keys.requests, queued.keys.dead) == ("big-1", "p:requests:big-1", "p:dead")
    with pytest.raises(ValueError, match="queue name must be at most 64 letters, digits"):
        config_from_env({"GENQ_QUEUE": "two words"})
    assert config.requests_retention_s == 24 * 3600
    assert config_from_env({"GENQ_REQUESTS_RETENTION_S": "0"}).requests_retention_s == 0
    with pytest.raises(ValueError, match="requests_retention_s must be >= 0"):
        config_from_env({"GENQ_REQUESTS_RETENTION_S": "-1"})
    assert (config.lane_aging_s, config.lane_aged_every) == (30, 10)
    aging = config_from_env({"GENQ_LANE_AGING_S": "0", "GENQ_LANE_AGED_EVERY": "4"})
    assert (aging.lane_aging_s, aging.lane_aged_every) == (0, 4)
    with pytest.raises(ValueError, match="lane_aged_every must be >= 2, got 1"):
        config_from_env({"GENQ_LANE_AGED_EVERY": "1"})
    assert config.dead_retention_s == 7 * 24 * 3600
    assert config_from_env({"GENQ_DEAD_RETENTION_S": "60"}).dead_retention_s == 60
    with pytest.raises(ValueError, match="dead_retention_s must be >= 0"):
        config_from_env({"GENQ_DEAD_RETENTION_S": "-1"})


def test_consumer_module_is_cheap_to_import() -> None:
    import subprocess
    import sys

    probe = "import sys, worker; worker.WorkerSettings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr

