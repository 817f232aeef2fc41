"""Starting beside packages that would break loading: refused at once, naming the package."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker import LLM


def test_an_engine_refuses_to_start_beside_hugging_faces_kernels_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hugging Face's `kernels` shares genq's Triton package's import name; with it installed
    transformers would import genq's and fail deep in a model's load."""
    dist = tmp_path / "kernels-0.19.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"Hugging Face's `kernels` package \(0\.19\.1\) is installed"):
        LLM(model=str(tmp_path / "never-read"))
