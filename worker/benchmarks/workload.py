"""Benchmark workloads, and the figures every mode of `genq bench throughput` reports for one
(`summarize`). W1: 128 prompts of random token ids, input length uniform in [32, 256], output
length uniform in [16, 256], ignore_eos, greedy, seed 0."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from producer.sampling_params import SamplingParams


class Workload(Protocol):
    def prompts(self) -> list[Any]: ...
    def sampling_params(self) -> list[SamplingParams]: ...
    def token_requests(self, tokenizer) -> list[tuple[list[int], int]]: ...
    def describe(self) -> dict[str, Any]: ...


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
                     seed: int = 0) -> RandomWorkload:
        """vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)]."""
        return cls(num_prompts, _bounds(input_len, range_ratio), _bounds(output_len, range_ratio), seed)

    def requests(self) -> list[tuple[list[int], int]]:
        """(prompt token ids, output length) per request, the same for every mode of a run."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_prompts):
            n_in, n_out = rng.randint(*self.input_len_range), rng.randint(*self.output_len_range)
            out.append(([rng.randrange(self.first_token_id, self.vocab_size) for _ in range(n_in)], n_out))
        return out

    def prompts(self) -> list[Any]:
        return [{"prompt_token_ids": ids} for ids, _ in self.requests()]

    def sampling_params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in self.requests()]

    def token_requests(self, tokenizer=None) -> list[tuple[list[int], int]]:
        return self.requests()

    def describe(self) -> dict[str, Any]:
        return {"kind": "random", **asdict(self)}


@dataclass(frozen=True)
class DatasetWorkload:
    """Prompts from a JSONL file: one {"prompt": str, "max_tokens": int} per line."""

    path: str
    items: tuple[tuple[str, int], ...]

    def prompts(self) -> list[Any]:
        return [prompt for prompt, _ in self.items]

    def sampling_params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in self.items]

    def token_requests(self, tokenizer) -> list[tuple[list[int], int]]:
        return [(tokenizer.encode(prompt), n) for prompt, n in self.items]

    def describe(self) -> dict[str, Any]:
        return {"kind": "dataset", "path": self.path, "num_prompts": len(self.items)}


def load_dataset(path: Path, limit: int | None = None, default_max_tokens: int = 128) -> DatasetWorkload:
    items = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append((str(row["prompt"]), int(row.get("max_tokens", default_max_tokens))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: expected {{'prompt': str, 'max_tokens': int}}: {e}") from None
    return DatasetWorkload(str(path), tuple(items[:limit] if limit else items))


def _bounds(mean: int, ratio: float) -> tuple[int, int]:
    return max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))


W1 = RandomWorkload()


def summarize(elapsed: float, num_requests: int, num_in: int, num_out: int) -> dict[str, Any]:
    """The figures of one timed run of a workload, the same keys whichever mode ran it."""
    return {
        "elapsed_s": round(elapsed, 4),
        "requests_per_s": round(num_requests / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 1),
        "num_requests": num_requests,
        "input_tokens": num_in,
        "output_tokens": num_out,
    }
