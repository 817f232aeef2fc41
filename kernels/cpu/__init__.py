"""genq's compiled CPU kernels: a C++ extension (torch's cpp_extension, AVX-512 or AVX2 chosen
at run time, a plain C++ version otherwise), built by the normal set-up (`python -m
kernels.cpu`, which the Makefile and the Dockerfile run) and loaded once per process.

`load()` builds or loads it (torch's `load` rebuilds only when the sources changed, under a
lock) and says whether it can serve; without a compiler, or where the build fails, it logs one
warning and the torch attention path serves instead, slower. The ops are then
`torch.ops.genq_cpu.<op>`; `paged_attention` here checks its arguments and calls the one op.

Sources: fused.cpp (small bf16 ops fused into one pass each: the residual add with the RMSNorm
after it, SiLU(gate) * up, rotary in place; `add_rms_norm_`, `silu_and_mul`, `rope_` here),
attention.cpp (the op, its checks and its threads; and `write_kv_`, this step's K and V into
their cache slots in one pass), attention_impl.h (the kernel,
written once over a vector type; vec_avx512.h, AVX-512's), attention_{avx512bf16,avx512,avx2,
scalar}.cpp (that kernel compiled for each instruction set, AVX-512-BF16's taking bf16 dot
products for bf16 caches; each file under its own `#pragma GCC target`: the extension is
never built with -march=native, so a .so built on one host runs on another).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

__all__ = ["ISA_NAMES", "SUPPORTED_HEAD_DIMS", "add_rms_norm_", "load", "paged_attention", "rope_", "silu_and_mul",
           "write_kv_"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_SOURCES = ["attention.cpp", "attention_avx512bf16.cpp", "attention_avx512.cpp", "attention_avx2.cpp",
            "attention_scalar.cpp", "fused.cpp"]
SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # attention_impl.h's attend_dispatch
ISA_NAMES = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}


def _build_dir() -> Path:
    """The source tree's own build folder (one per checkout: two checkouts of different
    sources never rebuild each other's), or torch's default where the tree is read-only."""
    folder = _HERE / "_build"
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory("genq_cpu", verbose=False))
    return folder if os.access(folder, os.W_OK) else Path(_get_default_dir())


def _get_default_dir() -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory("genq_cpu", verbose=False)


@functools.cache
def load(verbose: bool = False) -> bool:
    """Build (where the sources changed) and load the extension, once per process; False, with
    one warning, where it cannot be."""
    from torch.utils.cpp_extension import load as load_extension

    started = time.perf_counter()
    try:
        load_extension(
            name="genq_cpu",
            sources=[str(_HERE / name) for name in _SOURCES],
            extra_cflags=["-O3", "-fopenmp", "-DNDEBUG"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build, a bad .so: all mean the torch path
        log.warning("genq's compiled CPU kernels are unavailable (%s: %s); attention on the CPU runs on the "
                    "torch path instead, slower", type(e).__name__, str(e).strip().splitlines()[-1:] or "")
        return False
    log.debug("genq_cpu loaded in %.1f s", time.perf_counter() - started)
    return True


def paged_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim], written
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim], q's dtype
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, width] int32
    query_start: torch.Tensor,  # [B + 1] int32: each sequence's rows of q
    seq_lens: torch.Tensor,  # [B] int32: context including this step's tokens (already in the cache)
    scale: float,
    window: int | None = None,  # a sliding window: each query sees its last `window` positions
    chunk: int | None = None,  # chunked attention: each query sees only its own chunk's positions
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32: a logit per head in each softmax
    attend_until: torch.Tensor | None = None,  # [T] int32: each row's last visible position
    isa: str = "auto",
) -> torch.Tensor:
    """Causal attention of each sequence's new queries (at the last positions of its context)
    over its cached K/V, read in place through the block tables. Returns `out`."""
    if isa not in ISA_NAMES:
        raise ValueError(f"isa must be one of {sorted(ISA_NAMES)}, got {isa!r}")
    torch.ops.genq_cpu.paged_attention(out, q, k_cache, v_cache, block_tables, query_start, seq_lens, attend_until,
                                       sinks, scale, window or 0, chunk or 0, softcap or 0.0, ISA_NAMES[isa])
    return out


def write_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """k and v [T, kv_heads, head_dim] (last dim contiguous) into the caches [blocks, kv_heads,
    block_size, head_dim] of their dtype, at each token's slot (int64 [T]), in one pass."""
    torch.ops.genq_cpu.write_kv_(k_cache, v_cache, k, v, slot_mapping)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  isa: str = "auto") -> None:
    """In place, bf16 [T, hidden] each: residual <- x + residual; x <- rms_norm(residual) * weight."""
    torch.ops.genq_cpu.add_rms_norm_(x, residual, weight, eps, _isa(isa))


def silu_and_mul(gate_up: torch.Tensor, isa: str = "auto") -> torch.Tensor:
    """SiLU(gate) * up of a bf16 [T, 2 * intermediate] (gate | up): [T, intermediate]."""
    return torch.ops.genq_cpu.silu_and_mul(gate_up, _isa(isa))


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, isa: str = "auto") -> None:
    """Rotate-half rotary of bf16 q and k heads [T, heads, head_dim] in place, by each token's
    cos and sin rows ([T, head_dim] each, or [T, 1, head_dim])."""
    torch.ops.genq_cpu.rope_(qk, cos, sin, _isa(isa))


def _isa(name: str) -> int:
    """The kernels' number for an instruction set (the fused ops run AVX-512 or plain C++)."""
    if name not in ISA_NAMES:
        raise ValueError(f"isa must be one of {sorted(ISA_NAMES)}, got {name!r}")
    return ISA_NAMES[name]
