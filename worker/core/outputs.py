"""What the engine returns: vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop string or token id that stopped it
    logprobs: list[Any] | None = None  # per generated token: TokenLogprobs
    # Whisper, asked by extra_args {"token_timestamps": true}: on the final output, where in
    # the audio (seconds) each of the completion's tokens was said (all of them)
    token_timestamps: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    prompt_logprobs: list[Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    embedding: list[float] | None = None  # an embedding request's vector (its final output)
    # the prompt's positions: len(prompt_token_ids), or those of a prompt given as embeddings
    # (prompt_token_ids empty then)
    num_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax of the score head's logits, one per label


@dataclass
class ClassificationRequestOutput:
    """What `LLM.classify` returns per prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`: its generated tokens and their text."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None  # "stop" (an end of sequence) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best first
