"""What one Redis, or one master of a Redis Cluster, sustains when it is kept busy: the step
traffic of N workers, built ahead of time by the worker's own rules, then sent as fast as each
server takes it. `redis_capacity.py --saturate` runs it after its trials.

Why: the capacity trials run at the pace of simulated H200 workers, which on this small machine
leaves every server mostly idle, and an idle server pays more CPU per command (its caches are
cold at each wake-up): a single Redis carrying a third of the rate, with the same calls and
events per token, spent 1.2-1.4x the CPU per token (docs/queue.md, "Redis Cluster"). A master
of a three-master cluster carries a third, so its CPU share measured at that pace mixes the
split with this effect. Here every
server runs flat out, as a Redis at its capacity does:

- jobs are submitted (the client's SUBMIT script), read by each worker's consumer and started
  (the worker's START script): untimed;
- the trace: `steps` steps of `batch` running jobs per worker, a token each, turned into STEP
  calls by the publisher's rules (`worker.queue.jobs`: hold_delta, publish_due, ShardTurns,
  unsent_events; `Scripts.step_args`), steps `step_ms` apart in virtual time; a finished job's
  place goes to the next of its worker's jobs, whose first token goes out at once;
- each server in turn (the others idle) is sent its calls, pipelined, while one subscriber
  connection follows every job's events channel on it (SUBSCRIBE, or SSUBSCRIBE where events
  go on shard channels) and drops what it reads;
- reported per server: its CPU (INFO cpu) per token of the trace, how busy it was over its
  replay (CPU over wall time: the sender, one Python thread, may not keep it fully busy), and
  the tokens a second one core of it sustains (tokens over its CPU seconds).

Only the step traffic is replayed (the STEP calls: about two thirds of a server's CPU in the
trials); intake, heartbeats and the relays' replays stay in the trials' figures.
"""

from __future__ import annotations

import asyncio
import random
import socket
import string
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.async_client import AsyncClient
from producer.protocol import Event, Keys, decode_job, encode_event, entry_ref
from producer.redis_conn import connect, connect_async, is_cluster_url, xreadgroup
from producer.sampling_params import SamplingParams
from worker.queue.jobs import (
    HeldJob,
    Meter,
    ShardTurns,
    final_record,
    hold_delta,
    new_completions,
    publish_due,
    unsent_events,
)
from worker.queue.scripts import JobWrite, Scripts

PIPELINE = 32  # STEP calls per round trip in the replay
SUBMIT_AT_ONCE = 64


@dataclass
class Trace:
    """The STEP calls of a run, by server (node URL), and what they carry."""

    keys: Keys
    script: str  # the STEP script as these keys call it (PUBLISH or SPUBLISH)
    calls: dict[str, list[tuple[str, list[Any]]]] = field(default_factory=dict)  # node -> [(stream key, ARGV)]
    channels: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # node -> shard -> events channels
    tokens: int = 0
    events: int = 0
    jobs: int = 0


def saturate(url: str, nodes: tuple[str, ...], prefix: str, workers: int, batch: int, steps: int, step_ms: float,
             interval_ms: float, output_len: tuple[int, int], shards: int | None = None) -> dict[str, Any]:
    """Build the trace on `url` (a Redis or a cluster whose masters are `nodes`), replay each
    node's share, one node at a time; returns the trace's size and a row per node."""
    trace = asyncio.run(_build(url, prefix, workers, batch, steps, step_ms, interval_ms, output_len, shards))
    rows = []
    for node in nodes:
        calls = trace.calls.get(node, [])
        rows.append({"node": node, "calls": len(calls), **_replay(node, trace, calls)})
    return {"tokens": trace.tokens, "events": trace.events, "jobs": trace.jobs, "nodes": rows}


async def _build(url: str, prefix: str, workers: int, batch: int, steps: int, step_ms: float,
                 interval_ms: float, output_len: tuple[int, int], shards: int | None) -> Trace:
    client = AsyncClient(url, prefix, shards if is_cluster_url(url) else None)
    keys = client.keys
    conn = connect_async(url)
    rng = random.Random(f"{prefix}{workers}")
    lo, hi = output_len
    per_worker = batch + int(batch * steps / ((lo + hi) / 2) * 1.5) + 16  # (enough in all but rare draws)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(lo, hi), ignore_eos=True)
              for _ in range(per_worker * workers)]
    for at in range(0, len(params), SUBMIT_AT_ONCE):
        await asyncio.gather(*(client.submit({"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(64)]}, p)
                               for p in params[at:at + SUBMIT_AT_ONCE]))
    scripts = [Scripts(conn, keys, f"w{n}") for n in range(workers)]
    await scripts[0].ensure_group()
    queues = [await _take(conn, keys, s, per_worker) for s in scripts]
    trace = Trace(keys, scripts[0].step_script)
    nodes = _nodes_of_shards(url, keys)
    for s, queue in zip(scripts, queues, strict=True):
        _trace_worker(trace, s, queue, nodes, rng, batch, steps, step_ms, interval_ms)
    await conn.aclose()
    await client.aclose()
    return trace


async def _take(conn: Any, keys: Keys, scripts: Scripts, count: int) -> list[HeldJob]:
    """Read about `count` entries as the worker's consumer, an equal part from each shard, and
    start their jobs."""
    entries: list[tuple[str, Any]] = []
    part = -(-count // keys.shards)
    for shard_keys in keys.every_shard:
        reply = await xreadgroup(conn, shard_keys.group, scripts.consumer, {shard_keys.requests: ">"}, part)
        entries += [(entry_ref(e.decode(), "", shard_keys.shard), f) for e, f in reply[0][1]] if reply else []
    random.Random(scripts.consumer).shuffle(entries)  # (the shards' jobs mixed, as they come to a worker)
    jobs = [decode_job(f) for _, f in entries]
    codes = await scripts.start(jobs, [e for e, _ in entries], time.time())
    held = []
    for job, (entry_id, _), code in zip(jobs, entries, codes, strict=True):
        if code == "run":
            h = HeldJob(job, entry_id, new_completions(1))
            h.prompt_tokens = len(job.prompt_token_ids or ())
            held.append(h)
    return held


def _nodes_of_shards(url: str, keys: Keys) -> dict[int, str]:
    """The URL of the node serving each shard's keys (the one node of a single Redis)."""
    if not is_cluster_url(url):
        return {0: url}
    cluster = connect(url)
    try:
        out = {}
        for shard_keys in keys.every_shard:
            node = cluster.get_node_from_key(shard_keys.requests)
            out[shard_keys.shard] = f"redis://127.0.0.1:{node.port}"
        return out
    finally:
        cluster.close()


def _trace_worker(trace: Trace, scripts: Scripts, queue: list[HeldJob], nodes: dict[int, str], rng: random.Random,
                  batch: int, steps: int, step_ms: float, interval_ms: float) -> None:
    """One worker's steps, as SimWorker._step makes them, its STEP calls added to the trace."""
    running, waiting = queue[:batch], queue[batch:]
    turns, interval_s = ShardTurns(trace.keys.shards), interval_ms / 1000
    trace.jobs += len(running)
    for job in queue:
        trace.channels.setdefault(nodes[job.shard], {}).setdefault(job.shard, []).append(trace.keys.events(job.id))
    step_s = step_ms / 1000
    for step in range(steps):
        writes: dict[int, list[JobWrite]] = {}
        for held, events, write in step_writes(running, turns, interval_s, step * step_s, step_s, rng, scripts.consumer):
            trace.events += len(events)
            writes.setdefault(held.shard, []).append(write)
            if held.finished:
                running.remove(held)
                if waiting:
                    running.append(waiting.pop(0))
                    trace.jobs += 1
        trace.tokens += len(running)
        for shard, shard_writes in writes.items():
            shard_keys = trace.keys.on_shard(shard)
            trace.calls.setdefault(nodes[shard], []).append(
                (shard_keys.requests, scripts.step_args(shard_keys, shard_writes)))


def step_writes(running: list[HeldJob], turns: ShardTurns, interval_s: float, now: float, step_s: float,
                rng: random.Random, worker: str) -> list[tuple[HeldJob, list[Event], JobWrite]]:
    """One step of a simulated worker (`step_s` after its last, ending at `now`): a token for
    each running job (its last at its max_tokens), and what goes out by the publisher's rules
    (`worker.queue.publisher`): firsts and finals at once, then the held jobs of the shards
    whose turn it is. A finishing job's write has its record and usage."""
    going = []
    for held in running:
        made = len(held.completions[0].token_ids) + sum(len(u.token_ids) for u in held.unsent.values())
        last = made + 1 >= (held.job.sampling_params.max_tokens or 1)
        hold_delta(held, 0, _piece(rng), [rng.randrange(3, 49152)], "length" if last else None)
        if publish_due(held, interval_s):
            going.append(held)
        elif held.unsent:
            turns.holding(held.shard, now - step_s, interval_s)
    due = turns.due(now, interval_s, step_s)
    going += [h for h in running if h.unsent and h.shard in due and not publish_due(h, interval_s)]
    out = []
    for held in going:
        events = unsent_events(held)
        write = JobWrite(held.id, held.entry_id, [encode_event(e) for e in events])
        if held.finished:
            write.record = final_record(held, worker, now)
            write.meter = Meter(time.strftime("%Y-%m-%d", time.gmtime(now)), "", "bench", held.prompt_tokens or 0,
                                len(held.completions[0].token_ids))
        out.append((held, events, write))
    turns.keep((h.shard for h in running if h.unsent), due)
    return out


def _piece(rng: random.Random) -> str:
    """A token's text: English BPE averages about 4 characters a token, a space before words."""
    return " " * (rng.random() < 0.7) + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 6)))


def _replay(node: str, trace: Trace, calls: list[tuple[str, list[Any]]]) -> dict[str, Any]:
    """Send `calls` to `node` pipelined, a subscriber on its channels; its CPU and wall time."""
    conn = redis.Redis.from_url(node)
    sha = str(conn.script_load(trace.script))
    subscriber = _Subscriber(node, trace.channels.get(node, {}), trace.keys.sharded_pubsub)
    try:
        before, start = _cpu_s(conn), time.perf_counter()
        for at in range(0, len(calls), PIPELINE):
            pipe = conn.pipeline(transaction=False)
            for key, args in calls[at:at + PIPELINE]:
                pipe.evalsha(sha, 1, key, *args)
            for reply in pipe.execute(raise_on_error=True):
                if reply:
                    raise RuntimeError(f"{node}: entries reported lost in the replay: {reply[:3]}")
        wall_s, cpu_s = time.perf_counter() - start, _cpu_s(conn) - before
    finally:
        subscriber.close()
        conn.close()
    tokens = max(trace.tokens, 1)
    return {"cpu_s": round(cpu_s, 4), "wall_s": round(wall_s, 4), "busy": round(cpu_s / wall_s, 3) if wall_s else None,
            "cpu_us_per_token": round(cpu_s / tokens * 1e6, 3),
            "tokens_per_cpu_s": round(tokens / cpu_s) if cpu_s else None}


def _cpu_s(conn: redis.Redis) -> float:
    cpu: Any = conn.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


class _Subscriber:
    """A connection subscribed to every channel given (per shard: an SSUBSCRIBE takes one
    slot's channels), its messages read and dropped by a thread, as a relay's would be read."""

    def __init__(self, node: str, channels: dict[int, list[str]], sharded: bool) -> None:
        where = urllib.parse.urlparse(node)
        self.sock = socket.create_connection((where.hostname or "127.0.0.1", where.port or 6379))
        wanted = 0
        for names in channels.values():
            for at in range(0, len(names), 1000):
                part = names[at:at + 1000]
                self.sock.sendall(_command(["SSUBSCRIBE" if sharded else "SUBSCRIBE", *part]))
                wanted += len(part)
        conn = redis.Redis.from_url(node)
        try:  # (every subscription in place before the replay)
            deadline = time.monotonic() + 30
            count = "SHARDNUMSUB" if sharded else "NUMSUB"
            probe = [n for names in channels.values() for n in names[-1:]]
            while probe and time.monotonic() < deadline:
                counts = conn.execute_command("PUBSUB", count, *probe)
                if all(int(c) >= 1 for c in counts[1::2]):
                    break
                time.sleep(0.01)
        finally:
            conn.close()
        self._stop = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                if not self.sock.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


def _command(parts: list[str]) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for p in parts:
        b = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)
