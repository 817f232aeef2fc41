"""How much generation one Redis carries: N simulated workers' traffic and M API relays on one
embedded Redis, no model.

Each simulated worker plays what a `genq worker` sends, through genq's own code: jobs go in
with the client's SUBMIT script (`producer.async_client.AsyncClient.submit`), are read with
XREADGROUP and started with the worker's START script (`Scripts.start`); every step (one every
`--step-ms`) each of its `--batch` running jobs makes one token, which the worker's bookkeeping
(`worker.queue.jobs`: hold_delta, publish_due, ShardTurns, unsent_events, the publisher's rules) turns into
events sent with the STEP script (`Scripts.publish`), the finishing jobs' record, usage and
XACK with them; it beats (`Scripts.heartbeat`) every `--heartbeat-s`. Each job is followed by
one of the M relays (`api.relay.Relay`, one pub/sub connection each, as one API process), as
a streaming request does. Jobs' output lengths are uniform in `--output-len` (W1's 16-256).

    python benchmarks/redis_capacity.py [--workers 1,2,4] [--relays 2] [--batch 128] [--step-ms 10]
        [--stream-interval-ms 0,60] [--seconds 10] [--procs 2] [--cluster [--masters 3]] [--redis 7|6.2]

For each interval and each worker count (stopping once publish -> subscriber p99 passes
`--p99-limit-ms`), over `--seconds` after a warm-up:
- tokens/s made, and the target (N x batch / step);
- Redis CPU: used_cpu_sys + used_cpu_user (INFO cpu) over the wall time, in cores;
- commands per token: every command Redis ran (INFO commandstats, where commands a Lua script
  runs count too), split into the calls clients sent (counted as redis-py packs them) and the
  commands scripts ran (the rest); and XADD, PUBLISH, EVALSHA per token;
- publish -> subscriber latency p50/p99: from just before the STEP call until the relay's
  follower takes the event.
Then what one Redis core would sustain at the measured CPU per token, in workers of 5.5k
tokens/s (an H200 running W1 today) and 16k (its target).

The servers are `--redis 7` (Debian's, which the set-up unpacks into the virtualenv; the
default where it is there) or the embedded `6.2`, the same for both trials. On a Redis 7
cluster the relays follow jobs' events on shard channels (SSUBSCRIBE) and the STEP script
SPUBLISHes them, as genq does there.

With `--cluster`, each trial runs again on a Redis Cluster of `--masters` masters (no replicas,
`producer.redis_cluster`), its request streams split over the default shards, and each
master's share is reported: its commands (INFO commandstats) and CPU (used_cpu_sys + user)
per token made, as a share of the single Redis's in the same run (per token, since the two
trials make slightly different numbers of tokens), and of the cluster's total. First it prints
what one XADD and one PUBLISH cost each server's CPU, one server busy at a time (the trials'
CPU figures move with whatever else the machine runs; these hardly do). The generator (Python, on
`--procs` processes) is far more costly per token than Redis: on a small machine it, not
Redis, limits the rate, so the CPU per token is the figure to project from.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import redis
import redis.asyncio
import redis.asyncio.connection
from redis_saturate import saturate, step_writes

from api.relay import Relay
from producer.async_client import AsyncClient
from producer.protocol import Keys, decode_job, entry_ref
from producer.records import WorkerInfo, encode_worker_info
from producer.redis_cluster import RedisClusterNodes
from producer.redis_conn import (
    connect,
    connect_async,
    is_cluster_url,
    xreadgroup,
)
from producer.redis_server import RedisServer, find_redis7_server
from producer.sampling_params import SamplingParams
from producer.shard_pubsub import connect_async_events
from worker.queue.config import DEFAULT_STREAM_COALESCE_MIN_TOKENS_PER_S
from worker.queue.jobs import (
    HeldJob,
    ShardTurns,
    TokenRate,
    coalescing_interval_s,
    new_completions,
)
from worker.queue.scripts import Scripts

H200_TOKENS_PER_S = 5500  # W1 on an H200 today (docs/benchmarks.md)
H200_TARGET_TOKENS_PER_S = 16000
START_DELAY_S = 2.0  # the processes import and connect before the warm-up starts


@dataclass
class Share:
    """What one generator process measured inside the window."""

    tokens: int = 0
    events: int = 0
    steps: int = 0
    step_s: list[float] = field(default_factory=list)  # each step's length (start to start)
    latencies_s: list[float] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)  # commands clients sent, by name
    errors: list[str] = field(default_factory=list)


class Window:
    """The measured interval [start, end) in unix time, shared by every process."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def open(self) -> bool:
        return self.start <= time.time() < self.end


_SENT: collections.Counter[str] = collections.Counter()
_WINDOW: Window | None = None


def _count_sent_commands() -> None:
    """Count every command this process's redis-py connections pack, by name (inside the
    window): pipelines, pub/sub and script calls all go through pack_command."""
    original = redis.asyncio.connection.Connection.pack_command

    def pack_command(self: Any, *args: Any) -> Any:
        if _WINDOW is not None and _WINDOW.open():
            name = args[0]
            _SENT[(name.decode() if isinstance(name, bytes) else str(name)).split()[0].upper()] += 1
        return original(self, *args)

    redis.asyncio.connection.Connection.pack_command = pack_command  # type: ignore[method-assign]


class SimWorker:
    """One worker's Redis traffic: intake, a publish per step, finishes, heartbeats."""

    def __init__(self, name: str, url: str, keys: Keys, client: AsyncClient, relays: list[Relay],
                 args: argparse.Namespace, share: Share, sent_at: dict[tuple[str, int], float]) -> None:
        self.name = name
        self.conn = connect_async(url)
        self.scripts = Scripts(self.conn, keys, name)
        self.next_shard = 0  # the shard the next read starts at (a worker reads every shard)
        self.keys, self.client, self.relays, self.args = keys, client, relays, args
        self.share, self.sent_at = share, sent_at
        self.held: list[HeldJob] = []
        self.rng = random.Random(name)
        self.followers: set[asyncio.Task[None]] = set()
        self.step_at: float | None = None
        self.rate = TokenRate()  # the tokens it made over the last second (the publisher's gate)
        self.turns = ShardTurns(keys.shards)  # when each shard's held tokens go out

    async def run(self, window: Window) -> None:
        step_s, next_beat = self.args.step_ms / 1000, 0.0
        due = time.monotonic()
        while time.time() < window.end:
            await self._fill()
            await self._step(window)
            if time.monotonic() >= next_beat:
                await self._beat()
                next_beat = time.monotonic() + self.args.heartbeat_s
            due += step_s
            if (wait_s := due - time.monotonic()) > 0:
                await asyncio.sleep(wait_s)
            else:
                due = time.monotonic()  # behind: the steps it missed are not made up
        for task in self.followers:
            task.cancel()
        await self.conn.aclose()

    async def _fill(self) -> None:
        """Top the batch up: submit, follow, read and start as many jobs as finished."""
        need = self.args.batch - len(self.held)
        if need <= 0:
            return
        lo, hi = self.args.output_len
        for _ in range(need):
            prompt = [self.rng.randrange(3, 49152) for _ in range(self.rng.randint(32, 256))]
            params = SamplingParams(temperature=0.0, max_tokens=self.rng.randint(lo, hi), ignore_eos=True)
            handle = await self.client.submit({"prompt_token_ids": prompt}, params)
            relay = self.relays[self.rng.randrange(len(self.relays))]
            task = asyncio.create_task(self._follow(relay, handle.id))
            self.followers.add(task)
            task.add_done_callback(self.followers.discard)
        entries = await self._read(need)
        jobs = [decode_job(f) for _, f in entries]
        codes = await self.scripts.start(jobs, [e for e, _ in entries], time.time())
        for job, (entry_id, _), code in zip(jobs, entries, codes, strict=True):
            if code == "run":
                held = HeldJob(job, entry_id, new_completions(1))
                held.prompt_tokens = len(job.prompt_token_ids or ())
                self.held.append(held)

    async def _read(self, need: int) -> list[tuple[str, Any]]:
        """Up to `need` new entries, shard after shard from one further each time (one read on a
        single Redis), as the worker's intake loops take turns."""
        entries: list[tuple[str, Any]] = []
        shards = self.keys.every_shard
        for k in range(len(shards)):
            if len(entries) >= need:
                break
            keys = shards[(self.next_shard + k) % len(shards)]
            reply = await xreadgroup(self.conn, keys.group, self.name, {keys.requests: ">"}, need - len(entries))
            entries += [(entry_ref(e.decode(), "", keys.shard), f) for e, f in reply[0][1]] if reply else []
        self.next_shard = (self.next_shard + 1) % len(shards)
        return entries

    async def _follow(self, relay: Relay, job_id: str) -> None:
        try:
            async for _, event in relay.follow([job_id]):
                sent = self.sent_at.pop((job_id, event.seq), None)
                if sent is not None and _WINDOW is not None and _WINDOW.open():
                    self.share.latencies_s.append(time.monotonic() - sent)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noted, never silent: a broken follow would hide latency
            self.share.errors.append(f"{type(exc).__name__}: {exc}")

    async def _step(self, window: Window) -> None:
        """One engine step: a token for every running job, published by the publisher's rules."""
        now, counting = time.time(), window.open()
        step_s, self.step_at = (0.0 if self.step_at is None else now - self.step_at), now
        if counting:
            self.share.step_s.append(step_s)
        writes, done = [], []
        interval_s = coalescing_interval_s(self.args.interval_ms / 1000, self.rate, DEFAULT_STREAM_COALESCE_MIN_TOKENS_PER_S,
                                           step_s)
        self.rate.add(now, len(self.held))
        for held, events, write in step_writes(self.held, self.turns, interval_s, now, step_s, self.rng, self.name):
            for event in events:
                self.sent_at[(held.id, event.seq)] = time.monotonic()
            if held.finished:
                done.append(held)
            writes.append(write)
            self.share.events += len(events) if counting else 0
        self.share.tokens += len(self.held) if counting else 0
        self.share.steps += 1 if counting else 0
        lost = await self.scripts.publish(writes)
        if lost:
            self.share.errors.append(f"{len(lost)} entries lost")
        for held in done:
            self.held.remove(held)

    async def _beat(self) -> None:
        info = WorkerInfo(model="bench", max_num_seqs=self.args.batch, running=len(self.held))
        await self.scripts.heartbeat(self.keys.worker(self.name), encode_worker_info(info),
                                     [(h.id, h.entry_id) for h in self.held], 30)


def _generate(url: str, prefix: str, names: list[str], num_relays: int, args: argparse.Namespace,
              window: tuple[float, float], out: Any) -> None:
    """One generator process: its workers and relays, until the window ends."""
    global _WINDOW
    _WINDOW = Window(*window)
    _count_sent_commands()
    share = Share()
    asyncio.run(_generate_async(url, prefix, names, num_relays, args, share))
    share.sent = dict(_SENT)
    out.put(asdict(share))


async def _generate_async(url: str, prefix: str, names: list[str], num_relays: int,
                          args: argparse.Namespace, share: Share) -> None:
    client = AsyncClient(url, prefix, args.shards if is_cluster_url(url) else None)
    keys = client.keys  # (with the shards the cluster records)
    conns = [connect_async(url) for _ in range(max(1, num_relays))]
    relays = [Relay(conn, keys, connect_async_events(url, conn, keys.sharded_pubsub)) for conn in conns]
    for relay in relays:
        await relay.start()
    sent_at: dict[tuple[str, int], float] = {}
    workers = [SimWorker(n, url, keys, client, relays, args, share, sent_at) for n in names]
    await workers[0].scripts.ensure_group()
    assert _WINDOW is not None
    await asyncio.gather(*(w.run(_WINDOW) for w in workers))
    for relay in relays:
        await relay.aclose()
    await client.aclose()


@dataclass(frozen=True)
class Target:
    """Where a trial runs: `url` for its processes, `nodes` the URLs of the servers measured."""

    name: str
    url: str
    nodes: tuple[str, ...]


def _trial(target: Target, num_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run N workers over `procs` processes; measure each Redis (node) over the window."""
    conns = [redis.Redis.from_url(node) for node in target.nodes]
    for conn in conns:
        conn.flushall()
    prefix = f"cap-{args.interval_ms:g}-{num_workers}:"
    start = time.time() + START_DELAY_S + args.warmup_s
    window = (start, start + args.seconds)
    procs = max(1, min(args.procs, num_workers))
    names = [f"w{i}" for i in range(num_workers)]
    out: Any = multiprocessing.get_context("fork").Queue()
    children = [
        multiprocessing.get_context("fork").Process(
            target=_generate, args=(target.url, prefix, names[p::procs], _split(args.relays, procs, p), args, window, out))
        for p in range(procs)
    ]
    for child in children:
        child.start()
    time.sleep(max(0.0, window[0] - time.time()))
    before = [_redis_counts(conn) for conn in conns]
    time.sleep(max(0.0, window[1] - time.time()))
    after = [_redis_counts(conn) for conn in conns]
    shares = [out.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)
    row = _summary(num_workers, args, shares, _summed(before), _summed(after))
    row["redis"] = target.name
    row["nodes"] = [_node_row(b, a) for b, a in zip(before, after, strict=True)]
    if len(conns) == 1:
        row["bytes_per_job"] = _bytes_per_job(conns[0], Keys(prefix))
    for conn in conns:
        conn.close()
    return row


def _summed(counts: list[dict[str, float]]) -> dict[str, float]:
    """Every node's counts added up (the time: the first node's)."""
    total: collections.Counter[str] = collections.Counter()
    for c in counts:
        total.update({k: v for k, v in c.items() if k != "_TIME"})
    return {**total, "_TIME": counts[0]["_TIME"]}


def _node_row(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One node's commands (INFO itself left out) and CPU seconds over the window."""
    ran = sum(after[k] - before.get(k, 0.0) for k in after if not k.startswith("_") and k != "INFO")
    return {"commands": ran, "cpu_s": after["_CPU_S"] - before["_CPU_S"]}


def _bytes_per_job(conn: redis.Redis, keys: Keys, sample: int = 200) -> dict[str, float]:
    """MEMORY USAGE of finished jobs' records and events (events kept for their retention)."""
    records, events, tokens = 0, 0, 0
    found = 0
    for key in conn.scan_iter(match=keys.job("*"), count=1000):
        status, made = cast(list[Any], conn.hmget(key, ["status", "completion_tokens"]))
        if status != b"finished" or made is None:
            continue
        job_id = key.decode().removeprefix(keys.job(""))
        records += _memory(conn, key)
        events += _memory(conn, keys.events(job_id))
        tokens += int(made)
        found += 1
        if found == sample:
            break
    if not found:
        return {}
    return {"jobs": found, "record": round(records / found), "events": round(events / found),
            "events_per_token": round(events / max(tokens, 1), 1), "tokens": round(tokens / found)}


def _memory(conn: redis.Redis, key: Any) -> int:
    return int(cast(Any, conn.memory_usage(key, samples=0)) or 0)


def _split(total: int, parts: int, index: int) -> int:
    return total // parts + (index < total % parts)


def _redis_counts(conn: redis.Redis) -> dict[str, float]:
    cpu: Any = conn.info("cpu")
    stats: Any = conn.info("commandstats")
    counts = {k.removeprefix("cmdstat_").upper(): float(v["calls"]) for k, v in stats.items()}
    counts |= {"_US:" + k.removeprefix("cmdstat_").upper(): float(v["usec"]) for k, v in stats.items()}
    counts["_CPU_S"] = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    counts["_TIME"] = time.time()
    return counts


def _summary(num_workers: int, args: argparse.Namespace, shares: list[dict[str, Any]],
             before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    wall_s = after["_TIME"] - before["_TIME"]
    ran = {k: after[k] - before.get(k, 0.0) for k in after if not k.startswith("_")}
    ran.pop("INFO", None)  # (this process's own)
    sent: collections.Counter[str] = collections.Counter()
    for s in shares:
        sent.update(s["sent"])
    tokens = sum(s["tokens"] for s in shares) or 1
    total, client_calls = sum(ran.values()), sum(sent.values())
    lat = sorted(x for s in shares for x in s["latencies_s"])
    steps_due = num_workers * wall_s * 1000 / args.step_ms
    step_ms = sorted(x * 1000 for s in shares for x in s["step_s"])
    return {
        "workers": num_workers, "interval_ms": args.interval_ms,
        "target_tokens_per_s": round(num_workers * args.batch * 1000 / args.step_ms),
        "tokens_per_s": round(tokens / wall_s), "events_per_token": round(sum(s["events"] for s in shares) / tokens, 3),
        "steps_made_share": round(sum(s["steps"] for s in shares) / max(steps_due, 1), 3),
        "step_ms_p50": round(step_ms[len(step_ms) // 2], 2) if step_ms else None,
        "redis_cpu_cores": round((after["_CPU_S"] - before["_CPU_S"]) / wall_s, 3),
        "redis_cpu_us_per_token": round((after["_CPU_S"] - before["_CPU_S"]) / tokens * 1e6, 3),
        "commands_per_token": round(total / tokens, 3),
        "client_calls_per_token": round(client_calls / tokens, 3),
        "script_commands_per_token": round(max(0.0, total - client_calls) / tokens, 3),
        "per_token": {c: round(ran.get(c, 0.0) / tokens, 3) for c in ("EVALSHA", "XADD", "PUBLISH", "XPENDING", "EXPIRE")},
        "command_us_per_token": _command_us(before, after, tokens, set(sent)),
        "latency_ms": {"p50": _pick(lat, 0.5), "p99": _pick(lat, 0.99), "n": len(lat)},
        "errors": sorted({e for s in shares for e in s["errors"]})[:5],
    }


def _command_us(before: dict[str, float], after: dict[str, float], tokens: int, sent: set[str],
                top: int = 6) -> dict[str, float]:
    """The commands' own time per token (INFO commandstats usec; a script's includes the
    commands it runs), the `top` costliest, and the rest of the CPU ("other": reading and
    writing connections, the event loop, crons): the CPU less the time of the commands
    clients `sent`."""
    spent = {k[4:]: after[k] - before.get(k, 0.0) for k in after if k.startswith("_US:") and k != "_US:INFO"}
    costly = dict(sorted(spent.items(), key=lambda kv: -kv[1])[:top])
    out = {k: round(v / tokens, 3) for k, v in costly.items()}
    cpu_us = (after["_CPU_S"] - before["_CPU_S"]) * 1e6
    out["other"] = round((cpu_us - sum(v for k, v in spent.items() if k in sent)) / tokens, 3)
    return out


def _pick(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2) if ordered else None


def _project(row: dict[str, Any]) -> str:
    per_token_s = row["redis_cpu_us_per_token"] / 1e6
    if per_token_s <= 0:
        return "no CPU measured"
    core = 1 / per_token_s
    return (f"one Redis core at this CPU per token: {core:,.0f} tokens/s = {core / H200_TOKENS_PER_S:.1f} H200 workers "
            f"today ({H200_TOKENS_PER_S}/s), {core / H200_TARGET_TOKENS_PER_S:.1f} at {H200_TARGET_TOKENS_PER_S}/s")


def _print_row(row: dict[str, Any]) -> None:
    lat = row["latency_ms"]
    print(f"interval {row['interval_ms']:g} ms, {row['workers']} workers: {row['tokens_per_s']:,} tokens/s "
          f"(target {row['target_tokens_per_s']:,}, steps made {row['steps_made_share']:.0%}, step p50 "
          f"{row['step_ms_p50']} ms); Redis CPU "
          f"{row['redis_cpu_cores']:.2f} cores, {row['redis_cpu_us_per_token']:.2f} us/token; commands/token "
          f"{row['commands_per_token']:.2f} (client calls {row['client_calls_per_token']:.2f}, in scripts "
          f"{row['script_commands_per_token']:.2f}; {row['per_token']}); events/token {row['events_per_token']:.2f}; "
          f"publish->subscriber p50 {lat['p50']} ms p99 {lat['p99']} ms (n={lat['n']})"
          + (f"; errors {row['errors']}" if row["errors"] else ""))
    print(f"  command time, us/token: {row['command_us_per_token']}")
    print("  " + _project(row) + f"; bytes per finished job: {row.get('bytes_per_job')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4", help="worker counts to ramp through, comma-separated")
    ap.add_argument("--relays", type=int, default=2, help="API relays (pub/sub connections) following the jobs")
    ap.add_argument("--batch", type=int, default=128, help="running jobs per worker")
    ap.add_argument("--step-ms", type=float, default=10.0, help="a step every this many ms (H200-class: ~10)")
    ap.add_argument("--output-len", default="16,256", help="output tokens per job, uniform in lo,hi")
    ap.add_argument("--stream-interval-ms", default="0,60", help="coalescing intervals to run, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per trial")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--heartbeat-s", type=float, default=5.0)
    ap.add_argument("--procs", type=int, default=2, help="generator processes")
    ap.add_argument("--p99-limit-ms", type=float, default=50.0)
    ap.add_argument("--cluster", action="store_true",
                    help="run each trial on a Redis Cluster too, and report each master's share")
    ap.add_argument("--masters", type=int, default=3, help="the cluster's masters (no replicas)")
    ap.add_argument("--shards", type=int, default=None,
                    help="request-stream shards on the cluster (default: genq's, DEFAULT_CLUSTER_SHARDS)")
    ap.add_argument("--redis", choices=["7", "6.2"], default="7" if find_redis7_server() else "6.2",
                    help="the servers' version: 7, unpacked by the set-up (a cluster's events on shard "
                         "channels), or the embedded 6.2 (PUBLISH, relayed to every node)")
    ap.add_argument("--saturate", action="store_true",
                    help="then replay the step traffic of the largest worker count to each server flat out "
                         "(benchmarks/redis_saturate.py): CPU per token and tokens/s at capacity")
    ap.add_argument("--saturate-steps", type=int, default=3000,
                    help="steps per worker in that replay (fewer: a replay of hundredths of a second, noisy)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    binary = find_redis7_server() if args.redis == "7" else None
    if args.redis == "7" and binary is None:
        ap.error("--redis 7: no Redis 7 in the virtualenv (make unpacks it where apt-get is)")
    args.output_len = tuple(int(x) for x in args.output_len.split(","))
    rows: list[dict[str, Any]] = []
    with RedisServer(binary=binary) as server, tempfile.TemporaryDirectory() as tmp:
        print(f"Redis {args.redis}")
        targets = [Target("single", server.url, (server.url,))]
        if args.cluster:
            nodes = RedisClusterNodes(Path(tmp), masters=args.masters, replicas=0, binary=binary).start()
            targets.append(Target("cluster", nodes.url, tuple(f"redis://127.0.0.1:{p}" for p in nodes.ports)))
        try:
            if args.cluster:
                _print_op_costs(targets[0], targets[1], args.redis == "7")
            _run_trials(targets, args, rows)
            if args.saturate:
                _print_saturation(targets, args)
        finally:
            if args.cluster:
                nodes.stop()
    _print_ratios([r for r in rows if r["redis"] == "single"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _run_trials(targets: list[Target], args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    for interval in (float(x) for x in args.stream_interval_ms.split(",")):
        args.interval_ms = interval
        for n in (int(x) for x in args.workers.split(",")):
            trial = [_trial(target, n, args) for target in targets]
            rows += trial
            for row in trial:
                _print_row(row)
            if len(trial) > 1:
                _print_shares(trial[0], trial[1])
            if trial[0]["steps_made_share"] < 0.9:
                print("  (the generator fell behind its steps: this machine's Python, not Redis, set the rate)")
            p99 = trial[0]["latency_ms"]["p99"]
            if p99 is not None and p99 > args.p99_limit_ms:
                print(f"  stop: p99 past {args.p99_limit_ms:g} ms")
                break


# 100 of one command in one script call, so the call's own cost is spread thin
_OPS_LUA = {
    "XADD": "for i = 1, 100 do redis.call('XADD', KEYS[1], 'MAXLEN', '1000', '*', 'event', ARGV[1]) end",
    "PUBLISH": "for i = 1, 100 do redis.call('PUBLISH', KEYS[1], ARGV[1]) end",
    "SPUBLISH": "for i = 1, 100 do redis.call('SPUBLISH', KEYS[1], ARGV[1]) end",  # (Redis 7)
}


def _print_saturation(targets: list[Target], args: argparse.Namespace) -> None:
    """The step traffic replayed flat out on each server (redis_saturate), and each master's
    CPU per token as a share of the single Redis's."""
    workers = max(int(x) for x in args.workers.split(","))
    interval = float(args.stream_interval_ms.split(",")[-1])
    single: float | None = None
    for target in targets:
        for node in target.nodes:
            redis.Redis.from_url(node).flushall()
        out = saturate(target.url, target.nodes, f"sat-{target.name}:", workers, args.batch, args.saturate_steps,
                       args.step_ms, interval, args.output_len, args.shards)
        print(f"saturated, {target.name}: the step traffic of {workers} workers at interval {interval:g} ms, "
              f"{out['tokens']:,} tokens, {out['events']:,} events, {out['jobs']} jobs")
        for row in out["nodes"]:
            share = ""
            if target.name == "single":
                single = row["cpu_us_per_token"]
            elif single:
                share = f"; {row['cpu_us_per_token'] / single:.1%} of the single Redis's CPU per token"
            print(f"  {row['node']}: {row['calls']} calls, CPU {row['cpu_us_per_token']:.2f} us/token, busy "
                  f"{row['busy']:.0%} over {row['wall_s']:.2f} s; one core of it: {row['tokens_per_cpu_s']:,} "
                  f"tokens/s{share}")


def _print_op_costs(single: Target, cluster: Target, sharded: bool, calls: int = 300) -> None:
    """CPU per XADD, per PUBLISH and (Redis 7, `sharded`) per SPUBLISH (run in a script,
    300-byte payload) on the single Redis and on each cluster node, one server busy at a time:
    what a master pays for the commands it runs and for the ones the others run (a PUBLISH goes
    to every node over the cluster bus, an SPUBLISH to its slot's master and replicas only)."""
    key = "cost:{c}events"
    on_cluster = connect(cluster.url)
    owner = on_cluster.get_node_from_key(key)
    on_cluster.close()
    nodes = [redis.Redis.from_url(url) for url in cluster.nodes]
    where = next(i for i, url in enumerate(cluster.nodes) if url.endswith(f":{owner.port}"))
    plain = redis.Redis.from_url(single.url)
    for name, lua in _OPS_LUA.items():
        if name == "SPUBLISH" and not sharded:
            continue
        alone = _op_cost(plain, [plain], key, lua, calls)[0]
        each = _op_cost(nodes[where], nodes, key, lua, calls)
        others = [c for i, c in enumerate(each) if i != where]
        elsewhere = f", each other master {sum(others) / len(others):.2f} us" if others else ""
        print(f"{name}: single Redis {alone:.2f} us; cluster: its key's master {each[where]:.2f} us"
              f"{elsewhere} (CPU per command)")
    for conn in (plain, *nodes):
        conn.close()


def _op_cost(conn: redis.Redis, measured: list[redis.Redis], key: str, lua: str, calls: int) -> list[float]:
    script = conn.register_script(lua)
    before = [_redis_counts(c)["_CPU_S"] for c in measured]
    for _ in range(calls):
        script(keys=[key], args=["x" * 300])
    after = [_redis_counts(c)["_CPU_S"] for c in measured]
    conn.delete(key)
    return [(a - b) / (calls * 100) * 1e6 for b, a in zip(before, after, strict=True)]


def _print_shares(single: dict[str, Any], cluster: dict[str, Any]) -> None:
    """Each master's commands and CPU per token, as a share of the single Redis's per token and
    of the cluster's total; the largest of each (the target: at most 40% on three masters)."""
    tokens = {id(r): max(r["tokens_per_s"], 1) for r in (single, cluster)}
    base_commands = single["nodes"][0]["commands"] / tokens[id(single)]
    base_cpu = single["nodes"][0]["cpu_s"] / tokens[id(single)]
    total_commands = sum(n["commands"] for n in cluster["nodes"]) or 1
    total_cpu = sum(n["cpu_s"] for n in cluster["nodes"]) or 1e-9
    shares = []
    for node in cluster["nodes"]:
        shares.append({
            "commands_vs_single": round(node["commands"] / tokens[id(cluster)] / base_commands, 3),
            "cpu_vs_single": round(node["cpu_s"] / tokens[id(cluster)] / max(base_cpu, 1e-12), 3),
            "commands_of_cluster": round(node["commands"] / total_commands, 3),
            "cpu_of_cluster": round(node["cpu_s"] / total_cpu, 3),
        })
    cluster["master_shares"] = shares
    print(f"  per master (share of the single Redis's per token; of the cluster's): {shares}")
    print(f"  largest master: {max(s['commands_vs_single'] for s in shares):.1%} of the single Redis's commands, "
          f"{max(s['cpu_vs_single'] for s in shares):.1%} of its CPU (per token made)")


def _print_ratios(rows: list[dict[str, Any]]) -> None:
    """Each interval's commands per token against interval 0's, at the same worker count."""
    base = {r["workers"]: r for r in rows if r["interval_ms"] == 0}
    for row in rows:
        b = base.get(row["workers"])
        if b is not None and row["interval_ms"] != 0:
            print(f"interval {row['interval_ms']:g} ms vs 0, {row['workers']} workers: commands/token "
                  f"{b['commands_per_token'] / row['commands_per_token']:.2f}x fewer, Redis CPU/token "
                  f"{b['redis_cpu_us_per_token'] / max(row['redis_cpu_us_per_token'], 1e-9):.2f}x less")


if __name__ == "__main__":
    raise SystemExit(main())
