"""`POST /v1/messages` (Anthropic's Messages API) against a live stack (Redis, a real worker on
the tiny Llama, uvicorn), driven by the official `anthropic` client, with the offline engine
and the chat endpoint (through the `openai` client) as the oracles for what the model says."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from api.batches import parse_line
from api.messages_api import MessageEvents, MessagesRequest, to_chat
from api.parsers.reasoning import split
from api.render import RelayedRequest
from api.settings import Settings
from producer.sampling_params import SamplingParams
from worker import LLM

SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Say something."}]
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]
SET_COLOUR = {"name": "set_colour", "description": "Pick a colour", "input_schema": {
    "type": "object", "required": ["colour", "bright"],
    "properties": {"colour": {"enum": ["red", "blue"]}, "bright": {"type": "boolean"}}}}
CHAT_TOOL = {"type": "function", "function": {"name": "set_colour", "description": "Pick a colour",
                                              "parameters": SET_COLOUR["input_schema"]}}


@pytest.fixture(scope="module")
def claude(api_url: str) -> Iterator[anthropic.Anthropic]:
    """The official Anthropic client on the module's API."""
    client = anthropic.Anthropic(base_url=api_url, api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)


# Anthropic's SDK has dropped temperature, top_p and top_k from its arguments (its newest models
# take none); vLLM's clients still send them, as genq takes them
GREEDY = {"temperature": 0.0}


def event_types(events: list) -> list[str]:
    return [e.type for e in events]


def test_text_whole_streamed_and_counted(served_model: str, claude: anthropic.Anthropic, offline: LLM) -> None:
    expected = offline.chat(CHAT_MESSAGES, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    request = {"model": served_model, "system": SYSTEM, "messages": MESSAGES, "max_tokens": 12, "extra_body": GREEDY}
    message = claude.messages.create(**request)
    assert (message.type, message.role, message.model) == ("message", "assistant", served_model)
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and block.text == expected.outputs[0].text
    length = expected.outputs[0].finish_reason == "length"
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens" if length else "end_turn", None)
    usage = message.usage  # input tokens split into those read from cache and the rest, as Anthropic's are
    assert usage.input_tokens + usage.cache_read_input_tokens == len(expected.prompt_token_ids)
    assert usage.output_tokens == len(expected.outputs[0].token_ids)
    assert claude.messages.count_tokens(model=served_model, system=SYSTEM, messages=MESSAGES).input_tokens == len(
        expected.prompt_token_ids)
    # streamed: the SDK's own accumulation of the events is the same message
    events = list(claude.messages.create(**request, stream=True))
    types = event_types(events)
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    assert events[-2].usage.output_tokens == usage.output_tokens
    with claude.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == block.text
        final = stream.get_final_message()
    assert ([b.text for b in final.content], final.stop_reason, final.usage.output_tokens) == (
        [block.text], message.stop_reason, usage.output_tokens)
    # a second time, the prompt is the prefix cache's
    again = claude.messages.create(**request)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(expected.prompt_token_ids)


def test_sampling_fields_reach_the_job(served_model: str, claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """top_k, top_p, temperature and chat's extras (seed, ignore_eos) as chat sends them: the
    same seed gives what chat gives; a stop sequence the reply would write ends it there."""
    sampling = {"extra_body": {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 5, "ignore_eos": True}}
    message = claude.messages.create(model=served_model, messages=MESSAGES, max_tokens=10, **sampling)
    chat = oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=10, seed=5,
                                       temperature=1.0, top_p=0.9, extra_body={"top_k": 20, "ignore_eos": True})
    text = chat.choices[0].message.content
    assert message.content[0].text == text and message.usage.output_tokens == 10
    stop = text[3:6]
    assert stop.strip() and stop not in text[:5]
    stopped = claude.messages.create(model=served_model, messages=MESSAGES, max_tokens=10, **sampling,
                                     stop_sequences=["never written", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]
    streamed = list(claude.messages.create(model=served_model, messages=MESSAGES, max_tokens=10, **sampling, stream=True,
                                           stop_sequences=[stop]))
    assert (streamed[-2].delta.stop_reason, streamed[-2].delta.stop_sequence) == ("stop_sequence", stop)


def test_a_tool_use_and_its_result_sent_back(served_model: str, claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    request = {"model": served_model, "messages": MESSAGES, "tools": [SET_COLOUR], "max_tokens": 200,
               "extra_body": {"temperature": 1.0}, "tool_choice": {"type": "tool", "name": "set_colour"}}
    message = claude.messages.create(**request)
    (use,) = message.content
    assert (use.type, use.name, message.stop_reason) == ("tool_use", "set_colour", "tool_use")
    jsonschema.validate(use.input, SET_COLOUR["input_schema"])
    events = list(claude.messages.create(**request, stream=True))
    starts = [e for e in events if e.type == "content_block_start"]
    assert len(starts) == 1 and (starts[0].content_block.type, starts[0].content_block.name) == ("tool_use", "set_colour")
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    jsonschema.validate(json.loads(pieces), SET_COLOUR["input_schema"])
    assert events[-2].delta.stop_reason == "tool_use"
    with claude.messages.stream(**request) as stream:
        final = stream.get_final_message()
    jsonschema.validate(final.content[0].input, SET_COLOUR["input_schema"])
    # the agent loop: the tool_use and its result go back; chat given the same conversation says
    # the same (greedy); "any" is chat's "required"
    follow = [*MESSAGES, {"role": "assistant", "content": [use.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "done"},
                                           {"type": "text", "text": "Thanks."}]}]
    answer = claude.messages.create(model=served_model, messages=follow, tools=[SET_COLOUR], max_tokens=8,
                                    extra_body=GREEDY, tool_choice={"type": "none"})
    chat = oai.chat.completions.create(
        model=served_model, max_tokens=8, temperature=0.0, tools=[CHAT_TOOL], tool_choice="none",
        messages=[*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "done"}, {"role": "user", "content": "Thanks."}],
    )
    assert answer.content[0].text == chat.choices[0].message.content
    any_call = claude.messages.create(**{**request, "tool_choice": {"type": "any"}})
    assert [b.type for b in any_call.content] == ["tool_use"] and any_call.stop_reason == "tool_use"


def test_a_last_assistant_message_is_continued(served_model: str, claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """A prefill: the reply goes on from it (and does not repeat it), as chat's
    continue_final_message does."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "Well,"}]
    message = claude.messages.create(model=served_model, messages=prefill, max_tokens=8, extra_body=GREEDY)
    chat = oai.chat.completions.create(model=served_model, messages=prefill, max_tokens=8, temperature=0.0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert message.content[0].text == chat.choices[0].message.content
    plain = claude.messages.create(model=served_model, messages=MESSAGES, max_tokens=8, extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > plain.usage.input_tokens + \
        plain.usage.cache_read_input_tokens


def test_thinking_is_a_thinking_block(served_model: str, live_worker: str, serve_api, offline: LLM) -> None:
    """Under deepseek_r1 the tiny model, which never writes </think>, only thinks."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    text = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    request = {"model": served_model, "messages": MESSAGES, "max_tokens": 10,
               "extra_body": {"temperature": 0.0, "ignore_eos": True}}
    with serve_api(Settings(redis_url=live_worker, reasoning_parser="deepseek_r1")) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = client.messages.create(**request)
        (block,) = message.content
        assert (block.type, block.thinking) == ("thinking", text)
        with client.messages.stream(**request) as stream:
            assert stream.get_final_message().content == message.content
        # thinking switched by the template's variable: the tiny template ignores it, the
        # request is well formed
        thinking = client.messages.create(**request, thinking={"type": "enabled", "budget_tokens": 1024})
        assert thinking.content == message.content
        # thinking the client does not want shown is left out
        omitted = client.messages.create(**request, thinking={"type": "adaptive", "display": "omitted"})
        assert omitted.content == [] and omitted.usage.output_tokens == 10
        client.close()


def test_thinking_budget_tokens_end_the_thinking(
    served_model: str, live_worker: str, live_thinking: dict, serve_api, tiny_llama_dir: Path
) -> None:
    """Where the deployment reads <think> tags, budget_tokens is the workers' thinking budget:
    past it </think> is forced and the reply answers. The oracle: the offline engine with the
    live worker's markers and that budget, its text split as deepseek_r1 splits it."""
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, reasoning_config=live_thinking)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking_token_budget=3)
    reasoning, answer = split(offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text, "deepseek_r1")
    assert reasoning and answer
    request = {"model": served_model, "messages": MESSAGES, "max_tokens": 12, "extra_body": {"temperature": 0.0, "ignore_eos": True},
               "thinking": {"type": "enabled", "budget_tokens": 3}}
    with serve_api(Settings(redis_url=live_worker, reasoning_parser="deepseek_r1")) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = client.messages.create(**request)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
            ("thinking", reasoning), ("text", answer)]
        with client.messages.stream(**request) as stream:
            assert [b.type for b in stream.get_final_message().content] == ["thinking", "text"]
        client.close()
    # a message batch's lines are run as the deployment runs requests: budgeted where it reads tags
    params = {k: v for k, v in request.items() if k != "extra_body"} | request["extra_body"]
    line = json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/messages", "body": params})
    assert parse_line(line, "/v1/messages", Settings(reasoning_parser="deepseek_r1")).body.thinking_token_budget == 3
    assert parse_line(line, "/v1/messages", Settings()).body.thinking_token_budget is None


def test_an_output_format_guides_the_reply(served_model: str, claude: anthropic.Anthropic) -> None:
    schema = SET_COLOUR["input_schema"]
    for fields in ({"output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}},
                   {"extra_body": {"output_format": {"type": "json_schema", "schema": schema}}}):
        message = claude.messages.create(model=served_model, messages=MESSAGES, max_tokens=100, **fields)
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), schema)


def test_what_is_not_supported_is_a_400_in_anthropics_shape(served_model: str, api_url: str) -> None:
    base = {"model": served_model, "messages": MESSAGES, "max_tokens": 4}
    cases = [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64", "data": "JVBE"}}]}]},
         "messages.0.content.0.source.type"),
        ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "deep"}}, "thinking.type"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
        ({"stop_sequences": "x" * 3}, "stop_sequences"),
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
    ]
    with httpx.Client(base_url=api_url, timeout=60) as http:
        for extra, param in cases:
            response = http.post("/v1/messages", json={**base, **extra})
            body = response.json()
            assert response.status_code == 400, (extra, body)
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert body["error"]["message"].startswith(f"{param}: ") or param in body["error"]["message"], body
        unknown = http.post("/v1/messages", json={**base, "model": "claude-sonnet-4-5"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        # the OpenAI routes keep OpenAI's shape
        assert http.post("/v1/chat/completions", json={"messages": []}).json()["error"]["param"] == "messages"


def test_models_and_a_full_context_as_anthropic_names_them(served_model: str, claude: anthropic.Anthropic) -> None:
    """Anthropic's client lists the models in its own shape; a reply the context cut short
    before max_tokens says so rather than max_tokens."""
    (model,) = claude.models.list().data
    assert (model.type, model.id, model.display_name) == ("model", served_model, served_model)
    assert model.created_at.year >= 2026 and claude.models.retrieve(served_model).id == served_model
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.models.retrieve("claude-sonnet-4-5")
    assert info.value.body["error"]["type"] == "not_found_error"
    long = [{"role": "user", "content": "hi " * 990}]  # near the live worker's 1024 tokens
    full = claude.messages.create(model=served_model, messages=long, max_tokens=200, extra_body={"ignore_eos": True})
    assert full.stop_reason == "model_context_window_exceeded" and full.usage.output_tokens < 200


def test_a_message_batch_runs_and_its_results_are_anthropics(
    served_model: str, claude: anthropic.Anthropic, poll, http
) -> None:
    """Anthropic's Message Batches API: each request answered as /v1/messages answers it, one
    the worker refuses errored, their results in order; a bad request refused at creation,
    naming it; a canceled batch's requests that never ran canceled; ended batches deleted."""
    params = {"model": served_model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    batch = claude.messages.batches.create(requests=[
        {"custom_id": "plain", "params": params},
        {"custom_id": "system", "params": {**params, "system": SYSTEM}},
        {"custom_id": "bad-token", "params": {**params, "logit_bias": {"10000000": 1}}},  # the worker refuses it
    ])
    assert batch.type == "message_batch" and batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    done = poll(lambda: (b := claude.messages.batches.retrieve(batch.id)).processing_status == "ended" and b, 120.0,
                "the batch ended")
    assert (done.request_counts.succeeded, done.request_counts.errored, done.request_counts.processing) == (2, 1, 0)
    assert done.ended_at is not None and done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    results = list(claude.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["plain", "system", "bad-token"]
    for result, extra in zip(results[:2], ({}, {"system": SYSTEM}), strict=True):
        direct = claude.messages.create(**{k: v for k, v in params.items() if k not in ("temperature", "ignore_eos")},
                                        extra_body={"temperature": 0.0, "ignore_eos": True}, **extra)
        assert result.result.type == "succeeded" and result.result.message.content[0].text == direct.content[0].text
    errored = results[2].result
    assert errored.type == "errored" and "outside the vocabulary" in errored.error.error.message
    assert batch.id in [b.id for b in claude.messages.batches.list()]
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.batches.create(requests=[{"custom_id": "a", "params": params},
                                                 {"custom_id": "b", "params": {**params, "max_tokens": "many"}}])
    assert "requests.1.params.max_tokens" in info.value.message
    # canceled while its first request runs: that one, and what never ran, are canceled
    long = claude.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": {**params, "max_tokens": 900}}
                                                    for i in range(3)])
    poll(lambda: http.get(f"/v1/jobs/{long.id}-0").json().get("status") == "running", 60.0, "the first request running")
    assert claude.messages.batches.cancel(long.id).processing_status in ("canceling", "ended")
    ended = poll(lambda: (b := claude.messages.batches.retrieve(long.id)).processing_status == "ended" and b, 120.0,
                 "the canceled batch ended")
    kinds = [r.result.type for r in claude.messages.batches.results(long.id)]
    assert kinds[0] == "canceled" and ended.request_counts.canceled == kinds.count("canceled")
    assert ended.request_counts.errored == 0
    for batch_id in (batch.id, long.id):
        assert claude.messages.batches.delete(batch_id).type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.retrieve(batch_id)


def test_the_anthropic_client_raises_its_own_errors(served_model: str, claude: anthropic.Anthropic) -> None:
    refused = {"model": served_model, "messages": MESSAGES, "max_tokens": 4,
               "extra_body": {"logit_bias": {"10000000": 1}}}  # the worker refuses the job
    with pytest.raises(anthropic.BadRequestError, match="outside the vocabulary"):
        claude.messages.create(**refused)
    with pytest.raises(anthropic.APIStatusError, match="outside the vocabulary"):  # an error event mid-stream
        list(claude.messages.create(**refused, stream=True))
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=served_model, messages=MESSAGES, max_tokens=4, tools=[{"type": "bash_20250124", "name": "bash"}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "tools.0.type" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-sonnet-4-5", messages=MESSAGES, max_tokens=4)


def test_x_api_key_is_a_key_as_bearer_is(live_worker: str, serve_api, served_model: str) -> None:
    """Anthropic's clients send the key as `x-api-key` (older SDKs, curl examples, Claude Code's
    ANTHROPIC_API_KEY) or as a bearer token (this SDK)."""
    count = {"model": served_model, "messages": MESSAGES}
    with serve_api(Settings(redis_url=live_worker, api_keys=("k1",))) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": "k1"}).json()["input_tokens"] > 0
            refused = http.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": "k2"})
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        right = anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0)
        assert right.messages.count_tokens(**count).input_tokens > 0
        wrong = anthropic.Anthropic(base_url=url, api_key="k2", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(**count)
        right.close()
        wrong.close()


def test_tool_input_streams_as_prefixes_the_sdk_can_parse() -> None:
    """Whitespace before a call's arguments (a guided reply may write some) is not sent: the
    SDK parses every prefix of the input as partial JSON, and whitespace alone is none."""
    req = RelayedRequest(id="msg_x", job_ids=["x"], n=1, model="m", created=0)
    events = MessageEvents(req)
    lines = [events.start(3)]
    for delta in ({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "\n "}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "  "}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ' "b" }'}}]}):
        lines += events.delta(delta)
    final = {"stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 4}}
    lines += events.end(final)
    snapshot, buffers = None, {}  # the SDK's own accumulation of a stream's events
    for line in lines:
        data = json.loads(line.split("data: ", 1)[1])
        event = construct_type(type_=RawMessageStreamEvent, value=data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot.content[0].input == {"a": "b"} and snapshot.stop_reason == "tool_use"


def test_image_blocks_and_tool_results_become_chats_parts() -> None:
    """The translation itself: base64 and URL images as chat's image_url parts, a user turn's
    tool results as tool messages before its text, an error result said to be one, earlier
    thinking left out, system blocks joined."""
    data = base64.b64encode(b"\x89PNG...").decode()
    request = MessagesRequest.model_validate({"max_tokens": 4, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                                     {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "look", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "no"}]}, {"type": "text", "text": "Hm?"},
                                     {"type": "document", "title": "Notes", "source": {"type": "text", "data": "x = 1"}}]},
    ], "tools": [{**SET_COLOUR, "strict": True}]})
    chat = to_chat(request).model_dump(exclude_none=True)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][0]["content"] == "A\nB"
    image, url, text = chat["messages"][1]["content"]
    assert image["image_url"]["url"] == f"data:image/png;base64,{data}"
    assert url["image_url"]["url"] == "https://example.com/a.png" and text["text"] == "What is it?"
    assistant = chat["messages"][2]
    assert assistant["content"] == "Let me look."
    assert assistant["tool_calls"][0]["function"] == {"name": "look", "arguments": '{"x": 1}'}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: no"}
    assert chat["messages"][4]["content"] == "Hm?Notes\n\nx = 1"  # a text document is its text
    assert chat["tools"][0]["function"]["strict"] is True  # a strict tool's calls are held to its schema
    assert "continue_final_message" not in chat or chat["continue_final_message"] is False
