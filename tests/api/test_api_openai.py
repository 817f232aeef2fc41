"""The OpenAI-compatible endpoints against a live stack (Redis, a real worker on the tiny
Llama, uvicorn), driven by the official `openai` client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import redis

from api.settings import Settings
from producer.protocol import Keys, decode_job
from producer.sampling_params import SamplingParams
from worker import LLM

MESSAGES = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_workers_model(served_model: str, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list()] == [served_model]
    card = oai.models.retrieve(served_model)
    assert (card.id, card.object, card.max_model_len) == (served_model, "model", 1024)
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-nope")


def test_unknown_model_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"


def test_chat_non_streaming_carries_usage(served_model: str, oai: openai.OpenAI) -> None:
    response = oai.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY)
    assert response.object == "chat.completion" and response.model == served_model
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    usage = response.usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_usage_counts_prompt_tokens_the_prefix_cache_served(served_model: str, oai: openai.OpenAI) -> None:
    prompt = "A prompt long enough to fill two blocks of sixteen tokens in the worker's cache. " * 2
    first = oai.completions.create(model=served_model, prompt=prompt, max_tokens=2)
    again = oai.completions.create(model=served_model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens  # whole blocks


def test_reset_prefix_cache_empties_the_workers_caches(served_model: str, oai: openai.OpenAI, live_worker: str,
                                                      serve_api) -> None:
    """vLLM's POST /reset_prefix_cache, under GENQ_SERVER_DEV_MODE alone: it answers once the
    worker said (at its next heartbeat) that it emptied its cache, so the prompt it served from
    memory is computed again by the very next request."""
    prompt = "A prompt the worker is asked to forget, long enough for two blocks of sixteen tokens. " * 2

    def cached() -> int:
        return oai.completions.create(model=served_model, prompt=prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    with serve_api(Settings(redis_url=live_worker)) as url:
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 404
    with serve_api(Settings(redis_url=live_worker, server_dev_mode=True)) as url:
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
    assert cached() == 0
    assert cached() > 0  # and the cache serves on


def test_a_cache_salt_keeps_a_prompts_cached_blocks_to_its_own_salt(served_model: str, oai: openai.OpenAI) -> None:
    """vLLM's cache_salt, through the queue to the worker's prefix cache."""
    prompt = "Another prompt long enough to fill two blocks of sixteen tokens in the worker's cache. " * 2

    def cached(salt: str | None, **kwargs) -> int:
        extra = {"cache_salt": salt} if salt else {}
        if kwargs.get("chat"):
            reply = oai.chat.completions.create(model=served_model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=2, extra_body=extra)
        else:
            reply = oai.completions.create(model=served_model, prompt=prompt, max_tokens=2, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("s3cret-a") == 0
    assert cached("s3cret-b") == 0 and cached(None) == 0  # neither another salt nor none shares them
    assert cached("s3cret-a") > 0 and cached(None) > 0
    assert cached("s3cret-a", chat=True) == 0 and cached("s3cret-a", chat=True) > 0
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served_model, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})
    assert info.value.body["param"] == "cache_salt"


def test_prompt_cache_key_reaches_the_jobs_the_workers_steer_by_it(
    served_model: str, oai: openai.OpenAI, shared_redis
) -> None:
    """OpenAI's prompt_cache_key, from chat, completions and the Responses API, onto the job
    (worker.queue.affinity sends a key's jobs to the worker that ran the last one)."""
    oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=1, prompt_cache_key="conv-1")
    oai.completions.create(model=served_model, prompt="x", max_tokens=1, extra_body={"prompt_cache_key": "conv-2"})
    oai.responses.create(model=served_model, input="x", max_output_tokens=1, prompt_cache_key="conv-3")
    conn = redis.Redis.from_url(shared_redis.url)
    entries = conn.xrevrange(Keys().requests, count=3)
    assert sorted(decode_job(fields).prompt_cache_key for _, fields in entries) == ["conv-1", "conv-2", "conv-3"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served_model, prompt="x", max_tokens=1, extra_body={"prompt_cache_key": ""})
    assert info.value.body["param"] == "prompt_cache_key"


def test_chat_streaming_matches_non_streaming(served_model: str, oai: openai.OpenAI) -> None:
    expected = oai.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY)
    chunks = list(oai.chat.completions.create(
        model=served_model, messages=MESSAGES, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    ))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == expected.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_count_each_choice_so_far(served_model: str, oai: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk an event brings carries its
    choice's usage so far (the role chunks go out before the worker has counted the prompt:
    null there), and the last chunk the request's."""
    expected = oai.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY)
    prompt_tokens = expected.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(
        model=served_model, messages=MESSAGES, stream=True, n=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY,
    ))
    role_chunks, event_chunks, last = chunks[:2], chunks[2:-1], chunks[-1]
    assert all(c.usage is None and c.choices[0].delta.role == "assistant" for c in role_chunks)
    counts: dict[int, int] = {0: 0, 1: 0}
    for chunk in event_chunks:
        (choice,) = chunk.choices
        assert chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.completion_tokens > counts[choice.index]  # each chunk brought tokens
        assert chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens
        counts[choice.index] = chunk.usage.completion_tokens
    assert counts == {0: 12, 1: 12}
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 24)
    # completions too; without continuous_usage_stats, null until the last chunk
    chunks = list(oai.completions.create(
        model=served_model, prompt="Once upon", stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY,
    ))
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == 12
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in chunks)
    chunks = list(oai.completions.create(
        model=served_model, prompt="Once upon", stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}, **GREEDY,
    ))
    assert all(c.usage is None for c in chunks)


def test_vllm_xargs_reach_the_workers_logits_processors(served_model: str, oai: openai.OpenAI,
                                                        tiny_llama_dir: Path) -> None:
    """The live worker loads NoRepeatNGram; a request's vllm_xargs set it, as offline."""
    prompt = [6, 19425, 3, 1, 4, 1, 5, 9, 2, 6]  # greedy on the tiny Llama repeats its first bigram
    body = {"model": served_model, "prompt": prompt, "temperature": 0.0, "max_tokens": 8}
    served = oai.completions.create(extra_body={"ignore_eos": True, "vllm_xargs": {"no_repeat_ngram_size": 2}}, **body)
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                  logits_processors=["worker.sample.logits_processors:NoRepeatNGram"])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"no_repeat_ngram_size": 2})
    expected = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert served.choices[0].text == expected.text
    assert oai.completions.create(extra_body={"ignore_eos": True}, **body).choices[0].text != expected.text
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(extra_body={"vllm_xargs": {"no_repeat_ngram_size": "two"}}, **body)
    assert "no_repeat_ngram_size must be an int >= 1, got 'two'" in bad.value.body["message"]


def test_prompt_embeds_through_the_queue(served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    """vLLM's prompt_embeds: torch.save's bytes, base64-encoded, carried in the job to the
    worker, which decodes as the offline engine does."""
    import base64
    import io

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        embeds = [hf.get_input_embeddings()(torch.tensor(ids)) * 1.1 for ids in ([5, 6, 7, 8, 9], [30, 31, 32])]

    def encoded(tensor: torch.Tensor) -> str:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return base64.b64encode(buffer.getvalue()).decode()

    body = {"model": served_model, "prompt": "", "temperature": 0.0, "max_tokens": 8}
    served = oai.completions.create(extra_body={"ignore_eos": True, "prompt_embeds": [encoded(e) for e in embeds]},
                                    **body)
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = offline.generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    assert [c.text for c in served.choices] == [o.outputs[0].text for o in expected]
    assert served.usage.prompt_tokens == 5 + 3
    failures = [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "must be base64"),
        ({"prompt_embeds": encoded(embeds[0]), "echo": True}, "echo", "echo needs the prompt's tokens"),
        ({"prompt_embeds": encoded(torch.zeros(3, 7))}, None, r"prompt_embeds must be [positions, 64]"),
    ]
    for extra, param, message in failures:
        with pytest.raises(openai.BadRequestError) as bad:
            oai.completions.create(extra_body=extra, **body)
        assert message in bad.value.body["message"] and (param is None or bad.value.body["param"] == param)
    with pytest.raises(openai.BadRequestError) as both:
        oai.completions.create(extra_body={"prompt_embeds": encoded(embeds[0])}, **{**body, "prompt": "hi"})
    assert both.value.body["param"] == "prompt"


def test_completion_prompt_forms_and_choice_indices(served_model: str, oai: openai.OpenAI) -> None:
    one = oai.completions.create(model=served_model, prompt="Once upon", **GREEDY)
    assert one.object == "text_completion" and one.choices[0].text
    ids = oai.completions.create(model=served_model, prompt=[1, 2, 3, 4], **GREEDY)
    assert ids.choices[0].text
    batch = oai.completions.create(
        model=served_model, prompt=["Once upon", "The sky"], n=2, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == one.choices[0].text  # greedy
    other = oai.completions.create(model=served_model, prompt="The sky", **GREEDY)
    assert batch.choices[2].text == batch.choices[3].text == other.choices[0].text
    assert batch.usage.completion_tokens == 4 * 12
    assert batch.usage.prompt_tokens == one.usage.prompt_tokens + other.usage.prompt_tokens


def test_truncate_prompt_tokens_keeps_the_prompts_tail(served_model: str, oai: openai.OpenAI) -> None:
    ids = [(7 * i) % 4000 + 5 for i in range(40)]
    body = {"model": served_model, "temperature": 0.0, "max_tokens": 6}
    cut = oai.completions.create(prompt=ids, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 10}, **body)
    tail = oai.completions.create(prompt=ids[-10:], extra_body={"ignore_eos": True}, **body)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == tail.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 0}, **body)
    assert bad.value.body["param"] == "truncate_prompt_tokens"


def test_bad_words_keep_a_word_out(served_model: str, oai: openai.OpenAI) -> None:
    body = {"model": served_model, "prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 16}
    free = oai.completions.create(extra_body={"ignore_eos": True}, **body).choices[0].text
    word = free.split()[2]
    banned = oai.completions.create(extra_body={"ignore_eos": True, "bad_words": [word]}, **body).choices[0].text
    assert word in free.split() and word not in banned.split() and banned != free


def test_a_thinking_token_budget_ends_the_thinking(
    served_model: str, oai: openai.OpenAI, live_thinking: dict, tiny_llama_dir: Path
) -> None:
    """vLLM's thinking_token_budget reaches the worker, whose thinking opens with the reply
    (live_thinking): three tokens of it, then </think> forced, then the answer, as the offline
    engine with the same markers writes it; the budget is checked by name."""
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, reasoning_config=live_thinking)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking_token_budget=3)
    expected = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    assert "</think>" in expected.text
    reply = oai.chat.completions.create(model=served_model, messages=MESSAGES, temperature=0.0, max_tokens=12,
                                        extra_body={"ignore_eos": True, "thinking_token_budget": 3})
    assert reply.choices[0].message.content == expected.text
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=served_model, messages=MESSAGES, extra_body={"thinking_token_budget": -1})
    assert info.value.body["param"] == "thinking_token_budget"


def test_invocations_answer_as_the_endpoint_the_body_is_for(served_model: str, oai: openai.OpenAI, http) -> None:
    """SageMaker's one route: a chat body is answered as chat answers it, a completions body
    as completions does, streamed too; a body for no endpoint, or a bad one, is a 400 naming
    what is wrong."""
    chat = {"model": served_model, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 8}
    expected = oai.chat.completions.create(**chat).choices[0].message.content
    assert http.post("/invocations", json=chat).json()["choices"][0]["message"]["content"] == expected
    completion = {"model": served_model, "prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 8}
    text = oai.completions.create(**completion).choices[0].text
    assert http.post("/invocations", json=completion).json()["choices"][0]["text"] == text
    with http.stream("POST", "/invocations", json={**completion, "stream": True}) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines) == text
    for body, param in (({"model": served_model, "text": "x"}, "body"), ({"messages": "hi"}, "messages")):
        response = http.post("/invocations", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_completion_streaming_with_usage(served_model: str, oai: openai.OpenAI) -> None:
    expected = oai.completions.create(model=served_model, prompt="Once upon", **GREEDY)
    chunks = list(oai.completions.create(
        model=served_model, prompt="Once upon", stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_logprobs(served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    completion = oai.completions.create(
        model=served_model, prompt="Once upon", logprobs=2, **GREEDY
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    # the tokens spelled as the tokenizer decodes each alone; the worker runs the tiny model
    # greedy in float32, so the offline engine names the same token ids
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = offline.generate("Once upon", params, use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = offline.get_tokenizer()
    assert logprobs.tokens == [tokenizer.decode([i]) for i in ids]
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True))
    # text_offset: where each token begins in the text, streamed or not
    text = completion.choices[0].text
    starts = [len("".join(logprobs.tokens[:i])) for i in range(12)]
    assert "".join(logprobs.tokens) == text and logprobs.text_offset == starts
    chunks = oai.completions.create(
        model=served_model, prompt="Once upon", logprobs=2, stream=True, **GREEDY
    )
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == starts
    chat = oai.chat.completions.create(
        model=served_model, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 for t in content)
    chat_ids = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].token_ids
    assert [t.token for t in content] == [tokenizer.decode([i]) for i in chat_ids]
    assert all(t.bytes == list(t.token.encode()) and t.top_logprobs[0].token == t.token for t in content)


def test_token_ids_beside_the_text_as_vllm_returns_them(served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    """vLLM's return_token_ids (RL trainers read the exact tokens instead of retokenizing) and
    return_tokens_as_token_ids, against the offline engine on the same tiny model."""
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [done] = offline.generate("Once upon", params, use_tqdm=False)
    [chatted] = offline.chat(MESSAGES, params, use_tqdm=False)
    extra = {"ignore_eos": True, "return_token_ids": True}
    body = {"model": served_model, "temperature": 0.0, "max_tokens": 12, "extra_body": extra}
    completion = oai.completions.create(prompt="Once upon", **body).choices[0]
    assert (completion.token_ids, completion.prompt_token_ids) == (done.outputs[0].token_ids, done.prompt_token_ids)
    chunks = [c.choices[0] for c in oai.completions.create(prompt="Once upon", stream=True, **body) if c.choices]
    assert [t for c in chunks for t in c.token_ids] == done.outputs[0].token_ids
    assert chunks[0].prompt_token_ids == done.prompt_token_ids
    assert not any(getattr(c, "prompt_token_ids", None) for c in chunks[1:])
    chat = oai.chat.completions.create(messages=MESSAGES, **body)
    assert (chat.choices[0].token_ids, chat.prompt_token_ids) == (chatted.outputs[0].token_ids, chatted.prompt_token_ids)
    streamed = list(oai.chat.completions.create(messages=MESSAGES, stream=True, **body))
    assert [t for c in streamed for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])] == chatted.outputs[0].token_ids
    assert [c.prompt_token_ids for c in streamed if getattr(c, "prompt_token_ids", None)] == [chatted.prompt_token_ids]
    plain = oai.completions.create(prompt="Once upon", **{**body, "extra_body": {"ignore_eos": True}}).choices[0]
    assert plain.token_ids is None and plain.prompt_token_ids is None  # only when asked
    # logprobs naming tokens by id: the sampled one and every alternative
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    named = oai.completions.create(prompt="Once upon", logprobs=2, **{**body, "extra_body": as_ids}).choices[0].logprobs
    assert named.tokens == [f"token_id:{i}" for i in done.outputs[0].token_ids]
    assert all(key.startswith("token_id:") for top in named.top_logprobs for key in top)
    content = oai.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2,
                                          **{**body, "extra_body": as_ids}).choices[0].logprobs.content
    assert [t.token for t in content] == [f"token_id:{i}" for i in chatted.outputs[0].token_ids]
    assert all(alt.token.startswith("token_id:") for t in content for alt in t.top_logprobs)


def test_echo_and_prompt_logprobs_score_the_prompt(
    served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    # lm-evaluation-harness' loglikelihood request: echo, logprobs, one new token, greedy
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    tokenizer = offline.get_tokenizer()
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    expected = offline.generate(prompt, params, use_tqdm=False)[0]
    ids, num_prompt = expected.prompt_token_ids, len(expected.prompt_token_ids)
    generated = expected.outputs[0]
    for form, text in ((prompt, prompt), (ids, tokenizer.decode(ids))):
        request = {"model": served_model, "prompt": form, "echo": True, "logprobs": 2,
                   "max_tokens": 1, "temperature": 0.0, "n": 2}
        choice, second = oai.completions.create(**request).choices
        assert choice.text == second.text == text + generated.text
        assert second.logprobs == choice.logprobs  # greedy: the prompt echoed on each choice
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([i]) for i in [*ids, *generated.token_ids]]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it
        want = [e.logprob for e in expected.prompt_logprobs[1:]] + [generated.logprobs[0].logprob]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert all(len(top) in (2, 3) and token in top
                   for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(num_prompt + 1)]
        streamed = [c.choices[0] for c in oai.completions.create(**request, stream=True)]
        for index in (0, 1):
            mine = [c for c in streamed if c.index == index]
            assert "".join(c.text for c in mine) == choice.text
            assert [t for c in mine for t in c.logprobs.tokens] == lp.tokens
            assert [o for c in mine for o in c.logprobs.text_offset] == lp.text_offset
    # vLLM's prompt_logprobs: the same numbers keyed by token id, on each choice
    scored = oai.completions.create(model=served_model, prompt=prompt, max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    positions = scored.choices[0].prompt_logprobs
    assert len(positions) == num_prompt and positions[0] is None
    for position, token_id, entry in zip(positions[1:], ids[1:], expected.prompt_logprobs[1:], strict=True):
        assert position[str(token_id)]["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert position[str(token_id)]["rank"] == entry.rank
        assert position[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
        assert {str(t) for t in entry.top_logprobs} <= set(position)
    chat = oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})
    chat_prompt = offline.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert [list(p) for p in chat.prompt_logprobs[1:]] == [[str(t)] for t in chat_prompt[1:]]
    # without logprobs: every completion of every prompt begins with its prompt
    prompts = [prompt, "Once upon"]
    batch = oai.completions.create(model=served_model, prompt=prompts, n=2, echo=True, **GREEDY)
    assert [c.text[: len(prompts[c.index // 2])] for c in batch.choices] == [prompt, prompt, *prompts[1:] * 2]
    assert all(c.logprobs is None for c in batch.choices)
    assert batch.usage.completion_tokens == 4 * 12
    by_ids = oai.completions.create(model=served_model, prompt=ids, echo=True, **GREEDY)
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))


def test_logit_bias_and_allowed_token_ids(served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    forced = oai.completions.create(model=served_model, prompt="Once upon", logit_bias={"123": 100}, **GREEDY)
    assert forced.choices[0].text == tokenizer.decode([123] * 12)
    chat = oai.chat.completions.create(
        model=served_model, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=12, logprobs=True,
        extra_body={"ignore_eos": True, "allowed_token_ids": [7, 99, 512]},
    )
    assert {t.token for t in chat.choices[0].logprobs.content} <= {tokenizer.decode([i]) for i in (7, 99, 512)}
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):  # the worker knows the vocabulary
        oai.completions.create(model=served_model, prompt="x", logit_bias={"10000000": 1}, max_tokens=2)


def test_guided_choice_and_json_mode(served_model: str, oai: openai.OpenAI) -> None:
    choices = ["red", "green", "blue sky"]
    picked = oai.completions.create(
        model=served_model, prompt="Colour:", n=4, temperature=1.0, seed=2, max_tokens=16,
        extra_body={"guided_choice": choices},
    )
    assert [(c.text in choices, c.finish_reason) for c in picked.choices] == [(True, "stop")] * 4
    # the tiny random model never closes its object in a few tokens, but it must open one
    json_mode = oai.chat.completions.create(
        model=served_model, messages=MESSAGES, temperature=0.0, max_tokens=6,
        response_format={"type": "json_object"},
    )
    assert json_mode.choices[0].message.content.lstrip().startswith("{")


def test_guided_regex_outputs_match(served_model: str, oai: openai.OpenAI) -> None:
    pattern = r"\d{3}-\d{4}|(yes|no)!"
    chat = oai.chat.completions.create(
        model=served_model, messages=MESSAGES, n=4, temperature=1.0, seed=5, max_tokens=16,
        extra_body={"guided_regex": pattern},
    )
    assert all(re.fullmatch(pattern, c.message.content) and c.finish_reason == "stop" for c in chat.choices)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served_model, prompt="x", max_tokens=2, extra_body={"guided_regex": "(?<=a)b"})
    assert info.value.body["param"] == "guided_regex" and "not supported" in info.value.body["message"]


def test_structured_outputs_as_current_vllm_spells_them(served_model: str, oai: openai.OpenAI, tiny_llama_dir) -> None:
    """vLLM >= 0.12's `structured_outputs` (its guided_* fields are gone there), grammars
    among them; the grammar's sentences are judged by xgrammar, vLLM's backend for them."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    grammar = 'root ::= ("yes" | "no") ", " [a-z]{2,5} ("!" | ".")\n'
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    lark_grammar = 'start: ("yes" | "no") ", " /[a-z]{2,5}/ ("!" | ".")'  # the same language, as Lark writes it
    for extra in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar},
                  {"structured_outputs": {"grammar": lark_grammar}}):
        chat = oai.chat.completions.create(model=served_model, messages=MESSAGES, n=3, temperature=1.0, seed=8,
                                           max_tokens=16, extra_body=extra)
        for c in chat.choices:
            matcher = xgr.GrammarMatcher(compiled)
            assert matcher.accept_string(c.message.content) and matcher.is_completed(), c.message.content
            assert c.finish_reason == "stop"
    picked = oai.completions.create(model=served_model, prompt="Colour:", n=3, temperature=1.0, seed=2, max_tokens=8,
                                    extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert {c.text for c in picked.choices} <= {"red", "blue"}
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}, "additionalProperties": False}
    shaped = oai.completions.create(model=served_model, prompt="Count:", temperature=1.0, seed=1, max_tokens=40,
                                    extra_body={"structured_outputs": {"json": json.dumps(schema)}})
    assert shaped.choices[0].text.lstrip().startswith("{")
    if shaped.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(shaped.choices[0].text), schema)
    # compact JSON (disable_any_whitespace): every prefix is one xgrammar takes without any whitespace
    compact_json = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_json_schema(
        json.dumps(schema), any_whitespace=False)
    compact = oai.completions.create(model=served_model, prompt="Count:", n=3, temperature=1.0, seed=4, max_tokens=24,
                                     extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    for c in compact.choices:
        matcher = xgr.GrammarMatcher(compact_json)
        assert matcher.accept_string(c.text) and (c.finish_reason == "length" or matcher.is_completed()), c.text
    # a structural tag (vLLM's response_format type): a few allowed tokens make the trigger come
    tag = {"type": "structural_tag", "triggers": ["<"],
           "structures": [{"begin": "<t>", "schema": schema, "end": "</t>"}]}
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    allowed = sorted({i for p in ["<", "t", ">", "</", "/", "{", '"', "n", ":", "1", "}", "x"]
                      for i in tokenizer.encode(p, add_special_tokens=False)})
    tagged = oai.chat.completions.create(model=served_model, messages=MESSAGES, n=4, temperature=1.0, seed=3,
                                         max_tokens=32, response_format=tag, extra_body={"allowed_token_ids": allowed})
    item = xgr.StructuralTagItem(begin="<t>", schema=json.dumps(schema), end="</t>")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(xgr.Grammar.from_structural_tag([item], ["<"]))
    assert all(xgr.GrammarMatcher(compiled).accept_string(c.message.content) for c in tagged.choices)
    assert any("<t>{" in c.message.content for c in tagged.choices)
    for extra, message in (({"structured_outputs": {"grammar": "root ::= x"}}, 'Rule "x" is not defined'),
                           ({"structured_outputs": {"regex": "a", "json_object": True}}, "exactly one of"),
                           ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "cannot be combined"),
                           ({"response_format": {"type": "structural_tag", "triggers": ["<"]}}, "structures must be")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=served_model, prompt="x", max_tokens=2, extra_body=extra)
        assert message in info.value.body["message"]
        assert info.value.body["param"] == next(iter(extra)), info.value.body


def test_json_schema_outputs_validate(served_model: str, oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"},
            "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
            "note": {"type": "null"},
        },
        "required": ["colour", "ok", "sizes"],
    }
    chat = oai.chat.completions.create(
        model=served_model, messages=MESSAGES, temperature=1.0, seed=4, max_tokens=400, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
    )
    completion = oai.completions.create(
        model=served_model, prompt="JSON:", temperature=1.0, seed=5, max_tokens=400,
        extra_body={"guided_json": json.dumps(schema)},
    )
    texts = [c.message.content for c in chat.choices] + [completion.choices[0].text]
    for text, reason in zip(texts, [c.finish_reason for c in [*chat.choices, *completion.choices]], strict=True):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


SET_COLOUR = {"type": "function", "function": {
    "name": "set_colour", "description": "Pick a colour",
    "parameters": {"type": "object", "required": ["colour", "bright"], "properties": {
        "colour": {"enum": ["red", "blue"]}, "bright": {"type": "boolean"}}},
}}


def test_a_forced_tool_call_has_arguments_that_fit_its_schema(served_model: str, oai: openai.OpenAI) -> None:
    request = {"model": served_model, "messages": MESSAGES, "tools": [SET_COLOUR], "temperature": 1.0,
               "seed": 3, "max_tokens": 400, "tool_choice": {"type": "function", "function": {"name": "set_colour"}}}
    message = oai.chat.completions.create(**request).choices[0].message
    (call,) = message.tool_calls
    assert message.content is None and (call.type, call.function.name) == ("function", "set_colour")
    jsonschema.validate(json.loads(call.function.arguments), SET_COLOUR["function"]["parameters"])
    # streamed (same seed, same tokens): the first piece names the call, the rest add arguments
    chunks = oai.chat.completions.create(**request, stream=True)
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "set_colour"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])  # one call, continued
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    required = oai.chat.completions.create(**{**request, "tool_choice": "required"}).choices[0].message
    assert required.tool_calls[0].function.arguments == call.function.arguments
    # the conversation goes on with the call and its result in the history
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    follow_up = oai.chat.completions.create(model=served_model, messages=history, max_tokens=4)
    assert follow_up.choices[0].message.content is not None


def _reply(oai: openai.OpenAI, served_model: str, text: str, **request) -> tuple[openai.types.chat.ChatCompletion, list]:
    """A chat reply under tool_choice "auto" whose text is forced (guided_choice) to `text`,
    whole and streamed."""
    request = {"model": served_model, "messages": MESSAGES, "tools": [SET_COLOUR], "max_tokens": 200,
               "extra_body": {"guided_choice": [text]}, **request}
    return oai.chat.completions.create(**request), list(oai.chat.completions.create(**request, stream=True))


def _streamed(chunks: list) -> tuple[str, dict[int, dict], list[str | None]]:
    """The content, the calls by index (name, id, arguments joined) and finish reasons."""
    content, calls = "", {}
    for c in chunks:
        for t in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(t.index, {"name": None, "id": None, "arguments": ""})
            call["name"] = call["name"] or t.function.name
            call["id"] = call["id"] or t.id
            call["arguments"] += t.function.arguments or ""
        content += c.choices[0].delta.content or ""
    return content, calls, [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]


def test_tool_choice_auto_reads_the_calls_the_model_writes(served_model: str, oai: openai.OpenAI) -> None:
    call = '{"name": "set_colour", "arguments": {"colour": "red", "bright": true}}'
    whole, chunks = _reply(oai, served_model, f"Setting it.\n<tool_call>\n{call}\n</tool_call>")
    (choice,) = whole.choices
    (tool_call,) = choice.message.tool_calls
    assert (choice.message.content, choice.finish_reason) == ("Setting it.", "tool_calls")
    assert tool_call.function.name == "set_colour" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == {"colour": "red", "bright": True}
    content, calls, reasons = _streamed(chunks)
    assert (content, reasons) == ("Setting it.", ["tool_calls"])
    assert calls == {0: {"name": "set_colour", "id": calls[0]["id"], "arguments": tool_call.function.arguments}}
    assert calls[0]["id"].startswith("call_")
    # the client library's stream reader sees the arguments come piece by piece, and the call whole at the end
    request = {"model": served_model, "messages": MESSAGES, "tools": [SET_COLOUR], "max_tokens": 200,
               "extra_body": {"guided_choice": [f"Setting it.\n<tool_call>\n{call}\n</tool_call>"]}}
    with oai.chat.completions.stream(**request) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert len(pieces) > 1 and "".join(pieces) == tool_call.function.arguments
    assert final.message.tool_calls[0].function.arguments == tool_call.function.arguments
    assert (final.message.content, final.finish_reason) == ("Setting it.", "tool_calls")
    # two calls in one reply; without parallel_tool_calls only the first is kept
    second = '{"name": "set_colour", "arguments": {"colour": "blue", "bright": false}}'
    text = f"<tool_call>{call}</tool_call><tool_call>{second}</tool_call>"
    both, chunks = _reply(oai, served_model, text)
    assert [json.loads(t.function.arguments)["colour"] for t in both.choices[0].message.tool_calls] == ["red", "blue"]
    assert both.choices[0].message.content is None and len({t.id for t in both.choices[0].message.tool_calls}) == 2
    assert [c["arguments"] for c in _streamed(chunks)[1].values()] == [t.function.arguments for t in both.choices[0].message.tool_calls]
    first, chunks = _reply(oai, served_model, text, parallel_tool_calls=False)
    assert len(first.choices[0].message.tool_calls) == 1 and len(_streamed(chunks)[1]) == 1
    # a reply without a call is plain content, and a block that is no call stays in it
    for text in ("No call needed.", "Bad <tool_call>{oops}</tool_call>"):
        plain, chunks = _reply(oai, served_model, text, tool_choice="auto")
        assert (plain.choices[0].message.content, plain.choices[0].message.tool_calls) == (text, None)
        assert plain.choices[0].finish_reason == "stop" and _streamed(chunks) == (text, {}, ["stop"])


GET_TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "properties": {
        "zone": {"enum": ["utc", "local"]}}},
}}


def test_required_with_several_tools_calls_them_with_fitting_arguments(served_model: str, oai: openai.OpenAI) -> None:
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (SET_COLOUR, GET_TIME)}
    request = {"model": served_model, "messages": MESSAGES, "tools": [SET_COLOUR, GET_TIME], "tool_choice": "required",
               "temperature": 1.0, "seed": 11, "max_tokens": 300}
    choice = oai.chat.completions.create(**request).choices[0]
    calls = choice.message.tool_calls
    assert choice.message.content is None and calls and len({c.id for c in calls}) == len(calls)
    for call in calls:  # each names a tool, and its arguments fit that tool's schema
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    assert choice.finish_reason == "tool_calls"  # the array closed: guided replies end by themselves
    streamed = _streamed(list(oai.chat.completions.create(**request, stream=True)))[1]  # same seed, same tokens
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(c.function.name, c.function.arguments) for c in calls]
    single = oai.chat.completions.create(**request, parallel_tool_calls=False).choices[0]
    assert len(single.message.tool_calls) == 1 and single.finish_reason == "tool_calls"


def test_required_with_many_tools(served_model: str, oai: openai.OpenAI) -> None:
    """Twenty tools, more than the grammar follows side by side: the calls' tags keep it one
    state until the name is written."""
    tools = [{"type": "function", "function": {**SET_COLOUR["function"], "name": f"set_colour_{i}"}} for i in range(20)]
    choice = oai.chat.completions.create(model=served_model, messages=MESSAGES, tools=tools, tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, seed=2, max_tokens=300).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.function.name in {t["function"]["name"] for t in tools}
        jsonschema.validate(json.loads(call.function.arguments), SET_COLOUR["function"]["parameters"])


def test_tool_choice_none_is_plain_text_and_auto_can_be_turned_off(
    served_model: str, oai: openai.OpenAI, live_worker: str, serve_api
) -> None:
    plain = oai.chat.completions.create(model=served_model, messages=MESSAGES, tools=[SET_COLOUR],
                                        tool_choice="none", max_tokens=4)
    assert plain.choices[0].message.tool_calls is None
    for tools, choice, message in (([SET_COLOUR], "sometimes", "must be none, auto"), (None, "required", "needs tools")):
        with pytest.raises(openai.BadRequestError, match=message) as info:
            oai.chat.completions.create(model=served_model, messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=4)
        assert info.value.body["param"] == "tool_choice"
    with serve_api(Settings(redis_url=live_worker, tool_call_parser="none")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="GENQ_TOOL_CALL_PARSER=none") as info:
            client.chat.completions.create(model=served_model, messages=MESSAGES, tools=[SET_COLOUR], max_tokens=4)
        assert info.value.body["param"] == "tool_choice"
        client.close()


@pytest.mark.parametrize(("parser", "text"), [
    ("llama3_json", '<|python_tag|>{"name": "set_colour", "parameters": {"colour": "red", "bright": true}}'),
    ("mistral", 'Setting it.[TOOL_CALLS]set_colour[ARGS]{"colour": "red", "bright": true}'),
])
def test_llama3_and_mistral_tool_call_parsers(served_model: str, live_worker: str, serve_api, parser: str,
                                              text: str) -> None:
    """A server whose models write Llama 3's or Mistral's calls (GENQ_TOOL_CALL_PARSER); the
    reply's text is forced, as above. The client library's stream reader sees the arguments
    come piece by piece and ends with the call the whole reply has."""
    with serve_api(Settings(redis_url=live_worker, tool_call_parser=parser)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        request = {"model": served_model, "messages": MESSAGES, "tools": [SET_COLOUR], "max_tokens": 200,
                   "extra_body": {"guided_choice": [text]}}
        whole = client.chat.completions.create(**request).choices[0]
        with client.chat.completions.stream(**request) as stream:
            pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion().choices[0]
        client.close()
    (call,) = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("set_colour", {"colour": "red", "bright": True})
    assert (whole.message.content, whole.finish_reason) == ("Setting it." if parser == "mistral" else None, "tool_calls")
    assert len(pieces) > 1 and "".join(pieces) == call.function.arguments
    assert final.message.tool_calls[0].function.arguments == call.function.arguments


def test_continuing_the_last_message_and_template_kwargs(served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    started = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
    chat = oai.chat.completions.create(model=served_model, messages=started, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "continue_final_message": True,
                                 "chat_template_kwargs": {"enable_thinking": False}}})
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = offline.chat(started, params, use_tqdm=False, continue_final_message=True)[0]
    assert expected.prompt.endswith("Once upon a")  # the reply goes on from inside the message
    assert chat.choices[0].message.content == expected.outputs[0].text
    assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)
    # vLLM's echo: the reply begins with the message it goes on from, streamed or not
    echoed = {**GREEDY, "extra_body": {"ignore_eos": True, "continue_final_message": True, "echo": True,
                                       "chat_template_kwargs": {"enable_thinking": False}}}
    whole = oai.chat.completions.create(model=served_model, messages=started, **echoed)
    assert whole.choices[0].message.content == "Once upon a" + expected.outputs[0].text
    chunks = list(oai.chat.completions.create(model=served_model, messages=started, stream=True, **echoed))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    plain = oai.chat.completions.create(model=served_model, messages=MESSAGES, extra_body={"echo": True}, **{
        k: v for k, v in GREEDY.items() if k != "extra_body"})
    assert not plain.choices[0].message.content.startswith("Say something")  # a user's message is not echoed
    with pytest.raises(openai.BadRequestError, match="may not set tokenize") as info:
        oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.body["param"] == "chat_template_kwargs"


def test_a_reasoning_parser_splits_the_thinking_off(
    served_model: str, oai: openai.OpenAI, live_worker: str, serve_api, tiny_llama_dir: Path
) -> None:
    """The tiny model never writes </think>: under deepseek_r1 (the reply starts thinking) it
    is all reasoning, and a guided reply's grammar never starts (it holds after </think>);
    under qwen3 (no <think> first) it is all content, and guided replies are not split; under
    gpt_oss its reader finds no harmony tag in the words (tests/api/test_harmony.py), so it is
    all content, and a guided reply's grammar never starts (it holds once the final channel opens)."""
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    text = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    for parser, reasoning, content in (("deepseek_r1", text, ""), ("qwen3", None, text), ("gpt_oss", None, text)):
        with serve_api(Settings(redis_url=live_worker, reasoning_parser=parser)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            message = client.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY).choices[0].message
            assert (message.reasoning_content, message.reasoning, message.content) == (reasoning, reasoning, content)
            chunks = list(client.chat.completions.create(model=served_model, messages=MESSAGES, stream=True, **GREEDY))
            deltas = [c.choices[0].delta for c in chunks]
            for name in ("reasoning_content", "reasoning"):  # vLLM's older name, and its current one
                assert "".join(d.model_extra.get(name) or "" for d in deltas) == (reasoning or "")
            assert "".join(d.content or "" for d in deltas) == content
            # vLLM's include_reasoning=false: the thinking left out, the content as it was
            hidden = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "include_reasoning": False}}
            message = client.chat.completions.create(model=served_model, messages=MESSAGES, **hidden).choices[0].message
            assert (message.reasoning_content, message.reasoning, message.content) == (None, None, content)
            chunks = list(client.chat.completions.create(model=served_model, messages=MESSAGES, stream=True, **hidden))
            assert not any(c.choices[0].delta.model_extra.get("reasoning") for c in chunks)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
            guided = client.chat.completions.create(model=served_model, messages=MESSAGES, temperature=0.0, max_tokens=6,
                                                    response_format={"type": "json_object"}).choices[0].message
            if parser == "deepseek_r1":  # six tokens of free thinking, as unguided
                assert text.startswith(guided.reasoning_content) and guided.content == ""
                _thinking_turned_off(client, served_model, text)
            elif parser == "gpt_oss":  # free until the final channel opens, which it never does
                assert guided.reasoning_content is None and text.startswith(guided.content)
            else:
                assert guided.reasoning_content is None and guided.content.lstrip().startswith("{")
            client.close()


def offline_reply(tiny_llama_dir: Path) -> str:
    """The tiny model's greedy reply to MESSAGES (GREEDY's 12 tokens), from the offline engine."""
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    return offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


def thinks_only_when_asked(client: openai.OpenAI, served_model: str, text: str, turned_on: dict) -> dict:
    """A plain request's reply is all content; one with `turned_on` template variables all
    reasoning (the tiny model never writes </think>). Returns that request's arguments."""
    plain = client.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY).choices[0].message
    assert (plain.reasoning_content, plain.content) == (None, text)
    on = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "chat_template_kwargs": turned_on}}
    thought = client.chat.completions.create(model=served_model, messages=MESSAGES, **on).choices[0].message
    assert (thought.reasoning_content, thought.content) == (text, "")
    return on


def test_deepseek_v3_replies_think_only_when_asked(
    served_model: str, live_worker: str, serve_api, tiny_llama_dir: Path
) -> None:
    """DeepSeek-V3.1's template thinks only with chat_template_kwargs thinking true: then the
    tiny model's reply (no </think>) is all reasoning, streamed or not; else all content."""
    text = offline_reply(tiny_llama_dir)
    with serve_api(Settings(redis_url=live_worker, reasoning_parser="deepseek_v3")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        on = thinks_only_when_asked(client, served_model, text, {"thinking": True})
        chunks = list(client.chat.completions.create(model=served_model, messages=MESSAGES, stream=True, **on))
        assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == text
        client.close()


def test_the_deployments_template_variables_stand_unless_a_request_sets_its_own(
    served_model: str, live_worker: str, serve_api, tiny_llama_dir: Path
) -> None:
    """vLLM's --default-chat-template-kwargs: {"enable_thinking": false} for every request turns
    the thinking off (under deepseek_r1 the reply is then all content), unless a request turns
    it on again; the Messages API's requests get them too."""
    text = offline_reply(tiny_llama_dir)
    settings = Settings(redis_url=live_worker, reasoning_parser="deepseek_r1",
                        default_chat_template_kwargs={"enable_thinking": False})
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=60) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        thinks_only_when_asked(client, served_model, text, {"enable_thinking": True})
        message = http.post("/v1/messages", json={"model": served_model, "messages": MESSAGES, "max_tokens": 12,
                                                  "temperature": 0.0, "ignore_eos": True}).json()
        assert [block["type"] for block in message["content"]] == ["text"]
        client.close()


def _thinking_turned_off(client: openai.OpenAI, served_model: str, text: str) -> None:
    """Under deepseek_r1, a request whose template closes the thinking (enable_thinking, or
    DeepSeek-V3.1's thinking, false) answers: all content, streamed or not, and a guided
    reply's grammar holds from its first token."""
    for kwargs in ({"enable_thinking": False}, {"thinking": False}):
        off = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "chat_template_kwargs": kwargs}}
        message = client.chat.completions.create(model=served_model, messages=MESSAGES, **off).choices[0].message
        assert (message.reasoning_content, message.content) == (None, text)
    chunks = list(client.chat.completions.create(model=served_model, messages=MESSAGES, stream=True, **off))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert not any(c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks)
    guided = client.chat.completions.create(model=served_model, messages=MESSAGES, temperature=0.0, max_tokens=6,
                                            response_format={"type": "json_object"},
                                            extra_body={"chat_template_kwargs": kwargs}).choices[0].message
    assert guided.reasoning_content is None and guided.content.lstrip().startswith("{")


def test_a_predicted_output_is_taken_and_changes_nothing(served_model: str, oai: openai.OpenAI) -> None:
    """OpenAI's `prediction`: a hint for workers that guess with n-grams (this one does not
    guess): the reply is the same; a prediction of the wrong shape is a 400 naming it."""
    plain = oai.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY).choices[0].message.content
    predicted = oai.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY,
                                            prediction={"type": "content", "content": [{"type": "text", "text": plain}]})
    assert predicted.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=2,
                                    prediction={"type": "diff", "content": "x"})  # type: ignore[typeddict-item]
    assert info.value.body["param"] == "prediction"


def test_a_prompt_and_max_tokens_past_max_model_len_are_a_400_naming_both(
    served_model: str, oai: openai.OpenAI, shared_redis
) -> None:
    """vLLM's rule, never a clamp: refused by the API where it knows the prompt's length (token
    ids) or max_tokens alone cannot fit, before anything is queued; else by the worker, whose
    refusal of the job is the same 400."""
    conn = redis.Redis.from_url(shared_redis.url)
    queued = conn.xlen(Keys().requests)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served_model, prompt=[5] * 1000, max_tokens=100)
    assert info.value.body["param"] == "max_tokens"
    assert ("maximum context length is 1024 tokens. However, you requested 1100 tokens "
            "(1000 in the prompt, 100 in the completion)") in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match=r"at least 1000000001 tokens") as info:
        oai.chat.completions.create(model=served_model, messages=MESSAGES, max_completion_tokens=10**9)
    assert info.value.body["param"] == "max_completion_tokens"
    assert conn.xlen(Keys().requests) == queued  # neither was queued
    with pytest.raises(openai.BadRequestError, match=r"maximum context length is 1024 tokens.*in the prompt, "
                                                      r"1020 in the completion") as info:
        oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=1020)  # the worker's refusal
    assert info.value.body["code"] == "invalid_request"
    fits = oai.completions.create(model=served_model, prompt=[5] * 1000, max_tokens=24, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    clamped = oai.completions.create(model=served_model, prompt=[5] * 1000, max_tokens=10**9, temperature=0.0,
                                     extra_body={"ignore_eos": True, "clamp_max_tokens": True})  # genq's opt-in
    assert fits.usage.completion_tokens == clamped.usage.completion_tokens == 24
    assert clamped.choices[0].finish_reason == "length"


def test_stop_and_max_completion_tokens(served_model: str, oai: openai.OpenAI) -> None:
    response = oai.chat.completions.create(
        model=served_model, messages=MESSAGES, temperature=0.0, max_completion_tokens=5,
        seed=1, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "priority": -1},
    )
    assert response.usage.completion_tokens == 5


def test_a_job_the_worker_refuses_is_a_400_or_an_error_chunk(served_model: str, oai: openai.OpenAI) -> None:
    too_long = "word " * 1100  # the worker's max_model_len is 1024: it fails the job (text: the API
    # cannot count its tokens)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served_model, prompt=too_long, max_tokens=4)
    assert info.value.body["code"] == "invalid_request" and "max_model_len" in info.value.body["message"]
    with pytest.raises(openai.APIError, match="max_model_len"):
        list(oai.completions.create(model=served_model, prompt=too_long, max_tokens=4, stream=True))
