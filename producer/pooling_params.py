"""PoolingParams: vLLM's parameters of an embedding request (`LLM.embed`, the `embed` jobs
behind `/v1/embeddings`). Plain Python, shared by the producer, the worker and the API."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from producer.field_mappings import from_mapping


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt becomes one vector: the final hidden state (after the model's last norm)
    of its last token, as vLLM pools decoder models, scaled to unit length unless
    `normalize` is False; with `dimensions` (a Matryoshka model's, OpenAI's and vLLM's name)
    only its first that many values, scaled so."""

    normalize: bool = True
    # vLLM's: pool only the last k tokens of a longer prompt (-1: as many as max_model_len
    # allows); None: a prompt longer than max_model_len is refused
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive number of tokens or -1, got {k!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive number, got {d!r}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["dimensions"] is None:  # unset, a job reads as it did before them
            del data["dimensions"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> PoolingParams:
        """Build from a decoded payload; unknown fields are an error, not silently dropped."""
        return from_mapping(cls, data, "pooling_params", "pooling parameter(s)")
