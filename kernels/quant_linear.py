"""A linear layer over quantized weights with block scales: fp8 (e4m3) or int8 values, one
byte each, or int4 values packed eight to an int32. The weight stays that narrow in memory;
each tile is widened to the activation dtype on its way to the dot.

The weight [N, K] comes with a float32 scale grid [cdiv(N, BM), cdiv(K, BN)]: every BM x BN
block of the weight is its values times one scale. That covers FP8 checkpoints' 128 x 128
blocks (Qwen3-*-FP8, DeepSeek-V3), one scale per output channel (BM = 1, BN = K), one per
tensor (that grid filled with one value), and int4 groups along K (BM = 1, BN = 128 in
W4A16 checkpoints). A tile of BLOCK_K columns lies in one scale column, so each tile's
partial dot is scaled once per output column as it is added to the fp32 accumulator: the
weight itself is never rounded, unlike a weight dequantized to the activation dtype first
(the reference below rounds as that does).

int4 weights are packed as compressed-tensors packs them: value k of a row in bits
4 * (k % 8) of int32 k // 8, stored plus 8 (an unsigned nibble for -8..7).

Integer weights may come with zero points (GPTQ and AWQ checkpoints): an int8 grid shaped
and strided as the scales, each block's values less its zero point before the scale (w =
(q - z) * s). The differences stay integers within 255, exact in bf16.

Activations stay in their dtype (W8A16, W4A16): the decode steps, bound by reading the
weights, read a half (a quarter) of a bf16 weight's bytes, and the outputs differ from the
dequantized model's by accumulation order alone. Every size depends on the row count only,
so a decode step's layers can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels._common import (
    cdiv,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    dot_dtype,
    is_interpreted,
    tl,
    triton,
)

__all__ = ["quant_linear", "quant_linear_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# weight storage: fp8 and int8 values, or int4 values packed in int32s
_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.int32)


@triton.jit
def weight_tile(
    w_base,  # [BLOCK_N] pointers: the start of each column's row of stored weights
    k0,
    K,
    K_WORDS,  # int32 words a packed int4 row holds: cdiv(K, 8)
    col_ok,  # [BLOCK_N]
    INT4: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP4: tl.constexpr = False,
):
    """Values k0 .. k0 + BLOCK_K of BLOCK_N weight rows, as stored ([BLOCK_K, BLOCK_N]; zero
    past K): fp8 or int8 values as they are, int4 words spread into their nibbles minus 8 (row
    8 * word + nibble is value k0 + that), each word read once; with FP4 the nibbles are e2m1
    codes (MXFP4's bytes read as int32 words: the same nibble order), decoded to float32.
    Shared with `fused_moe`."""
    if INT4:
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(w_base[None, :] + words[:, None], mask=(words < K_WORDS)[:, None] & col_ok[None, :], other=0)
        nibbles = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
        nibbles = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))
        if FP4:  # sign, two exponent bits, a mantissa bit: 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6
            exponent = (nibbles >> 1) & 3
            mantissa = (nibbles & 1).to(tl.float32)
            magnitude = tl.where(exponent == 0, mantissa * 0.5,
                                 (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
            tile = tl.where(nibbles >= 8, -magnitude, magnitude)
        else:
            tile = nibbles - 8
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_base[None, :] + ks[:, None], mask=(ks < K)[:, None] & col_ok[None, :], other=0.0)
    return tile


@triton.jit
def _quant_linear_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] float8_e4m3fn or int8; INT4: [N, cdiv(K, 8)] int32
    scale_ptr,  # [cdiv(N, SCALE_ROWS), cdiv(K, SCALE_COLS)] float32
    zero_ptr,  # int8, the scales' shape and strides; read only when HAS_ZERO
    bias_ptr,  # [N], read only when HAS_BIAS
    out_ptr,  # [M, N]
    M,
    N,
    K,
    K_WORDS,  # int32 words a packed int4 row holds: cdiv(K, 8)
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    SCALE_ROWS: tl.constexpr,  # weight rows per scale row
    SCALE_COLS: tl.constexpr,  # weight columns per scale column: a multiple of BLOCK_K, or >= K
    INT4: tl.constexpr,  # w packs eight int4 values per int32
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, else the default "tf32"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + cols.to(tl.int64) * stride_wn  # [BLOCK_N]
    scale_rows = (cols // SCALE_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_base + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = weight_tile(w_base, k0, K, K_WORDS, col_ok, INT4, BLOCK_K, BLOCK_N)  # [BLOCK_K, BLOCK_N]
        if HAS_ZERO:
            zero = tl.load(zero_ptr + scale_rows + k0 // SCALE_COLS, mask=col_ok, other=0)  # [BLOCK_N]
            w = w.to(tl.int32) - zero.to(tl.int32)[None, :]
        scale = tl.load(scale_ptr + scale_rows + k0 // SCALE_COLS, mask=col_ok, other=0.0)  # [BLOCK_N]
        # the values are exact in bf16 (fp8's 4-bit significands, integers within 256)
        part = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tiles(m: int) -> tuple[int, int]:
    """BLOCK_M and BLOCK_N for `m` rows: narrow tiles for decode steps, so a layer's columns
    spread over many programs."""
    return (16, 64) if m <= 16 else (32, 64) if m <= 32 else (64, 128)


def block_k(scale_cols: int, k: int) -> int:
    """The widest K tile that never straddles two scale columns."""
    if scale_cols >= k:
        return 128 if k >= 128 else 64 if k >= 64 else 32 if k >= 32 else 16
    return next(b for b in (128, 64, 32, 16) if scale_cols % b == 0)


def check_zero(name: str, zero: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Zero points go with integer weights, as an int8 grid laid out as their scales."""
    if weight.dtype not in (torch.int8, torch.int32):
        raise ValueError(f"{name} (zero points) goes with int8 or int4 weights, got {weight.dtype} weights")
    check_dtype(name, zero, (torch.int8,))
    if zero.shape != scale.shape or zero.stride() != scale.stride():
        raise ValueError(f"{name} must have the scales' shape {list(scale.shape)} and strides {scale.stride()}, "
                         f"got {list(zero.shape)} and {zero.stride()}")


def _check_inputs(x, weight, scale, block, bias, zero) -> None:
    check_dtype("x", x, _DTYPES)
    check_shape("x", x, (None, None))
    check_last_dim_contiguous("x", x)
    k = x.shape[1]
    check_dtype("weight", weight, _WEIGHT_DTYPES)
    check_shape("weight", weight, (None, cdiv(k, 8) if weight.dtype == torch.int32 else k))
    check_last_dim_contiguous("weight", weight)
    n = weight.shape[0]
    rows, cols = block
    if rows < 1 or cols < 1:
        raise ValueError(f"block must be two positive sizes, got {tuple(block)}")
    if cols < k and cols % 16:
        raise ValueError(f"a scale block of {cols} columns is narrower than K={k} and not a multiple of 16")
    check_dtype("scale", scale, (torch.float32,))
    check_shape("scale", scale, (cdiv(n, rows), cdiv(k, cols)))
    if bias is not None:
        check_dtype("bias", bias, (x.dtype,))
        check_shape("bias", bias, (n,))
    if zero is not None:
        check_zero("zero", zero, weight, scale)


def quant_linear(
    x: torch.Tensor,  # [M, K] float16, bfloat16 or float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn or int8, or [N, cdiv(K, 8)] int32: packed int4
    scale: torch.Tensor,  # [cdiv(N, block[0]), cdiv(K, block[1])] float32
    block: tuple[int, int],  # weight rows, columns per scale
    bias: torch.Tensor | None = None,  # [N] in x's dtype
    zero: torch.Tensor | None = None,  # int8 zero points, laid out as the scales
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ ((weight - zero) * scale).T + bias, the scale and zero spread over their blocks."""
    _check_inputs(x, weight, scale, block, bias, zero)
    tensors = dict(x=x, weight=weight, scale=scale) | ({} if bias is None else dict(bias=bias))
    tensors |= {} if zero is None else dict(zero=zero)
    check_device(_quant_linear_kernel, **tensors)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n = tiles(m)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _quant_linear_kernel[grid](
        x, weight, scale, scale if zero is None else zero, weight if bias is None else bias, out, m, n, k, cdiv(k, 8),
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=block[0], SCALE_COLS=block[1], INT4=weight.dtype == torch.int32, HAS_ZERO=zero is not None,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype(x.dtype, is_interpreted(_quant_linear_kernel)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k(block[1], k),
    )  # fmt: skip
    return out


def quant_linear_ref(x, weight, scale, block, bias=None, zero=None) -> torch.Tensor:
    """The same product over the weight dequantized to x's dtype first, as a checkpoint
    loader that dequantizes serves it."""
    dense = dequantize_ref(weight, scale, block, x.dtype, x.shape[-1], zero)
    return F.linear(x.float(), dense.float(), None if bias is None else bias.float()).to(x.dtype)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of e2m1's codes 0..7 (8..15: negative)


def dequantize_ref(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   k: int | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Weights [..., N, K] (packed int4: [..., N, cdiv(K, 8)], K given; fp4: e2m1 codes two to
    a uint8, low nibble first), less their zero points if any, times their scales [...,
    cdiv(N, block[0]), cdiv(K, block[1])] spread over the blocks, in fp32, then rounded to
    `dtype`."""
    if weight.dtype == torch.uint8:
        codes = torch.stack((weight & 0xF, weight >> 4), dim=-1).flatten(-2)[..., :k].long()
        magnitude = torch.tensor(_E2M1, device=weight.device)[codes % 8]
        weight = torch.where(codes >= 8, -magnitude, magnitude)
    if weight.dtype == torch.int32:
        nibbles = (weight[..., None] >> torch.arange(0, 32, 4, device=weight.device)) & 0xF
        weight = (nibbles.flatten(-2)[..., :k] - 8).to(torch.int8)
    if scale.dtype == torch.uint8:  # MXFP4's e8m0 exponents
        scale = 2.0 ** (scale.float() - 127)
    n, k = weight.shape[-2:]

    def spread(grid: torch.Tensor) -> torch.Tensor:
        return grid.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]

    values = weight.float() if zero is None else weight.float() - spread(zero.float())
    return (values * spread(scale)).to(dtype)
