"""Linear layers over weights that oneDNN lays out once, at load time (bfloat16 and float32 on CPU).

`F.linear` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight, which it re-lays
into its blocked layout on every call. Doing that once and keeping the blocked copy makes each
matmul 1.3x (128 rows) to 2.3x (8 rows) faster at decode batch sizes and 1.1x at prefill sizes
(`benchmarks/cpu_linear.py`), on the same arithmetic: the outputs are bitwise equal to
`F.linear`'s. These are torch's own oneDNN ops, the ones its compiler uses for frozen CPU models.

float32 `F.linear` goes to MKL's sgemm instead, which on some CPUs (an AVX2 AMD EPYC) takes
1.7-2.8x longer than oneDNN's blocked weights at 1-128 rows and 1.1-1.2x longer at 512-2048
(`benchmarks/cpu_linear.py --dtype float32`). There the two sum in different orders: the
outputs agree to float32 rounding, not bitwise.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can run prepacked linears of `dtype` (bfloat16 only
    where the CPU multiplies it natively)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:  # private ops: a build may lack them, and then F.linear serves
        ops = torch.ops.mkldnn
        _ = (ops._reorder_linear_weight, ops._linear_pointwise)
        return dtype == torch.float32 or bool(ops._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """`linear`'s weight in oneDNN's blocked layout (an opaque tensor, not a parameter), and its
    bias. `batch_hint` is the number of rows oneDNN should expect; any number works."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = pack_weight(linear.weight, batch_hint)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_features] -> [T, out_features]
        return packed_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """A linear layer's weight [out, in] in oneDNN's blocked layout, for `packed_linear`."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) over the weight `pack_weight` laid out (bitwise the same in bfloat16)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`; returns how many. A replaced
    layer's plain weight is freed unless another module shares it (a tied lm_head keeps the
    embedding's)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(targets)
