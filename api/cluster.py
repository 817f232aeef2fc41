"""What Redis says about the cluster: queue depth and the workers' heartbeats.

Works on Redis 6.2 (the embedded server): `XINFO GROUPS ... lag` is 7.0-only, so the entries
not yet delivered are counted from the group's last-delivered id, up to a cap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio

from producer.protocol import LANES, Keys, ProtocolError
from producer.records import WorkerInfo, decode_worker_info

log = logging.getLogger(__name__)

# KEYS[1]: requests stream. ARGV[1]: consumer group, ARGV[2]: cap on the undelivered count.
# Returns {undelivered, pending}. One script so both numbers come from one moment.
QUEUE_DEPTH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
local last, pending = nil, 0
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
  if info['name'] == ARGV[1] then last, pending = info['last-delivered-id'], info['pending'] end
end
if last == nil then return {redis.call('XLEN', KEYS[1]), 0} end
local cap, undelivered, start = tonumber(ARGV[2]), 0, '(' .. last
while undelivered < cap do
  local batch = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 256)
  if #batch == 0 then break end
  undelivered = undelivered + #batch
  start = '(' .. batch[#batch][1]
end
return {undelivered, pending}
"""

METRICS_DEPTH_CAP = 100_000  # /metrics counts undelivered entries up to this many
QUEUES_MAX_AGE_S = 1.0  # the queues counted in a depth may be this old (workers come and go slowly)


@dataclass(frozen=True)
class QueueDepth:
    undelivered: int  # in the stream, not yet read by any worker (capped)
    pending: int  # delivered to a worker, not yet acknowledged (waiting or running there)
    # a queue's: the depth of each of its priority lanes' streams, by lane name (LANES)
    lanes: dict[str, QueueDepth] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.undelivered + self.pending


@dataclass(frozen=True)
class LiveWorker:
    """A worker whose heartbeat hash is still there."""

    name: str
    info: WorkerInfo

    @property
    def serving(self) -> bool:
        return self.info.state == "serving"  # not draining after a SIGTERM


class Cluster:
    """Reads the queue and the heartbeats; one instance per app."""

    def __init__(self, conn: redis.asyncio.Redis, keys: Keys, pubsub_conn: redis.asyncio.Redis | None = None) -> None:
        self._redis = conn
        # PUBLISH goes here: on a Redis Cluster a plain connection to one node (the asyncio
        # cluster client has no PUBLISH; every node relays it)
        self._publisher = pubsub_conn or conn
        self._keys = keys
        self._depth = conn.register_script(QUEUE_DEPTH_LUA)
        self._workers: tuple[float, list[LiveWorker]] | None = None  # (monotonic time, beats)

    async def notify(self, key: str) -> None:
        """Tell the workers that the record at `key` they follow changed: each beats at once,
        acting on it, rather than at its next heartbeat (which would read it anyway)."""
        await self._publisher.publish(self._keys.control_channel, key)

    async def queue_depth(self, cap: int = METRICS_DEPTH_CAP) -> QueueDepth:
        """Jobs queued or running, over the shared stream and the queue of every live worker
        (each stream counted up to `cap`)."""
        depths = (await self.queue_depths(cap)).values()
        return QueueDepth(sum(d.undelivered for d in depths), sum(d.pending for d in depths))

    async def queue_depths(self, cap: int = METRICS_DEPTH_CAP) -> dict[str, QueueDepth]:
        """Each queue's depth, by name ("": the shared stream), its priority lanes together:
        that one and every live worker's."""
        queues = {""} | {w.info.queue for w in await self.workers(max_age_s=QUEUES_MAX_AGE_S)}
        depths = {}
        for queue in sorted(queues):
            lanes = {}
            for lane in LANES:
                lanes[lane] = await self._lane_depth(queue, lane, cap)
            depths[queue] = QueueDepth(sum(d.undelivered for d in lanes.values()),
                                       sum(d.pending for d in lanes.values()), lanes)
        return depths

    async def _lane_depth(self, queue: str, lane: str, cap: int) -> QueueDepth:
        """One lane of `queue`, summed over the request-stream shards (each counted up to `cap`;
        on a cluster they are asked at once, each on its own master)."""
        streams = [k.on_queue(queue).on_lane(lane).requests for k in self._keys.every_shard]
        replies = await asyncio.gather(*(self._depth(keys=[s], args=[self._keys.group, cap]) for s in streams))
        return QueueDepth(sum(int(u) for u, _ in replies), sum(int(p) for _, p in replies))

    async def workers(self, max_age_s: float = 0.0) -> list[LiveWorker]:
        """Live workers: heartbeat hashes still there (they expire when beats stop). A SCAN
        walks the whole keyspace, so callers on the request path accept a recent answer."""
        now = time.monotonic()
        if self._workers is not None and now - self._workers[0] <= max_age_s:
            return self._workers[1]
        beats = await self._scan_workers()
        self._workers = (now, beats)
        return beats

    async def _scan_workers(self) -> list[LiveWorker]:
        names = [k async for k in self._redis.scan_iter(match=self._keys.worker_pattern, count=100)]
        if not names:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        beats = await pipe.execute()
        prefix_len = len(self._keys.worker(""))
        parsed = [
            parse_beat(name.decode()[prefix_len:], raw)
            for name, raw in zip(names, beats, strict=True)
            if raw  # expired between SCAN and HGETALL
        ]
        return [worker for worker in parsed if worker is not None]

    async def served_models(self, max_age_s: float = 0.0) -> list[str]:
        """Model names the serving workers report (draining ones excluded): base models
        first (the shared stream's first: a job naming no model runs there), then their
        aliases, then their LoRA adapters."""
        serving = [w.info for w in await self.workers(max_age_s) if w.serving and w.info.model]
        shared = sorted({info.model for info in serving if not info.queue})
        models = shared + sorted({info.model for info in serving} - set(shared))
        models += sorted({name for info in serving for name in info.names} - set(models))
        return models + sorted({name for info in serving for name in info.adapters} - set(models))

    async def model_named(self, name: str, max_age_s: float = 0.0) -> str:
        """The model's own name for one of its aliases (any other name as it is)."""
        for worker in await self.workers(max_age_s):
            if worker.serving and name in worker.info.names:
                return worker.info.model
        return name

    async def sampling_defaults(self, model: str, max_age_s: float = QUEUES_MAX_AGE_S) -> dict[str, Any]:
        """The sampling values a serving worker of `model` (or of the adapter it names) reports
        from its generation_config.json; none where no such worker is live."""
        for worker in await self.workers(max_age_s):
            if worker.serving and (model in worker.info.names or model in worker.info.adapters):
                return worker.info.default_sampling
        return {}

    async def ping(self) -> bool:
        return bool(await self._redis.ping())


def parse_beat(name: str, raw: dict[bytes, bytes]) -> LiveWorker | None:
    """None (and a warning) for a heartbeat that does not decode, so one odd worker cannot
    break /metrics or /health."""
    try:
        return LiveWorker(name, decode_worker_info(raw, name))
    except ProtocolError as exc:
        log.warning("ignoring worker %s: %s", name, exc)
        return None
