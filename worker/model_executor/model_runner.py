"""The model runner: the only part of the engine that builds tensors.

Each step turns the scheduler's plain-data batch into one flat batch (no padding): input ids,
positions, slot_mapping and attention metadata; writes KV into the paged cache; and returns
the logits of the rows that sample a token.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from worker.config import EngineConfig, kv_group_layout
from worker.core.block_manager import KVSwaps
from worker.core.multimodal import ImageInputs
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.attention import GroupedMetadata, in_bucket, pad_tables
from worker.model_executor.attention_selector import (
    make_attention_backend,
    resolve_attention_backend,
)
from worker.model_executor.image_encoders import ImageEmbeddings, load_image_encoder
from worker.model_executor.input_batch import InputBatch
from worker.model_executor.lora import LoRAManager
from worker.model_executor.model_loader import iter_safetensors
from worker.model_executor.models.config import ModelConfig, Span
from worker.model_executor.models.linear_attention import LinearStates
from worker.model_executor.models.llama import LlamaForCausalLM, fuse_small_ops
from worker.model_executor.models.moe import pack_experts
from worker.model_executor.models.packed_linear import can_pack, pack_linears
from worker.model_executor.models.quantized_model import dequantize_all, use_quantized
from worker.model_executor.models.whisper import CrossStates, CrossStep
from worker.model_executor.sleep import ParkedStorages, drop_laid_out, weight_tensors
from worker.model_executor.tensor_parallel import (
    TensorParallel,
    deal_experts,
    shard_adapter,
    shard_weights,
)
from worker.model_executor.weight_copy import check_same_weights, copy_weights

if TYPE_CHECKING:
    from worker.model_executor.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module names it only from 3.13

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_supports_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_supports_bf16():
        return torch.bfloat16
    return torch.float32


@dataclass
class ModelOutput:
    request_ids: list[str]  # one per logits row (consecutive rows for a request with guesses)
    logits: torch.Tensor  # [num_rows, vocab] float32
    # request id -> [chunk_len, vocab] logits at each computed position, for prompt logprobs
    chunk_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # request id -> [hidden] float32: the last row of an embedding request's prompt
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    # every row's final hidden state [T, hidden] (an MTP draft reads the target's), and the
    # step's requests as they lie in it, with each one's end row (exclusive)
    hidden: torch.Tensor | None = None
    batch: list[ScheduledRequest] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    # the residual stream before the model's aux_layers, concatenated (an EAGLE-3 head reads it)
    aux: torch.Tensor | None = None

    @functools.cached_property
    def rows(self) -> dict[str, tuple[int, int]]:
        """Each request's rows in `hidden`: [start, end) (made when a draft asks, not every step)."""
        return {s.request_id: (end - len(s.token_ids), end) for s, end in zip(self.batch, self.ends, strict=True)}


@dataclass
class StepImages:
    """What images bring to a step's rows: the rows that take image embeddings ([k]) and those
    embeddings ([k, hidden]), and the rotary positions where they are not the rows' own
    (M-RoPE after an image: a list, or [3, T] where the streams differ). The runner that
    encodes the images makes it; under tensor parallelism rank 0 sends it to the others."""

    rows: tuple[torch.Tensor, torch.Tensor] | None
    rope: list[int] | torch.Tensor | None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config, max_model_len: int,
                 image_config: Any = None, parallel: TensorParallel | None = None,
                 model_class: type[LlamaForCausalLM] = LlamaForCausalLM):
        """`image_config`: an image-text checkpoint's whole config, when it takes images: its
        vision encoder loads beside the model, before the KV cache takes what memory is left.
        `parallel`: this runner's rank of a tensor-parallel group (worker.model_executor.tensor_parallel), which
        holds its share of the model (`model_config` is that share's). `model_class`: what
        runs `hf_config` (a draft layer: worker.model_executor.models.mtp's, worker.model_executor.models.eagle3's)."""
        self.config = config
        self.model_path = model_path
        self.parallel = parallel
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.block_size = config.block_size
        # the whole model's, as its checkpoint holds it; model_config is this rank's share
        self.checkpoint_config = ModelConfig.from_hf(hf_config, config.quantization, max_model_len)
        self.model_config = (self.checkpoint_config if parallel is None
                             else self.checkpoint_config.shard(parallel.world_size, config.enable_expert_parallel))
        # the layers' KV groups: (window, layers) each, with block tables of its own over the
        # one pool; layer j of every group keeps its KV in the same tensor (its slot). Layers of
        # linear attention keep a state per request instead (self.states), in no group
        cfg = self.model_config
        self.kv_layers = [i for i in range(cfg.num_hidden_layers)
                          if i not in cfg.linear_layers and i not in cfg.mlp_only_layers]
        layout = kv_group_layout(tuple(cfg.kept_windows[i] for i in self.kv_layers), len(self.kv_layers), config)
        self.kv_layout = [(window, tuple(self.kv_layers[j] for j in layers)) for window, layers in layout]
        self.layer_group = [0] * self.model_config.num_hidden_layers
        self.layer_slot = [0] * self.model_config.num_hidden_layers
        for group, (_, layers) in enumerate(self.kv_layout):
            for slot, layer in enumerate(layers):
                self.layer_group[layer], self.layer_slot[layer] = group, slot
        self.num_slots = max(len(layers) for _, layers in self.kv_layout)
        # what each group's layers see (their windows, chunks): a mask for each
        self.group_spans = [frozenset(self.model_config.layer_span(i) for i in layers) for _, layers in self.kv_layout]
        self.backend = resolve_attention_backend(config.attention_backend, self.device)
        self.max_model_len = max_model_len
        # the triton backend brings the norm and rotary kernels with it: the whole CUDA path
        self.model = self._load_model(model_path, use_kernels=self.backend == "triton", model_class=model_class,
                                      dummy=config.load_format == "dummy")
        self.lora = None
        if config.enable_lora:
            share = None if parallel is None else functools.partial(
                shard_adapter, cfg=self.checkpoint_config, rank=parallel.rank, world_size=parallel.world_size)
            self.lora = LoRAManager(self.model, self.model_config, config.max_loras, config.max_lora_rank, self.dtype,
                                    self.device, share, self.checkpoint_config)
        self._pack(self.model)
        self.image_encoder = None if image_config is None else load_image_encoder(
            model_path, image_config, self.dtype, self.device, dummy=config.load_format == "dummy")
        self.image_embeds = ImageEmbeddings()
        # an encoder-decoder's (Whisper's): each running request's audio keys and values, a slot
        # for each request that may run at once, made before the KV cache as the states are; and
        # each request's clip's features, kept for as long as it lives (a preempted request
        # computes them again)
        self.cross: CrossStates | None = None
        self.clips: dict[str, tuple[torch.Tensor, int, int]] = {}  # request id -> its clip's features, digest, frames
        # requests that may run at once: max_num_seqs, or fewer where their slots would not fit
        self.max_num_seqs = self._num_request_slots(max_model_len)
        if getattr(self.model, "encoder_decoder", False):
            self.cross = CrossStates(cfg.num_hidden_layers, self.max_num_seqs, cfg.hf_config.encoder_positions,
                                     cfg.hidden_size, self.dtype, self.device)
        # linear attention's states, a slot for each request that may run at once (made before the
        # KV cache, which takes what memory is left)
        self.states = None if cfg.linear is None else LinearStates(
            cfg.linear, len(cfg.linear_layers), self.max_num_seqs, self.dtype, self.device)
        self.attention = make_attention_backend(self.backend, self.model_config, self.block_size, self.dtype, self.device)
        self.num_blocks = self._num_kv_blocks(max_model_len)
        self._kv_mapping: mmap.mmap | None = None  # the CPU pool's memory
        self.kv_caches = self._allocate_kv_cache()
        self.host_pool = self._allocate_host_tier(config.kv_offloading_size)
        self.num_host_blocks = 0 if self.host_pool is None else self.host_pool.shape[2]
        self.num_host_states = 0 if self.states is None else self.states.num_host
        self.graphs = self._decode_graphs()
        # the running requests' rows, kept across steps (worker.model_executor.input_batch)
        self.input_batch = InputBatch(len(self.kv_layout), self.max_num_seqs, -(-max_model_len // self.block_size))
        # sleep mode: what a sleep gave back, until it wakes
        self.asleep = False
        self._parked_cache: ParkedStorages | None = None
        self._parked_weights: ParkedStorages | None = None

    def add_images(self, request_ids: list[str], inputs: ImageInputs) -> None:
        """A prompt's images, encoded when a step first computes their tokens; their pixels
        wait in the model's dtype, which the encoder reads them in (half the host memory of
        float32 for a bfloat16 model)."""
        assert self.image_encoder is not None, "this model takes no images"
        pixels = [p.to(self.dtype) if p.is_floating_point() else p for p in inputs.pixel_values]
        if self.cross is not None:  # the encoder's clip, for the cross-attention
            frames = int(inputs.image_sizes[0][0])  # (its mel frames, before the window's padding)
            self.clips.update(dict.fromkeys(request_ids, (pixels[0], inputs.spans[0].digest, frames)))
            return
        self.image_embeds.add(request_ids, replace(inputs, pixel_values=pixels))

    def add_prompt_embeds(self, request_ids: list[str], embeds: torch.Tensor, digest: int) -> None:
        """A prompt given as embeddings [positions, hidden] (worker.core.prompt_embeds), in the
        model's dtype, whose rows stand in for its placeholder tokens' as an encoded image's do."""
        self.image_embeds.add_given(request_ids, embeds.to(self.dtype), digest)

    def encode_images(self, batch: list[ScheduledRequest]) -> dict[str, Exception]:
        """Encode the images this step's chunks reach first; the requests whose images the
        encoder failed on, with what it raised (the others' are encoded)."""
        failed: dict[str, Exception] = {}
        if self.cross is not None:
            return self._encode_clips(batch)
        if not self.image_embeds:
            return failed
        for s in batch:
            try:
                self.image_embeds.encode(s.request_id, s.start_pos, s.start_pos + len(s.token_ids), self._encode)
            except Exception as exc:  # an image's fault (or its size's: out of memory) fails its request alone
                failed[s.request_id] = exc
        return failed

    def _encode_clips(self, batch: list[ScheduledRequest]) -> dict[str, Exception]:
        """An encoder-decoder's: the audio keys and values of the step's requests that have
        none (their first step, or their first after a preemption), the projections run on the
        clip's encoder output (the encoder run per clip, unless it ran on the same clip lately:
        ImageEmbeddings' cache); the requests the encoder failed on, with what it raised."""
        assert self.cross is not None
        failed: dict[str, Exception] = {}
        for s in batch:
            if s.request_id in self.cross.slots:
                continue
            try:
                clip, digest, _ = self.clips[s.request_id]
                encoded = self.image_embeds.encoded(digest, functools.partial(self._encode_clip, clip))
                self.cross.store(s.request_id, *cast(Any, self.model).cross_kv(encoded))
            except Exception as exc:  # a clip's fault (or its size's: out of memory) fails its request alone
                failed[s.request_id] = exc
        return failed

    def cross_attention_weights(self, request_id: str, token_ids: list[int], heads: list[tuple[int, int]]
                                ) -> tuple[torch.Tensor, int]:
        """An encoder-decoder's running request's: the cross-attention weights of `heads` for
        its whole sequence `token_ids` (the model's cross_attention_weights), and its clip's mel
        frames."""
        assert self.cross is not None
        slot = self.cross.slots[request_id]
        weights = cast(Any, self.model).cross_attention_weights(token_ids, self.cross.keys[slot],
                                                                self.cross.values[slot], heads)
        return weights, self.clips[request_id][2]

    def _encode_clip(self, clip: torch.Tensor) -> torch.Tensor:  # [encoder positions, hidden]
        assert self.image_encoder is not None
        return self.image_encoder([clip], torch.zeros(1, 1)).to(self.dtype)[0]

    def forget(self, request_id: str, preempted: bool = False) -> None:
        """Drop the images and audio the runner keeps for a request that ended (its states are
        the caller's to remove, on every rank); for one `preempted` (it will compute its rows
        again), only its audio keys and values, before the step's encodes take slots."""
        if self.cross is not None:
            self.cross.remove(request_id)
        if preempted:
            return
        self.image_embeds.remove(request_id)
        self.clips.pop(request_id, None)

    def _encode(self, pixels: list[torch.Tensor], sizes: torch.Tensor) -> torch.Tensor:
        assert self.image_encoder is not None
        return self.image_encoder(pixels, sizes).to(self.dtype)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Decode graphs go with the kernel path (captured on CUDA; replayed eagerly over the
        same padded buffers on CPU, where the triton backend runs only for tests)."""
        # (a tensor-parallel step's reductions are not captured yet, nor an encoder-decoder's
        # cross-attention, which reads a slot per request)
        if (self.backend != "triton" or self.config.enforce_eager or self.parallel is not None
                or self.cross is not None):
            return None
        from worker.model_executor.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self.model, self.kv_caches, self.max_num_seqs, self.max_model_len,
                            self.block_size, self.device, self.layer_group, self.states,
                            self.model_config.linear_layers)

    def reload_weights(self, source: Path | Mapping[str, torch.Tensor], image_config: Any = None,
                       adjust: Callable[[LlamaForCausalLM], None] | None = None) -> None:
        """Read the checkpoint at `source` (one of the served model's shape; or its tensors by
        their checkpoint names) and copy its weights over the model's, and its image encoder's
        (`image_config`: the checkpoint's whole config; a path's alone), in place: whatever
        shares them (a draft's embedding, CUDA graphs) reads the new ones. The checkpoint is read into a model of its own on the host first
        (`adjust`: a change to it before it is compared, an MTP layer's shared embedding), so a
        GPU needs no room for a second copy; only when every rank has read and checked its
        share are any weights copied, so one that cannot be read leaves every rank's model as
        it was, and says why."""
        staged: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        error: Exception | None = None
        try:
            host = torch.device("cpu")
            fresh = self._load_model(source, self.model.use_kernels, type(self.model), device=host)
            if self.device == host:
                self._pack(fresh)
            if adjust is not None:
                adjust(fresh)
            staged.append((self.model, fresh))
            if self.image_encoder is not None:
                assert isinstance(source, Path), "an image encoder's weights are read from a checkpoint"
                staged.append((self.image_encoder, load_image_encoder(source, image_config, self.dtype, host)))
            for served, read in staged:
                check_same_weights(served, read)
        except Exception as exc:  # every rank reaches the agreement below, whatever failed
            error = exc
        if self.parallel is not None and self.parallel.min(int(error is None)) == 0 and error is None:
            error = RuntimeError(f"another tensor-parallel rank could not read its share of {source} "
                                 "(its log says why)")
        if error is not None:
            raise error
        self.graphs = None  # (recaptured below: graphs may hold tensors the copy replaces)
        if self._parked_weights is not None:  # asleep: the weights wake, to be overwritten
            self._parked_weights.restore(contents=False)
            self._parked_weights = None
        for served, read in staged:
            copy_weights(served, read)
        self.image_embeds.forget_encoded()  # no image is served from the old encoder's embeddings
        if not self.asleep:
            self.graphs = self._decode_graphs()
        self._awake_if_whole()

    def sleep(self, level: int) -> None:
        """Give the memory back (vLLM's sleep mode): the KV cache and the states per request
        (their contents forgotten); at level 2 the weights too (their contents forgotten: a
        weights load, `reload_weights`, brings them back), at level 1 on a GPU the weights go
        to host memory (on the CPU they stay where they are). Only an idle runner sleeps."""
        if self.asleep:
            return
        self.graphs = None
        cached: list[torch.Tensor] = []
        if self._kv_mapping is not None:  # the CPU pool's pages go back to the kernel, zeros when next read
            self._kv_mapping.madvise(mmap.MADV_DONTNEED)
        else:
            cached.append(self.kv_pool)
        if self.states is not None:
            cached += [t for t in (self.states.conv, self.states.recurrent, getattr(self.states, "saved_conv", None),
                                   getattr(self.states, "saved_recurrent", None)) if t is not None]
        if self.cross is not None:
            cached += [self.cross.keys, self.cross.values]
        self._parked_cache = ParkedStorages(cached, keep=False)
        if level == 2 or self.device.type != "cpu":
            self._parked_weights = ParkedStorages(weight_tensors([self.model, self.image_encoder]), keep=level == 1)
            if level == 2:
                drop_laid_out(self.model)
        self.image_embeds.forget_encoded()
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def weights_forgotten(self) -> bool:
        """Whether a level-2 sleep forgot the weights (a weights load brings them back)."""
        return self._parked_weights is not None and any(copy is None for _, _, copy in self._parked_weights.parked)

    def wake_weights(self) -> None:
        """The weights a level-1 sleep put on the host, back in place."""
        assert not self.weights_forgotten, "weights a level-2 sleep forgot come back with a weights load"
        if self._parked_weights is not None:
            self._parked_weights.restore()
            self._parked_weights = None
        self._awake_if_whole()

    def wake_cache(self) -> None:
        """The KV cache and the states per request, back (empty)."""
        if self._parked_cache is not None:
            self._parked_cache.restore(zero=True)
            self._parked_cache = None
            if self._kv_mapping is not None:  # (its pages faulted in again now, not by the first steps)
                with contextlib.suppress(OSError, ValueError):
                    self._kv_mapping.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
        self._awake_if_whole()

    def _awake_if_whole(self) -> None:
        if self.asleep and self._parked_weights is None and self._parked_cache is None:
            self.asleep = False
            self.graphs = self._decode_graphs()

    def _pack(self, model: LlamaForCausalLM) -> None:
        """Lay the linears' and experts' weights out for oneDNN, where this CPU runs them so;
        with genq's CPU kernels, a bf16 model's small ops run fused."""
        if self.backend in ("cpu", "torch") and can_pack(self.device, self.dtype):
            # decode steps run max_num_seqs rows at most: the size oneDNN should lay out for
            pack_linears(model, batch_hint=self.config.max_num_seqs)
            pack_experts(model, batch_hint=self.config.max_num_seqs)
        if self.backend == "cpu" and self.dtype == torch.bfloat16:
            fuse_small_ops(model)

    def _load_model(self, source: Path | Mapping[str, torch.Tensor], use_kernels: bool,
                    model_class: type[LlamaForCausalLM] = LlamaForCausalLM, device: torch.device | None = None,
                    dummy: bool = False) -> LlamaForCausalLM:
        """The model, built on `device` (the runner's unless given) and its weights read from
        the checkpoint at `source` (or given by their checkpoint names), or drawn at random
        (`dummy`)."""
        cfg = self.model_config
        with torch.device("meta"):  # built in the model's dtype, so loading writes each weight once
            model = model_class(cfg, use_kernels).to(self.dtype)
            if self.parallel is not None:  # (first: quantization names a rank's experts by their ids)
                model.reduce_with(self.parallel.all_reduce, self.parallel.world_size, self.parallel.rank)
            if cfg.quant is not None:
                kv_rows = cfg.num_key_value_heads * cfg.head_dim
                use_quantized(model, cfg.quant, (cfg.num_attention_heads * cfg.head_dim, kv_rows, kv_rows))
        device = device or self.device
        model = model.to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        if dummy:
            model.init_dummy_weights(getattr(cfg.hf_config, "initializer_range", 0.02))
        elif self.parallel is None:
            model.load_weights(_checkpoint_tensors(source, model.checkpoint_filter()))
        else:
            p, ep = self.parallel, self.config.enable_expert_parallel
            model.load_weights(_checkpoint_tensors(source, model.checkpoint_filter()), functools.partial(
                shard_weights, cfg=self.checkpoint_config, rank=p.rank, world_size=p.world_size, expert_parallel=ep),
                functools.partial(deal_experts, cfg=self.checkpoint_config, rank=p.rank, world_size=p.world_size)
                if ep else None)
        if cfg.quant is not None and not use_kernels:  # quantized matmuls are the kernel path's
            dequantize_all(model, self.dtype)
        model.eval()
        model.build_rotary(device)  # buffers made on the meta device hold nothing
        return model

    def _kv_block_bytes(self) -> int:
        """One block of every layer that keeps KV, K and V."""
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return cfg.kv_pools * len(self.kv_layers) * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def _num_kv_blocks(self, max_model_len: int) -> int:
        """Blocks in the pool, each `num_slots` layers' worth: as many as the memory holds,
        or num_gpu_blocks_override blocks of every layer's (as one group of every layer
        would have them)."""
        bs, chunk = self.block_size, self.config.max_num_batched_tokens
        if self.config.num_gpu_blocks_override is not None:
            budget = self.config.num_gpu_blocks_override
            self._allocate_saved_states(budget * self._kv_block_bytes())  # (besides those blocks)
        else:
            memory = self._cache_memory()
            if self.device.type != "cuda":  # (on CUDA, no longer free)
                memory -= self.max_num_seqs * self._request_state_bytes()
            budget = (memory - self._allocate_saved_states(memory)) // self._kv_block_bytes()
        num_blocks = budget * len(self.kv_layers) // self.num_slots
        if self.parallel is not None:  # every rank's pool holds the same blocks, for the one scheduler
            num_blocks = self.parallel.min(num_blocks)
        needed = 0
        for window, _ in self.kv_layout:
            group_needed = -(-max_model_len // bs)
            if window is not None:  # a sequence holds its window and one step's chunk at most
                group_needed = min(group_needed, -(-(window + chunk) // bs) + 1)
            needed += group_needed
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {bs} tokens, fewer than one "
                f"sequence of max_model_len={max_model_len} needs ({needed}); "
                "lower max_model_len or give the cache more memory"
            )
        return num_blocks

    def _cache_memory(self) -> int:
        """The bytes the requests' states may take (the KV cache, and what each request holds
        besides: _request_state_bytes): on CUDA, gpu_memory_utilization's share of the device
        less what is taken, less room for the images' embeddings kept lately; on the CPU,
        kv_cache_memory_gb."""
        if self.device.type != "cuda":
            return int(self.config.kv_cache_memory_gb * 2**30)
        free, total = torch.cuda.mem_get_info(self.device)
        if self.image_encoder is not None:
            free -= self.image_embeds.max_cache_bytes
        return int((free - total * (1 - self.config.gpu_memory_utilization)) * 0.9)

    def _request_state_bytes(self) -> int:
        """What each request that may run at once holds besides its KV cache, made up front:
        an encoder-decoder's audio keys and values (CrossStates), linear attention's states
        (LinearStates; twice, with a spare each, under speculative decoding)."""
        cfg, total = self.model_config, 0
        if getattr(self.model, "encoder_decoder", False):
            total += CrossStates.slot_bytes(cfg.num_hidden_layers, cfg.hf_config.encoder_positions, cfg.hidden_size,
                                            self.dtype)
        if cfg.linear is not None:
            spares = 2 if self.config.speculative_config else 1
            total += spares * LinearStates.request_bytes(cfg.linear, len(cfg.linear_layers), self.dtype)
        return total

    def _num_request_slots(self, max_model_len: int) -> int:
        """Requests that may run at once: max_num_seqs, or, where each holds states of its own
        (_request_state_bytes), as many as fit in the cache's memory beside the KV cache of a
        whole sequence each (whisper-large-v3's audio takes 245 MB a request in bfloat16, a
        large hybrid's states tens of MB: 128 of them need not fit a GPU). With
        num_gpu_blocks_override, max_num_seqs. The same count on every rank."""
        wanted, state = self.config.max_num_seqs, self._request_state_bytes()
        if not state or self.config.num_gpu_blocks_override is not None:
            return wanted
        kv = -(-max_model_len // self.block_size) * self._kv_block_bytes()
        memory = self._cache_memory()
        fits = memory // (state + kv)
        if self.parallel is not None:
            fits = self.parallel.min(fits)
        if fits < 1:
            raise ValueError(f"one request needs {(state + kv) / 2**20:.0f} MiB ({state / 2**20:.0f} MiB of states "
                             f"of its own, {kv / 2**20:.0f} MiB of KV cache), more than the cache's "
                             f"{memory / 2**20:.0f} MiB: give the cache more memory (gpu_memory_utilization, "
                             "kv_cache_memory_gb on the CPU)")
        if fits < wanted:
            logger.warning("the cache's %.0f MiB hold %d requests' own states (%.0f MiB each) and KV cache: %d run "
                           "at once, not max_num_seqs=%d", memory / 2**20, fits, state / 2**20, fits, wanted)
        return min(wanted, fits)

    def _allocate_saved_states(self, memory: int) -> int:
        """Slots for the linear-attention states the prefix cache keeps (num_state_snapshots,
        or as many as a tenth of the cache's `memory` holds, at most 8 per request that may
        run), and with speculative decoding a spare per request; the bytes they take."""
        if self.states is None:
            return 0
        count = self.config.num_state_snapshots if self.config.enable_prefix_caching else 0
        if count is None:
            count = min(memory // 10 // self.states.state_bytes, 8 * self.max_num_seqs)
            if self.parallel is not None:  # the one scheduler names the same slots on every rank
                count = self.parallel.min(count)
        return self.states.allocate_saved(count, spares=bool(self.config.speculative_config)) * self.states.state_bytes

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V pools per slot in the attention backend's layout, each layer given its
        slot's, zeroed: attention reads whole blocks, and a NaN left in an unwritten slot
        would poison the weighted sum even under a -inf mask."""
        shape = self.attention.cache_shape(self.num_blocks)
        pools = self.model_config.kv_pools
        if self.device.type != "cpu":
            pool = torch.zeros((self.num_slots, pools, *shape), dtype=self.kv_dtype, device=self.device)
        else:
            flat, self._kv_mapping = _cpu_pool(pools * self.num_slots * math.prod(shape), self.kv_dtype)
            pool = flat.view(self.num_slots, pools, *shape)
        self.kv_pool = pool  # [slots, pools, blocks, ...]
        slots = [(pool[i, 0], pool[i, pools - 1]) for i in range(self.num_slots)]
        return [slots[slot] for slot in self.layer_slot]

    def _allocate_host_tier(self, size_gb: float | None) -> torch.Tensor | None:
        """KV offloading's host slots, laid out as the pool's blocks: `size_gb` GiB in all, a
        tensor-parallel rank holding its share of each block (pinned where the pool is on a
        GPU, so copies run beside the stream's work). A model with states that keeps saved
        ones gives half of it to host slots for them (LinearStates.allocate_host)."""
        if not size_gb:
            return None
        block_bytes = self.kv_pool[:, :, 0].numel() * self.kv_pool.element_size()
        world = 1 if self.parallel is None else self.parallel.world_size
        size = size_gb * 2**30 / world
        if self.states is not None and self.states.num_saved:  # half of it for states: a prefix is
            # served from the host only up to a state kept (the scarcer part, a few per GiB)
            num_states = int(size / 2 // self.states.state_bytes)
            if self.parallel is not None:
                num_states = self.parallel.min(num_states)
            self.states.allocate_host(num_states, pinned=self.device.type == "cuda")
            size -= num_states * self.states.state_bytes
        num_slots = int(size // block_bytes)
        if self.parallel is not None:
            num_slots = self.parallel.min(num_slots)
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size={size_gb} GiB holds no block of this model's KV cache "
                             f"({block_bytes * world} bytes a block)")
        shape = (*self.kv_pool.shape[:2], num_slots, *self.kv_pool.shape[3:])
        return torch.empty(shape, dtype=self.kv_pool.dtype, pin_memory=self.device.type == "cuda")

    def swap_blocks(self, swaps: KVSwaps) -> None:
        """KV offloading's copies for a step, before it runs: evicted blocks out to their host
        slots, then host slots back into the blocks that take them (each destination's last
        copy is the one that counts); and so for saved states."""
        if self.states is not None and (swaps.states_out or swaps.states_back):
            self.states.swap(swaps.states_out, swaps.states_back)
        if not (swaps.out or swaps.back):
            return
        assert self.host_pool is not None
        pool, host = self.kv_pool.view(torch.uint8), self.host_pool.view(torch.uint8)  # (fp8 has no index_put)
        if swaps.out:
            block_in = {slot: block for block, slot in swaps.out}  # a slot given twice: its last
            host[:, :, list(block_in)] = pool[:, :, list(block_in.values())].to("cpu")
        if swaps.back:
            slot_for = {block: slot for slot, block in swaps.back}
            blocks = torch.tensor(list(slot_for), device=self.device)
            pool[:, :, blocks] = host[:, :, list(slot_for.values())].to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, images: StepImages | None = None,
                hidden: dict[str, torch.Tensor] | None = None) -> ModelOutput:
        """`images`: the step's, where the caller has them (step_images); else this runner's.
        `hidden`: each request's rows' input states, for a model that reads them (the MTP
        layer's: [len(token_ids), hidden] a request)."""
        batch, hidden_out = self._run_layers(out, images or self.step_images(out), hidden)
        ends = _row_ends(batch)
        request_ids, rows, chunks, pools = _sampled_rows(batch, ends)
        # every row samples (a step of decodes alone): the rows are all of them, in order, not gathered
        sampling = hidden_out if len(rows) == hidden_out.shape[0] else hidden_out[
            torch.tensor(rows, dtype=torch.long, device=self.device)]
        # into the model's buffer, kept across steps: the engine reads these before the next step
        logits = self.model.compute_logits(sampling, reuse=True)  # [num_rows, vocab]
        chunk_logits = {s.request_id: self.model.compute_logits(hidden_out[end - len(s.token_ids) : end])
                        for s, end in chunks}
        pooled = {s.request_id: self.model.pool(hidden_out[end - 1 : end])[0] for s, end in pools}
        return ModelOutput(request_ids, logits, chunk_logits, pooled, hidden_out, batch, ends, self.model.aux)

    @torch.inference_mode()
    def execute_layers(self, out: SchedulerOutput, images: StepImages | None) -> None:
        """A step's decoder layers alone: a tensor-parallel rank other than 0 takes its part in
        them, with the step's image inputs as rank 0 made them, and leaves the logits to rank 0."""
        self._run_layers(out, images)

    def step_images(self, out: SchedulerOutput) -> StepImages | None:
        """What this runner's images bring to the step's rows; None where they bring nothing."""
        if not self.image_embeds:
            return None
        batch = _order_decodes_first(out.scheduled)
        images = StepImages(self._image_rows(batch), self._rope_positions(batch))
        return None if images.rows is None and images.rope is None else images

    def _run_layers(self, out: SchedulerOutput, step: StepImages | None,
                    inputs: dict[str, torch.Tensor] | None = None) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """The step's requests as the batch orders them, and their rows' final hidden states.
        `inputs`: each request's input states, for a model that reads them (execute's `hidden`)."""
        batch = _order_decodes_first(out.scheduled)
        # where the engine's scheduler made the step, its changes go to the persistent batch
        rows = self.input_batch.update(out, batch) if out.finished_ids is not None else None
        lora = None
        if self.lora is not None:
            lora = self.lora.mapping([s.lora_id for s in batch], [len(s.token_ids) for s in batch])
        images = rope = None
        if step is not None:
            rope = step.rope
            if step.rows is not None:
                images = (step.rows[0].to(self.device), step.rows[1].to(self.device))
        if (self.graphs is not None and lora is None and images is None and not isinstance(rope, torch.Tensor)
                and inputs is None and not self.model.aux_layers and self.graphs.can_run(batch)):
            if self.states is not None:  # (the eager path's for_step does this)
                for request_id in out.preempted:
                    self.states.remove(request_id)
            width = -(-(max(s.start_pos for s in batch) + 1) // self.block_size)
            hidden = self.graphs.run(batch, self._step_tables(batch, rows, width), rope)  # [B, hidden]
        else:  # eager: prefills, steps with adapters (the graphs hold the base model only), with
            # image rows, or with M-RoPE's three streams
            input_ids, positions, meta = self._prepare(batch, out.preempted, rows)
            if self.cross is not None:  # each request's rows, and its slot
                segments = [(end - len(s.token_ids), end, self.cross.slots[s.request_id])
                            for s, end in zip(batch, _row_ends(batch), strict=True)]
                cast(Any, self.model).cross = CrossStep(self.cross, segments)
            if rope is not None:
                positions = torch.as_tensor(rope, dtype=torch.long).to(self.device)
            if inputs is None:
                hidden = self.model(input_ids, positions, self.kv_caches, meta, lora, images)  # [T, hidden]
            else:
                states = torch.cat([inputs[s.request_id] for s in batch])
                hidden = self.model(input_ids, positions, self.kv_caches, meta, lora, images, states)
        return batch, hidden

    def _prepare(self, batch: list[ScheduledRequest], preempted: list[str] | None = None,
                 rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """`preempted`: the requests the step's scheduling preempted (their linear-attention
        states are void). `rows`: the batch's rows in the persistent batch, which give the
        step's tables (None: each request's tables are read whole)."""
        input_ids, positions, seq_of_token = _flat_inputs(batch, self.device)
        width = -(-max([s.start_pos + len(s.token_ids) for s in batch]) // self.block_size)
        tables = self._step_tables(batch, rows, width)
        metas: list[Any] = []
        first: dict[frozenset[Span], Any] = {}  # per set of spans, its first group's metadata
        for g, kinds in enumerate(self.group_spans):
            table = tables[g].to(self.device, non_blocking=True)  # [B, width]
            slots = table[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
            metas.append(self.attention.build(batch, table, slots, kinds, like=first.get(kinds)))
            first.setdefault(kinds, metas[-1])
        meta = GroupedMetadata.of(metas, self.layer_group)
        if self.states is not None:  # linear attention's layers take their states instead
            states = self.states.for_step(((s.request_id, s.start_pos, len(s.token_ids), s.state_restore, s.state_saves,
                                            s.num_drafts) for s in batch), preempted or ())
            linear = self.model_config.linear_layers
            meta = GroupedMetadata([states if i in linear else meta.for_layer(i) for i in range(len(self.layer_group))])
        return input_ids, positions, meta

    def _image_rows(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of the flat batch that take image embeddings ([k]), and those ([k, hidden])."""
        if not self.image_embeds:
            return None
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for s, end in zip(batch, _row_ends(batch), strict=True):
            found = self.image_embeds.rows(s.request_id, s.start_pos, s.start_pos + len(s.token_ids),
                                           end - len(s.token_ids))
            if found is not None:
                rows += found[0]
                embeds.append(found[1])
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.long), torch.cat(embeds)

    def _rope_positions(self, batch: list[ScheduledRequest]) -> list[int] | torch.Tensor | None:
        """The step's rotary positions where some request's are not its positions (M-RoPE,
        after an image): a list where the three streams agree on every row, else [3, T];
        None where every row rotates by its position."""
        if not self.image_embeds:
            return None
        ropes = [self.image_embeds.rope_positions(s.request_id, s.start_pos, s.start_pos + len(s.token_ids))
                 for s in batch]
        if all(rope is None for rope in ropes):
            return None
        rows = [list(range(s.start_pos, s.start_pos + len(s.token_ids))) if rope is None else rope
                for s, rope in zip(batch, ropes, strict=True)]
        if all(isinstance(row, list) for row in rows):
            return [p for row in rows for p in row]  # type: ignore[union-attr]
        return torch.cat([torch.tensor(row).expand(3, -1) if isinstance(row, list) else row for row in rows], dim=1)

    def _step_tables(self, batch: list[ScheduledRequest], rows: np.ndarray | None, width: int
                     ) -> list[torch.Tensor]:
        """Each KV group's tables of the step's requests, their first `width` entries: [B, width]
        a group, on the host. From the persistent batch's `rows`; without them read whole from
        each request."""
        if rows is not None:
            return [self.input_batch.tables(g, rows, width) for g in range(len(self.kv_layout))]
        tables = [s.tables() for s in batch]
        return [pad_tables([t[g][:width] for t in tables], torch.device("cpu"), width)
                for g in range(len(self.kv_layout))]


def _checkpoint_tensors(source: Path | Mapping[str, torch.Tensor], keep: Callable[[str], bool] | None
                        ) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs, from its files or as given; with `keep`, those it names."""
    if isinstance(source, Path):
        return iter_safetensors(source, keep)
    return ((name, tensor) for name, tensor in source.items() if keep is None or keep(name))


def _cpu_pool(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed CPU tensor in one anonymous mapping (and the mapping, which a sleep gives back),
    on transparent huge pages where the kernel allows them, with every page faulted in now.
    Faulting pages one by one while steps first write them cost more than a second of a W1
    run; populating 2 GiB of huge pages up front
    takes about 0.1 s where free huge pages are at hand, and up to several seconds where the
    kernel must compact fragmented memory for them (3.6 s measured, against 0.7 s for small
    pages): a start-up cost, paid once. Huge pages also spare the TLB on attention's scattered block reads."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, numel * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advices = (getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    for advice in filter(None, advices):
        try:
            buf.madvise(advice)
        except OSError:  # an older kernel: pages then come on first touch
            pass
    return torch.frombuffer(buf, dtype=dtype), buf  # (the tensor keeps the mapping alive)


def _order_decodes_first(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes first, shortest context first, so each decode bucket pads little; then decodes
    with guesses to check and short chunks after a cached prefix, by length (each length
    attends as a bucket); then prefills. Within those, requests are grouped by adapter, so each
    adapter's rows are one slice."""
    decodes = sorted((s for s in scheduled if len(s.token_ids) == 1), key=_DECODE_ORDER)
    if len(decodes) == len(scheduled):  # (the common step: nothing else to sort out)
        return decodes
    others = [s for s in scheduled if len(s.token_ids) > 1]
    bucketed = sorted((s for s in others if in_bucket(s)), key=lambda s: (len(s.token_ids), s.lora_id, s.start_pos))
    return decodes + bucketed + [s for s in others if not in_bucket(s)]


_DECODE_ORDER = operator.attrgetter("lora_id", "start_pos")


def _flat_inputs(batch: list[ScheduledRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's flat batch: its input ids, their positions, and each one's request (its row
    of the batch): [T] each."""
    ids = [token_id for s in batch for token_id in s.token_ids]
    if len(ids) == len(batch):  # decodes only: a token each, at its start (numpy's lists in: torch's cost more)
        host_array = np.empty((3, len(ids)), dtype=np.int64)
        host_array[0], host_array[1], host_array[2] = ids, [s.start_pos for s in batch], np.arange(len(ids))
        input_ids, positions, seq_of_token = torch.from_numpy(host_array).to(device, non_blocking=True).unbind(0)
        return input_ids, positions, seq_of_token
    starts = torch.tensor([s.start_pos for s in batch])
    lens = torch.tensor([len(s.token_ids) for s in batch])
    seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), lens)
    first_row = torch.cumsum(lens, 0) - lens  # each request's first row
    positions = starts[seq_of_token] + torch.arange(len(ids)) - first_row[seq_of_token]
    host = torch.stack([torch.tensor(ids), positions, seq_of_token])  # [3, T], one copy over
    input_ids, positions, seq_of_token = host.to(device, non_blocking=True).unbind(0)
    return input_ids, positions, seq_of_token


def _sampled_rows(batch: list[ScheduledRequest], ends: list[int]) -> tuple[
        list[str], list[int], list[tuple[ScheduledRequest, int]], list[tuple[ScheduledRequest, int]]]:
    """The rows sampled (a sampling request's last row, and one more per guessed token before
    it) and their requests; the requests (and end rows) that want their prompt chunk's logprobs,
    and those pooled. One pass over the batch, not one for each: it runs every step."""
    request_ids: list[str] = []
    rows: list[int] = []
    chunks: list[tuple[ScheduledRequest, int]] = []
    pools: list[tuple[ScheduledRequest, int]] = []
    for s, end in zip(batch, ends, strict=True):
        if s.prompt_logprobs:
            chunks.append((s, end))
        if s.pool:
            pools.append((s, end))
        elif s.sample and s.num_drafts:
            request_ids += [s.request_id] * (1 + s.num_drafts)
            rows += range(end - 1 - s.num_drafts, end)
        elif s.sample:
            request_ids.append(s.request_id)
            rows.append(end - 1)
    return request_ids, rows, chunks, pools


def _row_ends(batch: list[ScheduledRequest]) -> list[int]:
    """End row (exclusive) of each request in the flat batch."""
    ends, row = [], 0
    for s in batch:
        row += len(s.token_ids)
        ends.append(row)
    return ends
