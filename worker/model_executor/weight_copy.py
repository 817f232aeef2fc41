"""Copying a freshly read model's weights over a served one's of the same shape (a weights
update: worker.model_executor.model_runner's `reload_weights`).

The served model's parameters and buffers are written in place, so whatever holds them goes
on reading the new values: a tied LM head, a draft that shares the embedding, a CUDA graph's
captured pointers. What a model keeps beside its parameters, laid out once at load (oneDNN's
packed weights, an attention layer's KV-cache scales), is taken from the fresh model whole.
Modules only the served model has (LoRA's slots, which it grew after loading) are left as
they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn


def check_same_weights(served: nn.Module, fresh: nn.Module) -> None:
    """ValueError naming the first tensor that one model holds and the other has not, or has
    in another shape or dtype: nothing is copied unless every tensor fits."""
    twins = dict(served.named_modules(remove_duplicate=False))
    for name, module in fresh.named_modules(remove_duplicate=False):
        ours, theirs = dict(_tensors(twins[name])) if name in twins else {}, dict(_tensors(module))
        for key in sorted(ours.keys() ^ theirs.keys()):
            where = f"{name}.{key}" if name else key
            raise ValueError(f"the checkpoint's {where} has no place in the served model" if key in theirs
                             else f"the checkpoint gives the served model's {where} no value")
        for key, tensor in theirs.items():
            held = ours[key]
            if (held.shape, held.dtype) != (tensor.shape, tensor.dtype):
                where = f"{name}.{key}" if name else key
                raise ValueError(f"the checkpoint's {where} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"the served model's {tuple(held.shape)} {held.dtype}")


def copy_weights(served: nn.Module, fresh: nn.Module) -> None:
    """`fresh`'s weights into `served` (check_same_weights first)."""
    twins = dict(fresh.named_modules(remove_duplicate=False))
    device = next(served.parameters()).device
    with torch.no_grad():
        for name, module in served.named_modules(remove_duplicate=False):
            twin = twins.get(name)
            if twin is None:
                continue
            given = dict(_tensors(twin))
            for key, tensor in _tensors(module):
                tensor.copy_(given[key])
            for key, value in vars(twin).items():  # (what it holds now, a step's scratch, is not a weight)
                if not key.startswith("_") and key in vars(module) and _holds_tensors(value):
                    setattr(module, key, _to(value, device))


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own parameters and buffers (not its children's)."""
    return [(key, t) for key, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and any(
        _holds_tensors(getattr(value, f.name)) for f in dataclasses.fields(value))


def _to(value: Any, device: torch.device) -> Any:
    """`value` (a tensor, or lists, tuples and dataclasses of them) on `device`; an opaque
    oneDNN tensor as it is (it only ever lives on the CPU it was packed on)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_mkldnn else value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value
