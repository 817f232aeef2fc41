"""LoRA adapters served beside the base model: many adapters, one batch.

An adapter is a PEFT directory (`adapter_config.json` and `adapter_model.safetensors`) whose
low-rank pairs add `(x @ A.T @ B.T) * scale` to the output of a projection. Adapters are read
once into CPU memory (`LoRAManager.add`); `max_loras` of them at a time sit in slots beside
the model's weights, and a step's rows are grouped by slot so every request gets its own
adapter (or none) within one forward pass. The scheduler admits no more distinct adapters
than there are slots.

Per fused projection (q/k/v, o, gate/up, down) a slot holds A as `[in, num_shards * R]` and
B as `[num_shards * R, out]`, R being `max_lora_rank`: each shard's pair sits in its own
rank-R band (zero-padded past the adapter's rank) and B's band covers only that shard's
output columns, so one pair of matmuls serves q, k and v (or gate and up) together. A
projection the adapter does not target stays zero and adds nothing. A layer with a state
(Qwen3.5's linear attention, Mamba2) keeps a slot set per projection of its own, by name.
An image-text model's adapter names its language model's projections under
`model.language_model.`; Nemotron-H's, each layer's one part under `backbone.layers.N.mixer`
(an MLP layer's up_proj and down_proj, without a gate). In a layer of experts the shared
expert takes adapters as a dense MLP of its own width (`mlp.shared_expert`, `shared_experts`,
Granite 4.0's `shared_mlp`); the routed experts take none.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.core.lora_request import LoRARequest
from worker.model_executor.lora_slots import LoRAMapping, LoRASlots
from worker.model_executor.models.config import ModelConfig
from worker.model_executor.models.linear_attention import StateMixer
from worker.model_executor.models.llama import LlamaForCausalLM, half_split_rows

# PEFT's module name -> (our fused projection, the shard's index in it; None: the whole of it,
# for models whose own projections are fused, Phi-3's)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None),
    # the layers with a state: Qwen3.5's linear attention (linear_attn), Mamba2 (Granite 4.0-H's
    # mamba); each projection its own
    **{name: (name, 0) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj", "out_proj")},
    # Granite 4.0's shared MLP: gate and up in one projection, down
    "input_linear": ("gate_up_proj", None), "output_linear": ("down_proj", 0),
    # Nemotron-H's MLP layers (up and down, no gate: its up_proj and down_proj there)
    "up": ("up", 0), "down": ("down", 0),
}
_GATELESS = {"up_proj": "up", "down_proj": "down"}  # a Nemotron-H MLP layer's names
# the projections of a layer with a state, Gated DeltaNet's or Mamba2's
STATE_PROJECTIONS = {False: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
                     True: ("in_proj", "out_proj")}
# (a layer of experts' shared expert: Qwen2-MoE's mlp.shared_expert, DeepSeek's and Nemotron 3's
# shared_experts, Granite 4.0's shared_mlp)
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.|backbone\.)?(?:language_model\.)?layers\.(\d+)\."
                  r"(?:self_attn|mlp|(shared_mlp)|linear_attn|mamba|mixer|feed_forward)\.(shared_experts?\.)?(\w+)"
                  r"\.lora_([AB])\.weight")
# a projection within a layer's routed experts
_EXPERTS_KEY = re.compile(r"layers\.(\d+)\.(?:mlp|mixer|block_sparse_moe|feed_forward)\.experts\.")
# adapter_config.json settings that change what an adapter computes beyond plain LoRA
_REFUSED = {
    "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication", "trainable_token_indices": "trainable_token_indices",
    "use_qalora": "QA-LoRA", "alora_invocation_tokens": "aLoRA", "lora_bias": "lora_bias",
}


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int  # the largest rank of its pairs
    # (layer index, fused projection) -> per shard, (A [rank, in], B [out, rank] * scale) or None
    pairs: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA directory for this model; ValueError naming what does not fit."""
    path = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {request.lora_name!r} ({path})"
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{where}: not a PEFT adapter directory (adapter_config.json and "
                         "adapter_model.safetensors are needed)")
    from safetensors.torch import load_file

    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 (unreadable JSON or safetensors: the adapter's fault)
        raise ValueError(f"{where}: cannot read its files: {type(exc).__name__}: {exc}") from None
    _check_config(config, where)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None and (experts := _EXPERTS_KEY.search(key)) is not None:
            raise ValueError(f"{where}: tensor {key!r} adapts the experts of layer {experts.group(1)}; genq applies "
                             "adapters to attention, layers with a state, dense MLPs and shared experts only")
        if match is None or match.group(4) not in TARGETS:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA pair of a projection genq applies "
                             f"adapters to ({', '.join(TARGETS)})")
        layer = int(match.group(1))
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} names layer {layer}, but the model has "
                             f"{cfg.num_hidden_layers}")
        shared = match.group(3) is not None or (match.group(2) is not None and _has_experts(cfg, layer))
        module = _module_of(cfg, layer, match.group(4), shared, f"{where}: tensor {key!r}")
        halves.setdefault((layer, module), {})[match.group(5)] = tensor
    adapter = LoRAAdapter(request, rank=0)
    for (layer, module), pair in sorted(halves.items()):
        a, b = _check_pair(pair, layer, module, cfg, max_rank, where)
        scale = _scale(config, f"model.layers.{layer}.{module}", a.shape[0])
        fused, shard = TARGETS[module]
        sizes = _shard_sizes(fused, cfg, layer)
        shards = adapter.pairs.setdefault((layer, fused), [None] * len(sizes))
        if shard is not None:
            shards[shard] = (a.float(), _model_rows(b.float(), fused, shard, cfg) * scale)
        else:  # one pair over the whole projection: A shared, B's rows split among the shards
            for i, b_rows in enumerate(b.float().split(sizes)):
                shards[i] = (a.float(), _model_rows(b_rows, fused, i, cfg) * scale)
        adapter.rank = max(adapter.rank, a.shape[0])
    if not adapter.pairs:
        raise ValueError(f"{where}: the adapter holds no LoRA weights")
    return adapter


def _model_rows(b: torch.Tensor, fused: str, shard: int, cfg: ModelConfig) -> torch.Tensor:
    """B's rows in the order the model holds the shard's: q and k's reordered where the
    model's RoPE rotates interleaved pairs (the base weights' rows are, at load)."""
    if cfg.interleaved_rope and fused == "qkv_proj" and shard in (0, 1):
        return half_split_rows(b, cfg.head_dim, cfg.rotary_dim)
    return b


_MLP = ("gate_up_proj", "down_proj")


def layer_projections(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The projections of layer `layer` an adapter may name: its mixer's (attention's, or a
    layer with a state's), and its MLP's; a Nemotron-H layer has one or the other (Nemotron 3's
    layers of experts none)."""
    if layer in cfg.mlp_only_layers:
        return tuple(_GATELESS)
    if cfg.one_part_layers and _has_experts(cfg, layer):
        return ()
    mlp = () if cfg.one_part_layers else ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "input_linear",
                                          "output_linear")
    if cfg.linear is not None and layer in cfg.linear_layers:
        return STATE_PROJECTIONS[cfg.linear.mamba2] + mlp
    return ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", *mlp)


def _has_experts(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe is not None and layer in cfg.moe.layers


def _module_of(cfg: ModelConfig, layer: int, proj: str, shared: bool, what: str) -> str:
    """The projection an adapter tensor (`what`) names in layer `layer`, under the name its
    pair is kept by: `shared`, its layer of experts' shared expert's (a dense MLP's names; the
    routed experts take none). ValueError if the layer has no such projection."""
    if shared:
        if not (_has_experts(cfg, layer) and cfg.moe is not None and cfg.moe.shared_expert_size):
            raise ValueError(f"{what} adapts a shared expert in layer {layer}, which has none")
        allowed = tuple(_GATELESS) if cfg.one_part_layers else ("gate_proj", "up_proj", "down_proj", "gate_up_proj",
                                                                "input_linear", "output_linear")
    elif TARGETS[proj][0] in _MLP and _has_experts(cfg, layer):
        raise ValueError(f"{what} adapts the MLP of layer {layer}, a mixture-of-experts layer; genq applies "
                         "adapters to attention, dense MLPs and shared experts only")
    else:
        allowed = layer_projections(cfg, layer)
    if proj not in allowed:
        raise ValueError(f"{what} adapts {proj} in layer {layer}, which has none: its projections are "
                         f"{', '.join(allowed) or 'its experts'}")
    gateless = layer in cfg.mlp_only_layers or (shared and cfg.one_part_layers)  # Nemotron-H's MLPs
    return _GATELESS.get(proj, proj) if gateless else proj


def _mlp_width(cfg: ModelConfig, layer: int) -> int:
    """The features of layer `layer`'s MLP: its shared expert's, in a layer of experts."""
    return cfg.moe.shared_expert_size if cfg.moe is not None and _has_experts(cfg, layer) else cfg.intermediate_size


def _check_config(config: dict, where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (trained biases); only 'none'")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} adapters are not supported ({key}={config[key]!r})")


def _check_pair(pair: dict[str, torch.Tensor], layer: int, module: str, cfg: ModelConfig,
                max_rank: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    name = f"layer {layer} {module}"
    if set(pair) != {"A", "B"}:
        raise ValueError(f"{where}: {name} has lora_{''.join(pair)} without its other half")
    a, b = pair["A"], pair["B"]  # [rank, in], [out, rank]
    fused, shard = TARGETS[module]
    in_features = _in_features(fused, cfg, layer)
    sizes = _shard_sizes(fused, cfg, layer)
    out_features = sum(sizes) if shard is None else sizes[shard]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (out_features, rank):
        raise ValueError(f"{where}: {name} pair has shapes A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                         f"model needs A [rank, {in_features}] and B [{out_features}, rank]")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} ({name}) is over max_lora_rank={max_rank}; "
                         "start the engine with a larger max_lora_rank")
    return a, b


def _scale(config: dict, module_name: str, rank: int) -> float:
    """PEFT's scaling: lora_alpha (or the alpha_pattern entry matching the module) over the
    rank, or over its square root for rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module_name):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _in_features(fused: str, cfg: ModelConfig, layer: int) -> int:
    inner = 0 if cfg.linear is None else cfg.linear.num_value_heads * cfg.linear.value_head_dim
    width = _mlp_width(cfg, layer)
    return {"o_proj": cfg.num_attention_heads * cfg.head_dim, "out_proj": inner,
            "down_proj": width, "down": width}.get(fused, cfg.hidden_size)


def _shard_sizes(fused: str, cfg: ModelConfig, layer: int) -> list[int]:
    """Each shard's output rows (Qwen3.5's q_proj gives each head's gate after its queries)."""
    q_size = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    width = _mlp_width(cfg, layer)
    sizes = {"qkv_proj": [q_size, kv_size, kv_size], "o_proj": [cfg.hidden_size],
             "gate_up_proj": [width] * 2, "down_proj": [cfg.hidden_size], "out_proj": [cfg.hidden_size],
             "up": [width], "down": [cfg.hidden_size]}
    if cfg.linear is not None:
        linear = cfg.linear
        inner = linear.num_value_heads * linear.value_head_dim
        sizes.update(in_proj_qkv=[linear.conv_dim], in_proj_z=[inner], in_proj_b=[linear.num_value_heads],
                     in_proj_a=[linear.num_value_heads], in_proj=[inner + linear.conv_dim + linear.num_value_heads])
    return sizes[fused]


class LoRAManager:
    """Adapters read into CPU memory by id, and the `max_loras` slots they take turns in."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 share: Callable[[LoRAAdapter], LoRAAdapter] | None = None, whole: ModelConfig | None = None):
        """`cfg`: the model as this runner holds it; on a tensor-parallel rank, `whole` is the
        whole model's (adapters are read and checked against it) and `share` takes the rank's
        part of an adapter (worker.model_executor.tensor_parallel.shard_adapter)."""
        if cfg.mla is not None:
            raise ValueError(f"LoRA adapters are not supported for {cfg.architecture}, whose attention is "
                             "multi-head latent attention (MLA); serve it without enable_lora")
        self.cfg = whole or cfg
        self.share = share
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.adapters: dict[int, LoRAAdapter] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recent first
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        for i, layer in enumerate(model.layers):
            state = cfg.linear is not None and i in cfg.linear_layers
            mixer = i not in cfg.mlp_only_layers and not (cfg.one_part_layers and _has_experts(cfg, i))
            targets = [] if not mixer else [(layer.self_attn, fused) for fused in (
                STATE_PROJECTIONS[cfg.linear.mamba2] if state and cfg.linear else ("qkv_proj", "o_proj"))]
            if i in cfg.mlp_only_layers:  # Nemotron-H's: up and down, no gate
                targets += [(layer.mlp, "up"), (layer.mlp, "down")]
            elif _has_experts(cfg, i) and cfg.moe is not None and cfg.moe.shared_expert_size:  # the shared expert's
                shared = layer.get_submodule("mlp.shared_expert")
                targets += [(shared, "up"), (shared, "down")] if cfg.one_part_layers else [
                    (shared, "gate_up_proj"), (shared, "down_proj")]
            elif not cfg.one_part_layers and not _has_experts(cfg, i):
                targets += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
            for owner, fused in targets:
                slots = LoRASlots(_in_features(fused, cfg, i), _shard_sizes(fused, cfg, i), max_loras, max_rank, dtype,
                                  device)
                if isinstance(owner, StateMixer):  # (it keeps its projections' by name)
                    owner.lora_slots[fused] = slots
                else:
                    setattr(owner, fused.removesuffix("_proj") + "_lora", slots)
                self.slots[(i, fused)] = slots

    def add(self, request: LoRARequest) -> None:
        """Read the adapter if its id is new; ValueError if it cannot serve this model, or if
        the id already stands for another adapter."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known.request.lora_path != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                                 f"{known.request.lora_name!r} from {known.request.lora_path}")
            return
        adapter = load_adapter(request, self.cfg, self.max_rank)
        self.adapters[request.lora_int_id] = adapter if self.share is None else self.share(adapter)

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (no request may still run with it); its slot becomes free."""
        self.adapters.pop(lora_id, None)
        self.resident.pop(lora_id, None)

    def mapping(self, lora_ids: list[int], num_rows: list[int]) -> LoRAMapping | None:
        """The step's mapping for requests running `lora_ids` (0: none) over `num_rows` rows
        each, in row order, loading adapters into slots as needed; None when no request has
        one. Neighbours with the same adapter share a run (the runner groups decodes so)."""
        if not any(lora_ids):
            return None
        adapters = list(dict.fromkeys(i for i in lora_ids if i))
        slots = self._make_resident(adapters)
        if len(adapters) > 1:
            return LoRAMapping([], self._row_slots([slots.get(i) for i in lora_ids], num_rows))
        runs: list[tuple[int, int, int]] = []
        start = 0
        for lora_id, n in zip(lora_ids, num_rows, strict=True):
            if lora_id and runs and runs[-1][0] == slots[lora_id] and runs[-1][2] == start:
                runs[-1] = (runs[-1][0], runs[-1][1], start + n)
            elif lora_id:
                runs.append((slots[lora_id], start, start + n))
            start += n
        return LoRAMapping(runs)

    def _row_slots(self, slot_of_request: list[int | None], num_rows: list[int]) -> torch.Tensor:
        """[T, slots, 1]: 1 at each row's slot, none for rows without an adapter."""
        rows = [slot for slot, n in zip(slot_of_request, num_rows, strict=True) for _ in range(n)]
        one_hot = torch.zeros(len(rows), self.max_loras + 1)
        one_hot[torch.arange(len(rows)), torch.tensor([self.max_loras if s is None else s for s in rows])] = 1
        return one_hot[:, : self.max_loras, None].to(self.device, self.dtype)

    def _make_resident(self, lora_ids: list[int]) -> dict[int, int]:
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"a step needs {len(lora_ids)} adapters but there are {self.max_loras} slots")
        for lora_id in lora_ids:
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
                continue
            taken = set(self.resident.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this step does not need gives up its slot
                evicted = next(i for i in self.resident if i not in lora_ids)
                slot = self.resident.pop(evicted)
            adapter = self.adapters[lora_id]
            for key, slots in self.slots.items():
                slots.load(slot, adapter.pairs.get(key))
            self.resident[lora_id] = slot
        return {lora_id: self.resident[lora_id] for lora_id in lora_ids}
