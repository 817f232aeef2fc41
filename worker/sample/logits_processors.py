"""Custom logits processors (vLLM's `logits_processors` engine argument): classes the engine
loads once, each asked for a function of its own by every request that comes in.

A processor class is built with the engine's configuration and answers
`new_req_logits_processor(params)` with None (the request does not use it) or a function
that takes the request's generated token ids (and, with three parameters, its prompt's
first) and one row of logits, and returns the row to sample from, as vLLM's
`AdapterLogitsProcessor` subclasses do. A request passes its own settings in
`SamplingParams.extra_args` (the API's `vllm_xargs`); a processor that finds them wrong
raises ValueError there, and the request is refused by name. The functions run on every row a
request samples from before the sampler's own penalties, bias and masks (a row of a request
with guesses sees the guesses before it as generated); one that raises ends its request
(`Engine.take_failures` says why), never the others.

`NoRepeatNGram` is one (transformers' `no_repeat_ngram_size`):
`logits_processors=["worker.sample.logits_processors:NoRepeatNGram"]`, and
`extra_args={"no_repeat_ngram_size": 3}` per request.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from producer.sampling_params import SamplingParams

RowFunction = Callable[..., torch.Tensor]  # (output_ids, logits) or (prompt_ids, output_ids, logits)


def load_logits_processors(entries: Iterable[str | type], config: Any) -> list[tuple[str, Any]]:
    """(name, instance) for each class (or "module:Class" / "module.Class"), built with the
    engine's config; ValueError naming the entry that cannot be loaded."""
    processors = []
    for entry in entries:
        name = entry if isinstance(entry, str) else f"{entry.__module__}.{entry.__qualname__}"
        cls = _import(entry) if isinstance(entry, str) else entry
        try:
            instance = cls(config)
        except Exception as exc:
            raise ValueError(f"logits processor {name!r} could not be built: {type(exc).__name__}: {exc}") from exc
        if not callable(getattr(instance, "new_req_logits_processor", None)):
            raise ValueError(f"logits processor {name!r} has no new_req_logits_processor(params) method")
        processors.append((name, instance))
    return processors


def _import(entry: str) -> Any:
    module, sep, attr = entry.partition(":")
    if not sep:
        module, _, attr = entry.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"logits processor {entry!r} cannot be imported: {exc}") from exc


@dataclass(frozen=True)
class RequestProcessor:
    name: str
    fn: RowFunction
    takes_prompt: bool  # called with the prompt's ids first


class LogitsProcessors:
    """The loaded processors and each request's functions."""

    def __init__(self, processors: list[tuple[str, Any]]):
        self.processors = processors
        self.by_request: dict[str, list[RequestProcessor]] = {}

    def make(self, params: SamplingParams, n: int) -> list[list[RequestProcessor]]:
        """The functions of a request's n samples (one set each: they may keep state);
        ValueError naming the processor that refused its settings."""
        return [_functions(self.processors, params) for _ in range(n)] if self.processors else []

    def keep(self, request_ids: Sequence[str], functions: list[list[RequestProcessor]]) -> None:
        """The samples' functions (`make`'s), as their requests enter the engine."""
        self.by_request.update({rid: fns for rid, fns in zip(request_ids, functions, strict=False) if fns})

    def remove(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)

    def apply(self, logits: torch.Tensor, row_ids: Sequence[str], prompts: Sequence[list[int]],
              outputs: Sequence[list[int]]) -> dict[str, str]:
        """Run each row's functions on it, in place; the requests whose function failed, and why
        (their rows are left as they were)."""
        failed: dict[str, str] = {}
        if self.by_request:
            with torch.inference_mode():  # (the logits are inference tensors)
                self._apply(logits, row_ids, prompts, outputs, failed)
        return failed

    def _apply(self, logits: torch.Tensor, row_ids: Sequence[str], prompts: Sequence[list[int]],
               outputs: Sequence[list[int]], failed: dict[str, str]) -> None:
        for row, rid in enumerate(row_ids):
            if rid in failed:
                continue
            for p in self.by_request.get(rid, ()):
                try:
                    args = (prompts[row], outputs[row]) if p.takes_prompt else (outputs[row],)
                    new = p.fn(*args, logits[row].clone())
                    if not isinstance(new, torch.Tensor) or new.shape != logits[row].shape:
                        raise TypeError(f"returned {type(new).__name__}, not a row of {logits.shape[-1]} logits")
                    logits[row] = new
                except Exception as exc:
                    failed[rid] = f"logits processor {p.name} failed: {type(exc).__name__}: {exc}"
                    break


def _functions(processors: list[tuple[str, Any]], params: SamplingParams) -> list[RequestProcessor]:
    fns = []
    for name, processor in processors:
        try:
            fn = processor.new_req_logits_processor(params)
        except Exception as exc:  # its code's failure is the request's refusal, not the engine's
            raise ValueError(f"logits processor {name}: {exc}") from exc
        if fn is not None:
            fns.append(RequestProcessor(name, fn, _positional_count(fn) == 3))
    return fns


def _positional_count(fn: RowFunction) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


class NoRepeatNGram:
    """transformers' `no_repeat_ngram_size`: no n-gram of the prompt and output occurs twice
    (`extra_args={"no_repeat_ngram_size": n}`)."""

    def __init__(self, config: Any) -> None:
        pass

    def new_req_logits_processor(self, params: SamplingParams) -> RowFunction | None:
        size = (params.extra_args or {}).get("no_repeat_ngram_size")
        if size is None:
            return None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"no_repeat_ngram_size must be an int >= 1, got {size!r}")

        def ban(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            tokens = prompt_ids + output_ids
            if len(tokens) + 1 < size:
                return logits
            tail = tuple(tokens[len(tokens) - size + 1 :])
            banned = [tokens[i + size - 1] for i in range(len(tokens) - size + 1)
                      if tuple(tokens[i : i + size - 1]) == tail]
            logits[banned] = float("-inf")
            return logits

        return ban
