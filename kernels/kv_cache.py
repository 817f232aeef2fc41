"""Write the batch's new keys and values into the paged KV cache.

A token's slot is `block_id * block_size + offset_in_block`; slot -1 marks a padding token
(e.g. the tail of a CUDA-graph batch) whose K/V must not be written.
"""

import torch

from kernels._common import (
    check_contiguous,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    is_interpreted,
    next_power_of_2,
    tl,
    triton,
)

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    value_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64, -1 for padding
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    FP8: tl.constexpr,  # the cache holds fp8 (e4m3): values are clamped to +-448, then rounded
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)[:, None]  # [HEADS_P, 1]
    dims = tl.arange(0, HEAD_P)[None, :]  # [1, HEAD_P]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims  # [HEADS_P, HEAD_P]
    k = tl.load(key_ptr + tok * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    if FP8:
        k = tl.minimum(tl.maximum(k.to(tl.float32), -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -448.0), 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_dtype("key", key, _DTYPES)
    check_shape("key", key, (None, None, None))
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, tuple(key.shape))
    check_shape("k_cache", k_cache, (None, None, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_dtype("value", value, (key.dtype,))
    check_dtype("k_cache", k_cache, (key.dtype, torch.float8_e4m3fn))
    check_dtype("v_cache", v_cache, (k_cache.dtype,))
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        check_last_dim_contiguous(name, t)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [T] int64; -1: padding token, not written
) -> None:
    """Store each token's key and value at its slot; slots must be < num_blocks * block_size.

    `key` and `value` may be views with any token and head strides (e.g. slices of a fused
    QKV projection) as long as head_dim is contiguous.
    """
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    check_device(
        _reshape_and_cache_kernel,
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and is_interpreted(_reshape_and_cache_kernel):
        # The interpreter's fp32 -> fp8 conversion drops the carry when rounding up across a
        # power of two (1.95 becomes 1.0), so there torch rounds first and the kernel copies.
        key, value = (x.float().clamp(-448.0, 448.0).to(k_cache.dtype) for x in (key, value))
        fp8 = False
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEADS_P=next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_P=next_power_of_2(head_dim), FP8=fp8,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )  # fmt: skip


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1: not written
) -> None:
    """Plain-torch `reshape_and_cache`; an fp8 cache takes the values clamped to +-448."""
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep]  # [num_written]
    for x, cache in ((key, k_cache), (value, v_cache)):
        x = x[keep].float().clamp(-448.0, 448.0) if cache.dtype == torch.float8_e4m3fn else x[keep]
        cache.view(-1, *x.shape[1:])[slots] = x.to(cache.dtype)
