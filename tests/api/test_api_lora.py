"""LoRA adapters through the OpenAI-compatible API, as vLLM serves them: each adapter is a
model of its own in /v1/models (its `parent` the base model) and in a request's `model`.
A live stack whose worker serves two adapters; outputs match the offline engine's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def live_worker(stack_redis: RedisServer, tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path],
                run_worker, tmp_path_factory) -> Iterator[str]:
    """The module's worker, serving adapters `all` and `qv` beside the tiny Llama."""
    args = ("--lora-modules", f"all={tiny_llama_adapters['all']}", f"qv={tiny_llama_adapters['qv']}",
            "--max-loras", "2", "--max-lora-rank", "8")
    with run_worker(stack_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("worker"), args) as url:
        yield url


@pytest.fixture(scope="module")
def oai(api_url: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path, tiny_llama_adapters: dict[str, Path]):
    from worker import LLM
    from worker.lora_request import LoRARequest

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    requests = {"all": LoRARequest("all", 1, str(tiny_llama_adapters["all"])),
                "qv": LoRARequest("qv", 2, str(tiny_llama_adapters["qv"])), "tiny-llama": None}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def text(model: str, prompt: str | None = None) -> str:
        if prompt is None:
            return llm.chat(MESSAGES, params, use_tqdm=False, lora_request=requests[model])[0].outputs[0].text
        return llm.generate(prompt, params, use_tqdm=False, lora_request=requests[model])[0].outputs[0].text

    return text


def test_models_lists_adapters_with_their_parent(served_model: str, oai: openai.OpenAI) -> None:
    cards = {m.id: m for m in oai.models.list()}
    assert list(cards) == [served_model, "all", "qv"]
    assert [getattr(cards[m], "parent", None) for m in cards] == [None, served_model, served_model]
    card = oai.models.retrieve("qv")
    assert (card.id, card.parent, card.max_model_len) == ("qv", served_model, 1024)


@pytest.mark.parametrize("model", ["tiny-llama", "all", "qv"])
def test_completions_and_chat_run_with_the_named_adapter(model: str, oai: openai.OpenAI, offline) -> None:
    prompt = "The capital of France is"
    completion = oai.completions.create(model=model, prompt=prompt, **GREEDY)
    assert (completion.model, completion.choices[0].text) == (model, offline(model, prompt))
    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, stream=True, **GREEDY))
    assert {c.model for c in chunks} == {model}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline(model)


def test_outputs_differ_by_adapter(oai: openai.OpenAI) -> None:
    texts = {m: oai.completions.create(model=m, prompt="Once upon a time", **GREEDY).choices[0].text
             for m in ("tiny-llama", "all", "qv")}
    assert len(set(texts.values())) == 3


def test_an_adapter_no_worker_serves_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="sql-lora", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and "all, qv" in info.value.body["message"]
