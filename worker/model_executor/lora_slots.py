"""The LoRA weights a model's layers read in a step: `LoRASlots`, one fused projection's
adapter slots, and `LoRAMapping`, which rows of the step run which slot and how their deltas
are added. Per fused projection (q/k/v, o, gate/up, down) a slot holds A as
`[in, num_shards * R]` and B as `[num_shards * R, out]` (`worker.model_executor.lora` says why).

Their own module because the models (`models.llama`, `models.linear_attention`) take them in
each forward pass while `worker.model_executor.lora`, which fills them, reads the models'
projections: the models depend on these two classes, not on adapter loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class LoRASlots(nn.Module):
    """One fused projection's adapter weights, `max_loras` slots of them."""

    def __init__(self, in_features: int, shard_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.shard_sizes = shard_sizes
        self.max_rank = max_rank
        self.width = len(shard_sizes) * max_rank  # k*R
        # every slot side by side: one matmul pair serves a step whatever its adapters
        self.a = torch.zeros(in_features, max_loras * self.width, dtype=dtype, device=device)  # [in, slots*k*R]
        self.b = torch.zeros(max_loras * self.width, sum(shard_sizes), dtype=dtype, device=device)  # [slots*k*R, out]

    def slot_a(self, slot: int) -> torch.Tensor:  # [in, k*R]
        return self.a[:, slot * self.width : (slot + 1) * self.width]

    def slot_b(self, slot: int) -> torch.Tensor:  # [k*R, out]
        return self.b[slot * self.width : (slot + 1) * self.width]

    def load(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> None:
        """Put an adapter's pairs for this projection in `slot`; None (untargeted) zeroes it."""
        a = torch.zeros(self.a.shape[0], self.width, dtype=self.a.dtype)
        b = torch.zeros(self.width, self.b.shape[1], dtype=self.b.dtype)
        offset = 0
        for i, size in enumerate(self.shard_sizes):
            pair = shards[i] if shards else None
            if pair is not None:
                rank, band = pair[0].shape[0], i * self.max_rank
                a[:, band : band + rank] = pair[0].T
                b[band : band + rank, offset : offset + size] = pair[1].T
            offset += size
        self.slot_a(slot).copy_(a)
        self.slot_b(slot).copy_(b)


@dataclass
class LoRAMapping:
    """Which rows of one step run which slot. With one adapter in the step, `runs` lists its
    `(slot, start, end)` row ranges; with several, `row_slots` is each row's one-hot slot
    ([T, slots, 1], zero rows for no adapter), and every slot is computed for every row and
    masked: a fixed two matmuls per projection instead of two per adapter."""

    runs: list[tuple[int, int, int]]
    row_slots: torch.Tensor | None = None  # [T, slots, 1] in the model dtype

    def add(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots | None) -> torch.Tensor:
        """y += each row's adapter delta, in place; y: [T, out], x: [T, in]."""
        assert slots is not None, "a model runs a LoRA mapping only once its slots are attached"
        if self.row_slots is None:
            for slot, start, end in self.runs:  # slices: views, no gather or scatter
                y[start:end].addmm_(x[start:end] @ slots.slot_a(slot), slots.slot_b(slot))
            return y
        h = (x @ slots.a).view(x.shape[0], -1, slots.width).mul_(self.row_slots)  # [T, slots, k*R]
        return y.addmm_(h.view(x.shape[0], -1), slots.b)
