"""Dynamic time warping over a [rows, cols] cost matrix (Whisper's token timestamps align a
reply's tokens to the audio's frames with it): the cheapest monotone path's step into every
cell, as a trace the path is read back from (`warp_path`).

Cell (i, j) (1-based; row 0 and column 0 are the start's edges) costs its matrix value plus
the cheapest of the cells before it: (i-1, j-1), the diagonal step (0), taken where it is
strictly cheapest; else (i-1, j), a step down the rows (1), where that is; else (i, j-1), a
step along the columns (2). Those are transformers' and openai-whisper's ties, and the sum is
rounded as theirs is (the matrix value in float64 plus the float32 cost before it, rounded to
float32), so the paths are theirs. The cells of one anti-diagonal (i + j) need only the two
diagonals before it: the kernel's one program holds a lane per row and walks the
diagonals in order, keeping each diagonal's costs and steps in rows of their own.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._common import check_device, check_dtype, check_shape, next_power_of_2, tl, triton

__all__ = ["dtw_trace", "dtw_trace_ref", "warp_path"]

DIAGONAL, DOWN, ALONG = 0, 1, 2


@triton.jit
def _dtw_kernel(
    cost_ptr,  # [rows, cols] float32
    acc_ptr,  # [rows + cols + 1, BLOCK] float32: acc[d, i] is cell (i, d - i)'s path cost; inf, acc[0, 0] 0
    steps_ptr,  # [rows + cols + 1, BLOCK] int8: the step into each cell, laid out as acc
    rows,
    cols,
    BLOCK: tl.constexpr,  # rows + 1 rounded up to a power of two: a lane per row
):
    i = tl.arange(0, BLOCK)
    for d in range(2, rows + cols + 1):
        j = d - i
        inside = (i >= 1) & (i <= rows) & (j >= 1) & (j <= cols)
        before = acc_ptr + (d - 1) * BLOCK
        diagonal = tl.load(acc_ptr + (d - 2) * BLOCK + i - 1, mask=inside, other=float("inf"))  # (i-1, j-1)
        down = tl.load(before + i - 1, mask=inside, other=float("inf"))  # (i-1, j)
        along = tl.load(before + i, mask=inside, other=float("inf"))  # (i, j-1)
        step = tl.where((diagonal < down) & (diagonal < along), 0, tl.where((down < diagonal) & (down < along), 1, 2))
        best = tl.where(step == 0, diagonal, tl.where(step == 1, down, along))
        value = tl.load(cost_ptr + (i - 1) * cols + (j - 1), mask=inside, other=0.0)
        total = (value.to(tl.float64) + best.to(tl.float64)).to(tl.float32)
        tl.store(acc_ptr + d * BLOCK + i, total, mask=inside)
        tl.store(steps_ptr + d * BLOCK + i, step.to(tl.int8), mask=inside)
        tl.debug_barrier()  # this diagonal written before any lane reads it for the next


def _with_edges(trace: torch.Tensor) -> torch.Tensor:
    """Row 0 steps along the columns, column 0 down the rows (the start's cell, down)."""
    trace[0, :] = ALONG
    trace[:, 0] = DOWN
    return trace


def dtw_trace(cost: torch.Tensor) -> torch.Tensor:
    """The step into each cell of `cost` ([rows, cols] float32, on the GPU or under the
    interpreter) by the rule above: [rows + 1, cols + 1] int8 on its device."""
    check_dtype("cost", cost, (torch.float32,))
    check_shape("cost", cost, (None, None))
    check_device(_dtw_kernel, cost=cost)
    rows, cols = cost.shape
    block = next_power_of_2(rows + 1)
    acc = torch.full((rows + cols + 1, block), float("inf"), dtype=torch.float32, device=cost.device)
    acc[0, 0] = 0.0
    steps = torch.full((rows + cols + 1, block), -1, dtype=torch.int8, device=cost.device)
    _dtw_kernel[(1,)](cost.contiguous(), acc, steps, rows, cols, BLOCK=block, num_warps=min(16, max(1, block // 32)))
    i = torch.arange(rows + 1, device=cost.device)[:, None]
    j = torch.arange(cols + 1, device=cost.device)[None, :]
    return _with_edges(steps[i + j, i])  # cell (i, j) is on diagonal i + j, lane i


def dtw_trace_ref(cost: torch.Tensor) -> torch.Tensor:
    """The same in numpy on the CPU, a diagonal's cells at once: [rows + 1, cols + 1] int8."""
    cost_of = cost.double().cpu().numpy()
    rows, cols = cost_of.shape
    acc = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    trace = np.full((rows + 1, cols + 1), -1, dtype=np.int8)
    acc[0, 0] = 0
    for d in range(2, rows + cols + 1):
        i = np.arange(max(1, d - cols), min(rows, d - 1) + 1)
        j = d - i
        diagonal, down, along = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        step = np.where((diagonal < down) & (diagonal < along), DIAGONAL,
                        np.where((down < diagonal) & (down < along), DOWN, ALONG))
        acc[i, j] = cost_of[i - 1, j - 1] + np.choose(step, [diagonal, down, along])
        trace[i, j] = step
    return _with_edges(torch.from_numpy(trace))


def warp_path(trace: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The path from the last cell back to the start, as its (row, column) indices from the
    start (0-based: the matrix's, not the trace's)."""
    steps = trace.cpu().numpy()
    i, j = steps.shape[0] - 1, steps.shape[1] - 1
    rows, columns = [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        columns.append(j - 1)
        step = steps[i, j]
        i, j = (i - 1, j - 1) if step == DIAGONAL else (i - 1, j) if step == DOWN else (i, j - 1)
    return np.array(rows[::-1]), np.array(columns[::-1])
