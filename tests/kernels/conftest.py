"""Kernel tests run on CUDA when there is one, else in Triton's interpreter on the CPU.

TRITON_INTERPRET is read when a `@triton.jit` function is decorated, so it is set here, at
import time, before any test module imports `kernels`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels._common import HAS_TRITON, is_interpreted  # noqa: E402  (after TRITON_INTERPRET)
from kernels.paged_attention import _paged_attention_kernel  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernels run: CUDA when available, else the CPU through Triton's interpreter."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not is_interpreted(_paged_attention_kernel):
        pytest.fail(
            "`kernels` was imported before TRITON_INTERPRET=1 was set and there is no GPU; "
            "set it in tests/conftest.py (or the environment) before anything imports kernels"
        )
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
