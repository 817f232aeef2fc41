"""`/tokenize` and `/detokenize` against a live stack: the token ids are the ones the worker's
tokenizer and chat template give (transformers, loaded from the model directory, is the
oracle), from the tokenizer the worker published in Redis."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from producer.chat_template import render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 日本 🙂"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_a_prompt_counts_as_the_worker_counts_it(http: httpx.Client, served_model: str, tokenizer) -> None:
    text = "The capital of France is Paris. 日本 🙂"
    out = http.post("/tokenize", json={"model": served_model, "prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = http.post("/detokenize", json={"model": served_model, "tokens": out["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(out["tokens"])


def test_workers_publish_the_models_end_of_sequence_ids(live_worker: str, served_model: str, tokenizer,
                                                        tiny_llama_dir: Path) -> None:
    """Beside the tokenizer's files: the ids that end a sequence for the model (its config's
    and the tokenizer's), which the API's beam search stops at."""
    import redis
    from transformers import AutoConfig

    from producer.protocol import TOKENIZER_EOS_FIELD, Keys

    configured = AutoConfig.from_pretrained(tiny_llama_dir).eos_token_id
    expected = ({configured} if isinstance(configured, int) else set(configured or [])) | {tokenizer.eos_token_id}
    conn = redis.Redis.from_url(live_worker)
    published = conn.hget(Keys().tokenizer(served_model), TOKENIZER_EOS_FIELD)
    conn.close()
    assert {int(t) for t in published.decode().split(",")} == expected


def test_messages_count_as_a_chat_job_would(http: httpx.Client, served_model: str, tokenizer) -> None:
    out = http.post("/tokenize", json={"model": served_model, "messages": MESSAGES}).json()
    assert out["tokens"] == render_chat(tokenizer, MESSAGES)["prompt_token_ids"]
    prefix = MESSAGES + [{"role": "assistant", "content": "Hello"}]
    continued = http.post("/tokenize", json={"messages": prefix, "continue_final_message": True,
                                             "add_generation_prompt": False}).json()
    assert continued["tokens"] == render_chat(tokenizer, prefix, continue_final_message=True)["prompt_token_ids"]
    # the chat endpoint's usage counts the same prompt
    chat = http.post("/v1/chat/completions", json={"model": served_model, "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"model": "gpt-nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, 400, "messages"),
])
def test_bad_requests_name_what_is_wrong(http: httpx.Client, path: str, body: dict, status: int, param) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status
    if param is not None:
        assert response.json()["error"]["param"] == param
