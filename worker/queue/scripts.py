"""The worker's writes to Redis: Lua scripts, one round trip each, and their typed callers.

Every write a worker makes on behalf of a job first checks that the job's stream entry is
still pending under this worker's name (`owned` below). That one check is what keeps
at-least-once delivery from turning into two writers: a worker that stalled past the claim
timeout (GC pause, network partition) and lost its entry to a reclaiming worker writes
nothing more for that job, and learns it from the script's reply.

Redis 6.2 is the floor (the embedded server): no XAUTOCLAIM deleted-entries report, so the
reclaim script finds idle entries with XPENDING IDLE and claims them one by one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio

from producer.protocol import (
    DEFAULT_EVENTS_RETENTION_S,
    EVENT_FIELD,
    EVENTS_TTL_S,
    JOB_TTL_S,
    LANES,
    USAGE_TTL_S,
    WORKER_HEARTBEAT_TTL_S,
    Job,
    JobStatus,
    Keys,
    entry_ref,
    pack_script_arg,
    publishing_events,
    ref_shard,
    split_ref,
)
from producer.redis_conn import mget
from worker.queue.jobs import Meter, TenantTokens

# The {host, pid} of another process that heartbeat hash `key` names; false when the hash is
# missing or names (host, pid). A worker's first heartbeat is how it claims its name.
_OTHER_OWNER = """
local function other_owner(key, host, pid)
  local owner = redis.call('HMGET', key, 'host', 'pid')
  if owner[1] and (owner[1] ~= host or owner[2] ~= pid) then return owner end
  return false
end
"""

_TERMINAL = ", ".join(f"['{s.value}'] = true" for s in JobStatus if s.terminal)

# Entries are named by their ref (protocol.entry_ref): `<id>` in the queue's stream `base`
# (KEYS[1]), `<id>@<lane>` in its lane's stream `base@<lane>`; a `#<shard>` after either says
# which shard's stream `base` is (the caller passes that one). locate gives (stream, id).
# owned is true when the entry is pending in the group under `consumer`; a missing group (the
# database was flushed) counts as not owned.
_OWNED = """
local function locate(base, ref)
  local name = string.match(ref, '^[^#]*')
  local at = string.find(name, '@', 1, true)
  if at then return base .. string.sub(name, at), string.sub(name, 1, at - 1) end
  return base, name
end
local function owned(base, group, consumer, ref)
  local stream, id = locate(base, ref)
  local p = redis.pcall('XPENDING', stream, group, id, id, 1)
  if type(p) ~= 'table' or p.err or #p ~= 1 then return false end
  return p[1][2] == consumer
end
local function ack(base, group, ref)
  local stream, id = locate(base, ref)
  redis.call('XACK', stream, group, id)
end
"""

# Publish a batch of engine steps. KEYS[1]: requests. ARGV[1] group, [2] consumer, [3] events
# TTL, [4] job TTL, [5] the jobs, one cmsgpack-packed list of {entry id, events key, job key,
# {encoded events}, {record field, value, ...}, {usage key, field prefix, prompt tokens,
# completion tokens, cached prompt tokens} or {}, {the tenant's minute counter, tokens} or
# {}, 1 where the write is made again (see below) or 0}: an empty record means not finishing,
# [6] usage TTL, [7] the events' TTL once the job has ended (0: deleted at once; the record
# keeps the outputs). A write made again (after an outage: Redis may have all, some or none
# of it) writes only the events whose seq is past the last its stream holds for their
# completion (`unseen`): a stream is never given an event twice, and its seqs only grow. A
# finishing job gets its last events, its record, its usage and its XACK together, so its
# tokens are counted exactly once however often it was delivered. The minute counter (for
# GENQ_RATE_LIMIT_TPM) takes each write's tokens as they come: the load a tenant puts on the
# workers, a rerun of a reclaimed job included. (One packed argument
# instead of a few per job: building a command of thousands of arguments cost the worker's
# event loop more than all the rest of a publish.)
# Returns the entry ids this worker no longer owns (nothing was written for them).
STEP_LUA = _OWNED + f"""
local function position(event)
  local e = cmsgpack.unpack(event)
  return e['index'] or 0, e['seq'] or -1
end
-- the events whose seq is past the last the stream holds for their completion (index), read
-- from the stream's end back until every index of them was met
local function unseen(events_key, events)
  local last, missing = {{}}, 0
  for _, event in ipairs(events) do
    local index = position(event)
    if last[index] == nil then last[index] = false; missing = missing + 1 end
  end
  local before = '+'
  while missing > 0 do
    local page = redis.call('XREVRANGE', events_key, before, '-', 'COUNT', 100)
    for _, entry in ipairs(page) do
      local index, seq = position(entry[2][2])
      if last[index] == false then last[index] = seq; missing = missing - 1 end
    end
    if #page < 100 then break end
    before = '(' .. page[#page][1]
  end
  local out = {{}}
  for _, event in ipairs(events) do
    local index, seq = position(event)
    if not last[index] or seq > last[index] then out[#out + 1] = event; last[index] = seq end
  end
  return out
end
local lost = {{}}
for _, job in ipairs(cmsgpack.unpack(ARGV[5])) do
  local entry_id, events_key, job_key, events, record = job[1], job[2], job[3], job[4], job[5]
  if owned(KEYS[1], ARGV[1], ARGV[2], entry_id) then
    if job[8] == 1 and #events > 0 then events = unseen(events_key, events) end
    for _, event in ipairs(events) do
      redis.call('XADD', events_key, '*', '{EVENT_FIELD}', event)
      redis.call('PUBLISH', events_key, event)
    end
    if #events > 0 then redis.call('EXPIRE', events_key, ARGV[3]) end
    if #record > 0 then
      redis.call('HSET', job_key, unpack(record))
      redis.call('EXPIRE', job_key, ARGV[4])
      redis.call('EXPIRE', events_key, ARGV[7])
      ack(KEYS[1], ARGV[1], entry_id)
      local meter = job[6]
      if meter and #meter > 0 then
        redis.call('HINCRBY', meter[1], meter[2] .. 'requests', 1)
        redis.call('HINCRBY', meter[1], meter[2] .. 'prompt_tokens', meter[3])
        redis.call('HINCRBY', meter[1], meter[2] .. 'completion_tokens', meter[4])
        redis.call('HINCRBY', meter[1], meter[2] .. 'cached_tokens', meter[5])
        redis.call('EXPIRE', meter[1], ARGV[6])
      end
    end
    local minute = job[7]
    if minute and #minute > 0 then
      redis.call('INCRBY', minute[1], minute[2])
      redis.call('EXPIRE', minute[1], 120)
    end
  else
    lost[#lost + 1] = entry_id
  end
end
return lost
"""

# Start jobs. KEYS[1]: requests; per job: job(id), cancel_flag(id).
# ARGV[1] group, [2] consumer, [3] now (unix s), [4] this worker's queue; then per job: entry
# id, n, submit time.
# Returns one code per job: run | cancelled | duplicate | ended | lost. Only `run` writes:
# status running, this worker, the entry id (and its queue), and the fields a job XADDed by a non-Python
# producer has no record for yet (n, submitted_at: readers need n to know when it ends);
# started_at is kept from a first run when resumed.
START_LUA = _OWNED + f"""
local terminal = {{{_TERMINAL}}}
local codes = {{}}
for j = 0, (#KEYS - 1) / 2 - 1 do
  local job_key, flag_key = KEYS[2 + 2 * j], KEYS[3 + 2 * j]
  local entry_id = ARGV[5 + 3 * j]
  local known = redis.call('HGET', job_key, 'entry_id')
  local code = 'run'
  if not owned(KEYS[1], ARGV[1], ARGV[2], entry_id) then code = 'lost'
  elseif known and known ~= entry_id then code = 'duplicate'
  elseif terminal[redis.call('HGET', job_key, 'status') or ''] then code = 'ended'
  elseif redis.call('EXISTS', flag_key) == 1 then code = 'cancelled'
  else
    redis.call('HSET', job_key, 'status', 'running', 'worker', ARGV[2], 'entry_id', entry_id)
    if ARGV[4] ~= '' then redis.call('HSET', job_key, 'queue', ARGV[4]) end
    redis.call('HSETNX', job_key, 'started_at', ARGV[3])
    redis.call('HSETNX', job_key, 'n', ARGV[6 + 3 * j])
    redis.call('HSETNX', job_key, 'submitted_at', ARGV[7 + 3 * j])
  end
  codes[#codes + 1] = code
end
return codes
"""

# Dead-letter entries. KEYS[1]: requests, KEYS[2]: dead; then per entry that fails a job:
# events(id), job(id). ARGV[1] group, [2] consumer, [3] the failed job's events' TTL, [4] job TTL; then per
# entry: entry id, number of dead-letter arguments, number of fail arguments (0: no job to
# fail; else 1 error event + record field/value pairs), "1" to delete the entry from its
# stream after the XACK (an oversize entry: stored once, never twice) else "0", dead-letter
# pairs, error event, record.
# The job is failed only when this entry is the job's own (its record names no other entry)
# and it has not ended: a garbage or duplicate entry carrying a live job's id must not end it.
DEAD_LUA = _OWNED + f"""
local terminal = {{{_TERMINAL}}}
local a, k, n = 5, 3, 0
while a <= #ARGV do
  local entry_id = ARGV[a]
  local num_dead, num_fail, drop = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3] == '1'
  local first = a + 4
  a = first + num_dead + num_fail
  local events_key, job_key = KEYS[k], KEYS[k + 1]
  if num_fail > 0 then k = k + 2 end
  if owned(KEYS[1], ARGV[1], ARGV[2], entry_id) then
    redis.call('XADD', KEYS[2], '*', unpack(ARGV, first, first + num_dead - 1))
    ack(KEYS[1], ARGV[1], entry_id)
    if drop then
      local stream, id = locate(KEYS[1], entry_id)
      redis.call('XDEL', stream, id)
    end
    n = n + 1
    if num_fail > 0 then
      local known = redis.call('HGET', job_key, 'entry_id')
      local status = redis.call('HGET', job_key, 'status') or ''
      if (not known or known == entry_id) and not terminal[status] then
        local event = ARGV[first + num_dead]
        redis.call('XADD', events_key, '*', '{EVENT_FIELD}', event)
        redis.call('PUBLISH', events_key, event)
        redis.call('EXPIRE', events_key, ARGV[3])
        redis.call('HSET', job_key, 'entry_id', entry_id, unpack(ARGV, first + num_dead + 1, a - 1))
        redis.call('EXPIRE', job_key, ARGV[4])
      end
    end
  end
end
return n
"""

# Heartbeat, in two parts. beat: write the heartbeat hash `key` (ARGV[first..last]: its
# field/value pairs) for `ttl` s, unless it names another process: then nothing is written and
# that process's {host, pid} returned. keep: re-own the in-flight entries ARGV[first_arg..]
# (their jobs' cancel flags are KEYS[first_flag..], in order); XCLAIM ... JUSTID to itself
# resets an entry's idle time without counting a delivery, so reclaimers leave it alone;
# entries another worker took are reported lost, never taken back (a plain XCLAIM with
# min-idle 0 would steal them back from a live worker). Returns {lost entry ids, entry ids
# whose job has a cancel flag}.
_BEAT_KEEP = _OWNED + _OTHER_OWNER + """
local function beat(key, ttl, first, last)
  local me = {}
  for i = first, last - 1, 2 do me[ARGV[i]] = ARGV[i + 1] end
  local owner = other_owner(key, me['host'], me['pid'])
  if owner then return owner end
  redis.call('HSET', key, unpack(ARGV, first, last))
  redis.call('EXPIRE', key, ttl)
  return false
end
local function keep(requests, group, consumer, first_flag, first_arg)
  local lost, cancelled = {}, {}
  for i = first_arg, #ARGV do
    local entry_id = ARGV[i]
    if owned(requests, group, consumer, entry_id) then
      local stream, id = locate(requests, entry_id)
      redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
      if redis.call('EXISTS', KEYS[first_flag + i - first_arg]) == 1 then
        cancelled[#cancelled + 1] = entry_id
      end
    else
      lost[#lost + 1] = entry_id
    end
  end
  return lost, cancelled
end
"""

# The heartbeat in one call (a single Redis). KEYS[1]: requests, KEYS[2]: worker(name); then
# cancel_flag(id) per in-flight job. ARGV[1] group, [2] consumer, [3] heartbeat TTL, [4]
# number of heartbeat arguments, the heartbeat field/value pairs, then one entry id per
# in-flight job. Returns {lost, cancelled, false}, or {{}, {}, {host, pid}} of the process the
# hash names when it is another (this worker stalled past the TTL and a namesake took the
# name): then nothing is written.
HEARTBEAT_LUA = _BEAT_KEEP + """
local num_fields = tonumber(ARGV[4])
local owner = beat(KEYS[2], ARGV[3], 5, 4 + num_fields)
if owner then return {{}, {}, owner} end
local lost, cancelled = keep(KEYS[1], ARGV[1], ARGV[2], 3, 5 + num_fields)
return {lost, cancelled, false}
"""

# On a Redis Cluster the worker's hash and its shard's keys live in different slots: the
# heartbeat is two calls, the hash first. BEAT_LUA: KEYS[1] worker(name); ARGV[1] heartbeat
# TTL, then the field/value pairs; returns false or {host, pid} as above. KEEP_LUA: KEYS[1]
# requests, then cancel_flag(id) per in-flight job; ARGV[1] group, [2] consumer, then one entry
# id per job; returns {lost, cancelled}.
BEAT_LUA = _BEAT_KEEP + """
return beat(KEYS[1], ARGV[1], 2, #ARGV)
"""
KEEP_LUA = _BEAT_KEEP + """
local lost, cancelled = keep(KEYS[1], ARGV[1], ARGV[2], 2, 3)
return {lost, cancelled}
"""

# Give a worker's name back: delete its hash (KEYS[1]) if it names this process (ARGV[1] host,
# [2] pid) and no other. Returns 1 if deleted.
UNCLAIM_LUA = _OTHER_OWNER + """
if other_owner(KEYS[1], ARGV[1], ARGV[2]) then return 0 end
return redis.call('DEL', KEYS[1])
"""

# Reclaim. KEYS[1]: one lane's stream (ids in the reply are of that stream). ARGV[1] group, [2] consumer, [3] min idle ms, [4] count.
# Entries idle for min idle ms (their worker died, or released them at shutdown) are claimed
# for this worker, one XCLAIM each inside the script, so no other reclaimer can take one
# between the XPENDING and the claim. Returns {entry id, deliveries including this one,
# fields or false (the entry was deleted from the stream; Redis 6.2 keeps it pending)}.
RECLAIM_LUA = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', ARGV[4])
local out = {}
for _, p in ipairs(pending) do
  local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], p[1])
  if #claimed == 1 then
    out[#out + 1] = {p[1], p[4] + 1, claimed[1] and claimed[1][2] or false}
  end
end
return out
"""

# Release at shutdown. KEYS[1]: requests. ARGV[1] group, [2] consumer, [3] idle ms; then
# entry ids. Sets each owned entry's idle time past any claim timeout, so the next reclaimer
# takes it at once instead of waiting, and gives back the delivery the release will cost
# (RETRYCOUNT): a graceful hand-over is not a failed attempt. Returns how many were released.
RELEASE_LUA = _OWNED + """
local n = 0
for i = 4, #ARGV do
  if owned(KEYS[1], ARGV[1], ARGV[2], ARGV[i]) then
    local stream, id = locate(KEYS[1], ARGV[i])
    local p = redis.call('XPENDING', stream, ARGV[1], id, id, 1)
    local retries = math.max(tonumber(p[1][4]) - 1, 0)
    redis.call('XCLAIM', stream, ARGV[1], ARGV[2], 0, id,
               'IDLE', ARGV[3], 'RETRYCOUNT', retries, 'JUSTID')
    n = n + 1
  end
end
return n
"""

# Hand entries to another worker of this stream (worker.queue.affinity). KEYS[1]: requests.
# ARGV[1] group, [2] consumer, [3] the receiving worker's name, [4] its handoff channel; then
# entry ids. Each entry still this worker's is claimed in the receiver's name (JUSTID: the
# delivery count stays, a handoff is no failed attempt; its idle time starts again), and the
# receiver is told their ids. Returns the ids handed over.
HANDOFF_LUA = _OWNED + """
local moved = {}
for i = 5, #ARGV do
  if owned(KEYS[1], ARGV[1], ARGV[2], ARGV[i]) then
    local stream, id = locate(KEYS[1], ARGV[i])
    redis.call('XCLAIM', stream, ARGV[1], ARGV[3], 0, id, 'JUSTID')
    moved[#moved + 1] = ARGV[i]
  end
end
if #moved > 0 then redis.call('PUBLISH', ARGV[4], table.concat(moved, ' ')) end
return moved
"""

# Read entries handed to this worker. KEYS[1]: requests. ARGV[1] group, [2] consumer; then entry
# ids. Returns {id, delivery count, fields or false} for each still pending under this worker
# (a notice that came late finds its entry reclaimed by another: that one is left alone).
TAKE_LUA = _OWNED + """
local out = {}
for i = 3, #ARGV do
  if owned(KEYS[1], ARGV[1], ARGV[2], ARGV[i]) then
    local stream, id = locate(KEYS[1], ARGV[i])
    local p = redis.call('XPENDING', stream, ARGV[1], id, id, 1)
    local entry = redis.call('XRANGE', stream, id, id)
    out[#out + 1] = {ARGV[i], p[1][4], entry[1] and entry[1][2] or false}
  end
end
return out
"""

# Forward entries to the queue whose workers serve their model. KEYS[1]: requests (this
# worker's); per entry: the target queue's requests stream, job(id). ARGV[1] group, [2]
# consumer, [3] job TTL; per entry: entry id, target queue name, number of field/value
# arguments, the entry's fields. The entry is copied to the target (its group created at id 0
# when missing, as SUBMIT does), the job's record is pointed at the copy, and the original is
# acknowledged, in one step. Returns one code per entry: moved | lost | duplicate (the job's
# record names another entry: left for the caller to dead-letter).
FORWARD_LUA = _OWNED + """
local codes, a = {}, 4
for j = 0, (#KEYS - 1) / 2 - 1 do
  local target, job_key = KEYS[2 + 2 * j], KEYS[3 + 2 * j]
  local entry_id, queue, n = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local first = a + 3
  a = first + n
  local known = redis.call('HGET', job_key, 'entry_id')
  local code = 'moved'
  if not owned(KEYS[1], ARGV[1], ARGV[2], entry_id) then code = 'lost'
  elseif known and known ~= entry_id then code = 'duplicate'
  else
    redis.pcall('XGROUP', 'CREATE', target, ARGV[1], '0', 'MKSTREAM')
    local copy = redis.call('XADD', target, '*', unpack(ARGV, first, a - 1))
    local _, id = locate(KEYS[1], entry_id)
    copy = copy .. string.sub(entry_id, #id + 1)  -- the copy keeps its lane and shard ('@<lane>#<shard>')
    redis.call('HSET', job_key, 'entry_id', copy, 'queue', queue)
    redis.call('EXPIRE', job_key, ARGV[3])
    ack(KEYS[1], ARGV[1], entry_id)
  end
  codes[#codes + 1] = code
end
return codes
"""

# Trim a stream by age. KEYS[1]: the stream (requests, dead). ARGV[1]: retention in ms.
# Entries at least the retention old (by Redis's clock, which made their ids) are removed, except
# what any consumer group still needs (the dead stream has none): its oldest pending entry and
# all after it (a worker may reclaim one and must read its fields), and every entry it has not
# been delivered yet (a backlog older than the retention is still work). XTRIM MINID cuts below one id, so an acked
# entry behind a long-pending one waits for it. Returns how many entries were removed.
# Redis's clock in ms (it makes the entries' ids), and the consumer groups of a stream, each a
# table of XINFO GROUPS fields ('name', 'last-delivered-id', ...).
_STREAM_CLOCK = """
local function now_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
local function groups(stream)
  local out = {}
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
    out[#out + 1] = info
  end
  return out
end
"""

TRIM_LUA = _STREAM_CLOCK + """
local function split(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function before(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  return am < bm or (am == bm and as < bs)
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cutoff_ms = now_ms() - tonumber(ARGV[1])
if cutoff_ms < 0 then return 0 end
local min_id = string.format('%d-0', cutoff_ms + 1)  -- entries of the cutoff's millisecond are old enough
for _, info in ipairs(groups(KEYS[1])) do
  local ms, seq = split(info['last-delivered-id'])
  local first_undelivered = string.format('%d-%d', ms, seq + 1)
  if before(first_undelivered, min_id) then min_id = first_undelivered end
  local pending = redis.call('XPENDING', KEYS[1], info['name'])
  if pending[1] > 0 and before(pending[2], min_id) then min_id = pending[2] end
end
return redis.call('XTRIM', KEYS[1], 'MINID', min_id)
"""

# How long the oldest entry the group has not read yet has waited in each stream. KEYS: the
# lanes' streams; ARGV[1]: the group. Returns ms per stream (by the clock that made the ids),
# -1 where the group has read every entry (or the stream or group is missing).
LANE_WAITS_LUA = _STREAM_CLOCK + """
local now = now_ms()
local out = {}
for i, stream in ipairs(KEYS) do
  out[i] = -1
  if redis.call('EXISTS', stream) == 1 then
    for _, info in ipairs(groups(stream)) do
      if info['name'] == ARGV[1] then
        local head = redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+', 'COUNT', 1)[1]
        if head then out[i] = math.max(0, now - tonumber(string.match(head[1], '^(%d+)-'))) end
      end
    end
  end
end
return out
"""


class NameTaken(RuntimeError):
    """Another live worker holds this worker's name: a starting worker waits for it to expire,
    a running one must stop."""

    def __init__(self, consumer: str, host: str, pid: int) -> None:
        super().__init__(f"worker name {consumer!r} was taken by host {host}, pid {pid}")
        self.host = host
        self.pid = pid


RELEASED_IDLE_MS = 10**12  # about 30 years: older than any claim timeout


@dataclass
class JobWrite:
    """What one publish writes for one job: events, and on finish the record (plus XACK) and
    its usage."""

    job_id: str
    entry_id: str
    events: list[bytes] = field(default_factory=list)
    record: dict[str, str | bytes] | None = None  # set: the job ends with this write
    meter: Meter | None = None  # with the record: counted once, with the XACK
    tenant_tokens: TenantTokens | None = None  # what this write adds to the tenant's minute
    again: bool = False  # made again after an outage: events the stream ends with are not repeated


@dataclass
class DeadLetter:
    """An entry going to the dead stream; `fail` set: also fail its job with this event."""

    entry_id: str
    fields: dict[str, bytes]  # records.encode_dead_letter
    job_id: str | None = None
    error_event: bytes | None = None
    record: dict[str, str | bytes] | None = None
    drop: bool = False  # delete the entry from its stream too (oversize: its payload is not in `fields`)


@dataclass(frozen=True)
class Forward:
    """An entry going to the stream of `queue`, whose workers serve its job's model."""

    entry_id: str
    job_id: str
    queue: str
    fields: dict[bytes, bytes]


class PartlyPublished(Exception):
    """Scripts.publish: the calls of some shards failed (`error`, the first), the others'
    went through. `unsent`: the writes to make again; `lost`: what the others found lost.
    Sending all of them again would not be harmless: an entry a finishing write acknowledged
    would then be reported lost."""

    def __init__(self, unsent: list[JobWrite], lost: set[str], error: BaseException) -> None:
        super().__init__(f"{len(unsent)} writes not sent: {error}")
        self.unsent = unsent
        self.lost = lost
        self.error = error


@dataclass(frozen=True)
class Reclaimed:
    entry_id: str
    delivery_count: int  # including this delivery
    fields: dict[bytes, bytes] | None  # None: deleted from the stream


T = TypeVar("T")


class Scripts:
    """The worker's Redis writes, one named delivery rule per method.

    `keys` names shard 0 and says how many shards there are (`keys.shards`): a method given
    entries calls its script once per shard they are in (each call's keys in that shard's
    slot), the shards at once; one that reads the queue reads every shard."""

    def __init__(self, conn: redis.asyncio.Redis, keys: Keys, consumer: str,
                 events_retention_s: float = DEFAULT_EVENTS_RETENTION_S) -> None:
        self.conn = conn
        self.keys = keys
        self.consumer = consumer
        # an ended job's events: EXPIRE takes whole seconds (0 deletes them at once)
        self.events_retention_s = int(events_retention_s)
        self._step = conn.register_script(publishing_events(STEP_LUA, keys))
        self._start = conn.register_script(START_LUA)
        self._dead = conn.register_script(publishing_events(DEAD_LUA, keys))
        self._heartbeat = conn.register_script(HEARTBEAT_LUA)
        self._beat = conn.register_script(BEAT_LUA)
        self._keep = conn.register_script(KEEP_LUA)
        self._unclaim = conn.register_script(UNCLAIM_LUA)
        self._reclaim = conn.register_script(RECLAIM_LUA)
        self._release = conn.register_script(RELEASE_LUA)
        self._trim = conn.register_script(TRIM_LUA)
        self._lane_waits = conn.register_script(LANE_WAITS_LUA)
        self._forward = conn.register_script(FORWARD_LUA)
        self._handoff = conn.register_script(HANDOFF_LUA)
        self._take = conn.register_script(TAKE_LUA)
        self._next_reclaim = 0  # the shard the next reclaim starts at: none is always last

    async def _per_shard(self, refs: Sequence[str], call: Callable[[Keys, list[int]], Awaitable[T]]) -> list[T]:
        """`call(keys of a shard, indexes of the refs in it)` for each shard the refs are in, at once."""
        groups = _shard_groups(refs)
        if len(groups) == 1:  # (the one call of a single Redis, awaited as it always was)
            shard, indexes = next(iter(groups.items()))
            return [await call(self.keys.on_shard(shard), indexes)]
        return list(await asyncio.gather(*(call(self.keys.on_shard(n), ix) for n, ix in groups.items())))

    async def _in_order(self, refs: Sequence[str], call: Callable[[Keys, list[int]], Awaitable[list[Any]]]) -> list[Any]:
        """As _per_shard, for a call that answers one item per index: the items in the refs' order."""
        out: list[Any] = [None] * len(refs)

        async def placed(keys: Keys, indexes: list[int]) -> None:
            for i, item in zip(indexes, await call(keys, indexes), strict=True):
                out[i] = item

        await self._per_shard(refs, placed)
        return out

    async def ensure_group(self) -> None:
        """Create the group on each lane's stream at id 0 if missing: entries enqueued before
        any worker existed are delivered too (a group created at `$` would skip them)."""
        for stream in (s for keys in self.keys.every_shard for s in keys.lane_streams):
            try:
                await self.conn.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def publish(self, writes: Sequence[JobWrite]) -> set[str]:
        """Append events and finish jobs in one round trip; returns entry ids no longer ours.

        Race prevented: events and final records from a worker that lost its entry to a
        reclaimer would interleave with the new owner's stream (same seq, other tokens)."""
        if not writes:
            return set()

        async def shard(keys: Keys, indexes: list[int]) -> list[Any]:
            return list(await self._step(keys=[keys.requests], args=self.step_args(keys, [writes[i] for i in indexes])))

        groups = _shard_groups([w.entry_id for w in writes])
        if len(groups) == 1:  # (a single Redis: one call, as it always was)
            return {_str(e) for e in await shard(self.keys.on_shard(next(iter(groups))), next(iter(groups.values())))}
        replies = await asyncio.gather(*(shard(self.keys.on_shard(n), ix) for n, ix in groups.items()),
                                       return_exceptions=True)
        lost: set[str] = set()
        unsent: list[int] = []
        for indexes, reply in zip(groups.values(), replies, strict=True):
            if isinstance(reply, BaseException):
                unsent += indexes
            else:
                lost |= {_str(e) for e in reply}
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is None:
            return lost
        if len(unsent) == len(writes):
            raise failed
        raise PartlyPublished([writes[i] for i in sorted(unsent)], lost, failed) from failed

    @property
    def step_script(self) -> str:
        """STEP_LUA as these keys call it (SPUBLISH on a Redis 7 cluster)."""
        return str(self._step.script)

    def step_args(self, keys: Keys, writes: Sequence[JobWrite]) -> list[Any]:
        """STEP_LUA's ARGV for `writes` of one shard (`keys`); its one key is keys.requests."""
        jobs = [
            [w.entry_id, keys.events(w.job_id), keys.job(w.job_id), w.events, _pairs(w.record or {}),
             self._meter(keys, w.meter) if w.record else [], self._minute(keys, w.tenant_tokens), int(w.again)]
            for w in writes
        ]
        return [keys.group, self.consumer, EVENTS_TTL_S, JOB_TTL_S, pack_script_arg(jobs), USAGE_TTL_S,
                self.events_retention_s]

    def _meter(self, keys: Keys, meter: Meter | None) -> list[Any]:
        """STEP_LUA's usage item: the day's hash, the field prefix, prompt, completion and cached
        tokens."""
        if meter is None:
            return []
        return [keys.usage(meter.day), f"{meter.tenant}\t{meter.model}\t", meter.prompt_tokens,
                meter.completion_tokens, meter.cached_tokens]

    def _minute(self, keys: Keys, counted: TenantTokens | None) -> list[Any]:
        """STEP_LUA's minute item: the tenant's minute counter and the tokens it adds."""
        if counted is None or not counted.tenant or counted.tokens == 0:
            return []
        return [keys.tokens(counted.tenant, counted.minute), counted.tokens]

    async def holders(self, entry_ids: Sequence[str]) -> dict[str, str]:
        """Who holds each entry now, in words, for the log of an entry found lost: the consumer
        and its delivery count, or that the group no longer has it pending (acknowledged, or
        the group was created again). One round trip; only lost entries come here."""
        pipe = self.conn.pipeline(transaction=False)
        for ref in entry_ids:
            stream, entry_id = self.keys.locate(ref)
            pipe.xpending_range(stream, self.keys.group, entry_id, entry_id, 1)
        replies = await pipe.execute(raise_on_error=False)
        out = {}
        for entry_id, reply in zip(entry_ids, replies, strict=True):
            if isinstance(reply, Exception):
                out[entry_id] = f"unknown ({reply})"
            elif not reply:
                out[entry_id] = "nobody: it is no longer pending (acknowledged, or the group was created again)"
            else:
                out[entry_id] = f"worker {_str(reply[0]['consumer'])} (delivered {reply[0]['times_delivered']} times)"
        return out

    async def start(self, jobs: Sequence[Job], entry_ids: Sequence[str], now: float) -> list[str]:
        """Mark jobs (taken from these entries) running; one code per job (see START_LUA).

        Races prevented: a cancel that landed while the entry sat in the stream (its flag is
        read here, atomically with the status write); a second entry for one job id running
        the job twice; a redelivered entry re-running a job that already ended."""
        if not jobs:
            return []

        async def shard(keys: Keys, indexes: list[int]) -> list[Any]:
            names = [keys.requests]
            args: list[Any] = [keys.group, self.consumer, repr(now), keys.queue]
            for i in indexes:
                names += [keys.job(jobs[i].id), keys.cancel_flag(jobs[i].id)]
                args += [entry_ids[i], jobs[i].sampling_params.n, repr(float(jobs[i].submit_time))]
            return list(await self._start(keys=names, args=args))

        return [_str(c) for c in await self._in_order(entry_ids, shard)]

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> int:
        """Move entries to the dead stream, XACK them, fail their jobs; returns how many.

        Race prevented: XADD to dead and XACK in one script, so an entry is never both gone
        from the pending list and missing from the dead stream (or dead-lettered twice by
        two reclaimers)."""
        if not letters:
            return 0

        async def shard(keys: Keys, indexes: list[int]) -> int:
            names = [keys.requests, keys.dead]
            args: list[Any] = [keys.group, self.consumer, self.events_retention_s, JOB_TTL_S]
            for letter in (letters[i] for i in indexes):
                dead = _pairs(letter.fields)
                fail: list[Any] = []
                if letter.job_id is not None and letter.error_event is not None:
                    names += [keys.events(letter.job_id), keys.job(letter.job_id)]
                    fail = [letter.error_event, *_pairs(letter.record or {})]
                args += [letter.entry_id, len(dead), len(fail), "1" if letter.drop else "0", *dead, *fail]
            return int(await self._dead(keys=names, args=args))

        return sum(await self._per_shard([letter.entry_id for letter in letters], shard))

    async def unclaim(self, name_key: str, host: str, pid: int) -> bool:
        """Delete the worker hash `name_key` if it is this process's (host, pid); whether it was."""
        return bool(await self._unclaim(keys=[name_key], args=[host, pid]))

    async def heartbeat(
        self, name_key: str, info: dict[str, str], in_flight: Sequence[tuple[str, str]], ttl_s: int
    ) -> tuple[set[str], set[str]]:
        """Write the heartbeat and keep in-flight (job id, entry id) entries owned; returns
        (entry ids lost to another worker, entry ids whose job has a cancel flag). Raises
        NameTaken, writing nothing, when the hash names another live process.

        Race prevented: without re-owning, a long job would look idle and be reclaimed while
        this worker still runs it."""
        fields = _pairs(info)
        ttl_s = max(ttl_s, WORKER_HEARTBEAT_TTL_S)
        flags = [self.keys.cancel_flag(j) for j, _ in in_flight]
        entry_ids = [entry_id for _, entry_id in in_flight]
        if self.keys.cluster:
            owner = await self._beat(keys=[name_key], args=[ttl_s, *fields])
            if not owner:
                lost, cancelled = await self._keep_owned(flags, entry_ids)
        else:
            args: list[Any] = [self.keys.group, self.consumer, ttl_s, len(fields), *fields, *entry_ids]
            lost, cancelled, owner = await self._heartbeat(keys=[self.keys.requests, name_key, *flags], args=args)
        if owner:
            raise NameTaken(self.consumer, _str(owner[0]), int(owner[1]))
        return {_str(e) for e in lost}, {_str(e) for e in cancelled}

    async def _keep_owned(self, flags: list[str], entry_ids: list[str]) -> tuple[list[Any], list[Any]]:
        """KEEP_LUA over the shards the entries are in (a cluster's heartbeat): (lost, cancelled)."""
        if not entry_ids:
            return [], []

        async def shard(keys: Keys, indexes: list[int]) -> list[Any]:
            return list(await self._keep(keys=[keys.requests, *(flags[i] for i in indexes)],
                                         args=[keys.group, self.consumer, *(entry_ids[i] for i in indexes)]))

        replies = await self._per_shard(entry_ids, shard)
        return [e for r in replies for e in r[0]], [e for r in replies for e in r[1]]

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Reclaimed]:
        """Claim up to `count` entries idle for `min_idle_ms` (their worker is gone), the
        lanes in their order, and within a lane the shards from one further on each call.

        Race prevented: a job stranded forever in a dead worker's pending list."""
        out: list[Reclaimed] = []
        first, self._next_reclaim = self._next_reclaim, (self._next_reclaim + 1) % self.keys.shards
        order = [(first + n) % self.keys.shards for n in range(self.keys.shards)]
        for lane in LANES:
            for shard in order:
                if len(out) >= count:
                    return out
                reply = await self._reclaim(
                    keys=[self.keys.on_shard(shard).on_lane(lane).requests],
                    args=[self.keys.group, self.consumer, min_idle_ms, count - len(out)],
                )
                out += [Reclaimed(entry_ref(_str(e), lane, shard), int(n), _fields(f)) for e, n, f in reply]
        return out

    async def release(self, entry_ids: Sequence[str]) -> int:
        """Hand owned entries back at shutdown, claimable by another worker at once.

        Race prevented: released work waiting a whole claim timeout while other workers idle."""
        if not entry_ids:
            return 0

        async def shard(keys: Keys, indexes: list[int]) -> int:
            args: list[Any] = [keys.group, self.consumer, RELEASED_IDLE_MS, *(entry_ids[i] for i in indexes)]
            return int(await self._release(keys=[keys.requests], args=args))

        return sum(await self._per_shard(entry_ids, shard))

    async def trim(self, stream: str, retention_s: float) -> int:
        """Remove entries of `stream` (requests, dead) older than `retention_s` that no group
        still needs; returns how many. Acked requests are dead weight once their job's record
        has expired (`genq inspect` reads a job's payload from its entry until then).

        Race prevented: trimming by age alone would delete a pending entry a reclaimer is about
        to read, or a backlog no worker has taken yet; the script reads the groups' positions
        and trims in one step."""
        return int(await self._trim(keys=[stream], args=[int(retention_s * 1000)]))

    async def lane_waits(self, lanes: Sequence[str], shard: int = 0) -> dict[str, float | None]:
        """Seconds the oldest entry of each lane (of `shard`) that no worker has read yet has
        waited; None for a lane whose entries have all been read."""
        keys = self.keys.on_shard(shard)
        waits = await self._lane_waits(keys=[keys.on_lane(lane).requests for lane in lanes], args=[keys.group])
        return {lane: None if ms < 0 else ms / 1000 for lane, ms in zip(lanes, waits, strict=True)}

    async def forward(self, moves: Sequence[Forward]) -> list[str]:
        """Hand entries to the queues serving their jobs' models; one code per move (see
        FORWARD_LUA).

        Race prevented: an entry both acknowledged here and missing there (a crash between
        the XADD and the XACK), or copied twice by two reclaimers of one entry."""
        if not moves:
            return []

        async def shard(keys: Keys, indexes: list[int]) -> list[Any]:
            names = [keys.requests]
            args: list[Any] = [keys.group, self.consumer, JOB_TTL_S]
            for move in (moves[i] for i in indexes):
                fields = _pairs(move.fields)
                lane = split_ref(move.entry_id)[1]
                names += [keys.on_queue(move.queue).on_lane(lane).requests, keys.job(move.job_id)]
                args += [move.entry_id, move.queue, len(fields), *fields]
            return list(await self._forward(keys=names, args=args))

        return [_str(c) for c in await self._in_order([m.entry_id for m in moves], shard)]

    async def hand_off(self, worker: str, entry_ids: Sequence[str]) -> list[str]:
        """Give entries this worker read to `worker`, which is told on its handoff channel;
        returns the ids handed over.

        Race prevented: an entry handed over after a reclaimer took it from this worker (a
        stall), so that two workers would run it."""
        if not entry_ids:
            return []

        async def shard(keys: Keys, indexes: list[int]) -> list[Any]:
            args = [keys.group, self.consumer, worker, keys.handoff_channel(worker), *(entry_ids[i] for i in indexes)]
            return list(await self._handoff(keys=[keys.requests], args=args))

        return [_str(e) for part in await self._per_shard(entry_ids, shard) for e in part]

    async def take(self, entry_ids: Sequence[str]) -> list[Reclaimed]:
        """The entries of a handoff notice that are still this worker's, with their fields.

        Race prevented: running an entry another worker reclaimed while the notice was late."""
        if not entry_ids:
            return []

        async def shard(keys: Keys, indexes: list[int]) -> list[Any]:
            return list(await self._take(keys=[keys.requests],
                                         args=[keys.group, self.consumer, *(entry_ids[i] for i in indexes)]))

        replies = await self._per_shard(entry_ids, shard)
        return [Reclaimed(_str(e), int(n), _fields(f)) for part in replies for e, n, f in part]

    async def routes(self, models: Sequence[str]) -> dict[str, str]:
        """The queues that live workers advertise for these models (absent: none does)."""
        if not models:
            return {}
        replies = await mget(self.conn, [self.keys.route(m) for m in models])
        return {m: _str(q) for m, q in zip(models, replies, strict=True) if q is not None}

    async def advertise(self, models: Sequence[str], ttl_s: int) -> None:
        """Say for `ttl_s` that this worker's queue serves these models (clients route by it)."""
        pipe = self.conn.pipeline(transaction=False)
        for model in models:
            pipe.set(self.keys.route(model), self.keys.queue, ex=ttl_s)
        await pipe.execute()

    async def models_beside(self, model: str) -> dict[str, str]:
        """Live workers reading this worker's stream that serve another model than `model`,
        by name: {worker: its model}. Consumers of the group whose heartbeat is gone, or that
        now read another queue, are not counted."""
        try:
            consumers = await self.conn.xinfo_consumers(self.keys.requests, self.keys.group)
        except redis.ResponseError:  # no group yet: nobody reads it
            return {}
        names = [n for n in (_str(c["name"]) for c in consumers) if n != self.consumer]
        pipe = self.conn.pipeline(transaction=False)
        for name in names:
            pipe.hmget(self.keys.worker(name), ["model", "queue"])
        beside = {}
        for name, (other, queue) in zip(names, await pipe.execute(), strict=True):
            if other is not None and _str(queue or b"") == self.keys.queue and _str(other) != model:
                beside[name] = _str(other)
        return beside

    async def own_pending(self, limit: int = 10_000) -> list[str]:
        """Entry refs pending under this worker's name, in every lane (to release what is
        left at shutdown)."""
        pipe = self.conn.pipeline(transaction=False)
        where = [(shard, lane) for shard in range(self.keys.shards) for lane in LANES]
        for shard, lane in where:
            pipe.xpending_range(self.keys.on_shard(shard).on_lane(lane).requests, self.keys.group, "-", "+", limit,
                                consumername=self.consumer)
        out = []
        for (shard, lane), rows in zip(where, await pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(rows, Exception):  # no group: nothing is pending there
                out += [entry_ref(_str(r["message_id"]), lane, shard) for r in rows]
        return out


def _shard_groups(refs: Sequence[str]) -> dict[int, list[int]]:
    """The indexes of the refs in each shard, by shard."""
    groups: dict[int, list[int]] = {}
    for i, ref in enumerate(refs):
        groups.setdefault(ref_shard(ref), []).append(i)
    return groups


def _pairs(mapping: Mapping[Any, Any]) -> list[Any]:
    return [x for kv in mapping.items() for x in kv]


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(flat: Any) -> dict[bytes, bytes] | None:
    """Lua returns stream fields as a flat [k1, v1, k2, v2, ...] list, or false."""
    if not flat:
        return None
    return dict(zip(flat[0::2], flat[1::2], strict=True))
