"""Engine configuration: frozen dataclasses built at the entry points and passed down."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from worker.spec_decode.speculative import SpeculativeConfig

# `quantization`'s names (vLLM's, its Marlin kernels' too) -> the checkpoint quant_method each
# names: "fp8" quantizes a float checkpoint as it loads; the others confirm the checkpoint's own
QUANTIZATION_METHODS = {"fp8": "fp8", "gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                        "compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
                        "mxfp4": "mxfp4"}


# vLLM's logprobs_mode values: what a logprob reports
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")


@dataclass(frozen=True)
class EngineConfig:
    # a local HF directory or GGUF file; None: the default model (SmolLM2-135M-Instruct)
    model: str | None = None
    # vLLM's: a local directory whose tokenizer (and chat template) to use; None: the model's
    # own (a GGUF file's as transformers reads it, which may differ from its base model's)
    tokenizer: str | None = None
    # vLLM's: the chat template to use instead of the tokenizer's, a Jinja file's path or the
    # template itself (a model whose tokenizer has none, a template with another tool format)
    chat_template: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # step-time-aware chunking: each step's prompt chunks are sized so that the step, with its
    # decodes, is predicted to take at most this long (a cost model learned from the steps run:
    # worker.core.step_cost), so long prompts do not stall the others' tokens; at least a block
    # of prompt tokens per step, at most max_num_batched_tokens. None or 0: off, the static budget
    # alone (throughput's best: offline runs). A serving worker's default is
    # worker.queue.config.DEFAULT_SERVING_MAX_STEP_MS
    max_step_ms: float | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # size of the KV pool in blocks of every layer's KV, on any device (a hybrid model's pool
    # holds that memory as blocks of fewer layers each: more of them)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    # KV pool size on CPU, where there is no device memory to fill (Whisper's audio slots come out of it too)
    kv_cache_memory_gb: float = 2.0
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enforce_eager: bool = False
    # vLLM's: a step's outputs (detokenized, stop strings checked, logprobs spelled) are made
    # while the next step runs on the device, and come out of that step: one step later, the
    # host's work off the device's critical path. A request a stop string ends computes one
    # more token, which is dropped. On the CPU nothing overlaps: off by default
    async_scheduling: bool = False
    seed: int = 0
    cache_dir: str | None = None  # where the default model is converted to safetensors
    num_threads: int | None = None  # torch intra-op threads on CPU
    attention_backend: str = "auto"  # auto (triton on CUDA; cpu on CPU, torch without a compiler) | cpu | torch | triton
    # auto: the checkpoint's safetensors | dummy: seeded random weights of the config's shape,
    # for benchmarks where the weights cannot travel (vLLM's load_format="dummy")
    load_format: str = "auto"
    enable_lora: bool = False  # serve LoRA adapters (requests name one with a LoRARequest)
    max_loras: int = 1  # distinct adapters in one batch: the slots beside the weights
    max_lora_rank: int = 16  # the largest adapter rank the slots hold
    # vLLM's: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 1} guesses tokens from the request's own earlier text;
    # {"model": DIR, "num_speculative_tokens": 4}, a draft model's greedy tokens;
    # {"method": "mtp", "num_speculative_tokens": 1}, the model's own MTP layer's;
    # {"method": "eagle3", "model": DIR, ...}, an EAGLE-3 head's; None: off
    speculative_config: dict[str, Any] | None = None
    # fp8: the decoder layers' weights quantized to fp8 as they load (per output channel),
    # served by the fp8 kernel on CUDA; None: as the checkpoint stores them (an fp8
    # checkpoint is served as fp8 either way)
    quantization: str | None = None
    # the KV cache's values: auto (the model dtype) or fp8 (e4m3, vLLM's "fp8"/"fp8_e4m3":
    # twice the tokens in the same memory; values past +-448 are clamped)
    kv_cache_dtype: str = "auto"
    # a model that mixes full and sliding-window layers keeps only the blocks its windowed
    # layers' windows read (vLLM's hybrid KV cache manager); True: every layer keeps every block
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's: GiB of host memory (in all, over the tensor-parallel ranks) that cached KV blocks
    # evicted from the pool are copied to, and copied back from when a prefix reaches them;
    # None: the prefix cache holds only what the pool does
    kv_offloading_size: float | None = None
    # vLLM's: overrides of the checkpoint's image processor settings, e.g. {"max_pixels":
    # 1003520} to bound the tokens a Qwen-VL image takes; keys it does not know are refused
    mm_processor_kwargs: dict[str, Any] | None = None
    # the most images one prompt may hold (vLLM's limit_mm_per_prompt["image"]): a job that
    # reaches the queue other than through the API (which holds its requests to
    # GENQ_MAX_IMAGES_PER_REQUEST) cannot fill the worker's memory with pixels
    max_images_per_prompt: int = 16
    # the model split over this many devices (worker.model_executor.parallel): each holds its share of the
    # attention heads and MLP features, with the KV cache of its heads
    tensor_parallel_size: int = 1
    # vLLM's: the mixture-of-experts layers' experts dealt out whole over the tensor-parallel
    # ranks (each holds num_experts / N of them), not each expert's features split over all
    enable_expert_parallel: bool = False
    # a model with linear-attention layers (Qwen3.5, Qwen3-Next): its prefix cache keeps each
    # request's state after every mamba_block_size tokens (vLLM's name; a multiple of
    # block_size; None: 512 rounded up to one), in num_state_snapshots slots (None: as many
    # as a tenth of the KV cache's memory holds, at most 8 per max_num_seqs; 0: no prefix
    # caching for such a model). A prefix is served up to the last state kept
    mamba_block_size: int | None = None
    num_state_snapshots: int | None = None
    # vLLM's: what logprobs report: processed_logprobs (after penalties, bias and temperature;
    # genq's default), raw_logprobs (the model's own distribution; vLLM's default),
    # processed_logits or raw_logits (the values, not their log-softmax)
    logprobs_mode: str = "processed_logprobs"
    # vLLM's: "auto", requests that leave temperature, top_p, top_k, min_p or
    # repetition_penalty unset (the API's, LLM.generate without params) take the model's
    # generation_config.json values; "vllm", vLLM's own defaults; or a directory to read one from
    generation_config: str = "auto"
    # vLLM's: sampling values under generation_config.json's names ({"temperature": 0.5,
    # "max_new_tokens": 512}) that replace or add to those generation_config gives
    override_generation_config: dict[str, Any] | None = None
    # vLLM's: entries of the model's config.json replaced before it is read (a mapping merged
    # into a mapping), e.g. {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768}} for a longer context
    hf_overrides: dict[str, Any] | None = None
    # vLLM's: logits processor classes (or "module:Class" names) loaded once; each request may
    # take a function of its own from them (worker.sample.logits_processors)
    logits_processors: Sequence[str | type] = ()
    # vLLM's: the markers of a reasoning model's thinking, {"think_start_str": "<think>",
    # "think_end_str": "</think>"}, which requests' thinking_token_budget counts between
    # (worker.sample.thinking_budget); None: <think> and </think> where the tokenizer has them as tokens
    reasoning_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                             f"got {self.quantization!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank",
                     "max_images_per_prompt", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # a bad one fails here, by name
        self._check_optional()

    def _check_optional(self) -> None:
        """The settings that may be left unset."""
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.mamba_block_size is not None and (self.mamba_block_size < 1 or self.mamba_block_size % self.block_size):
            raise ValueError(f"mamba_block_size must be a positive multiple of block_size ({self.block_size}), "
                             f"got {self.mamba_block_size}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a mapping of config.json entries, got {self.hf_overrides!r}")
        if self.max_step_ms is not None and not self.max_step_ms >= 0:
            raise ValueError(f"max_step_ms must be >= 0 (0 or None: off), got {self.max_step_ms}")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB (or None: off), got {self.kv_offloading_size}")

    @property
    def state_interval(self) -> int:
        """Tokens between the linear-attention states the prefix cache keeps (mamba_block_size)."""
        return self.mamba_block_size or -(-512 // self.block_size) * self.block_size

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    max_loras: int = 0  # distinct adapters running at once (0: LoRA is off)
    # the model keeps a state per request (linear attention, Mamba2): after a wrong guess it
    # goes back to the state after the step's known tokens, so the guesses kept are computed
    # again (by the next step, which guesses on after them)
    recurrent: bool = False


def kv_group_layout(layer_windows: tuple[int | None, ...], num_layers: int,
                    config: EngineConfig) -> list[tuple[int | None, tuple[int, ...]]]:
    """How the layers keep their KV: (window, layers) per group, each group with its own
    block tables over the one pool of blocks. A windowed group gives back the blocks before
    its next query's window (the largest of its layers'); None keeps them all.

    One windowed group when every layer is windowed (Mistral v0.1), unless a draft model
    speculates: its cache holds as many tokens as the target's pool, so the target's pool
    must keep them all. Where full and windowed layers mix (Gemma 2 and 3, gpt-oss), groups
    of equally many layers, as many as the fewer kind has (vLLM's hybrid KV cache manager):
    a block id is then the same memory in every group, taken by whichever needs it (the last
    group of a kind may have fewer layers, leaving some of its blocks' memory unused), unless
    `disable_hybrid_kv_cache_manager`. One group that keeps everything otherwise."""
    windows = layer_windows or (None,) * num_layers
    every = tuple(range(num_layers))
    windowed = tuple(i for i, w in enumerate(windows) if w is not None)
    if not windowed:
        return [(None, every)]
    largest = max(w for w in windows if w is not None)
    if len(windowed) == num_layers:
        draft = bool((config.speculative_config or {}).get("model"))
        return [(None if draft else largest, every)]
    if config.disable_hybrid_kv_cache_manager:
        return [(None, every)]
    full = tuple(i for i in every if i not in windowed)
    size = min(len(full), len(windowed))
    return ([(None, full[i : i + size]) for i in range(0, len(full), size)]
            + [(largest, windowed[i : i + size]) for i in range(0, len(windowed), size)])
