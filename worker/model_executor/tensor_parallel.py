"""Tensor parallelism: one model split over several devices (vLLM's `tensor_parallel_size`).

Megatron's split, as vLLM makes it: each rank holds its share of the attention heads (query
and key-value alike, with their rows of q/k/v and columns of o_proj) and of the MLP's
intermediate features (rows of gate/up, columns of down_proj); the partial outputs of o_proj
and down_proj are summed over the ranks (an all-reduce), so every rank carries the whole
residual stream. Embeddings, norms and the LM head are whole on every rank. Each rank's KV
cache holds its own heads. A layer with a state per request (linear attention, Mamba2)
splits by its heads alike, each rank keeping its heads' part of every state. A mixture of
experts splits each expert as a dense MLP, or with expert parallelism (vLLM's
`enable_expert_parallel`) deals the experts out whole, rank r holding experts r * E/N to
(r + 1) * E/N - 1: each rank then serves the tokens routed to its experts, the others' rows
adding nothing, and the same one sum after the block gathers every expert's output.

The ranks reduce over a process group of their own (`join_group`: gloo on CPU, NCCL on CUDA),
made from a TCP store on the loopback. Running the ranks is `worker.model_executor.parallel`'s;
this module is what a model runner needs of its rank: its share of the weights and the group.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from worker.model_executor.lora import LoRAAdapter
    from worker.model_executor.models.config import LinearAttentionConfig, ModelConfig

# how long a rank waits for the others in one collective (or to join), before it gives up:
# a rank that dies closes its connections and the others fail at once, so this bounds only
# a rank that hangs
TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TensorParallel:
    """A rank's place in the group and the group's reductions."""

    rank: int
    world_size: int
    group: Any  # a torch.distributed ProcessGroup: gloo on CPU, NCCL on CUDA
    device: torch.device  # where the group's tensors live

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        self.group.allreduce([x]).wait()
        return x

    def min(self, value: int) -> int:
        """The least of every rank's `value`."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.group.allreduce([t], options).wait()
        return int(t.item())


# a decoder layer's projections by how they split: by output rows (their outputs are this
# rank's heads or features), or by input columns (partial sums, reduced after); an expert's
# as a dense MLP's (Mixtral's w1 and w3, w2); latent attention's per-head up-projections
# (q_b_proj, kv_b_proj) by rows, its latent projections whole (every rank keeps the latent cache)
_BY_ROWS = frozenset({"q_proj", "gate_proj", "up_proj", "w1", "w3", "q_b_proj", "kv_b_proj", "up"})
_KV = frozenset({"k_proj", "v_proj"})  # by rows too, a KV head each
_BY_COLUMNS = frozenset({"o_proj", "down_proj", "w2", "down"})  # (up and down: Nemotron-H's MLP, without a gate)
# experts stacked in one tensor: gate and up [E, 2 * I, H], down [E, H, I] (transformers 5's,
# and GraniteMoE's input_linear and output_linear)
_STACKED_UP = "experts.up_proj"  # (experts without a gate)
_STACKED_GATE_UP = ("experts.gate_up_proj", "input_linear.weight", _STACKED_UP)
_STACKED_DOWN = ("experts.down_proj", "output_linear.weight")


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, rank: int, world_size: int,
                  expert_parallel: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor's part on this rank (`cfg`: the whole model's). Checkpoints that
    fuse q/k/v or gate/up (Phi-3, GLM-4), or stack the experts, split each part alike. A bias
    of a split-by-columns projection is added once, by rank 0 (the others hold zeros). The
    router and the shared expert's gate are whole on every rank.

    Quantized weights come as genq holds them (worker.model_executor.models.quant): values [out, in] (int4
    packed [out, in / 8]) with their scale and zero-point grids (`<w>_scale`, `<w>_zero`, a
    row and column per block), and split as their values do: a grid by its block rows, or by
    its groups of columns (ModelConfig.shard has checked that each rank's rows and columns
    are whole blocks); a grid of one row or column (a scale per tensor, or per output
    channel of a layer split by columns) is whole on every rank. KV-cache scales, one per KV
    head, are split as the heads are.

    `expert_parallel`: the experts' tensors are this rank's already (deal_experts), whole."""
    for name, tensor in weights:
        yield name, tensor if expert_parallel and _is_experts(name) else _share(name, tensor, cfg, rank, world_size)


def deal_experts(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, rank: int, world_size: int
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert parallelism, before quantized weights are read (so that a rank never reads
    another's experts): this rank's experts' tensors, whole, numbered from 0 (stacked ones
    sliced, their biases added by the rank that holds the expert); the other ranks' dropped;
    every other tensor as it is."""
    for name, tensor in weights:
        dealt = _expert_share(name, tensor, rank, world_size, cfg)
        yield from [(name, tensor)] if dealt is None else dealt


# one expert's tensor in a checkpoint: experts.<e>.<its projection...>
_ONE_EXPERT = re.compile(r"(.*\.experts\.)(\d+)(\..*)")


def _expert_share(name: str, tensor: torch.Tensor, rank: int, world_size: int, cfg: ModelConfig
                  ) -> list[tuple[str, torch.Tensor]] | None:
    """Expert parallelism: an experts' tensor as this rank holds it (nothing, if another
    rank's expert), or None if `name` is none of the experts'."""
    assert cfg.moe is not None
    per_rank = cfg.moe.num_experts // world_size
    first = rank * per_rank
    one = _ONE_EXPERT.fullmatch(name)
    if one is not None:
        expert = int(one.group(2)) - first
        return [(f"{one.group(1)}{expert}{one.group(3)}", tensor)] if 0 <= expert < per_rank else []
    if _is_experts(name):
        return [(name, tensor[first : first + per_rank])]  # stacked: [E, ...]
    return None


def _is_experts(name: str) -> bool:
    """Whether a tensor is routed experts': one expert's, or all of them stacked."""
    from worker.model_executor.models.quant import grid_part

    values = name.removesuffix(grid_part(name))
    return (_ONE_EXPERT.fullmatch(name) is not None or values.endswith(_STACKED_GATE_UP + _STACKED_DOWN)
            or values.endswith(("gate_up_proj_bias", "down_proj_bias")))


def _share(name: str, tensor: torch.Tensor, cfg: ModelConfig, rank: int, world_size: int) -> torch.Tensor:
    """One checkpoint tensor's part on this rank (shard_weights)."""
    from worker.model_executor.models.kv_scales import scale_target
    from worker.model_executor.models.quant import grid_part

    if scale_target(name):  # a KV-cache scale: one a layer, or one per KV head
        return _kv_share(tensor.reshape(-1), cfg, rank, world_size) if tensor.numel() > 1 else tensor
    grid = grid_part(name)
    values = name.removesuffix(grid)  # the weight a grid belongs to
    module, _, kind = values.rpartition(".")
    module = module.rpartition(".")[2]
    if (grid and tensor.numel() == 1) or kind == "input_perm":
        return tensor  # a scale for the whole tensor; the order of a row-split layer's (whole) input

    def part(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return _part(t, dim, rank, world_size, bool(grid), f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)}")

    # stacked experts [E, 2 * I, H] (the Hub's Qwen3-VL-MoE [E, H, 2 * I]), gpt-oss's biases [E, 2 * I];
    # experts without a gate (Nemotron 3's) [E, I, H]
    if values.endswith(_STACKED_GATE_UP) or kind == "gate_up_proj_bias":
        dim = 2 if _inputs_first(name, tensor, cfg, 2) else 1
        halves = 1 if values.endswith(_STACKED_UP) else 2
        return torch.cat([part(half, dim) for half in tensor.chunk(halves, dim=dim)], dim=dim)
    if values.endswith(_STACKED_DOWN):  # [E, H, I], or the Hub's [E, I, H]
        return part(tensor, 1 if _inputs_first(name, tensor, cfg, 1) else 2)
    if cfg.linear is not None and (module in _STATE_MODULES or kind in _STATE_PER_HEAD or (
            module == "norm" and values.split(".")[-3:-2] in (["linear_attn"], ["mamba"], ["self_attn"]))):  # (Nemotron-H's mixer: self_attn)
        return _state_share(module, kind, tensor, cfg.linear, part, rank)
    by_rows, kv = _BY_ROWS | _whole_norms(cfg, "q_norm"), _KV | _whole_norms(cfg, "k_norm")
    if module in by_rows or kind == "sinks":  # (gpt-oss's sink logit per head)
        return part(tensor)
    if module in kv:
        return _kv_share(tensor, cfg, rank, world_size)
    if module == "qkv_proj":
        q, k, v = _qkv_parts(tensor, cfg)
        return torch.cat([part(q), _kv_share(k, cfg, rank, world_size), _kv_share(v, cfg, rank, world_size)])
    if module == "gate_up_proj":
        return torch.cat([part(half) for half in tensor.chunk(2)])
    if module in _BY_COLUMNS and kind == "weight":
        return part(tensor, 1)
    if module in _BY_COLUMNS or kind == "down_proj_bias":  # a bias added once, by rank 0
        return tensor if rank == 0 else torch.zeros_like(tensor)
    return tensor


# the layers with a state (Qwen3.5's linear attention, Mamba2): their projections and
# convolution, and their per-head parameters (A_log a tensor of its own, not a module's)
_STATE_MODULES = frozenset({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj", "conv1d", "out_proj"})
_STATE_PER_HEAD = frozenset({"dt_bias", "A_log", "D"})


def _state_share(module: str, kind: str, tensor: torch.Tensor, linear: LinearAttentionConfig,
                 part: Callable[..., torch.Tensor], rank: int) -> torch.Tensor:
    """A tensor of a layer with a state: this rank's heads (value heads, and the key heads or
    Mamba2 groups they read) in each section of its rows; out_proj by its columns (its bias
    added once, by rank 0); Gated DeltaNet's norm, over one head's features, whole."""
    groups = linear.num_key_heads * linear.key_head_dim  # q's or k's rows (Mamba2: B's or C's)
    inner = linear.num_value_heads * linear.value_head_dim
    sections = {"in_proj_qkv": [groups, groups, inner], "in_proj": [inner, inner, groups, groups, linear.num_value_heads],
                "conv1d": [inner, groups, groups] if linear.mamba2 else [groups, groups, inner]}.get(module)
    if module == "out_proj":
        return part(tensor, 1) if kind == "weight" else tensor if rank == 0 else torch.zeros_like(tensor)
    if module == "norm" and not linear.mamba2:
        return tensor
    if sections is None:  # one section: z, b, a, the per-head parameters, Mamba2's norm (its groups')
        return part(tensor)
    unit = sum(sections) // tensor.shape[0]  # weight rows a row stands for (a scale grid's: a block's)
    return torch.cat([part(section) for section in tensor.split([size // unit for size in sections])])


def _whole_norms(cfg: ModelConfig, name: str) -> frozenset[str]:
    """OLMo 2's q and k norms, over whole projections: their weights split as q's and k's rows
    (other models' norms are per head, whole on every rank)."""
    return frozenset({name}) if cfg.qk_norm_whole else frozenset()


def _qkv_parts(tensor: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """A fused q/k/v weight's (or its grid's) q, k and v rows."""
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    unit = (q_rows + 2 * kv_rows) // tensor.shape[0]  # weight rows a row stands for (a grid's: a block's)
    return tensor.split([q_rows // unit, kv_rows // unit, kv_rows // unit])


def _inputs_first(name: str, tensor: torch.Tensor, cfg: ModelConfig, dim: int) -> bool:
    """Whether stacked experts lie inputs before outputs, as Qwen3-VL-MoE's Hub checkpoints
    hold them: their intermediate features (gate and up's together) along `dim`, the loader's
    rule (a square matrix is taken as the Hub's)."""
    from worker.model_executor.models.llama import hub_stacked_experts

    assert cfg.moe is not None
    features = cfg.moe.intermediate_size * (2 if dim == 2 else 1)
    return hub_stacked_experts(cfg, name) and tensor.shape[dim] == features


def _part(t: torch.Tensor, dim: int, rank: int, world_size: int, grid: bool, what: str) -> torch.Tensor:
    """This rank's 1/world_size of `t` along `dim`; a grid's one row (or column), a scale for
    all the rows (or columns), is every rank's."""
    if grid and t.shape[dim] == 1:
        return t
    if t.shape[dim] % world_size:
        raise ValueError(f"{what} does not split over tensor_parallel_size={world_size}")
    return t.chunk(world_size, dim)[rank]


def _kv_share(rows: torch.Tensor, cfg: ModelConfig, rank: int, world_size: int) -> torch.Tensor:
    """A rank's rows of a key or value projection (or of its scale grid, or of the KV-cache
    scales, a row per head): its share of the KV heads or, where there are fewer heads than
    ranks, the one head its query heads read."""
    if cfg.num_key_value_heads >= world_size:
        return rows.chunk(world_size)[rank]
    per_head = rows.shape[0] // cfg.num_key_value_heads
    head = rank * cfg.num_key_value_heads // world_size
    return rows[head * per_head : (head + 1) * per_head]


def shard_adapter(adapter: LoRAAdapter, cfg: ModelConfig, rank: int, world_size: int) -> LoRAAdapter:
    """A LoRA adapter's part on this rank (`cfg`: the whole model's), each pair (A [r, in],
    B [out, r]) split as its projection is: by rows (q/k/v, gate/up, a state layer's in_proj),
    B's rows as the weight's and A whole; by columns (o_proj, down_proj, out_proj), A's columns
    and B whole, so each rank's delta is a partial sum, added to the projection's own before
    the ranks sum them."""
    pairs: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    for (layer, fused), shards in adapter.pairs.items():
        split: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, pair in enumerate(shards):
            if pair is None:
                split.append(None)
                continue
            a, b = pair
            if fused in ("o_proj", "down_proj", "out_proj", "down"):
                a = a.chunk(world_size, dim=1)[rank]
            elif fused == "qkv_proj" and i > 0:  # k, v
                b = _kv_share(b, cfg, rank, world_size)
            elif fused in _STATE_MODULES and cfg.linear is not None:  # B's rows as the weight's, section by section
                b = _state_share(fused, "weight", b, cfg.linear, lambda t, dim=0: t.chunk(world_size, dim)[rank], rank)
            else:
                b = b.chunk(world_size)[rank]
            split.append((a.contiguous(), b.contiguous()))
        pairs[(layer, fused)] = split
    return replace(adapter, pairs=pairs)


def join_group(rank: int, world_size: int, port: int, device: torch.device,
               store: dist.TCPStore | None = None) -> TensorParallel:
    """This rank's group, over the store rank 0 serves on `port`."""
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    prefixed = dist.PrefixStore("genq-tp", store)
    group: Any
    if device.type == "cuda":  # (a CPU build of torch has no NCCL)
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, TIMEOUT)
    return TensorParallel(rank, world_size, group, device)
