"""Custom logits processors (vLLM's `logits_processors` engine argument, per-request
`extra_args`): genq's NoRepeatNGram against transformers' `no_repeat_ngram_size`, a processor
whose function fails ending its own request only, and refusals by name."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM, RequestsFailed

NO_REPEAT = "worker.sample.logits_processors:NoRepeatNGram"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21, 22, 20, 21]]
# prompts whose greedy continuations on the tiny Llama repeat an n-gram (the prompt's last
# n - 1 tokens and the next token are its first ones), for n = 1, 2, 3
REPEATING = [([1, 2, 3, 4, 5, 6, 7, 8], 1), ([6, 19425, 3, 1, 4, 1, 5, 9, 2, 6], 2),
             ([1644, 1565, 21641, 276, 1166, 1736, 1644, 1565], 3)]


class FailsAfter:
    """Test processor: its function raises once a request has `fail_after` output tokens."""

    def __init__(self, config: Any) -> None:
        self.calls = 0

    def new_req_logits_processor(self, params: SamplingParams):
        limit = (params.extra_args or {}).get("fail_after")
        if limit is None:
            return None
        if not isinstance(limit, int):
            raise ValueError(f"fail_after must be an int, got {limit!r}")

        def check(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if len(output_ids) >= limit:
                raise RuntimeError(f"{len(output_ids)} tokens is too many")
            return logits

        return check


class CountUp:
    """Test processor: each row may only be `count_from` + the tokens generated before it."""

    def __init__(self, config: Any) -> None:
        pass

    def new_req_logits_processor(self, params: SamplingParams):
        start = (params.extra_args or {}).get("count_from")
        if start is None:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            forced = torch.full_like(logits, float("-inf"))
            forced[start + len(output_ids)] = 0.0
            return forced

        return force


def hf_no_repeat(model_dir, prompt: list[int], size: int, max_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, no_repeat_ngram_size=size)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram-guesses"])
def test_no_repeat_ngram_is_transformers(tiny_llama_dir, speculative):
    """Each row a request samples from gets its function's treatment, with the tokens before
    it (a row after guesses sees them as generated); requests without settings are untouched."""
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}} if speculative else {}
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, logits_processors=[NO_REPEAT], **spec)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"no_repeat_ngram_size": size})
              for _, size in REPEATING]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in REPEATING], params, use_tqdm=False)
    for out, (prompt, size) in zip(outs, REPEATING, strict=True):
        assert out.outputs[0].token_ids == hf_no_repeat(tiny_llama_dir, prompt, size, 24)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": p} for p, _ in REPEATING], plain, use_tqdm=False)
    assert all(f.outputs[0].token_ids != o.outputs[0].token_ids for f, o in zip(free, outs, strict=True))
    assert not llm.engine.logits_processors.by_request  # forgotten as requests end


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["", "async"])
def test_a_failing_function_ends_its_own_request(tiny_llama_dir, async_scheduling):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, logits_processors=[FailsAfter],
              async_scheduling=async_scheduling)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    failing = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2, extra_args={"fail_after": 3})
    expected = llm.generate([{"prompt_token_ids": PROMPTS[0]}], plain, use_tqdm=False)[0].outputs[0].token_ids
    why = "logits processor test_logits_processors.FailsAfter failed: RuntimeError: 3 tokens is too many"
    with pytest.raises(RequestsFailed, match=re.escape(f"1 of 2 prompts failed as they ran (prompt 1: {why}); ")) as failed:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}], [plain, failing],
                     use_tqdm=False)
    outs = failed.value.outputs
    assert outs[0].outputs[0].token_ids == expected and outs[0].outputs[0].finish_reason == "length"
    # the whole request ends (both samples, the second a step behind the first: it forks
    # after the prompt), what it had before the failing step kept
    assert [(c.finish_reason, len(c.token_ids)) for c in outs[1].outputs] == [("abort", 3), ("abort", 2)]
    assert failed.value.failures == {1: why}
    assert llm.engine.take_failures() == {} and not llm.engine.logits_processors.by_request
    # the engine serves on, and an earlier run's failure is not the next one's
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], plain, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_bad_settings_and_processors_are_refused_by_name(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
              logits_processors=[NO_REPEAT, FailsAfter])
    with pytest.raises(ValueError, match="logits processor worker.sample.logits_processors:NoRepeatNGram: "
                                         "no_repeat_ngram_size must be an int >= 1, got 0"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(extra_args={"no_repeat_ngram_size": 0}, n=2))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.logits_processors.by_request
    assert not llm.engine.generators
    with pytest.raises(ValueError, match="extra_args must be a JSON object"):
        SamplingParams(extra_args={"x": object()})
    with pytest.raises(ValueError, match="logits processor 'nowhere.at_all:Thing' cannot be imported"):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, logits_processors=["nowhere.at_all:Thing"])
    with pytest.raises(ValueError, match="has no new_req_logits_processor"):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, logits_processors=["worker.config.EngineConfig"])


def test_rows_after_guesses_see_the_guesses_as_generated(tiny_llama_dir):
    """The prompt counts up, so n-gram lookup guesses the next few counts; each guess row must
    see the guesses before it as output for the counting to go on (and the guesses are kept)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, logits_processors=[CountUp],
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompt = list(range(100, 130)) + [7]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                   extra_args={"count_from": 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == list(range(100, 116))
    assert llm.engine.speculator.stats.num_accepted_tokens >= 8
