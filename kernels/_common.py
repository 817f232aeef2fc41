"""Plumbing shared by the kernel modules: the guarded Triton import and input checks.

`import kernels` must work on a machine without Triton (the torch references are still
useful there), so Triton is imported here behind a guard. Without it, `triton.jit` yields a
placeholder whose launch raises, and every launcher calls `require_triton()` first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised in a subprocess by the tests
    HAS_TRITON = False

    class _UnavailableKernel:
        """Stands in for a `@triton.jit` kernel when Triton is missing."""

        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            require_triton()

    class _MissingTriton:
        def jit(self, fn: Any = None, **kwargs: Any) -> Any:
            if fn is None:
                return _UnavailableKernel
            return _UnavailableKernel(fn)

    class _MissingLanguage:
        # Kernel signatures evaluate annotations such as `tl.constexpr` at import time.
        def __getattr__(self, name: str) -> Any:
            return None

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingLanguage()  # type: ignore[assignment]

__all__ = [
    "HAS_TRITON",
    "cdiv",
    "check_device",
    "check_dtype",
    "check_shape",
    "check_contiguous",
    "check_last_dim_contiguous",
    "dot_dtype",
    "is_interpreted",
    "next_power_of_2",
    "padded_head_dim",
    "require_triton",
    "tl",
    "triton",
]


def require_triton() -> None:
    """Raise a clear error when a kernel is launched without Triton installed."""
    if not HAS_TRITON:
        raise RuntimeError(
            "genq kernels need Triton, which is not installed; install `triton` "
            "(Linux x86_64) or use the torch references / the CPU path instead"
        )


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (runs on CPU via numpy)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The tile width over a head: head_dim rounded up to a power of two, and to the 16
    columns `tl.dot` needs. Kernels mask the padded columns (Phi-3's 96 runs as 128)."""
    return max(16, next_power_of_2(head_dim))


def check_device(kernel: Any, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device: CUDA, or CPU when the kernel runs in Triton's interpreter."""
    require_triton()
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name}={t.device}" for name, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    device = devices.pop()
    if device.type == "cuda" or is_interpreted(kernel):
        return device
    raise ValueError(
        f"tensors are on {device}: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 "
        "set before `kernels` is imported to run them on the CPU"
    )


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    """`expected` lists each dimension's size; None accepts any size."""
    ok = t.dim() == len(expected) and all(
        want is None or have == want for have, want in zip(t.shape, expected, strict=True)
    )
    if not ok:
        want_str = "[" + ", ".join("*" if w is None else str(w) for w in expected) + "]"
        raise ValueError(f"{name} must have shape {want_str}, got {list(t.shape)}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def dot_dtype(dtype: torch.dtype, interpreted: bool) -> Any:
    """The operand dtype for `tl.dot` over tensors of `dtype`.

    Triton's interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those bit
    patterns, so there the bf16 operands are widened to fp32 (loads, stores and conversions
    of bf16 are still exercised; the bf16 tensor-core dot itself only runs on CUDA)."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreted:
        return tl.bfloat16
    return tl.float32
