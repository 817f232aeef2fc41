"""Worker configuration: one frozen dataclass, built at the two entry points (the arq
`WorkerSettings` class body and `genq worker`) and passed down by constructor.

`config_from_env` is the only reader of the environment, and only those entry points call
it. Importing this module stays cheap (no torch), so `arq --check` is quick.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from producer.jobs import DEFAULT_REDIS_URL
from producer.protocol import (
    DEFAULT_CLAIM_IDLE_S,
    DEFAULT_DELIVERY_LIMIT,
    DEFAULT_EVENTS_RETENTION_S,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_PREFIX,
    DEFAULT_SHUTDOWN_GRACE_S,
    JOB_TTL_S,
    Keys,
    validate_job_id,
    validate_queue_name,
)
from producer.redis_conn import is_cluster_url
from producer.shards import shards_from_env
from worker.config import EngineConfig
from worker.core.lora_request import LoRARequest

T = TypeVar("T")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # worker.model_executor.model_loader's default (it imports torch)
DEFAULT_DEAD_RETENTION_S = 7 * 24 * 3600  # dead letters wait a week for someone to look
# above the largest entry the API writes at its defaults (8 fetched images of 20 MiB, or a 64 MiB
# prompt_embeds tensor), below Redis's 512 MB bulk-string limit
DEFAULT_MAX_ENTRY_BYTES = 256 << 20
# a prompt start's blocks last about this long in a busy worker's prefix cache (its LRU order
# decides); past it the next job with that start may go to any worker
DEFAULT_CACHE_AFFINITY_TTL_S = 600.0
# a lane whose oldest entry has waited this long gets one entry in every DEFAULT_LANE_AGED_EVERY
# a worker reads: a batch's jobs (low lane) run, slowly, under any steady interactive load
DEFAULT_LANE_AGING_S = 30.0
DEFAULT_LANE_AGED_EVERY = 10
# step-time-aware chunking's target for a serving worker (EngineConfig.max_step_ms); offline
# runs (LLM, genq bench throughput) keep it off. See docs/engine.md for how it was chosen
DEFAULT_SERVING_MAX_STEP_MS = 20.0
# coalesced events: a job's tokens go out at most this often (docs/queue.md, "Coalesced events"),
# while the worker makes at least this many tokens a second; below that every step publishes: a
# CPU worker's few hundred events a second cost Redis next to nothing, and holding its tokens
# would stretch its streams' inter-token gaps from one step (~15 ms) to the interval
DEFAULT_STREAM_INTERVAL_MS = 60.0
DEFAULT_STREAM_COALESCE_MIN_TOKENS_PER_S = 1000.0

# Every variable the worker reads, with what it sets (docs/queue.md lists them too).
ENV_VARS = {
    "GENQ_REDIS_URL": "Redis URL",
    "GENQ_PREFIX": "key prefix",
    "GENQ_REDIS_SHARDS": "request-stream shards on a Redis Cluster (default: the number the cluster records, "
    "else 6; always 1 on a single Redis)",
    "GENQ_WORKER_NAME": "consumer name (default: the host name)",
    "GENQ_MODEL": "local model directory (default: SmolLM2-135M-Instruct)",
    "GENQ_SERVED_MODEL_NAME": "the name jobs use in `model` (default: the model directory's name)",
    "GENQ_QUEUE": "read genq:requests:<queue> instead of the shared genq:requests (each model's pool needs its own)",
    "GENQ_DTYPE": "auto | float32 | bfloat16 | float16",
    "GENQ_DEVICE": "auto | cpu | cuda",
    "GENQ_MAX_NUM_SEQS": "engine max_num_seqs",
    "GENQ_MAX_MODEL_LEN": "engine max_model_len",
    "GENQ_MAX_NUM_BATCHED_TOKENS": "engine max_num_batched_tokens",
    "GENQ_MAX_STEP_MS": "each step's prompt chunks sized to keep it under this many ms (default 200; 0: off, the static budget)",
    "GENQ_SCHEDULING_POLICY": "fcfs | priority: the order of the jobs a worker holds (default fcfs)",
    "GENQ_NUM_GPU_BLOCKS": "engine num_gpu_blocks_override",
    "GENQ_GPU_MEMORY_UTILIZATION": "the share of the GPU's memory the engine may fill (default 0.9)",
    "GENQ_KV_CACHE_MEMORY_GB": "GiB for the KV cache on the CPU (default 2)",
    "GENQ_NUM_THREADS": "torch threads on CPU",
    "GENQ_ENFORCE_EAGER": "1: no CUDA graphs for decode (default 0)",
    "GENQ_ASYNC_SCHEDULING": "1: a step's outputs are made while the next step runs on the device, one step later (default 0)",
    "GENQ_DISABLE_HYBRID_KV_CACHE_MANAGER": "1: a model mixing full and sliding-window layers keeps every layer's KV blocks (default 0)",
    "GENQ_LORA_MODULES": "LoRA adapters served beside the model: name=path,name=path (jobs name them in `model`)",
    "GENQ_ENABLE_LORA": "1: serve LoRA adapters (implied by GENQ_LORA_MODULES), following the runtime registry",
    "GENQ_MAX_LORAS": "engine max_loras: distinct adapters in one batch (default 1)",
    "GENQ_MAX_LORA_RANK": "engine max_lora_rank (default 16)",
    "GENQ_SPECULATIVE_CONFIG": 'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4} (default: off)',
    "GENQ_MAX_IMAGES_PER_PROMPT": "the most images one prompt may hold (default 16)",
    "GENQ_TENSOR_PARALLEL_SIZE": "split the model over this many GPUs, one process each (default 1)",
    "GENQ_KV_OFFLOADING_SIZE": "GiB of host memory for KV blocks evicted from the prefix cache (default: off)",
    "GENQ_MM_PROCESSOR_KWARGS": 'image processor overrides, JSON: {"max_pixels": 1003520} (default: the checkpoint\'s)',
    "GENQ_CLAIM_IDLE_S": "idle time after which another worker reclaims an entry",
    "GENQ_HEARTBEAT_S": "heartbeat period",
    "GENQ_CACHE_AFFINITY_TTL_S": "a prompt start's jobs go to the worker that last ran it, for this long (default 600; 0: off)",
    "GENQ_DELIVERY_LIMIT": "deliveries before an entry goes to the dead stream",
    "GENQ_LANE_AGING_S": "a priority lane whose oldest job waited this long is no longer passed over entirely (default 30; 0: strict lanes)",
    "GENQ_LANE_AGED_EVERY": "such a lane gets at least one in this many of the jobs a worker reads (default 10)",
    "GENQ_SHUTDOWN_GRACE_S": "SIGTERM: time in-flight jobs get before they are released",
    "GENQ_REQUESTS_RETENTION_S": "age past which done entries leave the requests stream (default: the job TTL, 24 h)",
    "GENQ_DEAD_RETENTION_S": "age past which dead letters leave the dead stream (default: a week)",
    "GENQ_EVENTS_RETENTION_S": "an ended job's events stay this long; later readers get its result from the record (default 300)",
    "GENQ_STREAM_INTERVAL_MS": "a job's new tokens are published at most this often, merged into one event; "
    "first and final events go out at once (default 60; 0: every step)",
    "GENQ_STREAM_COALESCE_MIN_TOKENS_PER_S": "tokens are held for GENQ_STREAM_INTERVAL_MS only while the worker makes "
    "at least this many a second (default 1000; 0: at any rate)",
    "GENQ_METRICS_PORT": "serve Prometheus metrics on this port (default: off)",
    "GENQ_METRICS_HOST": "address the metrics server binds (default 0.0.0.0)",
    "GENQ_OTLP_TRACES_ENDPOINT": "export a span per job to this OpenTelemetry collector (OTLP/HTTP; default: off)",
    "GENQ_TRACE_DIR": "write the per-step trace (a JSON line per engine step, publish and gc pause) into this "
    "directory (default: off; producer.trace_log)",
}


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    # request-stream shards on a Redis Cluster; None: the number recorded there (producer.shards)
    redis_shards: int | None = None
    # the pool's requests stream: "" reads the shared genq:requests, a name genq:requests:<name>.
    # Workers on one stream serve one model; clients route each job by its model (Keys.route).
    queue: str = ""
    name: str = field(default_factory=socket.gethostname)  # consumer name in the group
    # None: the model directory's name; "a,b": vLLM's several names, the first the model's own,
    # the others aliases jobs may name it by too
    served_model_name: str | None = None
    claim_idle_s: float = DEFAULT_CLAIM_IDLE_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    # a stream entry larger than this (redis-cli, a client past the API) is dead-lettered without
    # its payload and deleted from the stream: never stored twice
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    # jobs whose prompts start alike go, while it has room, to the worker that last ran one, for
    # this long after (worker.queue.affinity); 0 (or no prefix cache) turns it off
    cache_affinity_ttl_s: float = DEFAULT_CACHE_AFFINITY_TTL_S
    # a lower priority lane whose oldest entry has waited lane_aging_s gets at least one of
    # every lane_aged_every entries this worker reads (worker.queue.intake); 0: strict lanes
    lane_aging_s: float = DEFAULT_LANE_AGING_S
    lane_aged_every: int = DEFAULT_LANE_AGED_EVERY
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    # acked entries older than this leave genq:requests (each heartbeat trims); the default keeps
    # a job's payload, which `genq inspect` shows, as long as its record usually lives
    requests_retention_s: float = JOB_TTL_S
    dead_retention_s: float = DEFAULT_DEAD_RETENTION_S  # older dead letters are trimmed
    # an ended job's events live this long (its record, with every output, lives JOB_TTL_S): a
    # deployment's Redis holds events for the jobs of this window, not of a day
    events_retention_s: float = DEFAULT_EVENTS_RETENTION_S
    # a job's new tokens are published at most every stream_interval_ms, merged into one event
    # per completion (its first and final events at once): Redis's commands per token fall by
    # the steps merged (worker.queue.jobs.publish_due); 0 publishes every step
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS
    # ... while the worker makes at least this many tokens a second (over the last second); below
    # it every step publishes (see DEFAULT_STREAM_COALESCE_MIN_TOKENS_PER_S); 0: at any rate
    stream_coalesce_min_tokens_per_s: float = DEFAULT_STREAM_COALESCE_MIN_TOKENS_PER_S
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    otlp_traces_endpoint: str | None = None  # an OTLP/HTTP collector: a span per finished job (producer.tracing)
    # the per-step trace's directory (producer.trace_log; benchmarks/itl_trace.py reads it); None: off
    trace_dir: str | None = None
    # LoRA adapters served beside the model, (name, PEFT directory): a job whose `model` is
    # the name runs with the adapter. The engine needs enable_lora.
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        validate_job_id(self.name)  # same rules: it becomes part of key names
        validate_queue_name(self.queue)
        self._check_lora_modules()
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        # An entry is re-owned every beat; reclaiming sooner than two beats would steal live work.
        if self.claim_idle_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"claim_idle_s ({self.claim_idle_s}) must be at least two heartbeats "
                f"(heartbeat_s={self.heartbeat_s})"
            )
        if self.delivery_limit < 1:
            raise ValueError(f"delivery_limit must be >= 1, got {self.delivery_limit}")
        if self.max_entry_bytes < 1:
            raise ValueError(f"max_entry_bytes must be >= 1, got {self.max_entry_bytes}")
        if self.lane_aged_every < 2:
            raise ValueError(f"lane_aged_every must be >= 2, got {self.lane_aged_every}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        for name in ("requests_retention_s", "dead_retention_s", "events_retention_s", "cache_affinity_ttl_s",
                     "lane_aging_s", "stream_interval_ms", "stream_coalesce_min_tokens_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def _check_lora_modules(self) -> None:
        names = [name for name, _ in self.lora_modules]
        for name in names:
            if not name or "," in name or "=" in name or name.strip() != name:
                raise ValueError(f"LoRA module name {name!r} must be non-empty, without commas, '=' or edge spaces")
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must differ, got {', '.join(names)}")
        taken = [n for n in (self.model_name, *self.aliases) if n in names]
        if taken:
            raise ValueError(f"LoRA module name {taken[0]!r} is the served model's own name")
        if names and not self.engine.enable_lora:
            raise ValueError("LoRA modules are given but the engine's enable_lora is off")

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        """The adapters by the name jobs use, with engine ids 1, 2, ... in the given order."""
        return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(self.lora_modules, 1)}

    @property
    def model_name(self) -> str:
        """The name this worker serves (its first, with aliases): jobs whose `model` is set
        must use it or an alias."""
        if self.served_names:
            return self.served_names[0]
        if self.engine.model is None:
            return DEFAULT_MODEL_NAME
        return Path(self.engine.model).expanduser().name or self.engine.model

    @property
    def aliases(self) -> tuple[str, ...]:
        """The served model's other names (served_model_name's after the first)."""
        return self.served_names[1:]

    @property
    def served_names(self) -> tuple[str, ...]:
        """served_model_name's names, in order (none when it is unset)."""
        return tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())

    @property
    def base_names(self) -> frozenset[str]:
        """The `model` names that mean the base model: the served names and the --model path."""
        return frozenset(n for n in (self.model_name, *self.aliases, self.engine.model) if n)

    @property
    def keys(self) -> Keys:
        """The Redis names this worker uses: its queue's requests stream, the shared rest (one
        shard: the consumer settles their number with producer.shards when it connects)."""
        return Keys(self.prefix, self.queue, cluster=is_cluster_url(self.redis_url))

    @property
    def cache_affinity(self) -> bool:
        """Whether jobs are steered to the worker whose prefix cache holds their prompt's start."""
        return self.cache_affinity_ttl_s > 0 and self.engine.enable_prefix_caching

    def serves(self, model: str | None) -> bool:
        """A job for `model` may run here: no model asked, a base name, or one of the LoRA
        modules' names. (Runtime adapters are the engine thread's to know.)"""
        return model is None or model in self.base_names or model in dict(self.lora_modules)


def config_from_env(env: Mapping[str, str]) -> WorkerConfig:
    """The worker configuration from GENQ_* variables (the entry points pass os.environ)."""
    engine_args = _drop_none(
        model=env.get("GENQ_MODEL") or None,
        tokenizer=env.get("GENQ_TOKENIZER") or None,
        chat_template=env.get("GENQ_CHAT_TEMPLATE") or None,
        generation_config=env.get("GENQ_GENERATION_CONFIG") or None,
        logprobs_mode=env.get("GENQ_LOGPROBS_MODE") or None,
        dtype=env.get("GENQ_DTYPE") or None,
        device=env.get("GENQ_DEVICE") or None,
        max_num_seqs=_int(env, "GENQ_MAX_NUM_SEQS"),
        max_model_len=_int(env, "GENQ_MAX_MODEL_LEN"),
        max_num_batched_tokens=_int(env, "GENQ_MAX_NUM_BATCHED_TOKENS"),
        max_step_ms=_float(env, "GENQ_MAX_STEP_MS"),
        scheduling_policy=env.get("GENQ_SCHEDULING_POLICY") or None,
        num_gpu_blocks_override=_int(env, "GENQ_NUM_GPU_BLOCKS"),
        gpu_memory_utilization=_float(env, "GENQ_GPU_MEMORY_UTILIZATION"),
        kv_cache_memory_gb=_float(env, "GENQ_KV_CACHE_MEMORY_GB"),
        num_threads=_int(env, "GENQ_NUM_THREADS"),
        enforce_eager=_bool(env, "GENQ_ENFORCE_EAGER"),
        async_scheduling=_bool(env, "GENQ_ASYNC_SCHEDULING"),
        disable_hybrid_kv_cache_manager=_bool(env, "GENQ_DISABLE_HYBRID_KV_CACHE_MANAGER"),
        enable_lora=_bool(env, "GENQ_ENABLE_LORA"),
        max_loras=_int(env, "GENQ_MAX_LORAS"),
        max_lora_rank=_int(env, "GENQ_MAX_LORA_RANK"),
        speculative_config=_parse(env, "GENQ_SPECULATIVE_CONFIG", parse_json_object, "a JSON object"),
        mm_processor_kwargs=_parse(env, "GENQ_MM_PROCESSOR_KWARGS", parse_json_object, "a JSON object"),
        hf_overrides=_parse(env, "GENQ_HF_OVERRIDES", parse_json_object, "a JSON object"),
        reasoning_config=_parse(env, "GENQ_REASONING_CONFIG", parse_json_object, "a JSON object"),
        override_generation_config=_parse(env, "GENQ_OVERRIDE_GENERATION_CONFIG", parse_json_object, "a JSON object"),
        max_images_per_prompt=_int(env, "GENQ_MAX_IMAGES_PER_PROMPT"),
        tensor_parallel_size=_int(env, "GENQ_TENSOR_PARALLEL_SIZE"),
        enable_expert_parallel=_bool(env, "GENQ_ENABLE_EXPERT_PARALLEL"),
        kv_offloading_size=_float(env, "GENQ_KV_OFFLOADING_SIZE"),
        mamba_block_size=_int(env, "GENQ_MAMBA_BLOCK_SIZE"),
        num_state_snapshots=_int(env, "GENQ_NUM_STATE_SNAPSHOTS"),
        quantization=env.get("GENQ_QUANTIZATION") or None,
        kv_cache_dtype=env.get("GENQ_KV_CACHE_DTYPE") or None,
        logits_processors=tuple(filter(None, (s.strip() for s in env.get("GENQ_LOGITS_PROCESSORS", "").split(",")))) or None,
    )
    engine_args.setdefault("max_step_ms", DEFAULT_SERVING_MAX_STEP_MS)
    lora_modules = parse_lora_modules(env.get("GENQ_LORA_MODULES", ""), "GENQ_LORA_MODULES")
    if lora_modules:
        engine_args["enable_lora"] = True
    worker_args = _drop_none(
        redis_url=env.get("GENQ_REDIS_URL") or None,
        prefix=env.get("GENQ_PREFIX") or None,
        redis_shards=shards_from_env(env),
        queue=env.get("GENQ_QUEUE") or None,
        name=env.get("GENQ_WORKER_NAME") or None,
        served_model_name=env.get("GENQ_SERVED_MODEL_NAME") or None,
        claim_idle_s=_float(env, "GENQ_CLAIM_IDLE_S"),
        heartbeat_s=_float(env, "GENQ_HEARTBEAT_S"),
        delivery_limit=_int(env, "GENQ_DELIVERY_LIMIT"),
        max_entry_bytes=_int(env, "GENQ_MAX_ENTRY_BYTES"),
        cache_affinity_ttl_s=_float(env, "GENQ_CACHE_AFFINITY_TTL_S"),
        lane_aging_s=_float(env, "GENQ_LANE_AGING_S"),
        lane_aged_every=_int(env, "GENQ_LANE_AGED_EVERY"),
        shutdown_grace_s=_float(env, "GENQ_SHUTDOWN_GRACE_S"),
        requests_retention_s=_float(env, "GENQ_REQUESTS_RETENTION_S"),
        dead_retention_s=_float(env, "GENQ_DEAD_RETENTION_S"),
        events_retention_s=_float(env, "GENQ_EVENTS_RETENTION_S"),
        stream_interval_ms=_float(env, "GENQ_STREAM_INTERVAL_MS"),
        stream_coalesce_min_tokens_per_s=_float(env, "GENQ_STREAM_COALESCE_MIN_TOKENS_PER_S"),
        metrics_port=_int(env, "GENQ_METRICS_PORT"),
        metrics_host=env.get("GENQ_METRICS_HOST") or None,
        otlp_traces_endpoint=env.get("GENQ_OTLP_TRACES_ENDPOINT") or None,
        trace_dir=env.get("GENQ_TRACE_DIR") or None,
        lora_modules=lora_modules or None,
    )
    return WorkerConfig(engine=EngineConfig.from_kwargs(**engine_args), **worker_args)


def parse_lora_modules(specs: str | list[str], source: str) -> tuple[tuple[str, str], ...]:
    """`name=path` items (a comma-separated string, or a list of them) as (name, path) pairs;
    a malformed item names `source` (the variable or flag) and the item."""
    items = specs.split(",") if isinstance(specs, str) else specs
    pairs = []
    for item in filter(None, (i.strip() for i in items)):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"{source} items must be name=path, got {item!r}")
        pairs.append((name.strip(), path.strip()))
    return tuple(pairs)


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object (ValueError otherwise), for settings given as JSON."""
    value = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


def _drop_none(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _int(env: Mapping[str, str], name: str) -> int | None:
    return _parse(env, name, int, "an integer")


def _float(env: Mapping[str, str], name: str) -> float | None:
    return _parse(env, name, float, "a number")


def _bool(env: Mapping[str, str], name: str) -> bool | None:
    return _parse(env, name, _to_bool, "1 or 0 (true or false)")


def _parse(env: Mapping[str, str], name: str, convert: Callable[[str], T], what: str) -> T | None:
    """The variable converted, None when unset or empty; a bad value names the variable."""
    value = env.get(name)
    if not value:
        return None
    try:
        return convert(value)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


def _to_bool(value: str) -> bool:
    words = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if value.strip().lower() not in words:
        raise ValueError(value)
    return words[value.strip().lower()]
