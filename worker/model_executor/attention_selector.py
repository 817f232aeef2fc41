"""Which attention backend a model runner uses, and building it: the torch backend
(`worker.model_executor.attention`, the CPU path) or the Triton one
(`worker.model_executor.attention_triton`, the GPU path), as vLLM's attention selector picks
one. Its own module so that the Triton backend can build on the torch one's helpers without
the torch one having to know the Triton one exists.
"""

from __future__ import annotations

import torch

from worker.model_executor.attention import TorchAttention


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """`torch` (CPU default) or `triton` (CUDA default; on CPU only under TRITON_INTERPRET)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
    return name


def make_attention_backend(name: str, model_config, block_size: int, dtype: torch.dtype, device: torch.device):
    name = resolve_attention_backend(name, device)
    args = (block_size, model_config.num_attention_heads, model_config.num_key_value_heads,
            model_config.head_dim, dtype, device)
    if name == "torch":
        return TorchAttention(*args)
    if name == "triton":
        # imported here, not above: it imports `kernels` (and Triton), which the torch path never needs
        from worker.model_executor.attention_triton import TritonAttention

        return TritonAttention(*args)
