"""Engine tests use the model fixtures from tests/conftest.py, and this one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shape_only(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config and tokenizer, without its weights (for load_format="dummy")."""
    out = tmp_path_factory.mktemp("shape-only")
    for path in tiny_llama_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    return out
