"""The served weights, and the device memory they and the KV cache hold: weights updates
(vLLM's `reload_weights`: a trainer's new checkpoint, or its tensors, served between two steps)
and sleep mode (vLLM's `sleep` / `wake_up`: memory given back to a trainer sharing the
device). The engine's own concern is only that no later request reuses what old weights
computed: `forget_prefixes` is its prefix-cache reset.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from worker.config import EngineConfig
from worker.model_executor.model_loader import read_config, resolve_model_path
from worker.model_executor.models.config import ModelConfig, language_config
from worker.spec_decode.draft_model import HiddenStateProposer

logger = logging.getLogger(__name__)


class Weights:
    """One engine's weights: `runner` the target's, `proposer` its speculative decoder's (a
    draft with a runner of its own sleeps with it; an MTP layer or EAGLE-3 head reads the new
    weights with the target's); `num_unfinished()` its requests still running or waiting."""

    def __init__(self, config: EngineConfig, model_path: Path, max_model_len: int, runner: Any, proposer: Any,
                 forget_prefixes: Callable[[], None], num_unfinished: Callable[[], int]) -> None:
        self.config = config
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.runner = runner
        self.proposer = proposer
        self.model_config = runner.model_config
        self.forget_prefixes = forget_prefixes
        self.num_unfinished = num_unfinished
        self.source: Path | None = model_path  # the checkpoint served last (None: weights given)

    def reload(self, model_path: str | Path | None = None,
                       weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> Path | None:
        """Serve the weights of the checkpoint at `model_path` from now on: a checkpoint of the
        served model's shape (a fine-tune's, a training step's), read between two steps and
        copied over the weights in place; None reads the served model's own checkpoint again
        (one a trainer overwrote). Or `weights`: the tensors themselves, by their checkpoint
        names (a colocated trainer's `model.named_parameters()`), every one the model reads;
        for one process only (tensor_parallel_size 1) and a model without an image encoder.
        Returns the checkpoint's directory (None for `weights`).

        Running requests go on over the new weights (the keys and values they computed stay,
        as vLLM's weight updates leave them); the prefix cache and the image embeddings kept
        are forgotten, so no later request reuses what the old weights computed. An MTP
        draft's layer is read from the same checkpoint; another draft's weights, the tokenizer,
        the chat template and the generation config stay as they were. A checkpoint that
        does not fit is refused by name (ValueError; OSError where it cannot be read), the
        weights left as they were."""
        if weights is not None:
            self._reload_given(model_path, dict(weights))
            return None
        path = self.model_path if model_path is None else resolve_model_path(str(model_path), self.config.cache_dir)
        whole_config = read_config(path, self.config.hf_overrides)
        served = self.runner.checkpoint_config
        given = ModelConfig.from_hf(language_config(whole_config), self.config.quantization, self.max_model_len)
        differ = [f.name for f in fields(served) if f.name not in ("hf_config", "eos_token_ids")
                  and getattr(given, f.name) != getattr(served, f.name)]
        if differ:
            raise ValueError(f"{path} is not a checkpoint of the served model's shape: " + ", ".join(
                f"{name} {getattr(given, name)!r} (served: {getattr(served, name)!r})" for name in differ[:4]))
        self._reload(path, whole_config)
        self.source = path
        logger.info("serving the weights of %s", path)
        return path

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, for a trainer that shares the device: give back the KV cache's
        memory (its contents and the prefix cache forgotten), and at level 2 the weights' too
        (forgotten: waking reads them again, from the checkpoint served last, unless a
        `reload_weights` brings others first); at level 1 on a GPU the weights wait in host
        memory. Only an idle engine sleeps; while it does, requests are refused."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (the weights kept) or 2 (forgotten), got {level!r}")
        if unfinished := self.num_unfinished():
            raise ValueError(f"only an idle engine sleeps: {unfinished} "
                             "requests are unfinished")
        self.forget_prefixes()
        for runner in self._runners():
            runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` gave: `tags` "weights" and "kv_cache", both by default (vLLM's:
        a trainer wakes the weights alone to load new ones before the cache takes its memory)."""
        wanted = ["weights", "kv_cache"] if tags is None else list(tags)
        if unknown := [tag for tag in wanted if tag not in ("weights", "kv_cache")]:
            raise ValueError(f"wake_up tags are 'weights' and 'kv_cache', got {unknown}")
        if "weights" in wanted:
            if self.runner.weights_forgotten:  # (a level-2 sleep): read again, draft's MTP layer and all
                if self.source is None:
                    raise ValueError("the weights slept at level 2 were given in memory: reload_weights(weights=...) "
                                     "brings them back")
                self._reload(self.source, read_config(self.source, self.config.hf_overrides))
            for runner in self._runners():  # (a draft model's, an EAGLE-3 head's: their own checkpoint's)
                if runner.weights_forgotten:
                    runner.reload_weights(runner.model_path)
                runner.wake_weights()
        if "kv_cache" in wanted:
            for runner in self._runners():
                runner.wake_cache()

    def is_sleeping(self) -> bool:
        return bool(self.runner.asleep)

    def _runners(self) -> list[Any]:
        """The target's runner, and the draft's where one guesses with its own."""
        draft = getattr(self.proposer, "runner", None)
        return [self.runner] if draft is None else [self.runner, draft]

    def _reload_given(self, model_path: str | Path | None, weights: dict[str, torch.Tensor]) -> None:
        if model_path is not None:
            raise ValueError("reload_weights takes a checkpoint's path or its weights, not both")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("weights given in memory are read by one process: with tensor_parallel_size "
                             f"{self.config.tensor_parallel_size}, save them as a checkpoint and give its path")
        if self.runner.image_encoder is not None:
            raise ValueError(f"{self.model_config.architecture}'s encoder reads its weights from a checkpoint: "
                             "save them as one and give its path")
        self._reload(weights)
        self.source = None
        logger.info("serving the weights given (%d tensors)", len(weights))

    def _reload(self, source: Path | dict[str, torch.Tensor], whole_config: Any = None) -> None:
        self.runner.reload_weights(source, whole_config)
        if isinstance(self.proposer, HiddenStateProposer):
            self.proposer.reload_weights(source, self.runner.model)
        self.forget_prefixes()
