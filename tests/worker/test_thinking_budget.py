"""Thinking budgets (vLLM's thinking_token_budget): past the budget the end of the thinking is
forced, and the reply goes on as the engine would go on from a prompt that held it. The
oracle is the engine itself, unconstrained, on the prompt with the thinking it wrote and the
end marker appended (greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.sample.thinking_budget import ThinkingMarkers, ThinkingState

MARKERS = {"think_start_str": "<think>", "think_end_str": "</think>"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    return list(llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, reasoning_config=MARKERS)


@pytest.fixture(scope="module")
def markers(llm: LLM) -> ThinkingMarkers:
    found = ThinkingMarkers.from_config(MARKERS, llm.engine.tokenizer)
    assert found is not None and len(found.end) > 1  # the tiny tokenizer spells </think> in pieces
    return found


def thinking_prompt(llm: LLM, markers: ThinkingMarkers, text: str = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,") -> list[int]:
    """A prompt whose template has opened the thinking (as DeepSeek-R1's does)."""
    return llm.engine.tokenizer.encode(text, add_special_tokens=False) + list(markers.start)


@pytest.mark.parametrize("budget", [0, 5])
def test_the_end_is_forced_once_the_budget_is_spent(llm: LLM, markers: ThinkingMarkers, budget: int) -> None:
    prompt = thinking_prompt(llm, markers)
    free = generate(llm, prompt, greedy(16))
    assert not any(free[i:i + len(markers.end)] == list(markers.end) for i in range(len(free)))
    thought = free[:budget]
    rest = 16 - budget - len(markers.end)
    after = generate(llm, prompt + thought + list(markers.end), greedy(rest))
    budgeted = generate(llm, prompt, greedy(16, thinking_token_budget=budget))
    assert budgeted == thought + list(markers.end) + after
    # guesses (n-gram speculation) change nothing: a row after guesses is forced as if they were kept
    speculative = LLM(str(llm.engine.model_path), dtype="float32", num_gpu_blocks_override=256,
                      reasoning_config=MARKERS, speculative_config=NGRAM)
    assert generate(speculative, prompt, greedy(16, thinking_token_budget=budget)) == budgeted
    assert speculative.engine.speculator.stats.num_drafts > 0


def test_a_resumed_reply_keeps_the_budget_it_had_spent(llm: LLM, markers: ThinkingMarkers) -> None:
    """A job taken over from a worker that died goes on from the tokens it had sent (their
    thinking counted): its reply is the one it would have been."""
    prompt = thinking_prompt(llm, markers)
    params = greedy(16, thinking_token_budget=5)
    whole = generate(llm, prompt, params)
    llm.engine.add_request("resumed", {"prompt_token_ids": prompt}, params, resume_output_token_ids=whole[:3])
    rest: list[int] = []
    while llm.engine.has_unfinished_requests():
        rest += [t for out in llm.engine.step() for t in out.outputs[0].token_ids]
    assert whole[:3] + rest == whole


def test_a_reply_that_is_not_thinking_is_left_alone(llm: LLM, markers: ThinkingMarkers) -> None:
    prompt = llm.engine.tokenizer.encode("1, 2, 3, 4, 1, 2, 3,", add_special_tokens=False)
    assert generate(llm, prompt, greedy(12, thinking_token_budget=0)) == generate(llm, prompt, greedy(12))
    # nor one whose thinking ended in the prompt
    ended = thinking_prompt(llm, markers) + llm.engine.tokenizer.encode(" hm", add_special_tokens=False) + list(markers.end)
    assert generate(llm, ended, greedy(12, thinking_token_budget=0)) == generate(llm, ended, greedy(12))


def test_each_completion_has_its_own_budget(llm: LLM, markers: ThinkingMarkers) -> None:
    prompt = thinking_prompt(llm, markers)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=True, thinking_token_budget=4)
    outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs
    assert len({tuple(o.token_ids) for o in outputs}) > 1
    for output in outputs:
        assert list(output.token_ids[4:4 + len(markers.end)]) == list(markers.end)


def test_markers_in_the_output_open_and_close_thinking() -> None:
    """The state over token ids: thinking opened in the output counts from there; a natural end
    stops the count; forcing goes a token at a time; each thinking has the budget anew."""
    markers = ThinkingMarkers(start=(7, 8), end=(9, 10))
    state = ThinkingState(markers, budget=2)
    state.feed([1, 2, 7])
    assert state.due() is None and not state.thinking
    state.feed([8])
    assert state.thinking and state.due() is None
    state.feed([3, 4])
    assert state.due() == 9
    state.feed([9])
    assert state.due() == 10
    state.feed([10])
    assert not state.thinking and state.due() is None
    state.feed([5, 7, 8])  # thinking again, with the whole budget
    assert state.thinking and state.due() is None
    state.feed([6, 9, 10, 6, 6, 6])  # thought 1 token, then ended it itself
    assert not state.thinking and state.due() is None
    state.feed([7, 8, 1])
    assert state.due() is None
    state.feed([1])
    assert state.due() == 9


def test_known_tags_are_the_markers_where_they_are_tokens(tiny_llama_dir: Path) -> None:
    """Without a reasoning_config: the first known pair the tokenizer holds whole (Magistral's
    here), none where it holds none."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert ThinkingMarkers.from_config(None, tokenizer) is None
    tokenizer.add_tokens(["[THINK]", "[/THINK]", "</think>"], special_tokens=True)
    start, end = tokenizer.convert_tokens_to_ids(["[THINK]", "[/THINK]"])
    assert ThinkingMarkers.from_config(None, tokenizer) == ThinkingMarkers((start,), (end,))


def test_a_budget_the_worker_cannot_keep_is_refused_by_name(tiny_llama_dir: Path) -> None:
    plain = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)  # no <think> token, no markers
    with pytest.raises(ValueError, match="thinking_token_budget needs the thinking's markers"):
        plain.generate(["Hi"], greedy(4, thinking_token_budget=3), use_tqdm=False)
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(ValueError, match="reasoning_config must give think_start_str and think_end_str"):
        LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, reasoning_config={"think_start_str": "<t>"})
