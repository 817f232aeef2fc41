"""gpt-oss checkpoints in genq's layout.

transformers keeps each layer's experts stacked the other way round from genq, with gate and
up interleaved: `mlp.experts.gate_up_proj` [E, hidden, 2 * I] whose columns alternate gate,
up, gate, up; `gate_up_proj_bias` [E, 2 * I] alike; `down_proj` [E, I, hidden]. OpenAI's own
checkpoints store the expert weights in MXFP4 instead: `<proj>_blocks` [E, rows, cols / 32,
16] uint8, two 4-bit e2m1 values a byte (low nibble first), and `<proj>_scales` [E, rows,
cols / 32] uint8, a power of two (e8m0, bias 127) per 32 values, rows being output features.
On the kernel path they stay so (the codes and the exponents, 4.25 bits a value, on the
fused MoE kernel's fp4 path); elsewhere they are widened to the model's dtype as they load:
every e2m1 value times a power of two is exact in bfloat16. The router is `mlp.router`,
which genq calls `mlp.gate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from worker.model_executor.models.quant import e8m0_scales, unpack_fp4


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """[..., rows, G, 16] uint8 codes and their [..., rows, G] uint8 exponents, or ValueError."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match their scales "
                         f"{tuple(scales.shape)} {scales.dtype}: expected uint8 [..., G, 16] and [..., G]")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, G, 16] uint8 codes and [..., rows, G] uint8 exponents -> [..., rows, G * 32]
    float32."""
    check_mxfp4(blocks, scales)
    return (unpack_fp4(blocks) * e8m0_scales(scales)[..., None]).flatten(-2)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate, up, gate, up ... along `dim` -> all gates, then all ups (genq's w13 halves)."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def _same(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t


def checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], keep_mxfp4: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss checkpoint's tensors, renamed and laid out as genq's loader expects: experts
    [E, 2 * I, hidden] (gates, then ups) and [E, hidden, I]. MXFP4 ones are dequantized, or
    with `keep_mxfp4` come as their codes [E, rows, cols / 2] and `<name>_scale` [E, rows,
    cols / 32] (the uint8 exponents)."""
    pending: dict[str, torch.Tensor] = {}  # an MXFP4 weight's blocks or scales, until the other comes
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(("_proj_blocks", "_proj_scales")):
            stem, _, part = name.rpartition("_")
            other = f"{stem}_{'scales' if part == 'blocks' else 'blocks'}"
            if other not in pending:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, pending.pop(other)) if part == "blocks" else (pending.pop(other), tensor)
            rows = _deinterleave if stem.endswith("gate_up_proj") else _same  # rows are output features
            if keep_mxfp4:
                check_mxfp4(blocks, scales)
                yield stem, rows(blocks.flatten(-2), 1)
                yield stem + "_scale", rows(scales, 1)
            else:
                yield stem, rows(dequantize_mxfp4(blocks, scales), 1)
        elif name.endswith(".experts.gate_up_proj"):  # [E, hidden, 2 * I]
            yield name, _deinterleave(tensor.transpose(1, 2), 1)
        elif name.endswith(".experts.gate_up_proj_bias"):  # [E, 2 * I]
            yield name, _deinterleave(tensor, 1)
        elif name.endswith(".experts.down_proj"):  # [E, I, hidden]
            yield name, tensor.transpose(1, 2)
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"checkpoint has MXFP4 blocks without their scales (or scales without blocks): "
                         f"{', '.join(sorted(pending)[:4])}")
