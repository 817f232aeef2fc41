"""Builders and tolerances shared by the kernel tests.

`make_paged_batch` lays random per-sequence K/V out in a paged cache the way the engine
does (random physical blocks), keeps the dense copies for independent oracles, and poisons
everything a kernel must not read with NaN: the slots past each sequence's end in its last
block, and one whole block that every unused block-table entry points at.
"""

from dataclasses import dataclass

import torch

ON_CUDA = torch.cuda.is_available()

# (atol, rtol) per dtype. bf16 allows two ulps: besides the bf16 P.V product on CUDA, Triton's
# interpreter rounds fp32 -> bf16 toward zero where torch rounds to nearest even.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    assert not actual.isnan().any(), "kernel output has NaNs (unwritten or read poison)"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, num_heads, head_dim]; rows from num_real_tokens on are padding
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_num_blocks_per_seq] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64: the new tokens' slots, -1 for padding rows
    num_real_tokens: int

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.q, self.k_cache, self.v_cache,
            self.query_start_loc, self.seq_lens, self.block_tables,
        )  # fmt: skip


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_padding_tokens: int = 0,
) -> PagedBatch:
    """A mixed batch whose K/V (new tokens included) are already in the paged cache."""
    blocks_per_seq = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # two spare random blocks and one poison block
    poison = num_blocks - 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    v_cache = torch.randn_like(k_cache)
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    order = torch.randperm(num_blocks - 1, device=device).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), poison, dtype=torch.int32)
    dense_k, dense_v, new_slots = [], [], []
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    for b, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = torch.tensor([order.pop() for _ in range(blocks_per_seq[b])], dtype=torch.int32)
        block_tables[b, : len(blocks)] = blocks
        slots = _slots(blocks, block_size, seq_len, device)  # [seq_len]
        dense_k.append(torch.randn(seq_len, num_kv_heads, head_dim, device=device).to(dtype))
        dense_v.append(torch.randn(seq_len, num_kv_heads, head_dim, device=device).to(dtype))
        flat_k[slots] = dense_k[-1].float()
        flat_v[slots] = dense_v[-1].float()
        tail = torch.arange(seq_len, len(blocks) * block_size, device=device)
        flat_k[_slots(blocks, block_size, len(blocks) * block_size, device)[tail]] = float("nan")
        flat_v[_slots(blocks, block_size, len(blocks) * block_size, device)[tail]] = float("nan")
        new_slots.append(slots[seq_len - query_len :])
    num_real = sum(query_lens)
    new_slots.append(torch.full((num_padding_tokens,), -1, dtype=torch.int64, device=device))
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PagedBatch(
        q=torch.randn(num_real + num_padding_tokens, num_heads, head_dim, device=device).to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        dense_k=dense_k,
        dense_v=dense_v,
        slot_mapping=torch.cat(new_slots),
        num_real_tokens=num_real,
    )


def _slots(
    blocks: torch.Tensor, block_size: int, length: int, device: torch.device
) -> torch.Tensor:  # [length] int64
    pos = torch.arange(length)
    return (blocks.long()[pos // block_size] * block_size + pos % block_size).to(device)
