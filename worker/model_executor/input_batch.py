"""The persistent batch (vLLM V1's InputBatch): a row per running request, kept across steps.

A request the engine's scheduler runs keeps its row from its first step until it ends or is
preempted (SchedulerOutput.finished_ids, .preempted). Its block tables live in one
preallocated tensor per KV group, changed by difference: at its first step its tables are
written whole; at each later one only the blocks they gained since are appended (a table only
grows at its end: the block manager appends, and gives entries back in place, below). The
step's tables are the block manager's own lists, not copies. A freed row is zeroed, so a table read past its end gives block 0, as padding
would. A step's tables are then one gather of its requests' rows, not Python lists padded
request by request (`tables`).

Entries the block manager releases later (a sliding window's blocks behind it) keep their old
block ids here: attention never reads a position before its window, so neither the rows nor
the metadata built from them differ where they are read (tests/worker/test_input_batch.py
checks every step's metadata against the tables read whole).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.core.scheduler import ScheduledRequest, SchedulerOutput


class InputBatch:
    def __init__(self, num_groups: int, max_rows: int, max_blocks: int):
        """`max_rows`: the requests that may run at once; `max_blocks`: the longest table, a
        request of max_model_len tokens' (room is made for more of either where needed)."""
        self.num_groups = num_groups
        # (numpy's: a scalar written in a fraction of torch's indexing cost)
        self.block_tables = np.zeros((num_groups, max_rows, max_blocks), dtype=np.int64)  # [G, rows, blocks]
        self.num_blocks: list[list[int]] = [[0] * max_rows for _ in range(num_groups)]  # per group, per row
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))  # (popped from the end: low rows first)

    def __len__(self) -> int:
        return len(self.row_of)

    def update(self, out: SchedulerOutput, batch: Sequence[ScheduledRequest]) -> np.ndarray:
        """Take the step's changes: rows freed for the requests that ended or were preempted,
        rows for those new to the batch, blocks added; the rows of `batch` (the step's requests,
        in the order the runner lays them out): [B]."""
        for request_id in (*(out.finished_ids or ()), *out.preempted):
            self.remove(request_id)
        return np.array([self._row(s) for s in batch], dtype=np.int64)

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        for group in range(self.num_groups):
            self.block_tables[group, row, : self.num_blocks[group][row]] = 0
            self.num_blocks[group][row] = 0
        self._free_rows.append(row)

    def tables(self, group: int, rows: np.ndarray, width: int) -> torch.Tensor:
        """The tables of `rows` in `group`, their first `width` entries (0 past a table's end):
        [B, width], a copy."""
        return torch.from_numpy(self.block_tables[group, rows, :width])

    def _row(self, s: ScheduledRequest) -> int:
        row = self.row_of.get(s.request_id)
        if row is None:  # its first step: its tables whole (a released entry as block 0, as tables() reads it)
            row = self.row_of[s.request_id] = self._take_row()
            for group, table in enumerate(s.tables()):
                self._write(group, row, 0, table)
                self.num_blocks[group][row] = len(table)
            return row
        counts = self.num_blocks
        if not s.group_tables and counts[0][row] == len(s.block_table):
            return row  # (one KV group, no block gained: a decode's most common step)
        for group, table in enumerate((s.block_table, *s.group_tables)):
            if counts[group][row] < len(table):  # the blocks gained since its last step
                self._write(group, row, counts[group][row], [max(b, 0) for b in table[counts[group][row]:]])
                counts[group][row] = len(table)
        return row

    def _write(self, group: int, row: int, start: int, blocks: list[int]) -> None:
        end = start + len(blocks)
        if end > self.block_tables.shape[2]:  # (a step's guesses may reach past max_model_len)
            more = np.zeros((*self.block_tables.shape[:2], end), dtype=np.int64)
            self.block_tables = np.concatenate([self.block_tables, more], axis=2)
        self.block_tables[group, row, start:end] = blocks

    def _take_row(self) -> int:
        if not self._free_rows:  # (more requests at once than foreseen: room for twice as many)
            grown = self.block_tables.shape[1]
            self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)], axis=1)
            for counts in self.num_blocks:
                counts.extend([0] * grown)
            self._free_rows = list(range(2 * grown - 1, grown - 1, -1))
        return self._free_rows.pop()
