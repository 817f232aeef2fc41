"""RMSNorm, alone or fused with the residual add that precedes it in a decoder layer.

Rounding follows Hugging Face's Llama so the kernel matches the model it replaces: the
residual sum is rounded to the activation dtype (and that rounded value is what gets
normalised), the normalisation runs in float32 and is rounded to the activation dtype
before the weight multiply, whose product is rounded once more.
"""

import torch

from kernels._common import (
    cdiv,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    next_power_of_2,
    tl,
    triton,
)

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref", "rms_norm", "rms_norm_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Elements a program normalises at once: rows of a small hidden size share a program (the
# interpreter pays per program, and a GPU program with a 64-wide row would idle most lanes).
_TILE_ELEMENTS = 2048


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, HIDDEN]
    residual_ptr,  # [num_tokens, HIDDEN]; read only when HAS_RESIDUAL
    weight_ptr,  # [HIDDEN]
    out_ptr,  # [num_tokens, HIDDEN]
    residual_out_ptr,  # [num_tokens, HIDDEN]: x + residual; written only when HAS_RESIDUAL
    num_tokens,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # HIDDEN rounded up to a power of two
    ROWS: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < num_tokens) & (cols < HIDDEN)  # [ROWS, BLOCK]
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + rows * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 1)[:, None] / HIDDEN + eps)  # [ROWS, 1]
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)  # [1, BLOCK]
    tl.store(out_ptr + rows * stride_out + cols, (normed * weight).to(x.dtype), mask=mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, **others: torch.Tensor) -> None:
    check_dtype("x", x, _DTYPES)
    check_shape("x", x, (None, None))
    check_shape("weight", weight, (x.shape[1],))
    check_dtype("weight", weight, (x.dtype,))
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    for name, t in others.items():
        check_shape(name, t, tuple(x.shape))
        check_dtype(name, t, (x.dtype,))
        check_last_dim_contiguous(name, t)


def _launch(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    out: torch.Tensor,  # [num_tokens, hidden]
    residual_out: torch.Tensor | None,  # [num_tokens, hidden]
    eps: float,
) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = next_power_of_2(hidden)
    has_residual = residual is not None and residual_out is not None
    if residual is None or residual_out is None:
        residual, residual_out = x, out  # placeholders the kernel never touches
    rows = max(1, _TILE_ELEMENTS // block)
    _rms_norm_kernel[(cdiv(num_tokens, rows),)](
        x, residual, weight, out, residual_out, num_tokens,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        eps,
        HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_RESIDUAL=has_residual,
        num_warps=min(16, max(1, rows * block // 256)),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float = 1e-6,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]; may be x itself
) -> torch.Tensor:  # [num_tokens, hidden]
    """`x / rms(x) * weight`, computed in float32 and returned in x's dtype."""
    _check_inputs(x, weight, **({} if out is None else {"out": out}))
    out = torch.empty_like(x) if out is None else out
    check_device(_rms_norm_kernel, x=x, weight=weight, out=out)
    _launch(x, None, weight, out, None, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float = 1e-6,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (out, residual_out), each [num_tokens, hidden]
    """`residual_out = x + residual; out = rms_norm(residual_out) * weight`.

    With `inplace`, `out` is written over `x` and `residual_out` over `residual` (no
    allocation; the pair returned is (x, residual)).
    """
    _check_inputs(x, weight, residual=residual)
    check_device(_rms_norm_kernel, x=x, residual=residual, weight=weight)
    out = x if inplace else torch.empty_like(x)
    residual_out = residual if inplace else torch.empty_like(residual)
    _launch(x, residual, weight, out, residual_out, eps)
    return out, residual_out


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float = 1e-6,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Plain-torch RMSNorm with Hugging Face Llama's rounding."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # (out, residual_out)
    """Plain-torch residual add then RMSNorm; leaves its inputs unchanged."""
    residual_out = x + residual
    return rms_norm_ref(residual_out, weight, eps), residual_out
