"""Beam search's bookkeeping, shared by the API (`use_beam_search`, over the queue) and the
offline `LLM.beam_search`: plain Python over (token id, logprob) alternatives, as vLLM runs
beam search outside its engine. Each step, every live beam's likeliest next tokens come from
a one-token greedy request with logprobs; `step` keeps the `width` best continuations by
total log-probability, and `best` ranks what is left by logprob / length ** length_penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprob: float = 0.0  # their total log-probability
    finish_reason: str | None = None  # "stop" (an end of sequence) or "length"

    def score(self, length_penalty: float) -> float:
        return self.logprob / max(len(self.tokens), 1) ** length_penalty


def step(
    live: Sequence[Beam], alternatives: Sequence[Sequence[tuple[int, float]]], width: int, eos: set[int]
) -> tuple[list[Beam], list[Beam]]:
    """(the next live beams, the beams finished this step). `alternatives[i]` are live beam
    i's next tokens with their logprobs (at least 2 x width of them, so `width` survive
    however many end). An end of sequence ranked among the `width` best candidates finishes
    its beam; a worse one is dropped, as transformers does."""
    candidates = sorted(
        ((beam.logprob + lp, beam, token) for beam, tops in zip(live, alternatives, strict=True) for token, lp in tops),
        key=lambda c: -c[0],
    )
    nxt: list[Beam] = []
    done: list[Beam] = []
    for rank, (logprob, beam, token) in enumerate(candidates):
        if token in eos:
            if rank < width:
                done.append(Beam(beam.tokens + [token], logprob, "stop"))
            continue
        nxt.append(Beam(beam.tokens + [token], logprob))
        if len(nxt) == width:
            break
    return nxt, done


def best(done: list[Beam], live: list[Beam], n: int, length_penalty: float) -> list[Beam]:
    """The `n` best beams once the search stops: finished ones and those still live (cut
    at the length limit)."""
    ended = done + [Beam(b.tokens, b.logprob, "length") for b in live]
    return sorted(ended, key=lambda b: -b.score(length_penalty))[:n]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in [1, 10], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
