"""The genq wire protocol: every Redis key name, the job and event schemas, and their
encodings (the plain-string records, the job record, dead letters and heartbeats, are in
`producer.records`). Producer, worker and API all import this module; no other module spells a
key name. Every decoding problem raises `ProtocolError`.

Contract for whoever writes events (the worker):
- An event is appended with `APPEND_EVENTS_LUA`: XADD to the stream `events(id)` and PUBLISH
  on the channel of the same name, in one Lua call, so a reader that subscribes first and then
  replays with XRANGE loses nothing.
- `seq` strictly increases per completion `index`, across redeliveries too (a worker that
  resumes a job continues the numbering), because readers drop any event at or below the last
  `seq` they saw for that index.
- Every job that ends gets a terminal event: `finished=True` for each completion index
  (`finish_reason="abort"` for cancelled or expired ones), or one event with `error` set.
  Readers wait for it and never poll the job hash.
- The terminal status goes into the job hash in the same Lua call as the terminal event (or
  after it), never before: a reader that finds a terminal status takes the events it can
  replay as all there will be.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import zlib
from array import array
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any

import msgpack

from producer.data_urls import image_url_of, is_data_url
from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams
from producer.tracing import TRACEPARENT

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "genq:"

JOB_TTL_S = 24 * 3600  # job hash lifetime after the job ends (set by whoever ends it)
EVENTS_TTL_S = 24 * 3600  # events replay log lifetime, refreshed on every append
# once the job has ended its events live this much longer (workers' GENQ_EVENTS_RETENTION_S):
# enough for followers that were behind and SSE clients reconnecting; a later reader gets the
# result from the job record, which keeps every completion's text and token ids for JOB_TTL_S
DEFAULT_EVENTS_RETENTION_S = 300
CANCEL_FLAG_TTL_S = 24 * 3600  # outlives any queue wait, so a late intake still sees it
DEFAULT_DELIVERY_LIMIT = 3  # deliveries of one entry before it goes to the dead stream
DEFAULT_CLAIM_IDLE_S = 30.0  # pending this long without progress: another worker reclaims it
WORKER_HEARTBEAT_TTL_S = 30  # a worker hash disappears this long after its last beat
DEFAULT_HEARTBEAT_S = 5.0  # how often a worker beats and re-owns its in-flight entries
DEFAULT_SHUTDOWN_GRACE_S = 20.0  # SIGTERM: time in-flight jobs get before they are released

EVENT_FIELD = "event"  # the one field of an events-stream entry: the msgpack event
FINISH_ABORT = "abort"  # finish_reason of a completion ended by cancel or deadline
# error_type of a failed job: the job itself was at fault (a prompt too long for the model, a
# token id outside its vocabulary, an undecodable entry): running it again cannot succeed.
# Any other failure has no error_type.
ERROR_INVALID_REQUEST = "invalid_request"
MAX_JOB_ID_LEN = 200
MAX_QUEUE_NAME_LEN = 64
MAX_PROMPT_CACHE_KEY_LEN = 1024
# field of `Keys.tokenizer(model)` beside the files: the model's end-of-sequence ids, comma-separated
TOKENIZER_EOS_FIELD = "eos_token_ids"
TOKENIZER_LABELS_FIELD = "labels"  # a classification model's labels, JSON list; absent otherwise
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
USAGE_TTL_S = 400 * 24 * 3600  # a day's usage hash outlives a year of invoices

# KEYS[1]: events(id), both the stream and the channel name.
# ARGV[1]: EVENTS_TTL_S; ARGV[2..]: encoded events, in seq order.
# One Lua call per step: nothing can run between the XADD and the PUBLISH, so a reader that
# subscribed before its XRANGE sees each event in the replay, on the channel, or both.
APPEND_EVENTS_LUA = f"""
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], '*', '{EVENT_FIELD}', ARGV[i])
  redis.call('PUBLISH', KEYS[1], ARGV[i])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return #ARGV - 1
"""


def publishing_events(script: str, keys: Keys) -> str:
    """`script`, a Lua script whose only PUBLISHes are on events channels, as `keys` publish
    those: with SPUBLISH on a Redis 7 cluster (Keys.sharded_pubsub), as written elsewhere."""
    return script.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'") if keys.sharded_pubsub else script


class ProtocolError(Exception):
    """Anything read from Redis that does not follow this protocol.

    `job_id` is set when the id could be read, so a worker can fail that job instead of only
    dead-lettering the entry.
    """

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message if job_id is None else f"job {job_id}: {message}")
        self.job_id = job_id


# Priority lanes: each queue is read as three streams, a job going to the one of its priority's
# sign. Workers read them in this order and take from a lane only when those before it have
# nothing left, so a job with a lower priority than the backlog's runs before it (within a lane
# the engine's scheduler orders by the exact value). "" is the queue's own stream.
LANE_HIGH, LANE_NORMAL, LANE_LOW = "high", "", "low"
LANES = (LANE_HIGH, LANE_NORMAL, LANE_LOW)


def lane_of(priority: int) -> str:
    """The lane of a job with this priority (lower runs first, as vLLM's)."""
    return LANE_HIGH if priority < 0 else LANE_LOW if priority > 0 else LANE_NORMAL


def entry_ref(entry_id: str, lane: str, shard: int = 0) -> str:
    """How records, dead letters and workers name an entry: its id, with `@<lane>` when it is
    in a priority lane's stream (ids of two streams can be equal), and `#<shard>` when it is in
    a shard other than 0 (on a Redis Cluster with several; ids of two shards can be equal)."""
    ref = f"{entry_id}@{lane}" if lane else entry_id
    return f"{ref}#{shard}" if shard else ref


def split_ref(ref: str) -> tuple[str, str]:
    """(entry id, lane) of an entry_ref."""
    entry_id, _, lane = ref.partition("#")[0].partition("@")
    return entry_id, lane


def ref_shard(ref: str) -> int:
    """The shard of an entry_ref (0 when it names none)."""
    _, _, shard = ref.partition("#")
    if not shard:
        return 0
    if not shard.isdigit():
        raise ProtocolError(f"entry ref {ref!r}: shard {shard!r} is not a number")
    return int(shard)


SHARDS_ENV = "GENQ_REDIS_SHARDS"
# shards of the request streams on a Redis Cluster when nothing says otherwise: a multiple of
# 1, 2, 3 and 6 masters, so that each gets an equal share of them (see shard_tag); more shards
# cost more calls per engine step (its writes are one script call per shard they touch:
# docs/queue.md, "Redis Cluster")
DEFAULT_CLUSTER_SHARDS = 6
MAX_SHARDS = 1024
CLUSTER_SLOTS = 16384


def shard_of(job_id: str, shards: int = 1) -> int:
    """The request-stream shard that holds `job_id`'s entry and keys: a stable hash of the id
    (CRC-32, the same in every process and Python version) modulo the number of shards."""
    return zlib.crc32(job_id.encode()) % shards if shards > 1 else 0


@functools.lru_cache(maxsize=64)
def _shard_tags(shards: int) -> tuple[str, ...]:
    """Each shard's hash tag: `s<n>`, or `s<n>.<i>` with the first `i` that puts it in the n-th
    of `shards` equal runs of the cluster's slots. `redis-cli --cluster create` gives each
    master one run of slots of equal length, so with a multiple of the masters as shards each
    master serves an equal number of them (plain `s<n>` tags fall where CRC16 puts them:
    s0 to s5 over three masters split 1, 1 and 4)."""
    tags = []
    for n in range(shards):
        low, high = -(-n * CLUSTER_SLOTS // shards), -(-(n + 1) * CLUSTER_SLOTS // shards)  # (rounded up)
        i = 0
        while not low <= _key_slot(tag := f"s{n}.{i}" if i else f"s{n}") < high:
            i += 1
        tags.append(tag)
    return tuple(tags)


def _key_slot(tag: str) -> int:
    """The cluster slot of a name whose hash tag is `tag`: CRC16 (XMODEM) modulo 16384."""
    crc = 0
    for byte in tag.encode():
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc % CLUSTER_SLOTS


def shard_tag(shard: int, shards: int = 1) -> str:
    """The hash tag of a shard's names on a Redis Cluster (`genq:{s0}job:<id>`); see _shard_tags."""
    return _shard_tags(shards)[shard] if shards > 1 else f"s{shard}"


@dataclass(frozen=True)
class Keys:
    """Every Redis name genq uses, under one prefix. `queue` names the requests stream of
    one pool of workers: "" is the shared stream, `genq:requests`; a pool serving another
    model reads `genq:requests:<queue>`. `lane` names one of its priority lanes' streams
    (`genq:requests@high`, `genq:requests:<queue>@low`)."""

    prefix: str = DEFAULT_PREFIX
    queue: str = ""
    lane: str = LANE_NORMAL
    # On a Redis Cluster (`redis+cluster://`) the names a script uses together share a hash
    # tag: the request streams of shard `shard` (every queue and lane), and each job's record,
    # events, cancel flag, and the usage and minute counters its finish writes, all in the
    # slot of its shard. On a single Redis every name is as it always was. `shards`: how many
    # shards the request streams are split over (a job's is shard_of its id); always 1 on a
    # single Redis.
    cluster: bool = False
    shard: int = 0
    shards: int = 1
    # On a Redis 7 cluster a job's events channel is a shard channel (SPUBLISH / SSUBSCRIBE):
    # only its slot's master and replicas carry its messages, where a PUBLISH goes to every
    # node. Found by producer.shards with the number of shards; never on a single Redis.
    sharded_pubsub: bool = False

    def __post_init__(self) -> None:
        if self.cluster and ("{" in self.prefix or "}" in self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: on a Redis Cluster it may not hold '{{' or '}}' "
                             "(genq puts its own hash tags in the names)")
        if not 1 <= self.shards <= MAX_SHARDS or (self.shards > 1 and not self.cluster):
            raise ValueError(f"{self.shards} request-stream shards: a single Redis has 1, a Redis Cluster "
                             f"1 to {MAX_SHARDS} ({SHARDS_ENV})")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard}: there are {self.shards}")
        if self.sharded_pubsub and not self.cluster:
            raise ValueError("sharded pub/sub is a Redis Cluster's (Redis 7): a single Redis has none")

    def _slotted(self, name: str, shard: int | None = None) -> str:
        """`name` under the prefix, in the slot of `shard` (this one's) on a cluster."""
        if not self.cluster:
            return f"{self.prefix}{name}"
        return f"{self.prefix}{{{shard_tag(self.shard if shard is None else shard, self.shards)}}}{name}"

    def shard_of(self, job_id: str) -> int:
        """The shard that holds `job_id`'s entry and keys."""
        return shard_of(job_id, self.shards)

    def for_job(self, job_id: str) -> Keys:
        """The same names, on the shard that holds `job_id`."""
        return replace(self, shard=self.shard_of(job_id))

    def on_shard(self, shard: int) -> Keys:
        """The same names, on shard `shard`."""
        return replace(self, shard=shard)

    @property
    def every_shard(self) -> list[Keys]:
        """These names on each shard, in order (one on a single Redis)."""
        return [self.on_shard(n) for n in range(self.shards)]

    @property
    def shards_record(self) -> str:
        # string: the number of shards, written by the first process to use them; every
        # other checks it (producer.shards)
        return f"{self.prefix}shards"

    @property
    def requests(self) -> str:
        # stream: one entry per job
        stream = self._slotted(f"requests:{self.queue}" if self.queue else "requests")
        return f"{stream}@{self.lane}" if self.lane else stream

    def on_queue(self, queue: str) -> Keys:
        """The same names, with the requests stream of `queue` (its normal lane)."""
        return replace(self, queue=queue, lane=LANE_NORMAL)

    def on_lane(self, lane: str) -> Keys:
        """The same names, with the stream of this queue's `lane`."""
        return replace(self, lane=lane)

    @property
    def lane_streams(self) -> list[str]:
        """The streams of this queue's lanes, in the order workers read them."""
        return [self.on_lane(lane).requests for lane in LANES]

    def locate(self, ref: str) -> tuple[str, str]:
        """(stream, entry id) of an entry_ref on this queue (in the shard it names)."""
        entry_id, lane = split_ref(ref)
        return self.on_shard(ref_shard(ref)).on_lane(lane).requests, entry_id

    def rate(self, tenant: str, minute: int) -> str:
        return f"{self.prefix}rate:{tenant}:{minute}"  # counter with TTL: a key's requests that minute

    def tokens(self, tenant: str, minute: int) -> str:
        # counter with TTL: the prompt and completion tokens of a key's jobs that ended that minute
        return self._slotted(f"tokens:{tenant}:{minute}")

    def usage(self, day: str) -> str:
        # hash: tokens metered on `day` (UTC, YYYY-MM-DD), fields "tenant<TAB>model<TAB>metric"
        return self._slotted(f"usage:{day}")

    def route(self, model: str) -> str:
        return f"{self.prefix}route:{model}"  # string with TTL: the queue whose workers serve `model`

    @property
    def group(self) -> str:
        return f"{self.prefix}workers"  # consumer group on `requests`

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}cancel"  # pub/sub: job ids to abort now

    @property
    def control_channel(self) -> str:
        # pub/sub: the key of a record the workers follow (a weights update, sleep, pause, prefix
        # cache reset, the LoRA registry), just written: they beat now, not at their next heartbeat
        return f"{self.prefix}control"

    @property
    def dead(self) -> str:
        return self._slotted("dead")  # stream: entries no worker could run

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}workers:*"  # SCAN pattern for heartbeat hashes

    def job(self, job_id: str) -> str:
        return self._slotted(f"job:{job_id}", self.shard_of(job_id))  # hash: the job record

    def events(self, job_id: str) -> str:
        return self._slotted(f"events:{job_id}", self.shard_of(job_id))  # stream (replay log) and channel

    def cancel_flag(self, job_id: str) -> str:
        return self._slotted(f"cancel:{job_id}", self.shard_of(job_id))  # string with TTL: durable cancel request

    def worker(self, name: str) -> str:
        return f"{self.prefix}workers:{name}"  # hash with TTL: heartbeat

    def weights(self, model: str) -> str:
        # hash: the weights update the workers of `model` follow (producer.records.WeightsUpdate)
        return f"{self.prefix}weights:{model}"

    def sleep(self, model: str) -> str:
        # hash: the sleep or wake command the workers of `model` follow (producer.records.SleepCommand)
        return f"{self.prefix}sleep:{model}"

    def pause(self, model: str) -> str:
        # hash: the pause or resume the workers of `model` follow (producer.records.PauseCommand)
        return f"{self.prefix}pause:{model}"

    def drain(self, name: str) -> str:
        return f"{self.prefix}drain:{name}"  # string with TTL: worker `name` is asked to drain and stop (genq drain)

    def affinity(self, digest: str) -> str:
        return f"{self.prefix}affinity:{digest}"  # string with TTL: the worker that last ran a prompt start

    def handoff_channel(self, name: str) -> str:
        return f"{self.prefix}handoff:{name}"  # pub/sub: entry ids another worker handed to `name`

    @property
    def webhook_outbox(self) -> str:
        return f"{self.prefix}webhook_outbox"  # stream: webhook events to send (api.webhooks)

    @property
    def webhook_senders(self) -> str:
        return f"{self.prefix}webhook_senders"  # consumer group on webhook_outbox: the API processes

    def webhook_sent(self, event: str) -> str:
        return f"{self.prefix}webhook:{event}"  # string with TTL: the API sent this event ("type:object id")

    def in_flight(self, tenant: str) -> str:
        return f"{self.prefix}in_flight:{tenant}"  # sorted set: job id -> when it stops counting (api.api_keys)

    @property
    def api_keys(self) -> str:
        return f"{self.prefix}api_keys"  # hash: SHA-256 of an API key -> its plan (JSON; api.api_keys)

    @property
    def lora_adapters(self) -> str:
        return f"{self.prefix}lora_adapters"  # hash: LoRA adapter name -> path, loaded at run time

    @property
    def prefix_cache_resets(self) -> str:
        # string: a count; each worker empties its prefix cache when it sees the count move
        return f"{self.prefix}prefix_cache_resets"

    # The API's files, batches and stored responses (/v1/files, /v1/batches, /v1/responses);
    # workers never read them.

    @property
    def files(self) -> str:
        return f"{self.prefix}files"  # sorted set: file ids by creation time

    def file(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"  # hash: metadata and `content`

    @property
    def active_batches(self) -> str:
        return f"{self.prefix}batches:active"  # set: ids of batches still running

    @property
    def batches(self) -> str:
        return f"{self.prefix}batches"  # sorted set: batch ids by creation time

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}"  # hash: the batch object and its counters

    def batch_lines(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:lines"  # list: the requests, as JSON lines

    def batch_in_flight(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:in_flight"  # set: line numbers submitted, not done

    def batch_results(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:results"  # hash: line number -> output line

    def stored_response(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"  # string with TTL: JSON, /v1/responses

    def conversation(self, conv_id: str) -> str:
        return f"{self.prefix}conversation:{conv_id}"  # string with TTL: JSON, /v1/conversations

    def conversation_items(self, conv_id: str) -> str:
        return f"{self.prefix}conversation:{conv_id}:items"  # list with TTL: its items (JSON), oldest first

    def conversation_turn(self, conv_id: str, response_id: str) -> str:
        return f"{self.prefix}conversation:{conv_id}:turn:{response_id}"  # string with TTL: that turn was added

    def tokenizer(self, model: str) -> str:
        return f"{self.prefix}tokenizer:{model}"  # hash: the served model's tokenizer files, and `digest`

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:lease"  # string with TTL: the API driving it

    def arq_queue(self, name: str) -> str:
        # arq's own (unused) job queue for worker `name`; arq adds ':health-check' for the key
        # that `arq --check` reads. Not under `workers:` so worker_pattern matches beats only.
        return f"{self.prefix}arq:{name}"


class JobStatus(str, Enum):
    """Job lifecycle: queued -> running -> finished | failed | cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELLED)


# ---------------------------------------------------------------------------------------------
# msgpack helpers


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def pack_script_arg(obj: Any) -> bytes:
    """msgpack for a Lua script argument, read there with `cmsgpack.unpack`: Redis's cmsgpack
    (6.2) predates msgpack's bin and str8 types, so bytes and str both go as raw strings.
    For script arguments only, never for stored payloads."""
    return msgpack.packb(obj, use_bin_type=False)


def unpack(data: Any, what: str, job_id: str | None = None) -> Any:
    """Unpack msgpack bytes, turning every failure into a ProtocolError naming `what`."""
    if not isinstance(data, bytes):
        raise ProtocolError(f"{what} must be msgpack bytes, got {type(data).__name__}", job_id)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)  # logprobs: {token_id: ...}
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # msgpack raises several
        raise ProtocolError(f"{what} is not valid msgpack: {exc}", job_id) from exc


def as_text(value: Any, job_id: str | None = None) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{value[:40]!r} is not UTF-8", job_id) from exc


def str_keys(mapping: dict[Any, Any], job_id: str | None = None) -> dict[str, Any]:
    """Redis replies have bytes keys unless the connection decodes; accept both."""
    return {as_text(k, job_id): v for k, v in mapping.items()}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------
# Jobs: entries of the `requests` stream


@dataclass
class Job:
    """One generation job. Exactly one of `prompt`, `prompt_token_ids`, `messages`,
    `prompt_embeds` is set."""

    id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: [{"role": ..., "content": str or parts}]
    # the prompt as its input states (vLLM's prompt_embeds): a [positions, hidden] float tensor
    # as torch.save writes it, read by the worker (worker.core.prompt_embeds)
    prompt_embeds: bytes | None = None
    # chat: OpenAI-style tool definitions ({"type": "function", "function": {"name", ...}}),
    # handed to the model's chat template with the messages
    tools: list[dict[str, Any]] | None = None
    # chat: more for the template (vLLM's chat_template_kwargs): its own variables, such as
    # Qwen3's enable_thinking, and add_generation_prompt / continue_final_message
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None  # None: whatever the worker serves
    # set: an embedding job. Its prompt (text or token ids) is pooled into one vector, sent
    # on its one event as `embedding`; nothing is generated.
    pooling_params: PoolingParams | None = None
    # who the job is metered to (the API sets the id of the caller's API key): the worker
    # that finishes it adds its tokens to `usage(day)` under this name, once
    tenant: str | None = None
    # vLLM's cache_salt: the prefix cache shares this job's blocks only with jobs of the same
    # salt (a secret per tenant keeps others from learning its prompts by their speed)
    cache_salt: str | None = None
    # OpenAI's prompt_cache_key: jobs with one key go, while its worker has room, to the worker
    # that last ran one (worker.queue.affinity); unset, a key is made from the prompt's start
    prompt_cache_key: str | None = None
    # W3C trace context of the request that made the job (producer.tracing): the worker's span
    # of the job is its child
    traceparent: str | None = None
    # vLLM's return_token_ids: each completion's first event carries the prompt's token ids
    return_prompt_token_ids: bool = False
    priority: int = 0  # as in vLLM: lower values are scheduled first
    deadline: float | None = None  # absolute unix time; past it the job is aborted
    submit_time: float = 0.0  # unix time
    version: int = PROTOCOL_VERSION

    def validate(self) -> None:
        """Raise ValueError naming the first field that breaks the schema."""
        validate_job_id(self.id)
        _validate_prompt(self)
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if self.pooling_params is not None:
            _validate_embedding(self)
        if self.tenant is not None and not (isinstance(self.tenant, str) and _TENANT.fullmatch(self.tenant)):
            raise ValueError(f"tenant must be 1 to 64 letters, digits, '.', '_' or '-', got {self.tenant!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.traceparent is not None and not (isinstance(self.traceparent, str) and TRACEPARENT.fullmatch(self.traceparent)):
            raise ValueError(f"traceparent must be a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>), "
                             f"got {self.traceparent!r:.80}")
        if self.prompt_cache_key is not None and not (
                isinstance(self.prompt_cache_key, str) and 0 < len(self.prompt_cache_key) <= MAX_PROMPT_CACHE_KEY_LEN):
            raise ValueError(f"prompt_cache_key must be a string of 1 to {MAX_PROMPT_CACHE_KEY_LEN} characters, "
                             f"got {self.prompt_cache_key!r:.80}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a string, got {self.model!r}")
        if not isinstance(self.return_prompt_token_ids, bool):
            raise ValueError(f"return_prompt_token_ids must be true or false, got {self.return_prompt_token_ids!r}")
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.deadline is not None and not _is_number(self.deadline):
            raise ValueError(f"deadline must be a unix time, got {self.deadline!r}")
        if not _is_number(self.submit_time):
            raise ValueError(f"submit_time must be a unix time, got {self.submit_time!r}")


def validate_queue_name(queue: str) -> None:
    """A queue name becomes part of a stream's name: letters, digits, '.', '_' and '-'."""
    if len(queue) > MAX_QUEUE_NAME_LEN or not re.fullmatch(r"[A-Za-z0-9._-]*", queue):
        raise ValueError(
            f"queue name must be at most {MAX_QUEUE_NAME_LEN} letters, digits, '.', '_' or '-', "
            f"got {queue!r}"
        )


def validate_job_id(job_id: Any) -> None:
    """Ids become part of key names and CLI arguments: printable, no spaces, bounded."""
    if not isinstance(job_id, str) or not job_id:
        raise ValueError(f"job id must be a non-empty string, got {job_id!r}")
    if len(job_id) > MAX_JOB_ID_LEN or not job_id.isprintable() or any(c.isspace() for c in job_id):
        raise ValueError(
            f"job id must be at most {MAX_JOB_ID_LEN} printable characters without spaces, "
            f"got {job_id!r}"
        )


def _validate_prompt(job: Job) -> None:
    given = [n for n in PROMPT_FORMS if getattr(job, n) is not None]
    if len(given) != 1:
        raise ValueError(
            f"exactly one of {', '.join(PROMPT_FORMS)} must be set, got {', '.join(given) or 'none'}"
        )
    if job.prompt_embeds is not None and (not isinstance(job.prompt_embeds, bytes) or not job.prompt_embeds):
        raise ValueError("prompt_embeds must be the non-empty bytes torch.save writes of a tensor")
    if job.prompt is not None and (not isinstance(job.prompt, str) or not job.prompt):
        raise ValueError(f"prompt must be a non-empty string, got {job.prompt!r}")
    if job.prompt_token_ids is not None:
        ids = job.prompt_token_ids
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of token ids >= 0")
    if job.messages is not None:
        _validate_messages(job.messages)
    if job.tools is not None:
        _validate_tools(job)
    if job.chat_template_kwargs is not None:
        _validate_template_kwargs(job)


PROMPT_FORMS = ("prompt", "prompt_token_ids", "messages", "prompt_embeds")


def _validate_embedding(job: Job) -> None:
    if not isinstance(job.pooling_params, PoolingParams):
        raise ValueError("pooling_params must be a PoolingParams")
    if job.sampling_params.n != 1:
        raise ValueError(f"an embedding job has one output, got n={job.sampling_params.n}")


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} mappings")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a mapping, got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _validate_part(part, f"messages[{i}].content[{j}]")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")


def _validate_part(part: Any, where: str) -> None:
    """A content part: {"type": "text", "text": str}; an image for a model that takes them,
    its encoded bytes ({"type": "image", "image": bytes}) or a data URL ({"type":
    "image_url", "image_url": {"url": "data:image/png;base64,..."}}); or an audio clip for a
    model that takes them, its WAV bytes ({"type": "audio", "audio": bytes}), OpenAI's
    {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}} or a data URL
    ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}})."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return
    if kind in ("image", "audio") and isinstance(part.get(kind), bytes):
        return
    if kind in ("image_url", "audio_url") and is_data_url(image_url_of({"image_url": part.get(kind)})):
        return
    if kind == "input_audio" and isinstance(part.get("input_audio"), dict) and isinstance(part["input_audio"].get("data"), str):
        return
    raise ValueError(f"{where} must be a text part, an image or audio part with bytes, an image_url or audio_url "
                     "part with a data URL, or an input_audio part")


def _validate_tools(job: Job) -> None:
    if job.messages is None:
        raise ValueError("tools go with chat messages, not with a prompt")
    if not isinstance(job.tools, list):
        raise ValueError(f"tools must be a list of tool definitions, got {job.tools!r:.80}")
    for i, tool in enumerate(job.tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')


# what the worker itself sets when it renders a template (transformers' apply_chat_template)
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens",
})


def _validate_template_kwargs(job: Job) -> None:
    kwargs = job.chat_template_kwargs
    if job.messages is None:
        raise ValueError("chat_template_kwargs go with chat messages, not with a prompt")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"chat_template_kwargs must map names to values, got {kwargs!r:.80}")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    for flag in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(kwargs.get(flag, False), bool):
            raise ValueError(f"chat_template_kwargs {flag} must be true or false")
    if kwargs.get("add_generation_prompt") and kwargs.get("continue_final_message"):
        raise ValueError(
            "chat_template_kwargs add_generation_prompt and continue_final_message exclude each "
            "other: a reply is either begun or continued"
        )


def encode_job(job: Job) -> dict[str, bytes]:
    """Stream entry fields for XADD. `id` and `priority` are repeated outside the payload so
    `redis-cli XRANGE` shows them and a worker can name the job even if the payload is bad."""
    job.validate()
    payload = asdict(job)
    payload["sampling_params"] = job.sampling_params.to_dict()
    for optional in ("pooling_params", "tenant", "prompt_embeds", "cache_salt", "prompt_cache_key", "traceparent",
                     "return_prompt_token_ids"):
        if payload[optional] in (None, False):  # unset, the payload reads as it did before them
            del payload[optional]
    return {
        "id": job.id.encode(),
        "priority": str(job.priority).encode(),
        "payload": pack(payload),
    }


_JOB_REQUIRED = ("version", "id", "sampling_params", "submit_time")
_JOB_FIELDS = {f.name for f in fields(Job)}


def decode_job(entry: dict[Any, Any]) -> Job:
    """Decode the fields of one `requests` stream entry; raises ProtocolError."""
    entry = str_keys(entry)
    if "id" not in entry:
        raise ProtocolError(f"entry has no 'id' field (fields: {sorted(entry)})")
    job_id = as_text(entry["id"])
    if "payload" not in entry:
        raise ProtocolError("entry has no 'payload' field", job_id)
    payload = unpack(entry["payload"], "payload", job_id)
    if not isinstance(payload, dict):
        raise ProtocolError(f"payload must be a map, got {type(payload).__name__}", job_id)
    _check_version(payload.get("version"), job_id)
    missing = [k for k in _JOB_REQUIRED if k not in payload]
    unknown = sorted(set(payload) - _JOB_FIELDS)
    if missing or unknown:
        raise ProtocolError(f"payload missing {missing}, unknown {unknown}", job_id)
    if payload["id"] != job_id:
        raise ProtocolError(f"payload id {payload['id']!r} differs from entry id", job_id)
    try:
        payload["sampling_params"] = SamplingParams.from_dict(payload["sampling_params"])
        if payload.get("pooling_params") is not None:
            payload["pooling_params"] = PoolingParams.from_dict(payload["pooling_params"])
        job = Job(**payload)
        job.validate()
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"invalid job: {exc}", job_id) from exc
    return job


def _check_version(version: Any, job_id: str | None) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})",
            job_id,
        )


# ---------------------------------------------------------------------------------------------
# Events: entries of `events(id)` and messages on the channel of the same name


@dataclass
class Event:
    """What one engine step produced for one completion of a job."""

    seq: int  # strictly increasing per index; readers drop repeats
    token_ids: list[int] = field(default_factory=list)  # new tokens in this step
    text: str = ""  # new detokenized text in this step
    finished: bool = False  # this completion is done
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # stop token id or stop string that matched
    # prompt_tokens, completion_tokens, total_tokens; genq workers add cached_tokens (prompt
    # tokens the prefix cache served). On a completion's last event: the job's; genq workers
    # also send the counts so far on each completion's first event (seq 0)
    usage: dict[str, int] | None = None
    error: str | None = None  # set: the whole job failed; no more events follow
    error_type: str | None = None  # with error: ERROR_INVALID_REQUEST, or None
    index: int = 0  # completion index, 0 <= index < n
    # per new token, genq workers send {"logprob", "rank", "top_logprobs": {token_id: logprob},
    # "token": its text, "decoded": {token_id: text}}; readers also take a bare
    # {token_id: logprob} (the sampled token among them) from other producers
    logprobs: list[Any] | None = None
    # asked for by sampling_params.prompt_logprobs; sent once, on completion 0's seq 0: one
    # entry per prompt token in the form above plus its "token_id" (the first has only
    # "token_id" and "token": nothing precedes it), and the prompt as the worker decodes it
    prompt_logprobs: list[Any] | None = None
    prompt: str | None = None
    # the prompt's token ids as the worker ran it (after its chat template and truncation),
    # on each completion's seq 0, for a job with return_prompt_token_ids (vLLM's return_token_ids)
    prompt_token_ids: list[int] | None = None
    # an embedding job's vector, on its one (final) event: float32, little-endian
    # (pack_embedding / unpack_embedding)
    embedding: bytes | None = None
    # Whisper, asked by sampling_params.extra_args {"token_timestamps": true}: on the final
    # event, where in the audio (seconds) each of the completion's tokens was said, all of them
    token_timestamps: list[float] | None = None
    # unix time the worker step that made its newest token ended; only workers that write the
    # per-step trace (producer.trace_log) set it, for the API's relay lines
    time: float | None = None


_EVENT_TYPES: dict[str, tuple[type, ...]] = {
    "seq": (int,),
    "token_ids": (list,),
    "text": (str,),
    "finished": (bool,),
    "finish_reason": (str, type(None)),
    "stop_reason": (int, str, type(None)),
    "usage": (dict, type(None)),
    "error": (str, type(None)),
    "error_type": (str, type(None)),
    "index": (int,),
    "logprobs": (list, type(None)),
    "prompt_logprobs": (list, type(None)),
    "prompt": (str, type(None)),
    "prompt_token_ids": (list, type(None)),
    "embedding": (bytes, type(None)),
    "token_timestamps": (list, type(None)),
    "time": (float, type(None)),
}


def pack_embedding(vector: list[float]) -> bytes:
    """A vector on the wire: float32, little-endian (what OpenAI's base64 encoding holds)."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def unpack_embedding(data: bytes) -> list[float]:
    if len(data) % 4:
        raise ProtocolError(f"an embedding is float32s, got {len(data)} bytes")
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


_EVENT_FIELD_NAMES = tuple(f.name for f in fields(Event))


def encode_event(event: Event) -> bytes:
    """msgpack map; fields that are None are left out to keep per-token events small.
    (getattr, not asdict: the worker encodes one event per request per step, and asdict's
    deep copy was most of the cost.)"""
    data = {k: v for k in _EVENT_FIELD_NAMES if (v := getattr(event, k)) is not None}
    data["v"] = PROTOCOL_VERSION
    return pack(data)


def decode_event(data: bytes) -> Event:
    """Decode one event (stream entry value or pub/sub message); raises ProtocolError.

    A field this side does not know is skipped: during a rolling upgrade a newer worker may
    send more than an older API reads, and what it adds is detail, never the tokens."""
    obj = unpack(data, "event")
    if not isinstance(obj, dict):
        raise ProtocolError(f"event must be a map, got {type(obj).__name__}")
    _check_version(obj.pop("v", None), None)
    if "seq" not in obj:
        raise ProtocolError("event has no 'seq'")
    obj = {k: v for k, v in obj.items() if k in _EVENT_TYPES}
    for key, value in obj.items():
        allowed = _EVENT_TYPES[key]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ProtocolError(f"event field {key!r} has type {type(value).__name__}")
    if not all(_is_int(t) for t in [*obj.get("token_ids", []), *(obj.get("prompt_token_ids") or [])]):
        raise ProtocolError("event token_ids and prompt_token_ids must be integers")
    if obj["seq"] < 0 or obj.get("index", 0) < 0:
        raise ProtocolError("event seq and index must be >= 0")
    return Event(**obj)
