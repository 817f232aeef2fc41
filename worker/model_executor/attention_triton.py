"""The GPU backend: token-major blocks [num_blocks, block_size, num_kv_heads, head_dim] written
and read by the Triton kernels in `kernels/` (on CPU only under TRITON_INTERPRET, for tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import kernels
from worker.core.scheduler import ScheduledRequest
from worker.model_executor.attention import attend_until
from worker.model_executor.models.config import Chunked, Span


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int  # host-side bounds, so the launcher never waits on the device
    max_seq_len: int
    attend_until: torch.Tensor | None = None  # [T] int32: each row's last visible position, where some see past themselves

    def for_layer(self, index: int) -> TritonMetadata:
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
        k_cache, v_cache = kv_cache
        kernels.reshape_and_cache(k, v, k_cache, v_cache, self.slot_mapping)
        return kernels.paged_attention(
            q, k_cache, v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
            scale=scale, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
            sliding_window=None if isinstance(span, Chunked) else span,
            chunk_size=span.size if isinstance(span, Chunked) else None,
            softcap=softcap, sinks=None if sinks is None else sinks.float(), attend_until=self.attend_until,
        )


class TritonAttention:
    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def build(self, batch: list[ScheduledRequest], tables: torch.Tensor, slot_mapping: torch.Tensor,
              spans: frozenset[Span] = frozenset({None}), like: TritonMetadata | None = None) -> TritonMetadata:
        """`tables`: the requests' block tables of the KV group built for, as wide as the
        longest context needs ([B, width], on the device; the kernel takes each layer's span as
        it runs). `like`: another group's metadata of this step, whose query starts and context
        lengths this one shares."""
        query_lens = [len(s.token_ids) for s in batch]
        seq_lens = [s.start_pos + n for s, n in zip(batch, query_lens, strict=True)]
        padded = tables.to(torch.int32)
        if like is not None:
            return dataclasses.replace(like, slot_mapping=slot_mapping, block_tables=padded)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        until = None
        if any(s.both_ways for s in batch):
            rows = [attend_until(s, torch.device("cpu")) for s in batch]
            until = torch.cat([torch.arange(s.start_pos, s.start_pos + n) if row is None else row
                               for s, n, row in zip(batch, query_lens, rows, strict=True)])
            until = until.to(device=self.device, dtype=torch.int32)
        return TritonMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=padded,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            attend_until=until,
        )
