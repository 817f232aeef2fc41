"""The model's generation_config.json sampling values through the API: the worker reports
them in its heartbeat and the API gives them to requests that leave those fields unset (as
vLLM's server does), checked against the offline engine with the values given."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams
from worker import LLM

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.fixture(scope="module")
def live_worker(stack_redis: RedisServer, tuned_llama_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tuned_llama_dir, tmp_path_factory.mktemp("worker")) as url:
        yield url


def test_unset_fields_take_the_models_values(served_model: str, oai: openai.OpenAI, tuned_llama_dir: Path) -> None:
    offline = LLM(str(tuned_llama_dir), dtype="float32", num_gpu_blocks_override=64)

    def expected(**params) -> str:
        given = SamplingParams(max_tokens=16, ignore_eos=True, **params)
        return offline.generate({"prompt_token_ids": PROMPT}, given, use_tqdm=False)[0].outputs[0].text

    body = {"model": served_model, "prompt": PROMPT, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    # nothing set: the model's top_k 1 (greedy) and repetition penalty
    assert oai.completions.create(**body).choices[0].text == expected(temperature=0.0, repetition_penalty=1.5)
    # what a request sets wins, field by field
    unpenalized = {**body, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.0}}
    assert oai.completions.create(**unpenalized).choices[0].text == expected(temperature=0.0)
    assert expected(temperature=0.0) != expected(temperature=0.0, repetition_penalty=1.5)


def test_a_chat_that_leaves_max_tokens_unset_takes_the_models_max_new_tokens(served_model: str, oai: openai.OpenAI) -> None:
    """vLLM reads generation_config's max_new_tokens as max_tokens; a request's own value wins."""
    messages = [{"role": "user", "content": "Go on."}]
    unset = oai.chat.completions.create(model=served_model, messages=messages, extra_body={"ignore_eos": True})
    assert (unset.usage.completion_tokens, unset.choices[0].finish_reason) == (20, "length")
    given = oai.chat.completions.create(model=served_model, messages=messages, max_completion_tokens=24,
                                        extra_body={"ignore_eos": True})
    assert given.usage.completion_tokens == 24
    completion = oai.completions.create(model=served_model, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16  # OpenAI's default for completions
