"""Redis memory per job: the job record and its events, as a worker writes them, for W1-sized
jobs (prompts of 32 to 256 random token ids, here a fixed number of output tokens, one event
per token).

No model: the jobs go in with the client's SUBMIT script and the worker's own Lua scripts
(`worker.queue.scripts.Scripts`: start, then one publish per engine step for all jobs at once,
the last with each job's final record) write what a worker writes, on an embedded Redis.
`MEMORY USAGE` (every element sampled) of each job's keys gives the bytes.

    python benchmarks/redis_memory.py [--jobs 200] [--output-tokens 128] [--events-retention-s 300]

Runs twice, under two prefixes: `before`, events kept a day after the job ended (the old
EXPIRE, as the record), and `after`, events cut to `--events-retention-s` once the job ends.
Prints bytes per job (record, events, the requests-stream entry), the TTLs left on the keys,
and the memory a deployment holds at 1 million jobs a day: records and entries for a day
(JOB_TTL_S, GENQ_REQUESTS_RETENTION_S), events for a day (before) or for the retention (after).
`--check-expiry` also runs `after` with a 1 s retention and waits for the events to go.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import time
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.asyncio

from producer.client import Client
from producer.protocol import (
    DEFAULT_EVENTS_RETENTION_S,
    EVENTS_TTL_S,
    JOB_TTL_S,
    Keys,
    decode_job,
    encode_event,
)
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams
from worker.benchmarks.workload import RandomWorkload
from worker.queue.jobs import HeldJob, Meter, completion_event, final_record, new_completions
from worker.queue.scripts import JobWrite, Scripts

DAY_S = 24 * 3600
JOBS_PER_DAY = 1_000_000


@dataclass
class Sizes:
    record: float  # bytes per job, mean
    events: float
    entry: float  # the job's share of the requests stream
    record_ttl_s: int
    events_ttl_s: int  # -2: gone already

    def per_day(self, events_kept_s: float, entries: bool = True) -> float:
        """Bytes held at JOBS_PER_DAY: records (and entries) live a day, events `events_kept_s`."""
        rate = JOBS_PER_DAY / DAY_S
        kept = (self.record + self.entry * entries) * min(JOB_TTL_S, DAY_S)
        return rate * (kept + self.events * min(events_kept_s, DAY_S))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--events-retention-s", type=int, default=DEFAULT_EVENTS_RETENTION_S)
    ap.add_argument("--check-expiry", action="store_true", help="also wait for events cut to 1 s to go")
    args = ap.parse_args()
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        info = cast(dict[str, Any], conn.info("server"))
        print(f"redis {info['redis_version']}, {args.jobs} jobs of {args.output_tokens} tokens")
        before = asyncio.run(_run(server.url, "mem-before:", args, EVENTS_TTL_S))
        after = asyncio.run(_run(server.url, "mem-after:", args, args.events_retention_s))
        _report("before", before, EVENTS_TTL_S)
        _report("after", after, args.events_retention_s)
        print(f"after / before at {JOBS_PER_DAY:,} jobs a day: "
              f"{after.per_day(args.events_retention_s) / before.per_day(EVENTS_TTL_S):.2f}")
        if args.check_expiry:
            _check_expiry(server.url, conn, args)
        conn.close()
    return 0


async def _run(url: str, prefix: str, args: argparse.Namespace, retention_s: int) -> Sizes:
    """Submit the jobs, run them through the worker's scripts, measure their keys."""
    keys = Keys(prefix)
    workload = RandomWorkload(num_prompts=args.jobs, output_len_range=(args.output_tokens, args.output_tokens))
    with Client(url, prefix=prefix) as client:
        handles = [client.submit(p, SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True))
                   for p in workload.prompts()]
    conn = redis.asyncio.Redis.from_url(url)
    scripts = Scripts(conn, keys, "bench", events_retention_s=retention_s)
    await scripts.ensure_group()
    reply = await conn.xreadgroup(keys.group, "bench", {keys.requests: ">"}, count=args.jobs)
    entries = [(e.decode(), fields) for e, fields in reply[0][1]]
    held = await _start(scripts, entries, [h.id for h in handles], workload)
    await _generate(scripts, held, args.output_tokens)
    sizes = await _measure(conn, keys, [h.id for h in handles])
    await conn.aclose()
    return sizes


async def _start(scripts: Scripts, entries: list, job_ids: list[str], workload: RandomWorkload) -> list[HeldJob]:
    jobs = [decode_job(fields) for _, fields in entries]
    assert [j.id for j in jobs] == job_ids
    codes = await scripts.start(jobs, [e for e, _ in entries], time.time())
    assert set(codes) == {"run"}, codes
    held = [HeldJob(job, entry_id, new_completions(1)) for job, (entry_id, _) in zip(jobs, entries, strict=True)]
    for h, (ids, _) in zip(held, workload.requests(), strict=True):
        h.prompt_tokens = len(ids)
    return held


async def _generate(scripts: Scripts, held: list[HeldJob], output_tokens: int) -> None:
    """One publish per step for every job, as the worker's publisher does; the last one ends them."""
    rng = random.Random(0)
    for step in range(output_tokens):
        last = step == output_tokens - 1
        writes = []
        for h in held:
            event = completion_event(h, 0, _piece(rng), [rng.randrange(3, 49152)], "length" if last else None)
            assert event is not None
            write = JobWrite(h.id, h.entry_id, [encode_event(event)])
            if last:
                now = time.time()
                write.record = final_record(h, "bench", now)
                write.meter = Meter(time.strftime("%Y-%m-%d", time.gmtime(now)), "", "bench", h.prompt_tokens or 0,
                                    output_tokens)
            writes.append(write)
        lost = await scripts.publish(writes)
        assert not lost


def _piece(rng: random.Random) -> str:
    """A token's text: English BPE averages about 4 characters a token, a space before words."""
    return " " * (rng.random() < 0.7) + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 6)))


async def _measure(conn: redis.asyncio.Redis, keys: Keys, job_ids: list[str]) -> Sizes:
    pipe = conn.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.memory_usage(keys.job(job_id), samples=0)
        pipe.memory_usage(keys.events(job_id), samples=0)
    sizes = await pipe.execute()
    records, events = sizes[0::2], [s or 0 for s in sizes[1::2]]
    streams = [await conn.memory_usage(s, samples=0) or 0 for s in keys.lane_streams]
    return Sizes(
        record=sum(records) / len(job_ids), events=sum(events) / len(job_ids), entry=sum(streams) / len(job_ids),
        record_ttl_s=await conn.ttl(keys.job(job_ids[0])), events_ttl_s=await conn.ttl(keys.events(job_ids[0])),
    )


def _report(name: str, sizes: Sizes, events_kept_s: float) -> None:
    total = sizes.record + sizes.events
    print(f"{name}: bytes per job: record {sizes.record:.0f}, events {sizes.events:.0f}, record + events {total:.0f} "
          f"(requests entry {sizes.entry:.0f}); TTL left: record {sizes.record_ttl_s} s, events {sizes.events_ttl_s} s")
    print(f"{name}: at {JOBS_PER_DAY:,} jobs a day, events kept {events_kept_s} s: record + events "
          f"{sizes.per_day(events_kept_s, entries=False) / 2**30:.2f} GiB, with the requests entries "
          f"{sizes.per_day(events_kept_s) / 2**30:.2f} GiB (records and entries kept a day)")


def _check_expiry(url: str, conn: redis.Redis, args: argparse.Namespace) -> None:
    small = argparse.Namespace(**{**vars(args), "jobs": min(args.jobs, 50)})
    sizes = asyncio.run(_run(url, "mem-expiry:", small, 1))
    keys = Keys("mem-expiry:")
    deadline = time.monotonic() + 10
    while _count(conn, keys.events("*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"expiry check: events of {small.jobs} jobs ({sizes.events:.0f} B each) cut to 1 s; "
          f"{_count(conn, keys.events('*'))} events keys left after it, {_count(conn, keys.job('*'))} records kept")


def _count(conn: redis.Redis, pattern: str) -> int:
    return sum(1 for _ in conn.scan_iter(match=pattern, count=1000))


if __name__ == "__main__":
    raise SystemExit(main())
