"""`genq worker`: run a worker, the same as `arq worker.WorkerSettings`.

Flags override the GENQ_* environment (read here, at this entry point, and nowhere else);
the resulting configuration goes to arq's `run_worker` with the settings of
`worker.queue.consumer.WorkerSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

# Flags that set engine arguments, with their types.
_ENGINE_FLAGS: dict[str, type] = {
    "model": str,
    "tokenizer": str,
    "chat_template": str,
    "generation_config": str,
    "logprobs_mode": str,
    "dtype": str,
    "device": str,
    "max_num_seqs": int,
    "max_model_len": int,
    "max_num_batched_tokens": int,
    "max_step_ms": float,
    "num_gpu_blocks_override": int,
    "gpu_memory_utilization": float,
    "kv_cache_memory_gb": float,
    "num_threads": int,
    "seed": int,
    "load_format": str,
    "quantization": str,
    "kv_cache_dtype": str,
    "attention_backend": str,
    "max_loras": int,
    "max_lora_rank": int,
    "max_images_per_prompt": int,
    "tensor_parallel_size": int,
    "kv_offloading_size": float,
    "mamba_block_size": int,
    "num_state_snapshots": int,
}
# Flags that set worker arguments.
_WORKER_FLAGS: dict[str, type] = {
    "name": str,
    "served_model_name": str,
    "prefix": str,
    "redis_shards": int,
    "queue": str,
    "claim_idle_s": float,
    "heartbeat_s": float,
    "delivery_limit": int,
    "max_entry_bytes": int,
    "cache_affinity_ttl_s": float,
    "lane_aging_s": float,
    "lane_aged_every": int,
    "shutdown_grace_s": float,
    "requests_retention_s": float,
    "dead_retention_s": float,
    "events_retention_s": float,
    "stream_interval_ms": float,
    "stream_coalesce_min_tokens_per_s": float,
    "metrics_port": int,
    "metrics_host": str,
    "otlp_traces_endpoint": str,
    "trace_dir": str,
}


def build(parser: argparse.ArgumentParser) -> Any:
    for name, kind in {**_ENGINE_FLAGS, **_WORKER_FLAGS}.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help=_HELP.get(name))
    parser.add_argument(
        "--scheduling-policy", choices=("fcfs", "priority"),
        help="the order of the jobs this worker holds: fcfs (arrival) or priority (the job's priority, lower "
        "first, then arrival; under KV pressure the largest value is preempted first) "
        "(default: $GENQ_SCHEDULING_POLICY or fcfs)",
    )
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="disable the engine's prefix cache"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: every decode step runs eagerly"
    )
    parser.add_argument(
        "--async-scheduling", action="store_true",
        help="make a step's outputs while the next step runs on the device (they come one step later)",
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="with --tensor-parallel-size N: each rank holds 1/N of the experts whole (default: a share of every one)",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager", action="store_true",
        help="a model mixing full and sliding-window layers keeps every layer's KV blocks "
        "(default: its windowed layers keep only the blocks their windows read)",
    )
    for name, about in _JSON_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), metavar="JSON", help=about)
    parser.add_argument(
        "--enable-lora", action="store_true",
        help="serve LoRA adapters: those of --lora-modules and of the runtime registry (genq:lora_adapters)",
    )
    parser.add_argument(
        "--logits-processors", nargs="+", metavar="MODULE:CLASS",
        help="custom logits processor classes, e.g. worker.sample.logits_processors:NoRepeatNGram; requests "
        "set theirs in extra_args (the API's vllm_xargs) (default: $GENQ_LOGITS_PROCESSORS)",
    )
    parser.add_argument(
        "--lora-modules", nargs="+", metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served beside the model; jobs name them in `model` "
        "(default: $GENQ_LORA_MODULES)",
    )
    return run


# Flags that take a JSON object, and what each says.
_JSON_FLAGS = {
    "speculative_config": 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or, '
    'with a draft model, \'{"model": "DIR", "num_speculative_tokens": 4}\' (default: $GENQ_SPECULATIVE_CONFIG or off)',
    "hf_overrides": 'entries of the model\'s config.json replaced, e.g. \'{"rope_scaling": {"rope_type": "yarn", '
    '"factor": 4.0, "original_max_position_embeddings": 32768}}\' (default: $GENQ_HF_OVERRIDES or none)',
    "override_generation_config": 'sampling defaults under generation_config.json\'s names that replace or add to '
    'the model\'s, e.g. \'{"temperature": 0.5}\' (default: $GENQ_OVERRIDE_GENERATION_CONFIG or none)',
    "reasoning_config": 'the markers of a reasoning model\'s thinking, which requests\' thinking_token_budget counts '
    'between, e.g. \'{"think_start_str": "<think>", "think_end_str": "</think>"}\' '
    "(default: $GENQ_REASONING_CONFIG or <think> and </think> where they are tokens)",
    "mm_processor_kwargs": 'overrides of the image processor\'s settings, e.g. \'{"max_pixels": 1003520}\' to bound '
    "the tokens a Qwen-VL image takes (default: $GENQ_MM_PROCESSOR_KWARGS or the checkpoint's)",
}
_HELP = {
    "gpu_memory_utilization": "the share of the GPU's memory the engine may fill: the model, then the KV cache in what "
    "is left of it (default: $GENQ_GPU_MEMORY_UTILIZATION or 0.9; lower it to share a GPU)",
    "kv_cache_memory_gb": "on the CPU, GiB for the KV cache (and Whisper's audio slots) "
    "(default: $GENQ_KV_CACHE_MEMORY_GB or 2)",
    "chat_template": "the chat template to use instead of the tokenizer's: a Jinja file's path or the template "
    "itself (default: $GENQ_CHAT_TEMPLATE or the tokenizer's)",
    "max_images_per_prompt": "the most images one prompt may hold; more fail the job by name "
    "(default: $GENQ_MAX_IMAGES_PER_PROMPT or 16)",
    "model": "local model directory or GGUF file (default: $GENQ_MODEL or SmolLM2-135M-Instruct)",
    "logprobs_mode": "what logprobs report: processed_logprobs (after penalties, bias and temperature), raw_logprobs "
    "(the model's own), processed_logits or raw_logits (default: $GENQ_LOGPROBS_MODE or processed_logprobs)",
    "generation_config": "auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty unset "
    "take the model's generation_config.json values; vllm: vLLM's defaults; or a directory to read one from "
    "(default: $GENQ_GENERATION_CONFIG or auto)",
    "tokenizer": "local directory of the tokenizer to use, e.g. a GGUF model's base model's "
    "(default: $GENQ_TOKENIZER or the model's)",
    "name": "consumer name in the group (default: $GENQ_WORKER_NAME or the host name)",
    "served_model_name": "the model name jobs ask for (default: the model directory's name)",
    "queue": "read jobs from genq:requests:QUEUE instead of the shared genq:requests: a pool "
    "serving another model than the shared stream's workers needs its own (default: $GENQ_QUEUE)",
    "num_gpu_blocks_override": "size of the KV pool in blocks of every layer",
    "max_step_ms": "step-time-aware chunking: each step's prompt chunks are sized, by a cost model learned from the "
    "steps run, to keep the step under this many ms, so long prompts do not stall others' tokens; at least a block "
    "of prompt tokens a step (default: $GENQ_MAX_STEP_MS or 20; 0: off, the static max_num_batched_tokens)",
    "load_format": "auto (the checkpoint) or dummy (seeded random weights, for benchmarks)",
    "quantization": "fp8: the decoder layers' weights in fp8, quantized as they load (a quantized checkpoint "
    "is served as it is stored without it; gptq, awq, their _marlin names, compressed-tensors or mxfp4 "
    "only confirm the checkpoint's method; default: $GENQ_QUANTIZATION or none)",
    "kv_cache_dtype": "auto (the model dtype) or fp8: the KV cache in e4m3, twice the tokens in the same memory, "
    "divided by the checkpoint's KV-cache scales where it has them (default: $GENQ_KV_CACHE_DTYPE or auto)",
    "attention_backend": "auto (triton on CUDA; on the CPU, cpu: genq's compiled kernels, or torch where they could "
    "not be built), cpu, torch or triton (default: auto)",
    "redis_shards": "request-stream shards on a Redis Cluster (default: $GENQ_REDIS_SHARDS, else the number the "
    "cluster records, else 6; always 1 on a single Redis)",
    "claim_idle_s": "reclaim entries of other workers idle this long",
    "delivery_limit": "deliveries before an entry goes to the dead stream",
    "max_entry_bytes": "a larger stream entry goes to the dead stream without its payload and leaves the "
    "requests stream (default: $GENQ_MAX_ENTRY_BYTES or 256 MiB)",
    "cache_affinity_ttl_s": "jobs whose prompts start alike (or share a prompt_cache_key) go, while it has room, "
    "to the worker that last ran one, for this long after (default 600; 0: off)",
    "lane_aging_s": "a priority lane whose oldest job has waited this long gets a share of the jobs this "
    "worker reads, however busy the lanes before it are (default 30; 0: strict lanes)",
    "lane_aged_every": "that share: at least one in this many (default 10)",
    "shutdown_grace_s": "on SIGTERM, time in-flight jobs get before they are released",
    "requests_retention_s": "acked entries older than this leave the requests stream (default: 86400)",
    "dead_retention_s": "dead letters older than this leave the dead stream (default: 604800)",
    "events_retention_s": "an ended job's events stay this long; later readers get its result from the job record "
    "(default: $GENQ_EVENTS_RETENTION_S or 300; 0: deleted as it ends)",
    "stream_interval_ms": "publish a job's new tokens at most this often, merged into one event per completion; "
    "its first and final events go out at once (default: $GENQ_STREAM_INTERVAL_MS or 60; 0: every step)",
    "stream_coalesce_min_tokens_per_s": "hold tokens for --stream-interval-ms only while the worker makes at least "
    "this many tokens a second; below, every step publishes (default: $GENQ_STREAM_COALESCE_MIN_TOKENS_PER_S or "
    "1000; 0: at any rate)",
    "metrics_port": "serve Prometheus metrics on this port (default: off)",
    "otlp_traces_endpoint": "export a span per finished job to this OpenTelemetry collector, OTLP over HTTP, "
    "e.g. http://collector:4318 (default: off; needs genq[otel])",
    "trace_dir": "write the per-step trace into this directory: a JSON line per engine step, publish and gc "
    "pause (benchmarks/itl_trace.py reads it) (default: $GENQ_TRACE_DIR or off)",
    "max_loras": "distinct LoRA adapters in one batch (default 1)",
    "max_lora_rank": "the largest LoRA rank served (default 16)",
    "tensor_parallel_size": "split the model over this many GPUs, one process each "
    "(default: $GENQ_TENSOR_PARALLEL_SIZE or 1)",
    "kv_offloading_size": "GiB of host memory that KV blocks evicted from the prefix cache are kept in, and "
    "copied back from on a hit (default: $GENQ_KV_OFFLOADING_SIZE or off)",
    "mamba_block_size": "models with per-request states (Qwen3.5, Qwen3-Next, Granite 4.0-H): tokens between the "
    "states the prefix cache keeps, a multiple of the block size (default: $GENQ_MAMBA_BLOCK_SIZE or 512)",
    "num_state_snapshots": "models with per-request states: states the prefix cache keeps; 0: no prefix caching for them "
    "(default: $GENQ_NUM_STATE_SNAPSHOTS or a tenth of the KV cache's memory, at most 8 per max_num_seqs)",
}


def run(args: argparse.Namespace) -> int:
    from arq.worker import run_worker

    from worker.queue.config import config_from_env, parse_json_object, parse_lora_modules
    from worker.queue.consumer import WorkerSettings, arq_settings

    env = dict(os.environ)
    env["GENQ_REDIS_URL"] = args.redis_url  # --redis-url defaults to $GENQ_REDIS_URL already
    config = config_from_env(env)
    engine_args = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    if args.scheduling_policy:
        engine_args["scheduling_policy"] = args.scheduling_policy
    if args.no_prefix_caching:
        engine_args["enable_prefix_caching"] = False
    if args.enforce_eager:
        engine_args["enforce_eager"] = True
    if args.async_scheduling:
        engine_args["async_scheduling"] = True
    if args.enable_expert_parallel:
        engine_args["enable_expert_parallel"] = True
    if args.disable_hybrid_kv_cache_manager:
        engine_args["disable_hybrid_kv_cache_manager"] = True
    if args.enable_lora:
        engine_args["enable_lora"] = True
    for name in _JSON_FLAGS:
        if text := getattr(args, name):
            try:
                engine_args[name] = parse_json_object(text)
            except ValueError:
                raise SystemExit(f"--{name.replace('_', '-')} must be a JSON object, got {text!r}") from None
    if args.logits_processors:
        engine_args["logits_processors"] = tuple(args.logits_processors)
    worker_args = {k: getattr(args, k) for k in _WORKER_FLAGS if getattr(args, k) is not None}
    if args.lora_modules:
        worker_args["lora_modules"] = parse_lora_modules(args.lora_modules, "--lora-modules")
        engine_args["enable_lora"] = True
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, **engine_args), **worker_args
    )
    run_worker(WorkerSettings, **arq_settings(config))  # type: ignore[arg-type]
    return 0
