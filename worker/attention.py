"""Attention over the paged KV cache, in torch (the CPU path).

The runner orders each step's flat batch as decodes first (one new token each), then prefill
chunks. Decodes are batched into one SDPA call over their gathered, padded contexts; each
prefill chunk attends to its cached prefix plus its own tokens causally.

Grouped-query attention is handled without repeating K/V: the query heads that share a KV
head are laid out as extra query rows of that KV head ([.., num_kv_heads, group * q_len, D]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    token_end: int
    context_slots: torch.Tensor | None  # [ctx_len] slots of the cached prefix + chunk; None: no prefix
    mask: torch.Tensor  # [q_len, ctx_len] bool, True where a query may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int  # decode rows come first in the flat batch
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx] int64, padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool
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
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # [nd, num_kv_heads, group, D] against [nd, num_kv_heads, max_ctx, D]
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        kd = flat_k[meta.decode_slots].transpose(1, 2)
        vd = flat_v[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, -1, head_dim)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], flat_k, flat_v, chunk, group, scale)
    return out


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
        k, v = flat_k[chunk.context_slots], flat_v[chunk.context_slots]
    # Query rows ordered (kv head, group member, position): [1, num_kv_heads, group * q_len, D]
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
    kg = k.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, ctx_len, D]
    vg = v.transpose(0, 1).unsqueeze(0)
    mask = chunk.mask.repeat(group, 1)  # [group * q_len, ctx_len]
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
