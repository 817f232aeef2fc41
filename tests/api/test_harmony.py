"""gpt-oss's harmony replies read into reasoning, content and calls: whole and streamed in
pieces of any size, and as the chat renderer sends them. The replies follow OpenAI's harmony
format guide (the tiny live models cannot write it; no harmony tokenizer is on this machine)."""

from __future__ import annotations

import json
import random

import pytest

from api.generate import Collector
from api.parsers.call_stream import ToolCall
from api.parsers.harmony import HarmonyReader
from api.parsers.reasoning import split
from api.parsers.tool_calls import read_all
from api.render import ChatRenderer, RelayedRequest
from api.response_bodies import Usage
from producer.protocol import Event

WEATHER = ('<|channel|>analysis<|message|>User asks for the weather in Paris. Use the tool.<|end|>'
           '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
           '<|message|>{"city": "Paris"}')
CASES = [
    # (reply as the worker sends it (the closing <|return|> or <|call|> left out), reasoning,
    # content, calls as (name, arguments))
    ("<|channel|>analysis<|message|>2 + 2 = 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "2 + 2 = 4.", "It is 4.", []),
    (WEATHER, "User asks for the weather in Paris. Use the tool.", "", [("get_weather", {"city": "Paris"})]),
    # a preamble before two calls, the recipient before the channel in the second header
    ("<|channel|>analysis<|message|>Two cities.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
     '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}',
     "Two cities.", "Checking both.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    # the final answer with its closing tag kept, and text that only looks like a tag
    ("<|channel|>final<|message|>a <| b<|return|>", None, "a <| b", []),
    ("<|channel|>analysis<|message|>cut off while thinking <|en", "cut off while thinking <|en", "", []),
    ("Plain words from a template without harmony.", None, "Plain words from a template without harmony.", []),
    ("", None, "", []),
]


def _read(reply: str, sizes: random.Random | None) -> tuple[str | None, str]:
    """The reply through one reader, whole or in random pieces."""
    if sizes is None:
        return split(reply, "gpt_oss")
    reader, reasoning, content, at = HarmonyReader(), "", "", 0
    while at < len(reply):
        size = sizes.choice([1, 2, 3, 9])
        more_reasoning, more_content = reader.feed(reply[at : at + size])
        reasoning, content, at = reasoning + more_reasoning, content + more_content, at + size
        assert "<|" not in more_reasoning + more_content or "a <|" in reply  # no tag leaks out whole or cut
    more_reasoning, more_content = reader.finish()
    return (reasoning + more_reasoning) or None, content + more_content


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), CASES)
def test_whole_and_streamed_replies_read_alike(reply: str, reasoning: str | None, content: str, calls: list) -> None:
    rng = random.Random(reply)
    for sizes in [None] + [rng] * 20:
        got_reasoning, text = _read(reply, sizes)
        got_content, got_calls = read_all(text, "hermes")
        assert got_reasoning == reasoning
        assert (got_content or "") == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def test_a_call_whose_body_is_not_an_object_stays_in_the_content() -> None:
    for body in ("oops", "[1, 2]"):
        _, text = split(f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{body}", "gpt_oss")
        content, calls = read_all(text, "hermes")
        assert calls == [] and body in content


def test_a_call_cut_short_keeps_the_arguments_that_came() -> None:
    """A body that opens as an object streams as the call's arguments; max_tokens may cut it."""
    _, text = split('<|channel|>commentary to=functions.f <|constrain|>json<|message|> {"a": [1,', "gpt_oss")
    assert read_all(text, "hermes") == (None, [ToolCall("f", '{"a": [1,')])


def test_the_chat_renderer_streams_reasoning_then_the_call() -> None:
    req = RelayedRequest(id="chatcmpl-x", job_ids=["j"], n=1, model="m", created=0, reasoning_parser="gpt_oss",
                         read_tool_calls="hermes")
    cuts = [0, 9, 30, 60, 75, 120, 150, 185, len(WEATHER)]  # 185: inside the arguments
    pieces = [WEATHER[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    events = [Event(seq=i, text=t, token_ids=[i]) for i, t in enumerate(pieces)]
    events[-1].finished, events[-1].finish_reason = True, "stop"
    collector, renderer, deltas = Collector(req), ChatRenderer(), []
    for event in events:
        chunk = renderer.chunk(req, collector.add("j", event), event)
        if chunk:
            deltas.append(chunk["choices"][0])
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    assert reasoning == "User asks for the weather in Paris. Use the tool."
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [c["function"].get("name") for c in calls] == ["get_weather", None]  # then more arguments
    assert calls[0]["id"].startswith("call_") and {c["index"] for c in calls} == {0}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"
    message = renderer.response(req, collector.choices, Usage()).choices[0].message
    assert message.reasoning_content == reasoning and message.content is None
    assert message.tool_calls[0]["function"]["name"] == "get_weather"


def test_reasoning_effort_reaches_the_chat_template() -> None:
    """gpt-oss's template reads `reasoning_effort`; chat's field and the Responses API's
    reasoning.effort set it, and chat_template_kwargs that name it win."""
    from pydantic import ValidationError

    from api.request_bodies import ChatCompletionRequest
    from api.responses_api import ResponsesRequest, to_chat

    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=messages, reasoning_effort="low").template_kwargs() == {"reasoning_effort": "low"}
    both = ChatCompletionRequest(messages=messages, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert both.template_kwargs() == {"reasoning_effort": "high"}
    assert ChatCompletionRequest(messages=messages).template_kwargs() == {}
    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest(messages=messages, reasoning_effort="extreme")
    assert to_chat(ResponsesRequest(input="hi", reasoning={"effort": "medium"})).reasoning_effort == "medium"
