"""A mixture-of-experts MLP: every token through its top-k experts, all experts in one launch.

Each (token, choice) pair is a row of work. `moe_align` sorts the rows by expert and pads
each expert's run to a multiple of BLOCK_M, so each program's tile of BLOCK_M rows belongs to
one expert and multiplies by that expert's weights alone (a grouped GEMM, the layout of
vLLM's fused_moe). Two launches of one kernel make the MLP: x @ w13[e].T gives each row's
gate and up halves (or its up rows alone, for experts without a gate), the activation
(SiLU(gate) * up) runs in torch between them, and @ w2[e].T, scaled by the row's routing
weight, gives the row's output; a token's k rows are summed at the end.

Every size is fixed by the number of tokens (the padded row count has an upper bound:
rows + num_experts * (BLOCK_M - 1)), and the alignment is torch ops without host syncs, so
a decode step's MoE layers can be captured in a CUDA graph.

Rounding follows transformers: each projection is accumulated in fp32 and rounded to the
activation dtype; the routing weight multiplies that in the weights' dtype (fp32 for
Mixtral, the activation dtype for Qwen, whose product is rounded); a token's k products are
summed in fp32 and rounded once.
"""

from __future__ import annotations

from collections.abc import Callable

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
from kernels.quant_linear import block_k as quant_block_k
from kernels.quant_linear import check_zero, dequantize_ref, weight_tile

__all__ = ["fused_moe", "fused_moe_ref", "moe_align", "silu_and_mul"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_M = 16  # rows per tile: the tl.dot minimum, as a decode step routes few rows per expert
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _moe_matmul_kernel(
    a_ptr,  # [num_tokens, K] when A_PER_TOKEN, else [num_pairs, K]
    w_ptr,  # [num_experts, N, K]; INT4: [num_experts, N, cdiv(K, 8)] int32 (FP4: e2m1 codes)
    scale_ptr,  # [num_experts, cdiv(N, SCALE_ROWS), cdiv(K, SCALE_COLS)] float32 (E8M0: uint8 exponents); when SCALED
    zero_ptr,  # int8 zero points, the scales' shape and strides; read only when HAS_ZERO
    out_ptr,  # [num_pairs, N]
    topk_weights_ptr,  # [num_pairs]; read only when MUL_WEIGHT
    sorted_ids_ptr,  # [max_rows] int64: pair index per row, num_pairs for padding
    block_experts_ptr,  # [max_rows / BLOCK_M] int64: the expert of each tile, NUM_EXPERTS past the end
    num_pairs,
    N,
    K,
    K_WORDS,  # int32 words a packed int4 row holds: cdiv(K, 8)
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,  # a's rows are tokens (pair // TOP_K), else pairs
    MUL_WEIGHT: tl.constexpr,
    SCALED: tl.constexpr,  # w is quantized (fp8, int8, int4): each tile's partial product is scaled
    INT4: tl.constexpr,  # w packs eight int4 values per int32 (see kernels.quant_linear)
    FP4: tl.constexpr,  # with INT4: the nibbles are e2m1 codes (MXFP4), not offset integers
    E8M0: tl.constexpr,  # the scales are exponents (bias 127) of powers of two, a uint8 each
    HAS_ZERO: tl.constexpr,  # integer values less a zero point per scale block (GPTQ, AWQ)
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,  # a multiple of BLOCK_K, or >= K
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, else the default "tf32"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile)
    if expert < NUM_EXPERTS:  # tiles past the last expert's run hold only padding
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ids_ptr + rows)  # [BLOCK_M]
        valid = pairs < num_pairs
        if A_PER_TOKEN:
            a_rows = pairs // TOP_K
        else:
            a_rows = pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ks = tl.arange(0, BLOCK_K)
        a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
        w_base = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn  # [BLOCK_N]
        scale_rows = expert.to(tl.int64) * stride_se + (cols // SCALE_ROWS).to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_valid = (k0 + ks) < K
            a = tl.load(a_base + (k0 + ks)[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0)
            w = weight_tile(w_base, k0, K, K_WORDS, cols < N, INT4, BLOCK_K, BLOCK_N, FP4)  # [BLOCK_K, BLOCK_N]
            if HAS_ZERO:
                zero = tl.load(zero_ptr + scale_rows + k0 // SCALE_COLS, mask=cols < N, other=0)
                w = w.to(tl.int32) - zero.to(tl.int32)[None, :]
            part = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            if SCALED:
                scale = tl.load(scale_ptr + scale_rows + k0 // SCALE_COLS, mask=cols < N, other=0)
                if E8M0:
                    scale = tl.exp2(scale.to(tl.float32) - 127.0)
                part *= scale[None, :]
            acc += part
        out = acc.to(a_ptr.dtype.element_ty)  # the projection, rounded to the activation dtype
        if MUL_WEIGHT:  # in fp32, then rounded to out's dtype: fp32 for fp32 routing weights
            weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            out = out.to(tl.float32) * weight[:, None]
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols < N)[None, :])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's unit: SiLU of the gate half (the first) times the up half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert, each expert's run padded to a multiple of `block_m`.

    Returns sorted_ids [max_rows] (the flat (token, choice) pair of each row; num_pairs marks
    padding) and block_experts [max_rows / block_m] (each tile's expert; num_experts for
    tiles past the last run), max_rows = num_pairs + num_experts * (block_m - 1) rounded up
    to block_m. Torch ops of fixed sizes, no host sync."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    max_rows = cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)  # where each expert's padded run ends
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within one
    experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[run_ends[experts] - padded[experts] + rank] = order
    tile_starts = torch.arange(0, max_rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(run_ends, tile_starts, right=True)
    return sorted_ids, block_experts


_QUANTIZED = (torch.float8_e4m3fn, torch.int8, torch.int32, torch.uint8)  # int32: packed int4; uint8: fp4 codes


def _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, w13_zero, w2_zero, gated) -> None:
    check_dtype("x", x, _DTYPES)
    check_shape("x", x, (None, None))
    num_tokens, hidden = x.shape
    check_dtype("w13", w13, (x.dtype, *_QUANTIZED))
    per_column = {torch.int32: 8, torch.uint8: 2}.get(w13.dtype, 1)  # values a stored column holds
    if per_column == 2 and hidden % 8:
        raise ValueError(f"fp4 experts need a hidden size that is a multiple of 8, got {hidden}")
    check_shape("w13", w13, (None, None, cdiv(hidden, per_column)))
    num_experts, rows, _ = w13.shape
    if gated and rows % 2:
        raise ValueError(f"w13 must stack gate and up halves of equal size, got {rows} rows")
    inter = rows // 2 if gated else rows
    if per_column == 2 and inter % 8:
        raise ValueError(f"fp4 experts need an intermediate size that is a multiple of 8, got {inter}")
    check_shape("w2", w2, (num_experts, hidden, cdiv(inter, per_column)))
    quantized = w13.dtype in _QUANTIZED
    for name, w, scale, k, zero in (("w13", w13, w13_scale, hidden, w13_zero), ("w2", w2, w2_scale, inter, w2_zero)):
        check_dtype(name, w, (w13.dtype,))
        check_last_dim_contiguous(name, w)
        if quantized:
            if scale is None or block is None:
                raise ValueError(f"{name} is quantized ({w.dtype}): its scales and their block are needed")
            if block[1] < k and block[1] % 16:
                raise ValueError(f"a scale block of {block[1]} columns is narrower than {name}'s "
                                 f"{k} and not a multiple of 16")
            check_dtype(f"{name}_scale", scale, (torch.uint8,) if w.dtype == torch.uint8 else (torch.float32,))
            check_shape(f"{name}_scale", scale, (num_experts, cdiv(w.shape[1], block[0]), cdiv(k, block[1])))
            check_last_dim_contiguous(f"{name}_scale", scale)
            if zero is not None:
                check_zero(f"{name}_zero", zero, w, scale)
        elif scale is not None:
            raise ValueError(f"{name}_scale goes with quantized weights; {name} is {w.dtype}")
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    check_dtype("topk_ids", topk_ids, (torch.int64,))
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    check_dtype("topk_weights", topk_weights, (torch.float32, x.dtype))
    check_last_dim_contiguous("x", x)


def _launch(a, w, scale, zero, block, out, topk_weights, sorted_ids, block_experts, top_k, a_per_token,
            mul_weight) -> None:
    fp4 = w.dtype == torch.uint8
    if fp4:  # e2m1 codes read as int4 words: little-endian bytes keep the nibbles' order
        w = w.view(torch.int32)
    num_experts, n = w.shape[:2]
    k = a.shape[1]
    grid = (block_experts.shape[0], cdiv(n, _BLOCK_N))
    scaled = scale is not None
    _moe_matmul_kernel[grid](
        a, w, scale if scaled else w, zero if zero is not None else w, out, topk_weights, sorted_ids, block_experts, out.shape[0], n, k, cdiv(k, 8),
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0) if scaled else 0, scale.stride(1) if scaled else 0,
        out.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, A_PER_TOKEN=a_per_token, MUL_WEIGHT=mul_weight,
        SCALED=scaled, INT4=w.dtype == torch.int32, FP4=fp4, E8M0=fp4, HAS_ZERO=zero is not None,
        SCALE_ROWS=block[0] if scaled else 1, SCALE_COLS=block[1] if scaled else 1,
        DOT_DTYPE=dot_dtype(a.dtype, is_interpreted(_moe_matmul_kernel)),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=quant_block_k(block[1], k) if scaled else _BLOCK_K,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows (gated)
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [T, top_k]: float32 or x's dtype
    topk_ids: torch.Tensor,  # [T, top_k] int64 in [0, num_experts]; num_experts: no expert here
    w13_scale: torch.Tensor | None = None,  # quantized weights: [num_experts, cdiv(rows, block[0]), cdiv(cols, block[1])]
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,  # quantized weights: weight rows, columns per scale
    *,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,  # w13's products [pairs, rows] -> h
    gated: bool = True,  # w13 holds gate rows, then up rows; False: up rows alone
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate], x's dtype
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    w13_zero: torch.Tensor | None = None,  # int weights' int8 zero points, laid out as their scales
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, hidden]
    """Sum over each token's top-k experts of weight * down(SiLU(gate(x)) * up(x)). Weights
    in x's dtype, or quantized with float32 scales per block, widened tile by tile: fp8 or
    int8 values, int4 packed eight to an int32 (as `kernels.quant_linear` reads them), or
    e2m1 codes two to a uint8, low nibble first (MXFP4, whose scales are uint8 exponents of
    powers of two); integers may come with zero points (GPTQ, AWQ: (q - zero) * scale).
    `activation` replaces SiLU(gate) * up (it runs in torch between the two launches, on each
    row's first products, gate and up halves side by side); it is needed when `gated` is
    False (w13 [num_experts, intermediate, hidden]: experts without a gate, Nemotron 3's
    ReLU^2). Biases are added to each projection's rounded output (gpt-oss), before the
    routing weight. A pair whose id is num_experts is served by none of these experts (under
    expert parallelism, another rank's): it adds nothing."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, w13_zero, w2_zero, gated)
    if not gated and activation is None:
        raise ValueError("experts without a gate (gated=False) need their activation")
    for name, bias, rows in (("w13_bias", w13_bias, w13.shape[1]), ("w2_bias", w2_bias, w2.shape[1])):
        if bias is not None:
            check_dtype(name, bias, (x.dtype,))
            check_shape(name, bias, (w13.shape[0], rows))
    check_device(_moe_matmul_kernel, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    num_experts = w13.shape[0]
    # (pairs of id num_experts get tiles of their own, which the kernel skips as padding)
    sorted_ids, block_experts = moe_align(topk_ids, num_experts + 1, _BLOCK_M)
    weights = topk_weights.flatten().contiguous()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, w13, w13_scale, w13_zero, block, gate_up, weights, sorted_ids, block_experts, top_k,
            a_per_token=True, mul_weight=False)
    experts = topk_ids.flatten()  # [num_pairs]
    if w13_bias is not None:
        gate_up += w13_bias[experts.clamp(max=num_experts - 1)]
    h = silu_and_mul(gate_up) if activation is None else activation(gate_up)  # [num_pairs, intermediate]
    # weighted rows in the weights' dtype; their sum accumulates in fp32 and is rounded once
    # (the rows of pairs no expert here serves are never written: zero)
    if w2_bias is None:  # the kernel weighs each row as it writes it
        out = torch.zeros(num_pairs, hidden, dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
        _launch(h, w2, w2_scale, w2_zero, block, out, weights, sorted_ids, block_experts, top_k, a_per_token=False,
                mul_weight=True)
    else:  # the bias goes in before the weight
        down = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
        _launch(h, w2, w2_scale, w2_zero, block, down, weights, sorted_ids, block_experts, top_k, a_per_token=False,
                mul_weight=False)
        served = experts < num_experts
        out = (down + w2_bias[experts.clamp(max=num_experts - 1)]) * weights.masked_fill(~served, 0)[:, None]
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block=None, *,
                  activation=None, gated=True, w13_bias=None, w2_bias=None, w13_zero=None, w2_zero=None
                  ) -> torch.Tensor:
    """The same sum, each row's experts' weights gathered and multiplied densely (an
    independent oracle: no sorting, no tiles), with the kernel's rounding points; quantized
    weights are dequantized to x's dtype first. Pairs of id num_experts weigh nothing."""
    if w13_scale is not None:
        hidden, inter = x.shape[1], w2.shape[2] * {torch.int32: 8, torch.uint8: 2}.get(w2.dtype, 1)
        w13 = dequantize_ref(w13, w13_scale, block, x.dtype, hidden, w13_zero)
        w2 = dequantize_ref(w2, w2_scale, block, x.dtype, inter, w2_zero)
    served = topk_ids < w13.shape[0]
    topk_ids, topk_weights = topk_ids.clamp(max=w13.shape[0] - 1), topk_weights.masked_fill(~served, 0)
    gate_up = torch.einsum("th,tknh->tkn", x.float(), w13[topk_ids].float()).to(x.dtype)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[topk_ids]
    h = silu_and_mul(gate_up) if activation is None else activation(gate_up)  # [T, top_k, intermediate]
    out = torch.einsum("tki,tkhi->tkh", h.float(), w2[topk_ids].float()).to(x.dtype)
    if w2_bias is not None:
        out = out + w2_bias[topk_ids]
    return (out * topk_weights[..., None]).sum(dim=1).to(x.dtype)

