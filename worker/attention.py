"""Attention over the paged KV cache, in torch (the CPU path).

Cache layout on this path is head-major within a block: [num_blocks, num_kv_heads, block_size,
head_dim], so the gathered context of one KV head is a run of contiguous block rows and comes
out as [.., num_kv_heads, ctx, head_dim], ready for matmul without another copy.

The runner orders each step's flat batch as decodes first (one new token each, sorted by
context length), then prefill chunks. Decodes are attended in buckets of similar context
length (padding stays small); each prefill chunk attends to its cached prefix plus its own
tokens causally. Grouped-query attention is handled without repeating K/V: the query heads
that share a KV head are laid out as extra query rows of that KV head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeBucket:
    row_start: int  # rows [row_start, row_end) of the flat batch
    row_end: int
    # [n * num_kv_heads * max_blocks]: rows of the cache viewed as [num_blocks * num_kv_heads,
    # block_size * head_dim], ordered (sequence, kv head, block); padded with block 0
    block_rows: torch.Tensor
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] additive: 0 where a row may attend


@dataclass
class PrefillChunk:
    row_start: int
    row_end: int
    context_rows: torch.Tensor | None  # [num_kv_heads * num_blocks], ordered (kv head, block); None: no prefix
    mask: torch.Tensor  # [q_len, ctx_len] additive causal mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset
    write_rows: torch.Tensor  # [num_tokens * num_kv_heads] rows of the cache viewed as [-1, head_dim]
    decodes: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    head_dim = k.shape[-1]
    k_cache.view(-1, head_dim).index_copy_(0, meta.write_rows, k.reshape(-1, head_dim))
    v_cache.view(-1, head_dim).index_copy_(0, meta.write_rows, v.reshape(-1, head_dim))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already written to the cache
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    for bucket in meta.decodes:
        rows = slice(bucket.row_start, bucket.row_end)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, bucket, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _gather(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Block rows of one KV head each: [len(rows), block_size * head_dim]."""
    num_blocks, num_kv_heads = cache.shape[:2]
    return cache.view(num_blocks * num_kv_heads, -1).index_select(0, rows)


def _decode_attention(
    q: torch.Tensor,  # [n, num_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, D]
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, D]
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    ctx = bucket.mask.shape[-1]
    qd = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [n, kv_heads, group, D]
    kd = _gather(k_cache, bucket.block_rows).view(n, num_kv_heads, ctx, head_dim)
    vd = _gather(v_cache, bucket.block_rows).view(n, num_kv_heads, ctx, head_dim)
    # Plain matmuls beat SDPA's CPU kernel at these shapes (a few query rows per KV head).
    scores = torch.matmul(qd, kd.transpose(-1, -2))  # [n, kv_heads, group, ctx]
    scores = scores.float().mul_(scale).add_(bucket.mask)
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, vd).reshape(n, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,  # [q_len, num_heads, D]
    k: torch.Tensor,  # [q_len, num_kv_heads, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, D]
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, D]
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    ctx = chunk.mask.shape[-1]
    if chunk.context_rows is None:
        kg, vg = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, q_len, D]
    else:
        kg = _gather(k_cache, chunk.context_rows).view(num_kv_heads, -1, head_dim)[:, :ctx]
        vg = _gather(v_cache, chunk.context_rows).view(num_kv_heads, -1, head_dim)[:, :ctx]
    # Query rows ordered (kv head, group member, position): [1, kv_heads, group * q_len, D]
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(1, num_kv_heads, group * q_len, head_dim)
    mask = chunk.mask.repeat(group, 1)  # [group * q_len, ctx]
    o = F.scaled_dot_product_attention(qg, kg.unsqueeze(0), vg.unsqueeze(0), attn_mask=mask, scale=scale)
    o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(q_len, num_heads, head_dim)
