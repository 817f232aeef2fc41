"""`POST /v1/responses` against a live stack (Redis, a real worker on the tiny Llama, uvicorn),
driven by the official `openai` client, with the offline engine and the chat endpoint as the
oracles for what the model says."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from api.settings import Settings
from producer.sampling_params import SamplingParams
from worker import LLM

MESSAGES = [{"role": "user", "content": "Say something."}]
SET_COLOUR = {"type": "function", "name": "set_colour", "description": "Pick a colour", "parameters": {
    "type": "object", "required": ["colour", "bright"],
    "properties": {"colour": {"enum": ["red", "blue"]}, "bright": {"type": "boolean"}}}}


def test_text_in_text_out_whole_and_streamed(served_model: str, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    request = {"model": served_model, "input": "Say something.", "max_output_tokens": 12, "temperature": 0.0}
    response = oai.responses.create(**request)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == served_model
    assert response.output_text == expected.outputs[0].text
    length = expected.outputs[0].finish_reason == "length"
    assert response.status == ("incomplete" if length else "completed")
    assert (response.incomplete_details.reason if length else response.incomplete_details) == ("max_output_tokens" if length else None)
    assert response.usage.input_tokens == len(expected.prompt_token_ids)
    assert response.usage.output_tokens == len(expected.outputs[0].token_ids)
    (message,) = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    events = list(oai.responses.create(**request, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if length else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text
    # chat's sampling extras pass on: the same seed gives what chat gives
    seeded = {"temperature": 1.0, "max_output_tokens": 8, "extra_body": {"seed": 3, "ignore_eos": True}}
    sampled = oai.responses.create(model=served_model, input="Say something.", **seeded)
    chat = oai.chat.completions.create(model=served_model, messages=MESSAGES, temperature=1.0, max_tokens=8,
                                       seed=3, extra_body={"ignore_eos": True})
    assert sampled.output_text == chat.choices[0].message.content and sampled.usage.output_tokens == 8


def test_a_function_call_and_its_result_sent_back(served_model: str, oai: openai.OpenAI) -> None:
    request = {"model": served_model, "input": MESSAGES, "tools": [SET_COLOUR], "temperature": 1.0,
               "tool_choice": {"type": "function", "name": "set_colour"}, "max_output_tokens": 200}
    response = oai.responses.create(**request)
    (call,) = response.output
    assert (call.type, call.name, call.status) == ("function_call", "set_colour", "completed")
    jsonschema.validate(json.loads(call.arguments), SET_COLOUR["parameters"])
    events = list(oai.responses.create(**request, stream=True))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == pieces == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(pieces), SET_COLOUR["parameters"])
    # the agent loop: the call and its output go back as input items; the chat endpoint given
    # the same conversation says the same (greedy)
    follow = [*MESSAGES, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    answer = oai.responses.create(model=served_model, input=follow, tools=[SET_COLOUR], tool_choice="none",
                                  max_output_tokens=8, temperature=0.0)
    chat = oai.chat.completions.create(
        model=served_model, max_tokens=8, temperature=0.0, tools=[{"type": "function", "function": {
            k: v for k, v in SET_COLOUR.items() if k != "type"}}], tool_choice="none",
        messages=[*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "done"}],
    )
    assert answer.output_text == chat.choices[0].message.content


def test_a_reasoning_model_s_thinking_is_a_reasoning_item(
    served_model: str, live_worker: str, serve_api, tiny_llama_dir: Path
) -> None:
    """Under deepseek_r1 the tiny model, which never writes </think>, only thinks."""
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    text = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    request = {"model": served_model, "input": MESSAGES, "max_output_tokens": 10, "temperature": 0.0,
               "extra_body": {"ignore_eos": True}}
    with serve_api(Settings(redis_url=live_worker, reasoning_parser="deepseek_r1")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.responses.create(**request)
        (item,) = response.output
        assert item.type == "reasoning" and item.content[0].text == text and response.output_text == ""
        events = list(client.responses.create(**request, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
        assert [e.type for e in events][-2:] == ["response.output_item.done", "response.incomplete"]
        # a client that keeps no state (Codex) asks for the reasoning as encrypted_content and
        # sends the item back; earlier thinking is left out of the prompt, as chat templates do
        stateless = {**request, "store": False, "include": ["reasoning.encrypted_content"]}
        (item,) = client.responses.create(**stateless).output
        assert base64.b64decode(item.encrypted_content).decode() == text
        streamed = list(client.responses.create(**stateless, stream=True))
        assert streamed[-1].response.output[0].encrypted_content == item.encrypted_content
        follow = [*MESSAGES, item.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        again = client.responses.create(**{**request, "input": follow})
        chat = client.chat.completions.create(
            model=served_model, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True},
            messages=[*MESSAGES, {"role": "user", "content": "And?"}])
        assert again.output[0].content[0].text == chat.choices[0].message.reasoning_content
        client.close()


def test_a_stored_response_is_retrieved_and_continued(served_model: str, oai: openai.OpenAI) -> None:
    """previous_response_id continues the stored conversation: the chat endpoint given the
    whole conversation says the same (greedy)."""
    greedy = {"model": served_model, "max_output_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    first = oai.responses.create(input="Say something.", instructions="Be brief.", **greedy)
    assert oai.responses.retrieve(first.id).output_text == first.output_text and first.store
    second = oai.responses.create(input="And then?", previous_response_id=first.id, **greedy)
    assert second.previous_response_id == first.id
    given = oai.responses.input_items.list(first.id)  # what it was given, as items
    assert [(i.type, i.role, i.content[0].text) for i in given.data] == [("message", "user", "Say something.")]
    assert given.data[0].id.startswith("msg_") and not given.has_more
    chat = oai.chat.completions.create(  # instructions are not carried over, as OpenAI's are not
        model=served_model, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}, messages=[
            *MESSAGES, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    streamed = list(oai.responses.create(input="And then?", previous_response_id=first.id, stream=True, **greedy))
    assert streamed[-1].response.output_text == second.output_text
    assert oai.responses.retrieve(streamed[-1].response.id).output_text == second.output_text  # stored too
    oai.responses.delete(first.id)
    for call in (lambda: oai.responses.retrieve(first.id),
                 lambda: oai.responses.create(input="More?", previous_response_id=first.id, **greedy)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = oai.responses.create(input="Hi", store=False, **greedy)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_a_json_schema_format(served_model: str, oai: openai.OpenAI) -> None:
    schema = SET_COLOUR["parameters"]
    response = oai.responses.create(
        model=served_model, input="Pick one.", temperature=0.0, max_output_tokens=100,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
])
def test_what_is_not_supported_is_a_400_naming_the_field(served_model: str, oai: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(**{"model": served_model, "input": "Hi", **extra})
    assert info.value.body["param"] == param


def wait_until_ended(oai: openai.OpenAI, response_id: str, poll) -> object:
    def ended():
        response = oai.responses.retrieve(response_id)
        return response if response.status not in ("queued", "in_progress") else None

    return poll(ended, 60.0, "the background response ended")


def test_background_responses_are_polled_to_the_same_result(served_model: str, oai: openai.OpenAI, poll) -> None:
    request = {"model": served_model, "input": "Say something.", "max_output_tokens": 12, "temperature": 0.0}
    expected = oai.responses.create(**request)
    queued = oai.responses.create(**request, background=True)
    assert queued.background is True and queued.status in ("queued", "in_progress") and queued.output == []
    before = [i.content[0].text for i in oai.responses.input_items.list(queued.id).data]  # queued or done
    done = wait_until_ended(oai, queued.id, poll)
    assert before == [i.content[0].text for i in oai.responses.input_items.list(done.id).data] == ["Say something."]
    assert (done.status, done.output_text, done.usage.output_tokens) == (expected.status, expected.output_text,
                                                                         expected.usage.output_tokens)
    assert done.background is True
    follow_up = oai.responses.create(model=served_model, input="And again.", previous_response_id=done.id,
                                     max_output_tokens=4)
    assert follow_up.status in ("completed", "incomplete")


def test_a_background_response_outlives_the_api_process_that_took_it(
    served_model: str, oai: openai.OpenAI, live_worker: str, serve_api, poll
) -> None:
    """The API that took it stops at once; its job runs on, and another API finishes it."""
    with serve_api(Settings(redis_url=live_worker)) as url:
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        queued = other.responses.create(model=served_model, input="Say something.", max_output_tokens=24,
                                        temperature=0.0, background=True, extra_body={"ignore_eos": True})
        other.close()
    done = wait_until_ended(oai, queued.id, poll)
    assert done.status == "incomplete" and done.usage.output_tokens == 24


def test_cancelling_a_background_response(served_model: str, oai: openai.OpenAI, http, poll) -> None:
    queued = oai.responses.create(model=served_model, input="Say something.", max_output_tokens=900,
                                  background=True, extra_body={"ignore_eos": True})
    cancelled = oai.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert oai.responses.retrieve(queued.id).status == "cancelled"
    job_id = queued.id.removeprefix("resp_")
    assert poll(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled", 30.0, "the job cancelled")
    assert oai.responses.retrieve(queued.id).status == "cancelled"  # the job's end did not undo it
    finished = oai.responses.create(model=served_model, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Only a background response"):
        oai.responses.cancel(finished.id)


def test_background_needs_store(served_model: str, http) -> None:
    response = http.post("/v1/responses", json={"model": served_model, "input": "x", "background": True, "store": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "store"


def test_a_background_stream_can_be_resumed(served_model: str, oai: openai.OpenAI, poll) -> None:
    """background + stream: the events as they come; the stream again from Redis (GET with
    stream=true), whole or after the event a client saw last, the same events."""
    request = {"model": served_model, "input": "Say something.", "max_output_tokens": 12, "temperature": 0.0}
    expected = oai.responses.create(**request)
    events = list(oai.responses.create(**request, background=True, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].response.output_text == expected.output_text
    response_id = events[0].response.id
    done = wait_until_ended(oai, response_id, poll)
    assert done.output_text == expected.output_text
    again = list(oai.responses.retrieve(response_id, stream=True))
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in events]
    resumed = list(oai.responses.retrieve(response_id, stream=True, starting_after=4))
    assert [(e.type, e.sequence_number) for e in resumed] == [(e.type, e.sequence_number) for e in events[5:]]
    assert "".join(e.delta for e in resumed if e.type == "response.output_text.delta") == "".join(
        e.delta for e in events[5:] if e.type == "response.output_text.delta")
    with pytest.raises(openai.BadRequestError):
        list(oai.responses.retrieve(expected.id, stream=True))  # not a background response


def test_output_text_logprobs_whole_and_streamed(served_model: str, oai: openai.OpenAI) -> None:
    """include=["message.output_text.logprobs"] gives each output token's logprob and its
    alternatives: the chat endpoint's for the same request."""
    request = {"model": served_model, "input": "Say something.", "max_output_tokens": 8, "temperature": 0.0,
               "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = oai.responses.create(**request)
    part = response.output[0].content[0]
    chat = oai.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                       logprobs=True, top_logprobs=2)
    expected = chat.choices[0].logprobs.content
    # the same tokens; logprobs equal up to float rounding (the prefix cache computes the second differently)
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in expected]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert [[t.token for t in lp.top_logprobs] for lp in part.logprobs] == [[t.token for t in lp.top_logprobs]
                                                                           for lp in expected]
    assert "".join(lp.token for lp in part.logprobs) == part.text and response.top_logprobs == 2
    events = list(oai.responses.create(**request, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-4)
    assert oai.responses.create(**{**request, "include": None}).output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(**{**request, "include": ["file_search_call.results"]})
    assert info.value.body["param"] == "include"


def test_a_background_stream_that_times_out_says_where_to_resume(
    served_model: str, oai: openai.OpenAI, live_worker: str, serve_api, http, poll
) -> None:
    """Past the API's request timeout the stream ends with an error naming the resume point,
    not response.failed: the job is still running."""
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=0.5)) as url:
        impatient = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        events = list(impatient.responses.create(model=served_model, input="Say something.", max_output_tokens=900,
                                                 background=True, stream=True, extra_body={"ignore_eos": True}))
        impatient.close()
    assert events[-1].type == "error" and "starting_after=" in events[-1].message
    assert not any(e.type == "response.failed" for e in events)
    response_id = events[0].response.id
    assert oai.responses.retrieve(response_id).status in ("queued", "in_progress")
    assert oai.responses.cancel(response_id).status == "cancelled"


def test_a_calls_streamed_arguments_stay_in_its_item_when_content_follows_in_the_same_piece() -> None:
    """The chat renderer's delta may carry the end of a call's arguments and the content after
    it together; the Responses events put each in its own item, in the order written."""
    from api.generate import Collector
    from api.render import ChatRenderer, RelayedRequest
    from api.responses_api import ResponseEvents, ResponsesRequest
    from producer.protocol import Event

    reply = 'Checking.<tool_call>{"name": "set_colour", "arguments": {"colour": "red"}}</tool_call> Done.'
    cut = reply.index("red")
    req = RelayedRequest(id="resp-x", job_ids=["j"], n=1, model="m", created=0, read_tool_calls="hermes")
    events = [Event(seq=0, text=reply[:cut], token_ids=[0]),
              Event(seq=1, text=reply[cut:], token_ids=[1], finished=True, finish_reason="stop")]
    collector, renderer, stream = Collector(req), ChatRenderer(), ResponseEvents(ResponsesRequest(input="hi"), req)
    lines = []
    for event in events:
        chunk = renderer.chunk(req, collector.add("j", event), event)
        lines += stream.delta(chunk["choices"][0]["delta"]) if chunk else []
    lines += stream.end({"status": "completed"})
    sent = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    done = [e["item"] for e in sent if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("arguments") or i.get("content", [{}])[0].get("text")) for i in done] == [
        ("message", "Checking."), ("function_call", '{"colour": "red"}'), ("message", " Done.")]
    pieces = [e for e in sent if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) == 2 and {e["item_id"] for e in pieces} == {done[1]["id"]}


def test_a_strict_function_tool_stays_strict_in_the_chat_it_becomes() -> None:
    """A Responses function tool's `strict` reaches the chat request the reply is made by
    (where strict tools hold an auto reply's calls: api.parsers.strict_calls)."""
    from api.responses_api import ResponsesRequest, to_chat

    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
             {"type": "function", "name": "g"}]
    chat = to_chat(ResponsesRequest.model_validate({"input": "hi", "tools": tools}))
    assert [(t.function.name, t.function.strict) for t in chat.tools or []] == [("f", True), ("g", None)]
