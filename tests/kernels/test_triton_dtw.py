"""Dynamic time warping (Whisper's token timestamps): the kernel's trace against the numpy
reference's, and the paths read from them against transformers' cell-by-cell loop, on
matrices of small integers (ties everywhere, where the choice of step shows) and of floats
(where the float64 sum rounded to float32 shows)."""

import numpy as np
import pytest
import torch
from kernel_cases import ON_CUDA

from kernels.dtw import dtw_trace, dtw_trace_ref, warp_path

SHAPES = [(1, 1), (1, 7), (6, 1), (5, 9), (12, 30), (30, 12), (3, 70)]
if ON_CUDA:
    SHAPES += [(448, 1500), (200, 1500)]  # a whole reply over Whisper's 30 s window


@pytest.mark.parametrize("ties", [True, False], ids=["integers", "floats"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_traces_and_paths_are_transformers(shape, ties, device):
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping

    rng = np.random.default_rng(sum(shape))
    matrix = rng.integers(-2, 3, size=shape) if ties else rng.standard_normal(shape) * 10.0
    cost = torch.tensor(matrix, dtype=torch.float32)
    kernel, reference = dtw_trace(cost.to(device)), dtw_trace_ref(cost)
    assert kernel.dtype == reference.dtype == torch.int8
    assert torch.equal(kernel.cpu(), reference)
    theirs = _dynamic_time_warping(cost.double().numpy())
    assert [a.tolist() for a in warp_path(kernel)] == [b.tolist() for b in theirs]


def test_bad_inputs_are_refused_by_name(device):
    with pytest.raises(ValueError, match="cost must have dtype in \\(float32\\)"):
        dtw_trace(torch.zeros(2, 3, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="cost"):
        dtw_trace(torch.zeros(2, 3, 4, device=device))
