"""A model's generation_config.json, as vLLM reads it: the sampling values requests that
leave them unset take (vLLM's `generation_config` and `override_generation_config`), and the
end-of-sequence ids it lists beside config.json's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from producer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# what vLLM takes from a model's generation_config.json as its requests' sampling defaults,
# and the SamplingParams field each becomes
SAMPLING_DEFAULT_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_path: Path, generation_config: str, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's generation_config: "auto", the sampling values of the model's
    generation_config.json (Qwen3's temperature 0.6, top_p 0.95, top_k 20, ...; its
    max_new_tokens as max_tokens), which requests that leave them unset take; "vllm", none; else a directory whose
    generation_config.json to read; then vLLM's override_generation_config, values under the
    same names that replace or add to those. ValueError naming a value SamplingParams refuses."""
    unknown = sorted(set(override or {}) - set(SAMPLING_DEFAULT_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config takes {', '.join(SAMPLING_DEFAULT_KEYS)}, got {unknown[0]!r}")
    named = generation_config not in ("auto", "vllm")  # a directory
    path = (Path(generation_config).expanduser() if named else model_path) / "generation_config.json"
    if named and not path.is_file():
        raise ValueError(f"generation_config {generation_config!r} holds no generation_config.json")
    values = json.loads(path.read_text()) if generation_config != "vllm" and path.is_file() else {}
    values.update(override or {})
    found = {field: values[k] for k, field in SAMPLING_DEFAULT_KEYS.items() if values.get(k) is not None}
    try:
        SamplingParams(**found)
    except (ValueError, TypeError) as exc:
        where = f"{path} with override_generation_config" if override else str(path)
        raise ValueError(f"{where}: {exc}") from exc
    if found:
        logger.info("requests that leave them unset sample with the model's generation config: %s", found)
    return found


def generation_eos(model_path: Path) -> set[int]:
    """The EOS ids of the model's generation_config.json, which may list more than config.json
    (gpt-oss ends a reply at <|return|> and at a tool call's <|call|>; Llama 3's instruct
    models at <|eot_id|>), as vLLM and transformers' generate stop at them."""
    return _token_ids(generation_config_of(model_path).get("eos_token_id"))


def generation_config_of(model_path: Path) -> dict[str, Any]:
    """The model's generation_config.json ({} without one)."""
    path = model_path / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_ids(ids: Any) -> set[int]:
    """A generation config's token ids: one, a list, or none."""
    if ids is None:
        return set()
    return {int(t) for t in (ids if isinstance(ids, list) else [ids])}
