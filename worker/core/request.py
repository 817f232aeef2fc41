"""A request's state inside the engine. Plain Python: the scheduler reads and updates it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


NO_TOKEN = -1  # between the parts of a request's n-gram lookup


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Tokens generated so far. A resumed job starts with the tokens it had already emitted.
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Chained hashes of this request's full blocks, extended as tokens are added.
    block_hashes: list[int] = field(default_factory=list)
    max_tokens: int = 0  # resolved limit on len(output_token_ids)
    lora_id: int = 0  # the adapter it runs with (LoRARequest.lora_int_id); 0: the base model
    # Guessed next tokens (speculative decoding), computed with its next decode step; the
    # step's sampling decides how many were right.
    spec_token_ids: list[int] = field(default_factory=list)
    # An embedding request: its prompt is computed, its last position pooled, and it ends
    # there, sampling nothing.
    pooling_params: PoolingParams | None = None
    # sampling_params.bad_words as token sequences (each word as written and after a space)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # the prompt's images: (offset, length, digest of its pixels) each, hashed into the
    # prefix-cache keys of the blocks their tokens fill
    image_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # position ranges [start, end) whose tokens attend to each other both ways (Gemma 3's
    # images): a prefill chunk never ends inside one, so each is computed whole
    whole_spans: list[tuple[int, int]] = field(default_factory=list)
    # the prompt came as embeddings (worker.core.prompt_embeds): its token ids are placeholders
    given_embeds: bool = False
    # vLLM's cache_salt: its blocks are cached under keys salted with it, so only requests
    # with the same salt share them (a tenant's prompts cannot be probed by another's timing)
    cache_salt: str | None = None
    # sampling_params.prediction's tokens: an n-gram proposer looks for guesses in them too
    prediction_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_tokens_seen(self) -> list[int]:
        """The prompt's tokens as penalties and logits processors read them: none for a prompt
        given as embeddings."""
        return [] if self.given_embeds else self.prompt_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def lookup_token_ids(self) -> list[int]:
        """What an n-gram proposer searches: the prompt, the predicted output and the output,
        apart (-1 is no token: nothing matches across it, and a guess stops at it)."""
        if not self.prediction_token_ids:
            return self.all_token_ids
        return [*self.prompt_token_ids, NO_TOKEN, *self.prediction_token_ids, NO_TOKEN, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying both."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self, policy: str) -> tuple[float, ...]:
        """Lower runs first; for `priority`, lower value first and ties by arrival."""
        if policy == "priority":
            return (self.priority, self.arrival_time)
        return (self.arrival_time,)
