"""Redis records of the wire protocol, all plain strings so `redis-cli HGETALL` is readable
(except the msgpack parts named): the job record (hash `job(id)`), dead letters (the `dead`
stream) and worker heartbeats (hash `worker(name)`). Keys, jobs and events:
`producer.protocol`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from producer.protocol import (
    JobStatus,
    ProtocolError,
    as_text,
    pack,
    pack_embedding,
    str_keys,
    unpack,
    unpack_embedding,
)

# ---------------------------------------------------------------------------------------------
# The job record: hash `job(id)`


@dataclass
class CompletionOutput:
    """One finished completion of a job (n > 1 gives several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class JobRecord:
    """Fields of the job hash. Everything is optional: each writer sets what it knows."""

    status: JobStatus | None = None
    n: int | None = None  # completions to expect; readers wait for this many finishes
    entry_id: str | None = None  # the job's entry in `requests` (of `queue`)
    queue: str | None = None  # the queue whose stream holds the entry; unset: the shared one
    worker: str | None = None
    submitted_at: float | None = None  # unix times
    started_at: float | None = None
    finished_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt tokens, those the prefix cache served
    finish_reason: str | None = None  # of completion 0
    text: str | None = None  # of completion 0
    error: str | None = None
    error_type: str | None = None  # ERROR_INVALID_REQUEST: the job was at fault
    outputs: list[CompletionOutput] | None = None  # msgpack: every completion with token ids
    embedding: list[float] | None = None  # an embedding job's vector (float32 bytes in the hash)
    extra: dict[str, str] = field(default_factory=dict)  # fields this module does not know

    @property
    def usage(self) -> dict[str, int] | None:
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["cached_tokens"] = self.cached_tokens
        return usage


_RECORD_INTS = ("n", "prompt_tokens", "completion_tokens", "cached_tokens")
_RECORD_FLOATS = ("submitted_at", "started_at", "finished_at")
_RECORD_STRS = ("entry_id", "queue", "worker", "finish_reason", "text", "error", "error_type")


def encode_record(record: JobRecord) -> dict[str, str | bytes]:
    """HSET mapping of the fields that are set (None fields are left untouched)."""
    out: dict[str, str | bytes] = {}
    if record.status is not None:
        out["status"] = JobStatus(record.status).value
    for name in (*_RECORD_INTS, *_RECORD_STRS):
        value = getattr(record, name)
        if value is not None:
            out[name] = str(value)
    for name in _RECORD_FLOATS:
        value = getattr(record, name)
        if value is not None:
            out[name] = repr(float(value))
    if record.outputs is not None:
        out["outputs"] = pack([asdict(o) for o in record.outputs])
    if record.embedding is not None:
        out["embedding"] = pack_embedding(record.embedding)
    out.update(record.extra)
    return out


def decode_record(mapping: dict[Any, Any], job_id: str | None = None) -> JobRecord:
    """Decode an HGETALL reply; raises ProtocolError on a field that does not parse."""
    raw = str_keys(mapping, job_id)
    record = JobRecord()
    try:
        if "status" in raw:
            record.status = JobStatus(as_text(raw.pop("status")))
        for name, convert in (
            *((n, int) for n in _RECORD_INTS),
            *((n, float) for n in _RECORD_FLOATS),
            *((n, str) for n in _RECORD_STRS),
        ):
            if name in raw:
                setattr(record, name, convert(as_text(raw.pop(name), job_id)))
    except ValueError as exc:
        raise ProtocolError(f"job record: {exc}", job_id) from exc
    if "outputs" in raw:
        record.outputs = _decode_outputs(raw.pop("outputs"), job_id)
    if "embedding" in raw:
        data = raw.pop("embedding")
        if not isinstance(data, bytes):
            raise ProtocolError("job record embedding must be read as bytes", job_id)
        record.embedding = unpack_embedding(data)
    record.extra = {
        k: v.decode(errors="replace") if isinstance(v, bytes) else str(v) for k, v in raw.items()
    }
    return record


_OUTPUT_FIELDS = {f.name for f in fields(CompletionOutput)}


def _decode_outputs(data: Any, job_id: str | None) -> list[CompletionOutput]:
    items = unpack(data, "job record outputs", job_id)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ProtocolError("job record outputs must be a list of maps", job_id)
    try:  # keys a newer worker added are skipped, as in events
        return [
            CompletionOutput(**{k: v for k, v in item.items() if k in _OUTPUT_FIELDS})
            for item in items
        ]
    except TypeError as exc:
        raise ProtocolError(f"job record outputs: {exc}", job_id) from exc


# ---------------------------------------------------------------------------------------------
# Dead letters: entries of the `dead` stream


def encode_dead_letter(
    entry_id: str, entry: dict[Any, Any], reason: str, job_id: str | None = None, entry_bytes: int | None = None
) -> dict[str, bytes]:
    """XADD fields for an entry no worker can run; the original fields are kept as msgpack.
    `entry_bytes`: the entry was too large to keep (`entry` is empty), this was its size."""
    original = {as_text(k): v if isinstance(v, bytes) else as_text(v).encode() for k, v in entry.items()}
    fields = {
        "entry_id": entry_id.encode(),
        "id": (job_id or "").encode(),
        "reason": reason.encode(),
        "entry": pack(original),
    }
    if entry_bytes is not None:
        fields["entry_bytes"] = str(entry_bytes).encode()
    return fields


def decode_dead_letter(fields_: dict[Any, Any]) -> dict[str, Any]:
    """The dead letter as a plain dict: entry_id, id (None if unknown), reason, entry."""
    raw = str_keys(fields_)
    missing = [k for k in ("entry_id", "id", "reason", "entry") if k not in raw]
    if missing:
        raise ProtocolError(f"dead letter missing {missing}")
    return {
        "entry_id": as_text(raw["entry_id"]),
        "id": as_text(raw["id"]) or None,
        "reason": as_text(raw["reason"]),
        "entry": unpack(raw["entry"], "dead letter entry"),
        # set where the entry was too large to keep (its `entry` is empty)
        "entry_bytes": int(raw["entry_bytes"]) if "entry_bytes" in raw else None,
    }


# ---------------------------------------------------------------------------------------------
# Worker heartbeats: hash `worker(name)`, plain strings so `redis-cli HGETALL` is readable


@dataclass
class WorkerInfo:
    """What a worker reports every heartbeat; the hash expires WORKER_HEARTBEAT_TTL_S after the
    last beat, so `SCAN MATCH genq:workers:*` lists the live workers."""

    model: str  # the served model name jobs may ask for
    max_num_seqs: int
    aliases: str = ""  # comma-separated other names jobs may ask for the model by
    queue: str = ""  # the requests stream it reads: "" the shared one, else requests:<queue>
    lora_modules: str = ""  # comma-separated names of the LoRA adapters jobs may ask for too
    lora_errors: str = ""  # JSON {name: why}: runtime adapters this worker could not load
    max_loras: int = 0  # adapters in one batch; 0: LoRA is off (it follows no registry)
    max_model_len: int = 0  # prompt plus output tokens a job may reach (0: not reported)
    # JSON {field: value}: the model's sampling defaults (its generation_config.json's
    # temperature, top_p, ...), which the API gives requests that leave them unset
    sampling_defaults: str = ""
    state: str = "serving"  # serving | draining (SIGTERM received)
    running: int = 0  # requests in the engine's running queue
    waiting: int = 0  # requests in the engine's waiting queue
    free_slots: int = 0  # more requests it would take now
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    tokens_per_s: float = 0.0  # generated tokens per second since the last beat
    generation_tokens_total: int = 0
    prompt_tokens_total: int = 0
    requests_finished_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, the tokens it held
    affinity_handoffs_taken_total: int = 0  # jobs other workers handed here (worker.queue.affinity)
    prefix_cache_resets: int = 0  # the count of genq:prefix_cache_resets its engine has emptied its cache to
    # the weights update (genq:weights:<model>'s count) it acted on last, the checkpoint it serves
    # and, where it could not read that update's checkpoint, why (it serves the one before)
    weights_update: int = 0
    weights_path: str = ""
    weights_error: str = ""
    # the sleep command (genq:sleep:<model>'s count) it acted on last, and its sleep level now
    # (0: awake; it takes no jobs while not 0, nor while it lets its running ones end to sleep)
    sleep_command: int = 0
    sleep_level: int = 0
    # the pause command (genq:pause:<model>'s count) it acted on last, and whether it is paused
    # (it takes no jobs from the command on; paused once its running requests ended or were
    # aborted, or at once where they are kept)
    pause_command: int = 0
    paused: int = 0
    started_at: float = 0.0  # unix times
    heartbeat_at: float = 0.0
    pid: int = 0
    host: str = ""

    @property
    def names(self) -> list[str]:
        """The model's names: its own, then its aliases."""
        return [self.model, *(name for name in self.aliases.split(",") if name)]

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters' names (`lora_modules` split)."""
        return [name for name in self.lora_modules.split(",") if name]

    @property
    def default_sampling(self) -> dict[str, Any]:
        """`sampling_defaults` decoded; an unreadable value counts as none."""
        return _json_object(self.sampling_defaults)

    @property
    def adapter_errors(self) -> dict[str, str]:
        """`lora_errors` decoded; an unreadable value counts as none."""
        return {str(k): str(v) for k, v in _json_object(self.lora_errors).items()}


WEIGHTS_MODES = ("wait", "keep")


@dataclass(frozen=True)
class WeightsUpdate:
    """The hash genq:weights:<model>: the checkpoint its workers serve from update `count` on
    (the API's POST /update_weights_from_disk writes it; a worker that starts reads it too);
    `model_path` "": the model's own checkpoint, each worker's. `mode`: "wait" lets each
    worker's running requests end first (holding the jobs it takes meanwhile), "keep" updates
    between two steps, running requests going on over the new weights."""

    count: int
    model_path: str
    mode: str = "wait"

    @classmethod
    def from_hash(cls, mapping: dict[Any, Any]) -> WeightsUpdate | None:
        """The update an HGETALL read; None where there is none (or it is unreadable)."""
        raw = {k: as_text(v) for k, v in str_keys(mapping).items()}
        try:
            update = cls(int(raw["count"]), raw["model_path"], raw.get("mode", "wait"))
        except (KeyError, ValueError):
            return None
        return update if update.count > 0 and update.mode in WEIGHTS_MODES else None


SLEEP_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class SleepCommand:
    """The hash genq:sleep:<model>: what its workers do from command `count` on (the API's
    POST /sleep and /wake_up write it; a worker that starts reads it too). `level` 1 or 2: sleep
    (vLLM's sleep mode: take no jobs, let the running ones end, give the device's memory back);
    0: wake the parts `tags` names."""

    count: int
    level: int
    tags: tuple[str, ...] = SLEEP_TAGS

    @classmethod
    def from_hash(cls, mapping: dict[Any, Any]) -> SleepCommand | None:
        """The command an HGETALL read; None where there is none (or it is unreadable)."""
        raw = {k: as_text(v) for k, v in str_keys(mapping).items()}
        try:
            command = cls(int(raw["count"]), int(raw["level"]),
                          tuple(t for t in raw.get("tags", ",".join(SLEEP_TAGS)).split(",") if t))
        except (KeyError, ValueError):
            return None
        valid = command.count > 0 and command.level in (0, 1, 2) and set(command.tags) <= set(SLEEP_TAGS)
        return command if valid else None


PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class PauseCommand:
    """The hash genq:pause:<model>: what its workers do from command `count` on (the API's
    POST /pause and /resume write it; a worker that starts reads it too), as vLLM's
    pause_generation: `paused`, take no jobs (they wait in the queue) and, by `mode`, "abort"
    the running requests, "wait" for them to end, or "keep" them frozen until the resume;
    not `paused`, go on."""

    count: int
    paused: bool
    mode: str = "abort"

    @property
    def frozen(self) -> bool:
        """Whether the engine steps no request while this command stands."""
        return self.paused and self.mode == "keep"

    @classmethod
    def from_hash(cls, mapping: dict[Any, Any]) -> PauseCommand | None:
        """The command an HGETALL read; None where there is none (or it is unreadable)."""
        raw = {k: as_text(v) for k, v in str_keys(mapping).items()}
        try:
            command = cls(int(raw["count"]), raw["paused"] == "1", raw.get("mode", "abort"))
        except (KeyError, ValueError):
            return None
        return command if command.count > 0 and command.mode in PAUSE_MODES else None


def _json_object(text: str) -> dict[str, Any]:
    """A heartbeat field's JSON object; {} for an empty or unreadable one."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


_WORKER_FIELDS = {f.name: f.type for f in fields(WorkerInfo)}


def encode_worker_info(info: WorkerInfo) -> dict[str, str]:
    """HSET mapping of a heartbeat."""
    return {k: repr(v) if isinstance(v, float) else str(v) for k, v in asdict(info).items()}


def decode_worker_info(mapping: dict[Any, Any], name: str | None = None) -> WorkerInfo:
    """Decode an HGETALL of a heartbeat hash; unknown fields are ignored (newer workers)."""
    raw = {k: as_text(v) for k, v in str_keys(mapping).items() if k in _WORKER_FIELDS}
    convert = {"int": int, "float": float, "str": str}
    try:
        values = {k: convert[str(_WORKER_FIELDS[k])](v) for k, v in raw.items()}
        return WorkerInfo(**values)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"worker {name or '?'} heartbeat: {exc}") from exc
