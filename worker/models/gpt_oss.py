"""gpt-oss checkpoints in genq's layout.

transformers keeps each layer's experts stacked the other way round from genq, with gate and
up interleaved: `mlp.experts.gate_up_proj` [E, hidden, 2 * I] whose columns alternate gate,
up, gate, up; `gate_up_proj_bias` [E, 2 * I] alike; `down_proj` [E, I, hidden]. OpenAI's own
checkpoints store the expert weights in MXFP4 instead: `<proj>_blocks` [E, rows, cols / 32,
16] uint8, two 4-bit e2m1 values a byte (low nibble first), and `<proj>_scales` [E, rows,
cols / 32] uint8, a power of two (e8m0, bias 127) per 32 values, rows being output features.
They are widened to the model's dtype here, as they load: every e2m1 value times a power of
two is exact in bfloat16. The router is `mlp.router`, which genq calls `mlp.gate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# the sixteen e2m1 codes: sign, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, G, 16] uint8 codes and [..., rows, G] uint8 exponents -> [..., rows, G * 32]
    float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match their scales "
                         f"{tuple(scales.shape)} {scales.dtype}: expected uint8 [..., G, 16] and [..., G]")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = torch.ldexp(lut[codes.long()], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate, up, gate, up ... along `dim` -> all gates, then all ups (genq's w13 halves)."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss checkpoint's tensors, renamed and laid out as genq's loader expects: experts
    [E, 2 * I, hidden] (gates, then ups) and [E, hidden, I], MXFP4 ones dequantized."""
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
            dense = dequantize_mxfp4(blocks, scales)  # [E, rows, cols]: rows are output features
            yield stem, _deinterleave(dense, 1) if stem.endswith("gate_up_proj") else dense
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
