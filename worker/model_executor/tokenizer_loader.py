"""Tokenizers read from a local directory, each directory's read once per process.

transformers reads a tokenizer's files anew each time, `tokenizer.json` parsed in Python as
well as by the Rust tokenizer: 0.17 s for the default model's 49k vocabulary, most of what
building a small model's engine costs. A process that builds several engines of one model (an offline script, a trainer that
starts a fresh `LLM`, a test run) gets a copy of the tokenizer it read before: its Python
state its own (an engine sets its chat template on it), the Rust tokenizer under it shared,
as one engine's threads already share it (genq never adds tokens to it)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer

TOKENIZERS_KEPT = 4  # directories whose tokenizer is kept (about 20 MiB each for a 49k vocabulary)


def load_tokenizer(tokenizer: str | None, model_path: Path) -> Any:
    """The tokenizer of `tokenizer` (a local directory) if given, else the model's."""
    if tokenizer is None:
        return _read_or_copy(model_path)
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer {tokenizer!r} is not a local directory (genq never downloads)")
    try:
        return _read_or_copy(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {tokenizer!r}: {exc}") from exc


def _read_or_copy(directory: Path) -> Any:
    """A copy of the tokenizer this process read from `directory`, read now if it has none (or
    a file changed since)."""
    read = _read(directory.resolve(), _signature(directory))
    shared = {id(v): v for v in vars(read).values() if isinstance(v, Tokenizer)}  # (the Rust tokenizer)
    return copy.deepcopy(read, shared)


def _signature(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """Each file's name, size and modification time: a file written since is read again."""
    stats = ((p.name, p.stat()) for p in directory.iterdir() if p.is_file())
    return tuple(sorted((name, s.st_size, s.st_mtime_ns) for name, s in stats))


@functools.lru_cache(maxsize=TOKENIZERS_KEPT)
def _read(directory: Path, signature: tuple[tuple[str, int, int], ...]) -> Any:
    return AutoTokenizer.from_pretrained(directory)
