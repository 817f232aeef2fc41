"""Workloads shared by the benchmarks. W1: 128 random-token prompts, input length uniform in
[32, 256], output length uniform in [16, 256], ignore_eos, greedy, seed 0."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RandomWorkload:
    num_prompts: int = 128
    input_len_range: tuple[int, int] = (32, 256)
    output_len_range: tuple[int, int] = (16, 256)
    seed: int = 0
    vocab_size: int = 49152
    first_token_id: int = 3  # the default tokenizer's special tokens are 0..2: keep them out

    @classmethod
    def from_lengths(cls, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                     seed: int = 0, vocab_size: int = 49152) -> RandomWorkload:
        """vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)]."""
        return cls(num_prompts, _bounds(input_len, range_ratio), _bounds(output_len, range_ratio), seed, vocab_size)

    def requests(self) -> list[tuple[list[int], int]]:
        """(prompt token ids, output length) per request, the same for every mode of a run."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_prompts):
            n_in, n_out = rng.randint(*self.input_len_range), rng.randint(*self.output_len_range)
            out.append(([rng.randrange(self.first_token_id, self.vocab_size) for _ in range(n_in)], n_out))
        return out

    def describe(self) -> dict:
        return asdict(self)


def _bounds(mean: int, ratio: float) -> tuple[int, int]:
    return max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))


W1 = RandomWorkload()
