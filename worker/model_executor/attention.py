"""Attention over the paged KV cache, in torch (the CPU path).

Cache layout on this path is head-major within a block: [num_blocks, num_kv_heads, block_size,
head_dim], so the gathered context of one KV head is a run of contiguous block rows and comes
out as [.., num_kv_heads, ctx, head_dim], ready for matmul without another copy.

The runner orders each step's flat batch as decodes first (one new token each, sorted by
context length), then prefill chunks. Decodes are attended in buckets of similar context
length (padding stays small); each prefill chunk attends to its cached prefix plus its own
tokens causally (an image's tokens that attend both ways, Gemma 3's, to the image's end); a
layer with a sliding window sees only the last `window` positions before a query, and a layer
of chunked attention (Llama 4's) only those of the query's own chunk, each by its own mask
(one per span, worker.model_executor.models.config.Span); where every layer a step's metadata serves sees
less than everything (a hybrid model's windowed group, or a model windowed throughout) only
the blocks the widest span reads are gathered. Grouped-query attention is handled without repeating K/V: the query heads
that share a KV head are laid out as extra query rows of that KV head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from worker.core.scheduler import ScheduledRequest
from worker.model_executor.models.config import Chunked, Span

# Decodes attended together: small enough that length-sorted buckets pad little, large enough
# that per-call overhead stays small.
DECODE_BUCKET_SIZE = 32
# Chunks of at most this many tokens after a cached prefix (the prompt tails of n > 1
# completions, say) are attended in buckets as decodes with guesses are: one call for many.
BUCKET_MAX_QUERY = 16
# Prefill chunks attending to at most this many positions use two matmuls, which on CPU run about
# twice as fast as SDPA's flash kernel there; past it, SDPA's tiling wins.
MATMUL_PREFILL_MAX_CONTEXT = 256


class AttentionBackend(Protocol):
    """How one device keeps and reads the paged KV cache: its cache layout, the per-step
    metadata built from the scheduler's batch, and the forward pass over it."""

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]: ...

    def build(self, batch: list[ScheduledRequest], tables: torch.Tensor, slot_mapping: torch.Tensor,
              spans: frozenset[Span], like: Any = None) -> Any: ...


FP8 = torch.float8_e4m3fn  # kv_cache_dtype="fp8": the cache's values
FP8_MAX = 448.0


def in_bucket(s: ScheduledRequest) -> bool:
    """Attended in a decode bucket: one new token, guesses to check, or a short chunk after a
    cached prefix (not one whose tokens see past themselves: the buckets' masks are causal)."""
    n = len(s.token_ids)
    return n == 1 or bool(s.num_drafts) or (s.start_pos > 0 and n <= BUCKET_MAX_QUERY and not s.both_ways)


def attend_until(s: ScheduledRequest, device: torch.device) -> torch.Tensor | None:
    """The last position each of the step's tokens sees, where some see past themselves:
    those in a both-ways span see to its end ([len(s.token_ids)]); None where all are causal."""
    if not s.both_ways:
        return None
    until = torch.arange(s.start_pos, s.start_pos + len(s.token_ids), device=device)
    for lo, hi in s.both_ways:
        until[max(lo - s.start_pos, 0) : hi - s.start_pos] = hi - 1
    return until


def pad_tables(
    tables: list[list[int]], device: torch.device, width: int | None = None, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    width = width or max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=dtype, device=device)  # [B, width]


@dataclass
class DecodeBucket:
    """Sequences with `q_len` new tokens each, attended together: decodes (1), or decodes
    with guessed tokens to check (speculative decoding)."""

    row_start: int  # rows [row_start, row_end) of the flat batch
    row_end: int
    # [n * num_kv_heads * max_blocks]: rows of the cache viewed as [num_blocks * num_kv_heads,
    # block_size * head_dim], ordered (sequence, kv head, block); padded with block 0
    block_rows: torch.Tensor
    # [n, 1, group * q_len, max_blocks * block_size] additive: 0 where a row may attend (one
    # row for q_len 1: every query head of a sequence sees the same positions); per span
    # (None: causal only)
    masks: dict[Span, torch.Tensor]
    # where the gathered K and V land, reused by every layer of the step: [len(block_rows), bs * D]
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    q_len: int = 1


@dataclass
class SingleDecodes:
    """What a step's one-token decodes share, each bucket a view of it (a bucket's own would
    cost it half a dozen small tensor ops, ~5-20 us each on the CPU): the masks of them all
    over the widest context any reads ([n, 1, 1, max_blocks * block_size] per span: a
    position's entry is the same in every bucket's width), and the gather buffers of the
    largest bucket (the buckets attend one after another)."""

    masks: dict[Span, torch.Tensor]
    buffers: torch.Tensor  # [2, rows, block_size * head_dim]


@dataclass
class PrefillChunk:
    row_start: int
    row_end: int
    context_rows: torch.Tensor | None  # [num_kv_heads * num_blocks], ordered (kv head, block); None: no prefix
    # [group * q_len, ctx_len] additive causal mask, one copy per query head of a group; per span
    masks: dict[Span, torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset
    write_rows: torch.Tensor  # [num_tokens * num_kv_heads] rows of the cache viewed as [-1, head_dim]
    decodes: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)

    def for_layer(self, index: int) -> AttentionMetadata:
        return self  # one group: every layer's

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        span: Span = None,  # what the layer's queries see: a sliding window, their chunk, or all
        softcap: float | None = None,  # scores become softcap * tanh(score / softcap)
        sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head in each softmax (gpt-oss)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend over it."""
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, self)
        return paged_attention(q, k, v, k_cache, v_cache, self, scale, span, softcap, sinks)


@dataclass
class GroupedMetadata:
    """A step's metadata where the layers keep their KV in groups (full and windowed layers,
    each group with its own block tables): each layer's group's."""

    layers: list[Any]  # per layer

    @staticmethod
    def of(metas: list[Any], layer_group: list[int]) -> Any:
        """A step's metadata: one group's as it is, several groups' each to its layers."""
        return metas[0] if len(metas) == 1 else GroupedMetadata([metas[g] for g in layer_group])

    def for_layer(self, index: int) -> Any:
        return self.layers[index]


class TorchAttention:
    """The CPU backend: head-major blocks, decode buckets, torch ops."""

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.group = num_heads // num_kv_heads  # query heads per KV head
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # (made once: a step builds its metadata from many small tensors)
        self._heads = torch.arange(num_kv_heads, device=device)
        self._zero = torch.tensor(0.0, dtype=dtype, device=device)
        self._minus_inf = torch.tensor(float("-inf"), dtype=dtype, device=device)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def build(self, batch: list[ScheduledRequest], tables: torch.Tensor, slot_mapping: torch.Tensor,
              spans: frozenset[Span] = frozenset({None}),
              like: AttentionMetadata | None = None) -> AttentionMetadata:
        """Metadata for a batch ordered decodes first (shortest context first), then decodes
        with guesses and short chunks after a prefix (grouped by length), then prefills; `tables`:
        the requests' block tables of the KV group built for, as wide as the longest context
        needs, 0 past a table's end ([B, width], on the device); `spans`: what its layers see, a
        mask for each. `like`: another group's metadata of this step with the same spans, whose
        masks and gather buffers this one shares (its layers run one at a time)."""
        meta = AttentionMetadata(slot_mapping, self._write_rows(slot_mapping))
        row, i, lens = 0, 0, [len(s.token_ids) for s in batch]
        num_single = next((j for j, n in enumerate(lens) if n != 1), len(lens))  # (they come first)
        single = self._single_decodes(batch[:num_single], spans) if num_single and like is None else None
        while i < len(batch) and in_bucket(batch[i]):
            q_len, end = lens[i], i + 1
            limit = min(len(batch), i + DECODE_BUCKET_SIZE)
            while end < limit and lens[end] == q_len and (q_len == 1 or in_bucket(batch[end])):
                end += 1
            same = like.decodes[len(meta.decodes)] if like is not None else None
            meta.decodes.append(self._decode_bucket(batch[i:end], tables[i:end], row, q_len, spans, same,
                                                    (single, i) if q_len == 1 and single is not None else None))
            row, i = row + q_len * (end - i), end
        for s, table in zip(batch[i:], tables[i:], strict=True):
            meta.prefills.append(self._prefill_chunk(s, table, row, spans,
                                                     like.prefills[len(meta.prefills)] if like is not None else None))
            row += len(s.token_ids)
        return meta

    def _write_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rows of the head-major cache viewed as [-1, head_dim] for each (token, kv head)."""
        bs, heads = self.block_size, self.num_kv_heads
        block, offset = slot_mapping // bs, slot_mapping % bs  # [T]
        return ((block[:, None] * heads + self._heads[None, :]) * bs + offset[:, None]).view(-1)  # [T * heads]

    def _block_rows(self, table: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, num_blocks] rows of the cache viewed as [num_blocks * kv_heads, -1],
        for the blocks of `table` ([B, num_blocks])."""
        return table[:, None, :] * self.num_kv_heads + self._heads[None, :, None]

    def _single_decodes(self, decodes: list[ScheduledRequest], spans: frozenset[Span]) -> SingleDecodes:
        """The masks and buffers a step's one-token decodes share (SingleDecodes)."""
        bs, n = self.block_size, len(decodes)
        starts = [s.start_pos for s in decodes]
        firsts = [self._first_block(p, spans) for p in starts] if spans != {None} else [0] * n
        max_blocks = _num_blocks(starts, firsts, 1, bs)
        span = torch.arange(max_blocks * bs, device=self.device)[None, :]
        if any(firsts):
            span = torch.tensor(firsts, device=self.device)[:, None] * bs + span
        last = torch.from_numpy(np.array(starts, dtype=np.int64)).to(self.device)[:, None, None]
        masks = {seen: self._additive(self._allowed(span[:, None, :], last, seen)).view(n, 1, 1, -1) for seen in spans}
        num_rows = min(n, DECODE_BUCKET_SIZE) * self.num_kv_heads * max_blocks
        return SingleDecodes(masks, torch.empty(2, num_rows, bs * self.head_dim, dtype=self.dtype, device=self.device))

    def _decode_bucket(self, bucket: list[ScheduledRequest], tables: torch.Tensor, row: int, q_len: int,
                       spans: frozenset[Span], like: DecodeBucket | None = None,
                       single: tuple[SingleDecodes, int] | None = None) -> DecodeBucket:
        """`single`: where its decodes are of one token, what they share, and its first one's place
        among them."""
        bs, n = self.block_size, len(bucket)
        starts = [s.start_pos for s in bucket]
        firsts = [self._first_block(p, spans) for p in starts] if spans != {None} else [0] * n
        num_blocks = _num_blocks(starts, firsts, q_len, bs)
        rows = self._block_rows(_table_slices(tables, firsts, num_blocks))
        if like is None and single is not None:  # views of what the step's decodes share
            shared, first = single
            masks = {seen: mask[first : first + n, :, :, : num_blocks * bs] for seen, mask in shared.masks.items()}
            k_buffer, v_buffer = shared.buffers[:, : rows.numel()].unbind(0)
            return DecodeBucket(row, row + n, rows.view(-1), masks, k_buffer, v_buffer)
        # the positions each sequence's gathered blocks hold: [n, span] (a row for all where
        # every sequence's start at position 0)
        span = torch.arange(num_blocks * bs, device=self.device)[None, :]
        if any(firsts):
            span = torch.tensor(firsts, device=self.device)[:, None] * bs + span
        # query j of sequence i sits at start_i + j and sees positions up to it: [n, q_len, span]
        last = torch.tensor(starts, device=self.device)[:, None]
        if q_len > 1:
            last = last + torch.arange(q_len, device=self.device)[None, :]

        def mask(seen: Span) -> torch.Tensor:
            allowed = self._allowed(span[:, None, :], last[:, :, None], seen)
            if q_len > 1:  # rows ordered (group member, query) within a KV head
                allowed = allowed.unsqueeze(1).expand(n, self.group, q_len, -1).reshape(n, self.group * q_len, -1)
            return self._additive(allowed).view(n, 1, allowed.shape[1], -1)

        if like is not None:
            return DecodeBucket(row, row + q_len * n, rows.view(-1), like.masks, like.k_buffer, like.v_buffer, q_len)
        buffers = torch.empty(2, rows.numel(), bs * self.head_dim, dtype=self.dtype, device=self.device)
        return DecodeBucket(row, row + q_len * n, rows.view(-1), {seen: mask(seen) for seen in spans},
                            buffers[0], buffers[1], q_len)

    def _prefill_chunk(self, s: ScheduledRequest, table: torch.Tensor, row: int,
                       spans: frozenset[Span], like: PrefillChunk | None = None) -> PrefillChunk:
        q_len = len(s.token_ids)
        ctx_len = s.start_pos + q_len
        first = self._first_block(s.start_pos, spans)
        context_rows = None
        if s.start_pos > 0:
            num_blocks = -(-ctx_len // self.block_size) - first
            context_rows = self._block_rows(table[None, first : first + num_blocks]).view(-1)
        q_pos = torch.arange(s.start_pos, ctx_len, device=self.device)
        k_pos = torch.arange(first * self.block_size, ctx_len, device=self.device)
        until = attend_until(s, self.device)

        def mask(seen: Span) -> torch.Tensor:  # built once per step for all layers
            allowed = self._allowed(k_pos[None, :], q_pos[:, None], seen,
                                    None if until is None else until[:, None])  # [q_len, ctx_len]
            return self._additive(allowed).repeat(self.group, 1)  # [group * q_len, ctx_len]

        return PrefillChunk(row, row + q_len, context_rows,
                            like.masks if like is not None else {seen: mask(seen) for seen in spans})

    def _first_block(self, position: int, spans: frozenset[Span]) -> int:
        """The first block a query at `position` (or later) reads in any of these layers:
        where none sees everything, the blocks before the widest span are not gathered."""
        return min(first_seen(seen, position) for seen in spans) // self.block_size

    @staticmethod
    def _allowed(k_pos: torch.Tensor, q_pos: torch.Tensor, seen: Span,
                 until: torch.Tensor | None = None) -> torch.Tensor:
        """Which keys each query sees: those up to its position (or `until`, where it sees
        past itself), within its window or its chunk."""
        allowed = k_pos <= (q_pos if until is None else until)
        if isinstance(seen, Chunked):
            allowed &= k_pos >= torch.div(q_pos, seen.size, rounding_mode="floor") * seen.size
        elif seen is not None:
            allowed &= k_pos > q_pos - seen
        return allowed

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        return torch.where(allowed, self._zero, self._minus_inf)



def _num_blocks(starts: list[int], firsts: list[int], q_len: int, block_size: int) -> int:
    """The most blocks any of these sequences reads, each from its first (`firsts`) to the one
    holding its last query (at start + q_len - 1)."""
    if not any(firsts):  # (each from its first block: the latest start's end is the furthest)
        return -(-(max(starts) + q_len) // block_size)
    return max(-(-(p + q_len) // block_size) - first for p, first in zip(starts, firsts, strict=True))


def _table_slices(tables: torch.Tensor, firsts: list[int], num_blocks: int) -> torch.Tensor:
    """Each table's `num_blocks` entries from its own first one ([B, num_blocks]); 0 past the
    tables' width, as past a table's end."""
    width = tables.shape[1]
    if not any(firsts) and num_blocks <= width:
        return tables[:, :num_blocks]
    index = torch.tensor(firsts, device=tables.device)[:, None] + torch.arange(num_blocks, device=tables.device)
    inside = index < width
    return tables.gather(1, index.clamp(max=width - 1)).masked_fill_(~inside, 0)


def first_seen(span: Span, position: int) -> int:
    """The first position a query at `position` sees, in a layer of this span."""
    if isinstance(span, Chunked):
        return span.first_seen(position)
    return 0 if span is None else max(position - span + 1, 0)


def apply_softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in place: attention scores and logits kept within (-cap, cap)
    (Gemma 2)."""
    return x.div_(cap).tanh_().mul_(cap)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    head_dim = k.shape[-1]
    for x, cache in ((k, k_cache), (v, v_cache)):
        if cache.dtype == FP8:  # moved as bytes: torch has no index_copy_ for fp8
            x, cache = to_fp8(x).view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, head_dim).index_copy_(0, meta.write_rows, x.reshape(-1, head_dim))


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as an fp8 (e4m3) KV cache holds it: clamped to +-448, rounded to nearest."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already written to the cache
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    span: Span = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    for bucket in meta.decodes:
        rows = slice(bucket.row_start, bucket.row_end)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, bucket, scale, bucket.masks[span], softcap, sinks)
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale,
                                       chunk.masks[span], softcap, sinks)
    return out


def _gather(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block rows of one KV head each, in `dtype`: [len(rows), block_size * head_dim]."""
    num_blocks, num_kv_heads = cache.shape[:2]
    if cache.dtype != FP8:
        return torch.index_select(cache.view(num_blocks * num_kv_heads, -1), 0, rows, out=out)
    rows_fp8 = torch.index_select(cache.view(torch.uint8).view(num_blocks * num_kv_heads, -1), 0, rows).view(FP8)
    return rows_fp8.to(dtype) if out is None else out.copy_(rows_fp8)


def _matmul_attention(
    q: torch.Tensor,  # [B, kv_heads, rows, D]: a KV head's query rows
    k: torch.Tensor,  # [B, kv_heads, ctx, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # additive, broadcast to [B, kv_heads, rows, ctx]
    scale: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], ordered (kv head, group member)
) -> torch.Tensor:  # [B, kv_heads, rows, D]
    """Softmax in float32 between two matmuls in the model's dtype. Rows are ordered (group
    member, query) within a KV head, so the sinks of a head's rows are its members'."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if cap is not None:
        apply_softcap(scores, cap)
    scores.add_(mask)
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)
    batch, num_kv_heads, rows = scores.shape[:3]
    group = sinks.shape[0] // num_kv_heads
    column = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(batch, -1, -1, rows // group, 1)
    scores = torch.cat((scores, column.reshape(batch, num_kv_heads, rows, 1)), dim=-1)  # the sink, last
    return torch.matmul(scores.softmax(dim=-1)[..., :-1].to(q.dtype), v)


def _decode_attention(
    q: torch.Tensor,  # [n * q_len, num_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, D]
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
    mask: torch.Tensor,  # one of bucket.masks
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [n * q_len, num_heads, D]
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, q_len = k_cache.shape[1], bucket.q_len
    n, group = num_rows // q_len, num_heads // num_kv_heads
    ctx = mask.shape[-1]
    # a KV head's query rows, ordered (group member, query): [n, kv_heads, group * q_len, D]
    qd = q.view(n, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qd = qd.reshape(n, num_kv_heads, group * q_len, head_dim)
    kd = _gather(k_cache, bucket.block_rows, q.dtype, bucket.k_buffer).view(n, num_kv_heads, ctx, head_dim)
    vd = _gather(v_cache, bucket.block_rows, q.dtype, bucket.v_buffer).view(n, num_kv_heads, ctx, head_dim)
    # Plain matmuls beat SDPA's CPU kernel at these shapes (a few query rows per KV head).
    o = _matmul_attention(qd, kd, vd, mask, scale, softcap, sinks)  # [n, kv_heads, group * q_len, D]
    o = o.view(n, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(num_rows, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,  # [q_len, num_heads, D]
    k: torch.Tensor,  # [q_len, num_kv_heads, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, D]
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    mask: torch.Tensor,  # one of chunk.masks
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [q_len, num_heads, D]
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    ctx = mask.shape[-1]
    if chunk.context_rows is None:  # this step's K/V, as the cache holds them
        if k_cache.dtype == FP8:
            k, v = to_fp8(k).to(q.dtype), to_fp8(v).to(q.dtype)
        kg, vg = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, q_len, D]
    else:
        kg = _gather(k_cache, chunk.context_rows, q.dtype).view(num_kv_heads, -1, head_dim)[:, :ctx]
        vg = _gather(v_cache, chunk.context_rows, q.dtype).view(num_kv_heads, -1, head_dim)[:, :ctx]
    # Query rows ordered (kv head, group member, position): [1, kv_heads, group * q_len, D]
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(1, num_kv_heads, group * q_len, head_dim)
    if ctx <= MATMUL_PREFILL_MAX_CONTEXT or softcap is not None or sinks is not None:  # SDPA has neither
        o = _matmul_attention(qg, kg.unsqueeze(0), vg.unsqueeze(0), mask, scale, softcap, sinks)
    else:
        o = F.scaled_dot_product_attention(qg, kg.unsqueeze(0), vg.unsqueeze(0), attn_mask=mask, scale=scale)
    o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(q_len, num_heads, head_dim)
