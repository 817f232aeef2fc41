"""Rotary position embedding (neox style: rotate-half, as in Hugging Face Llama), in place.

The cos/sin cache is one float32 tensor `[max_position, head_dim]` holding
`cos(pos * inv_freq)` in its first half and `sin(pos * inv_freq)` in its second half
(`inv_freq` has head_dim / 2 entries), so each token's factors are one row.
`build_cos_sin_cache` makes it from any `inv_freq`, e.g. a Hugging Face rotary module's,
which already folds in rope scaling. For pair i < head_dim / 2 of a head `x`:

    out[i]            = x[i] * cos[i] - x[i + half] * sin[i]
    out[i + half]     = x[i + half] * cos[i] + x[i] * sin[i]

computed in float32 and rounded once to x's dtype (Hugging Face rounds each product).
Where a model rotates only part of each head (Phi-4-mini: 96 of 128 columns), q and k are
passed as views of those leading columns, and `head_dim` above is the rotated width; any even
width works (tiles are padded to a power of two and masked).
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

__all__ = ["apply_rotary_emb", "apply_rotary_emb_ref", "build_cos_sin_cache"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Elements of q a program rotates at once: the tokens of a model with few or narrow heads
# share a program (the interpreter pays per program; a GPU program would idle most lanes).
_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(
    x_ptrs,  # [TOKENS, 1, 1]: each token's [num_heads, 2 * HALF] row
    tok_ok,  # [TOKENS, 1, 1]
    stride_head,
    num_heads,
    cos,  # [TOKENS, 1, HALF_P] fp32
    sin,  # [TOKENS, 1, HALF_P] fp32
    HEADS_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P)[None, :, None]  # [1, HEADS_P, 1]
    cols = tl.arange(0, HALF_P)[None, None, :]  # [1, 1, HALF_P]
    mask = tok_ok & (heads < num_heads) & (cols < HALF)  # [TOKENS, HEADS_P, HALF_P]
    lo_ptrs = x_ptrs + heads * stride_head + cols
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0)
    x2 = tl.load(lo_ptrs + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(lo_ptrs, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(lo_ptrs + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int32 or int64
    q_ptr,  # [T, num_heads, 2 * HALF], rotated in place
    k_ptr,  # [T, num_kv_heads, 2 * HALF], rotated in place
    cos_sin_ptr,  # [max_position, 2 * HALF] fp32: cos | sin
    num_tokens,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    num_heads,
    num_kv_heads,
    HEADS_P: tl.constexpr,  # num_heads rounded up to a power of two
    KV_HEADS_P: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    HALF_P: tl.constexpr,  # HALF rounded up to a power of two
    TOKENS: tl.constexpr,  # tokens per program
):
    toks = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)[:, None, None]  # [TOKENS, 1, 1]
    tok_ok = toks < num_tokens
    pos = tl.load(positions_ptr + toks, mask=tok_ok, other=0).to(tl.int64)
    cols = tl.arange(0, HALF_P)[None, None, :]  # [1, 1, HALF_P]
    ok = tok_ok & (cols < HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + cols, mask=ok, other=0.0)  # [TOKENS, 1, HALF_P]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + cols, mask=ok, other=0.0)
    _rotate_heads(q_ptr + toks * stride_q_tok, tok_ok, stride_q_head, num_heads, cos, sin, HEADS_P, HALF, HALF_P)
    _rotate_heads(
        k_ptr + toks * stride_k_tok, tok_ok, stride_k_head, num_kv_heads, cos, sin, KV_HEADS_P, HALF, HALF_P
    )


def build_cos_sin_cache(
    inv_freq: torch.Tensor,  # [head_dim / 2]
    max_position: int,
    attention_scaling: float = 1.0,
) -> torch.Tensor:  # [max_position, head_dim] float32: cos | sin
    """The cos/sin table for positions 0..max_position-1, on inv_freq's device."""
    pos = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq.float())  # [max_position, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def _check_inputs(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    check_dtype("q", q, _DTYPES)
    check_shape("q", q, (None, None, None))
    num_tokens, _, head_dim = q.shape
    check_shape("k", k, (num_tokens, None, head_dim))
    check_dtype("k", k, (q.dtype,))
    check_shape("positions", positions, (num_tokens,))
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim))
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    for name, t in (("q", q), ("k", k), ("positions", positions)):
        check_last_dim_contiguous(name, t)
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")


def apply_rotary_emb(
    positions: torch.Tensor,  # [T] int32 or int64, each < max_position
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos | sin
) -> None:
    """Rotate q and k in place by their tokens' positions (views with strided tokens/heads ok)."""
    _check_inputs(positions, q, k, cos_sin_cache)
    check_device(_rotary_kernel, positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    heads_p, half_p = next_power_of_2(num_heads), next_power_of_2(head_dim // 2)
    tokens = max(1, _TILE_ELEMENTS // (heads_p * half_p))
    _rotary_kernel[(cdiv(num_tokens, tokens),)](
        positions, q, k, cos_sin_cache, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_heads, num_kv_heads,
        HEADS_P=heads_p, KV_HEADS_P=next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, HALF_P=half_p, TOKENS=tokens,
        num_warps=4 if tokens * num_heads * head_dim >= 2048 else 1,
    )  # fmt: skip


def apply_rotary_emb_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos | sin
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (q, k); the inputs are left unchanged
    """Plain-torch rotate-half rotary embedding, in float32, rounded once."""
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, head_dim / 2] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # [T, 1, head_dim]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)
