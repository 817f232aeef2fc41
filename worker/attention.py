"""Attention over the paged KV cache, in torch (the CPU path).

The runner orders each step's flat batch as decodes first (one new token each, sorted by
context length), then prefill chunks. Decodes are attended in buckets of similar context
length, each one SDPA call over its gathered, padded contexts, so padding stays small; each
prefill chunk attends to its cached prefix plus its own tokens causally.

Grouped-query attention is handled without repeating K/V: the query heads that share a KV
head are laid out as extra query rows of that KV head ([.., num_kv_heads, group * q_len, D]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeBucket:
    row_start: int  # rows [row_start, row_end) of the flat batch
    row_end: int
    slots: torch.Tensor  # [n * max_ctx] int64: each row's context slots, padded with slot 0
    mask: torch.Tensor  # [n, 1, 1, max_ctx] additive: 0 where a row may attend, -inf on padding


@dataclass
class PrefillChunk:
    row_start: int
    row_end: int
    context_slots: torch.Tensor | None  # [ctx_len] slots of cached prefix + chunk; None: no prefix
    mask: torch.Tensor  # [q_len, ctx_len] additive causal mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decodes: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already written to the cache
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, D]
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for bucket in meta.decodes:
        rows = slice(bucket.row_start, bucket.row_end)
        out[rows] = _decode_attention(q[rows], flat_k, flat_v, bucket, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], flat_k, flat_v, chunk, group, scale)
    return out


def _decode_attention(
    q: torch.Tensor,  # [n, num_heads, D]
    flat_k: torch.Tensor,  # [num_slots, num_kv_heads, D]
    flat_v: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, D]
    n, num_heads, head_dim = q.shape
    num_kv_heads = flat_k.shape[1]
    max_ctx = bucket.mask.shape[-1]
    qd = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [n, kv_heads, group, D]
    # index_select on the flat pool is several times faster than advanced indexing here.
    kd = flat_k.index_select(0, bucket.slots).view(n, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    vd = flat_v.index_select(0, bucket.slots).view(n, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=bucket.mask, scale=scale)
    return od.reshape(n, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,  # [q_len, num_heads, D]
    k: torch.Tensor,  # [q_len, num_kv_heads, D]
    v: torch.Tensor,
    flat_k: torch.Tensor,  # [num_slots, num_kv_heads, D]
    flat_v: torch.Tensor,
    chunk: PrefillChunk,
    group: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, D]
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if chunk.context_slots is not None:
        k = flat_k.index_select(0, chunk.context_slots)
        v = flat_v.index_select(0, chunk.context_slots)
    # Query rows ordered (kv head, group member, position): [1, num_kv_heads, group * q_len, D]
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(1, num_kv_heads, group * q_len, head_dim)
    kg = k.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, ctx_len, D]
    vg = v.transpose(0, 1).unsqueeze(0)
    mask = chunk.mask.repeat(group, 1)  # [group * q_len, ctx_len]
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(q_len, num_heads, head_dim)
