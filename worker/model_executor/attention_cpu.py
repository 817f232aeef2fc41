"""The compiled CPU backend: the torch backend's cache layout (head-major blocks, see
`worker.model_executor.attention`), read in place by genq's C++ kernel (`kernels.cpu`) rather
than gathered into buffers for torch's matmuls.

A step's metadata is what the kernel needs and nothing else: each sequence's rows in the flat
batch, its context length and its block table as int32 tensors, built once and shared by every
layer (a layer's window, chunk, soft-cap and sinks are the kernel's arguments). Where the
kernel cannot serve, the torch path does, decided in one place (`CpuMetadata.forward`): an fp8
cache, a head size the kernel was not built for, a dtype other than bfloat16 or float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu as cpu_kernels
from worker.core.scheduler import ScheduledRequest
from worker.model_executor.attention import (
    AttentionMetadata,
    TorchAttention,
    attend_until,
    paged_attention,
    write_kv,
)
from worker.model_executor.models.config import Chunked, Span

KERNEL_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, width] int32
    query_start: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    attend_until: torch.Tensor | None  # [T] int32 where some rows see past themselves
    torch_metadata: Callable[[], AttentionMetadata]  # the torch path's, built when first needed

    def for_layer(self, index: int) -> CpuMetadata:
        return self  # one group: every layer's

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        span: Span = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend over it (the kernel reads the
        new tokens' K/V from the cache, as their prefix's)."""
        k_cache, v_cache = kv_cache
        if k_cache.dtype == k.dtype:  # (an fp8 cache: values converted on the way, by the torch path)
            cpu_kernels.write_kv_(k_cache, v_cache, k, v, self.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, self.torch_metadata())
        if k_cache.dtype != q.dtype or q.dtype not in KERNEL_DTYPES:  # an fp8 cache: the torch path
            return paged_attention(q, k, v, k_cache, v_cache, self.torch_metadata(), scale, span, softcap, sinks)
        if q.stride(-1) != 1:
            q = q.contiguous()
        return cpu_kernels.paged_attention(
            torch.empty(q.shape, dtype=q.dtype), q, k_cache, v_cache, self.block_tables, self.query_start,
            self.seq_lens, scale, window=None if isinstance(span, Chunked) else span,
            chunk=span.size if isinstance(span, Chunked) else None, softcap=softcap,
            sinks=None if sinks is None else sinks.float(), attend_until=self.attend_until)


class CpuAttention:
    """The torch backend's layout and fallbacks (its TorchAttention), attended by the compiled
    kernel. Built only where `kernels.cpu.load()` succeeded (attention_selector)."""

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.torch = TorchAttention(block_size, num_heads, num_kv_heads, head_dim, dtype, device)
        # a head size or dtype the kernel lacks: the torch backend's metadata and path throughout
        self.kernel_serves = head_dim in cpu_kernels.SUPPORTED_HEAD_DIMS and dtype in KERNEL_DTYPES

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.torch.cache_shape(num_blocks)

    def build(self, batch: list[ScheduledRequest], tables: torch.Tensor, slot_mapping: torch.Tensor,
              spans: frozenset[Span] = frozenset({None}),
              like: AttentionMetadata | CpuMetadata | None = None) -> AttentionMetadata | CpuMetadata:
        """`tables`: [B, width] on the device, 0 past a table's end; `like`: another KV group's
        metadata of this step, whose rows and lengths this one shares."""
        if not self.kernel_serves:
            return self.torch.build(batch, tables, slot_mapping, spans, like if isinstance(like, AttentionMetadata) else None)
        torch_metadata = functools.cache(functools.partial(self.torch.build, batch, tables, slot_mapping, spans))
        block_tables = tables.to(torch.int32)
        if isinstance(like, CpuMetadata):
            return dataclasses.replace(like, slot_mapping=slot_mapping,
                                       block_tables=block_tables, torch_metadata=torch_metadata)
        query_lens = [len(s.token_ids) for s in batch]
        # (numpy's arrays of the lists, then torch's views of them: torch.tensor of a list of
        # Python ints costs three times as much, a step's largest host cost here)
        starts = np.zeros(len(batch) + 1, dtype=np.int32)
        starts[1:] = np.cumsum(query_lens)
        until = None
        if any(s.both_ways for s in batch):
            rows = [attend_until(s, torch.device("cpu")) for s in batch]
            until = torch.cat([torch.arange(s.start_pos, s.start_pos + n) if row is None else row
                               for s, n, row in zip(batch, query_lens, rows, strict=True)]).to(torch.int32)
        return CpuMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_start=torch.from_numpy(starts),
            seq_lens=torch.from_numpy(np.array([s.start_pos + n for s, n in zip(batch, query_lens, strict=True)],
                                               dtype=np.int32)),
            attend_until=until,
            torch_metadata=torch_metadata,
        )
