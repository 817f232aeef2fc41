"""The sampling rows' logits of each step in one float32 tensor kept from step to step (CPU).

glibc's malloc serves a block of up to 32 MiB from its heap once one that size has been freed
(its dynamic mmap threshold), but maps a larger one afresh on every allocation and unmaps it on
free. A step's [rows, vocab] float32 logits pass that size at 171 rows of a 49,152-token
vocabulary, and then every step faults the new tensor in page by page (25k faults at 512 rows)
and unmaps it after: on a two-layer model that took longer than the LM head's arithmetic, and
the step's time grew 2x faster than its rows (benchmarks/step_overhead.py, 256 rows against
128). So a larger LM head output is written into a buffer kept across calls, in chunks of rows
each under that size, which malloc mostly keeps on its heap (its trimming still hands one back
to the system now and then). Each row's logits are those of the LM head over that row, as
before; the buffer is overwritten by the next call, so its logits are valid until then (the
engine reads a step's before it runs the next). It stays allocated, sized for the most rows
seen: 100 MB for 512 rows of 49,152 tokens, what each such step allocated before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest block its dynamic threshold keeps on the heap
HEAP_BLOCK_BYTES = 32 * 2**20


class LogitsBuffer:
    """`logits(head, hidden, vocab_size)`: head(hidden) as float32, written into a buffer kept
    for the next call where that output would be too large for malloc's heap on the CPU, else
    a fresh tensor (on CUDA the caching allocator already reuses its blocks)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def logits(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               vocab_size: int) -> torch.Tensor:
        """`hidden`: [rows, hidden_size]; `vocab_size`: at least the width of head's output."""
        rows = hidden.shape[0]
        chunk_rows = max(1, HEAP_BLOCK_BYTES // (vocab_size * 4))
        if hidden.device.type != "cpu" or rows <= chunk_rows:
            return head(hidden).float()
        num_chunks = -(-rows // chunk_rows)
        chunk_rows = -(-rows // num_chunks)  # even chunks: 512 rows as 4 x 128, not 3 x 170 + 2
        first = head(hidden[:chunk_rows])
        out = self._rows(rows, first.shape[1])
        out[:chunk_rows].copy_(first)  # (a bfloat16 head's output is cast in the copy)
        del first
        for start in range(chunk_rows, rows, chunk_rows):
            out[start : start + chunk_rows].copy_(head(hidden[start : start + chunk_rows]))
        return out

    @property
    def capacity_rows(self) -> int:
        """Rows the kept buffer holds (0: none kept yet)."""
        return 0 if self._buffer is None else self._buffer.shape[0]

    def _rows(self, rows: int, width: int) -> torch.Tensor:
        """The buffer's first `rows` rows, the buffer grown to them where it is smaller."""
        if self._buffer is None or self._buffer.shape[0] < rows or self._buffer.shape[1] != width:
            self._buffer = None  # (freed before its successor is made)
            self._buffer = torch.empty(rows, width, dtype=torch.float32)
        return self._buffer[:rows]
