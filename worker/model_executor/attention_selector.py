"""Which attention backend a model runner uses, and building it: the compiled CPU backend
(`worker.model_executor.attention_cpu`, genq's C++ kernel: the CPU default where it builds),
the torch backend (`worker.model_executor.attention`, the CPU path without a compiler, and the
kernel's oracle) or the Triton one (`worker.model_executor.attention_triton`, the GPU path), as
vLLM's attention selector picks one. Its own module so that the Triton backend can build on the torch one's helpers without
the torch one having to know the Triton one exists.
"""

from __future__ import annotations

import torch

from worker.model_executor.attention import TorchAttention


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """`cpu` (CPU default where genq's kernels build; else `torch`, with one warning from
    kernels.cpu.load), `torch`, or `triton` (CUDA default; on CPU only under TRITON_INTERPRET)."""
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and _cpu_kernels_load() else "torch"
    if name not in ("cpu", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, cpu, torch or triton, got {name!r}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only, not on {device.type}")
    if name == "cpu" and not _cpu_kernels_load():
        raise ValueError("attention_backend 'cpu' needs genq's compiled CPU kernels, which could not be built "
                         "here (see the warning above; 'torch' or 'auto' serve without them)")
    return name


def _cpu_kernels_load() -> bool:
    from kernels import cpu  # (here: it imports `kernels`, which the other paths need not)

    return cpu.load()


def make_attention_backend(name: str, model_config, block_size: int, dtype: torch.dtype, device: torch.device):
    name = resolve_attention_backend(name, device)
    args = (block_size, model_config.num_attention_heads, model_config.num_key_value_heads,
            model_config.head_dim, dtype, device)
    if name == "torch":
        return TorchAttention(*args)
    if name == "cpu":
        from worker.model_executor.attention_cpu import CpuAttention

        return CpuAttention(*args)
    if name == "triton":
        # imported here, not above: it imports `kernels` (and Triton), which the torch path never needs
        from worker.model_executor.attention_triton import TritonAttention

        return TritonAttention(*args)
