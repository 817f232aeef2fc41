"""Memory given back while an engine sleeps (vLLM's sleep mode): tensors whose storage is
resized to nothing, and later to its size again, so every view and every module that holds
them stays as it was (worker.model_executor.model_runner's `sleep` and `wake_up`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class ParkedStorages:
    """The storages of `tensors` (each once, however many tensors share it), released: with
    `keep`, their contents wait on the host (pinned where they came from a GPU) until
    `restore` puts them back; without, `restore` gives them back their size, zeroed or not."""

    def __init__(self, tensors: Iterable[torch.Tensor], keep: bool) -> None:
        self.parked: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            copy = None
            if keep:
                copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                copy.untyped_storage().copy_(storage)
            self.parked.append((storage, storage.nbytes(), copy))
            storage.resize_(0)

    def restore(self, zero: bool = False, contents: bool = True) -> None:
        """Each storage at its size again: with its kept contents (unless not `contents`: they are
        about to be overwritten), else zeroed where `zero`."""
        for storage, size, copy in self.parked:
            storage.resize_(size)
            if copy is not None and contents:
                storage.copy_(copy.untyped_storage())
            elif zero:
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
        self.parked = []


def weight_tensors(modules: Iterable[nn.Module | None]) -> list[torch.Tensor]:
    """The parameters and buffers of `modules` (those that are there)."""
    return [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())]


def drop_laid_out(module: nn.Module) -> None:
    """Forget the weights `module` keeps laid out for oneDNN (opaque tensors, which no storage
    resize reaches); a weights load lays them out again."""
    for m in module.modules():
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.is_mkldnn:
                setattr(m, key, None)
            elif isinstance(value, list) and value and isinstance(value[0], tuple) and any(
                    isinstance(t, torch.Tensor) and t.is_mkldnn for t in value[0]):
                setattr(m, key, None)
