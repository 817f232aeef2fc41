"""A whole model's quantized layers: giving its decoder layers' projections and experts
quantized weights before the checkpoint loads (`use_quantized`), and on the torch path taking
them back to float (`dequantize_all`). These passes know both kinds of quantized module,
`QuantLinear` (`worker.model_executor.models.quant`, which says how weights are quantized) and
`Experts` (`worker.model_executor.models.moe`, which builds on quant), so they sit above both.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker.model_executor.models.moe import Experts
from worker.model_executor.models.quant import QuantConfig, QuantLinear, dequantize, in_features

# a decoder layer's projections that may be quantized, and the checkpoint's names for their shards
_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
            "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def use_quantized(model: nn.Module, cfg: QuantConfig, qkv_rows: tuple[int, int, int]) -> int:
    """Give the decoder layers' projections and experts quantized weights of
    `cfg.kind` (on the meta device, before the weights load): projections become
    `QuantLinear`s, experts take `Experts.use_quantized`. Left in float: what the checkpoint
    keeps in float, and fused weights whose shards (q/k/v of `qkv_rows` rows; gate
    and up halves) do not fill whole scale blocks or whose columns no kernel tile fits.
    Returns how many modules were given quantized weights."""
    def fits(block: tuple[int, int], shards: Iterable[int], in_features: Iterable[int]) -> bool:
        return (all(rows % block[0] == 0 for rows in shards)
                and all(block[1] >= k or block[1] % 16 == 0 for k in in_features))

    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, Experts):
            inter, hidden = parent.w2.shape[2], parent.w2.shape[1]
            block = cfg.block or (1, max(inter, hidden))  # one scale per expert row
            names = [f"model.{parent_name}.{parent.first_expert + e}.{proj}" for e in range(parent.num_experts)
                     for proj in ("gate_proj", "up_proj", "down_proj")]
            if not cfg.skips(names) and fits(block, (inter,), (inter, hidden)):
                if cfg.act_order:
                    raise ValueError("GPTQ experts quantized with desc_act (act-order) are not supported; "
                                     "supported: desc_act false, or static_groups")
                parent.use_quantized(block, cfg.kind, cfg.zero_points)
                replaced += 1
            continue
        if cfg.experts_only:
            continue
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name not in _TARGETS or not parent_name.startswith("layers."):
                continue
            block = cfg.layout(child.out_features, child.in_features)
            shards = qkv_rows if name == "qkv_proj" else (child.out_features // 2,) if name == "gate_up_proj" else ()
            if cfg.skips(f"model.{parent_name}.{shard}" for shard in _TARGETS[name]):
                continue
            if fits(block, shards, (child.in_features,)):
                setattr(parent, name, QuantLinear(child.in_features, child.out_features, child.bias, block, cfg.kind,
                                                  cfg.zero_points, cfg.act_order))
                replaced += 1
    return replaced


def dequantize_all(model: nn.Module, dtype: torch.dtype) -> None:
    """Every quantized weight back in `dtype` (the torch path): `QuantLinear`s become
    `nn.Linear`s, fp8 experts float ones."""
    for parent in list(model.modules()):
        if isinstance(parent, Experts) and parent.block is not None:
            for name in ("w13", "w2"):
                zero = getattr(parent, name + "_zero") if parent.zero_points else None
                dense = dequantize(getattr(parent, name), getattr(parent, name + "_scale"), parent.block,
                                   in_features(parent, name), zero).to(dtype)
                setattr(parent, name, nn.Parameter(dense, requires_grad=False))
                for part in ("_scale", "_zero") if parent.zero_points else ("_scale",):
                    delattr(parent, name + part)
            parent.block, parent.zero_points = None, False
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                dense = dequantize(child.weight, child.weight_scale, child.block, child.in_features,
                                   child.weight_zero).to(dtype)
                if child.input_perm is not None:  # back in the checkpoint's column order
                    dense = dense[:, torch.argsort(child.input_perm)]
                linear.weight = nn.Parameter(dense, requires_grad=False)
                linear.register_parameter("bias", child.bias)
                setattr(parent, name, linear)
