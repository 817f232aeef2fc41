"""Splitting a reasoning model's thinking from its answer, whole and streamed in pieces of any
size, and as the chat renderer sends it (the live tests' tiny model never writes </think>)."""

from __future__ import annotations

import random

import pytest

from api.chat import chat_prompt
from api.cluster import Cluster
from api.deps import AppState
from api.generate import Collector, Plan, plan
from api.metrics import Metrics
from api.parsers.reasoning import ReasoningReader, split
from api.relay import Relay
from api.render import ChatRenderer, RelayedRequest
from api.request_bodies import ChatCompletionRequest
from api.response_bodies import Usage
from api.settings import Settings
from producer.async_client import AsyncClient
from producer.protocol import Event

CASES = [
    # (parser, reply, reasoning, content)
    ("deepseek_r1", "Let me see.\n</think>\n\nIt is 4.", "Let me see.\n", "It is 4."),
    ("deepseek_r1", "<think>hmm</think>4", "hmm", "4"),
    ("deepseek_r1", "cut off while thinking </thi", "cut off while thinking </thi", ""),
    ("deepseek_r1", "", None, ""),
    ("qwen3", "<think>\nok</think>\n\nAnswer", "\nok", "Answer"),
    ("qwen3", "  <think>ok</think>Answer", "ok", "Answer"),
    ("qwen3", "Answer straight away", None, "Answer straight away"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>cut", "cut", ""),
    ("qwen3", "a </think> b", None, "a </think> b"),  # no opening: not thinking
    ("glm45", "<think>ok</think>Answer", "ok", "Answer"),
    ("seed_oss", "<seed:think>sum it</seed:think>\n6", "sum it", "6"),
    ("seed_oss", "<think>x</think>y", None, "<think>x</think>y"),
    ("mistral", "[THINK]2 and 2[/THINK]4", "2 and 2", "4"),
    ("mistral", "[THI", None, "[THI"),
    ("granite", "Here is my thought process:\nadd them\nHere is my response:\nIt is 4.", "\nadd them\n", "It is 4."),
    ("granite", "It is 4.", None, "It is 4."),
    ("minimax_m2", "weigh it</think>\n\nIt is 4.", "weigh it", "It is 4."),
    # kept: the thinking stays in the content, after the <think> the template opened
    ("minimax_m2_append_think", "weigh it</think>\n\nIt is 4.", None, "<think>weigh it</think>\n\nIt is 4."),
    ("minimax_m2_append_think", "cut off </thi", None, "<think>cut off </thi"),
    ("minimax_m2_append_think", "", None, "<think>"),
]


@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), CASES)
def test_whole_and_streamed_replies_split_alike(parser: str, reply: str, reasoning: str | None, content: str) -> None:
    assert split(reply, parser) == (reasoning, content)
    rng = random.Random(reply)
    for _ in range(20):
        reader, got_reasoning, got_content, at = ReasoningReader(parser), "", "", 0
        while at < len(reply):
            size = rng.choice([1, 2, 3, 9])
            piece_reasoning, piece_content = reader.feed(reply[at : at + size])
            got_reasoning, got_content, at = got_reasoning + piece_reasoning, got_content + piece_content, at + size
        more_reasoning, more_content = reader.finish()
        assert ((got_reasoning + more_reasoning) or None, got_content + more_content) == (reasoning, content)


def planned(parser: str, **fields) -> Plan:
    """A chat request planned as the route plans it under `parser` (no job is submitted)."""
    settings = Settings(reasoning_parser=parser)
    client = AsyncClient(settings.redis_url, settings.prefix)  # connects on first use only: never here
    state = AppState(settings, client, Relay(client.redis, client.keys), Cluster(client.redis, client.keys), Metrics())
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})
    return plan(state, body, [chat_prompt(body)], ChatRenderer(), "x", "m")


def test_parsers_plan_their_replies_as_their_models_write_them() -> None:
    """Magistral's [THINK] tags are special tokens: its replies keep them. DeepSeek-V3.1's
    template thinks only when asked: then its reply is read as deepseek_r1's, and a grammar
    holds after </think>; else the reply has no reasoning and the grammar holds from the start."""
    assert planned("mistral").params.skip_special_tokens is False
    assert planned("qwen3").params.skip_special_tokens is True
    assert planned("deepseek_v3").req.reasoning_parser is None
    thinking = {"chat_template_kwargs": {"thinking": True}, "response_format": {"type": "json_object"}}
    on = planned("deepseek_v3", **thinking)
    assert on.req.reasoning_parser == "deepseek_r1" and on.params.guided_decoding["after"] == "</think>"
    assert "after" not in planned("deepseek_v3", response_format={"type": "json_object"}).params.guided_decoding
    kept = planned("minimax_m2_append_think", response_format={"type": "json_object"})  # M2's thinking is free
    assert kept.req.reasoning_parser == "minimax_m2_append_think" and kept.params.guided_decoding["after"] == "</think>"


def test_the_chat_renderer_sends_reasoning_then_content() -> None:
    req = RelayedRequest(id="chatcmpl-x", job_ids=["j"], n=1, model="m", created=0, reasoning_parser="deepseek_r1")
    pieces = ["First, ", "add.</th", "ink>\n\n", "It is", " 4."]
    events = [Event(seq=i, text=t, token_ids=[i]) for i, t in enumerate(pieces)]
    events[-1].finished, events[-1].finish_reason = True, "stop"
    collector, renderer, deltas = Collector(req), ChatRenderer(), []
    for event in events:
        chunk = renderer.chunk(req, collector.add("j", event), event)
        deltas.append(chunk and chunk["choices"][0]["delta"])
    assert deltas == [{"reasoning": "First, ", "reasoning_content": "First, "},
                      {"reasoning": "add.", "reasoning_content": "add."}, None, {"content": "It is"}, {"content": " 4."}]
    message = renderer.response(req, collector.choices, Usage()).choices[0].message
    assert (message.reasoning_content, message.content) == ("First, add.", "It is 4.")


def test_kept_thinking_streams_as_content_after_its_opening_tag() -> None:
    """minimax_m2_append_think: the first piece of content opens with the template's <think>,
    and the whole message's content is the reply behind it, tags and all."""
    req = RelayedRequest(id="chatcmpl-x", job_ids=["j"], n=1, model="m", created=0,
                         reasoning_parser="minimax_m2_append_think")
    events = [Event(seq=i, text=t, token_ids=[i]) for i, t in enumerate(["First, ", "add.</th", "ink>\n\nIt is 4."])]
    events[-1].finished, events[-1].finish_reason = True, "stop"
    collector, renderer = Collector(req), ChatRenderer()
    deltas = [renderer.chunk(req, collector.add("j", e), e)["choices"][0]["delta"] for e in events]
    assert deltas == [{"content": "<think>First, "}, {"content": "add.</th"}, {"content": "ink>\n\nIt is 4."}]
    message = renderer.response(req, collector.choices, Usage()).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "<think>First, add.</think>\n\nIt is 4.")


def test_a_forced_call_after_thinking_is_named_in_its_first_piece() -> None:
    req = RelayedRequest(id="chatcmpl-x", job_ids=["j"], n=1, model="m", created=0,
                         reasoning_parser="deepseek_r1", tool_call="f")
    events = [Event(seq=i, text=t, token_ids=[i]) for i, t in enumerate(["hmm</think>", '{"a":', " 1}"])]
    collector, renderer = Collector(req), ChatRenderer()
    deltas = [renderer.chunk(req, collector.add("j", e), e)["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"reasoning": "hmm", "reasoning_content": "hmm"}
    first, second = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert (first["function"], first["id"]) == ({"name": "f", "arguments": '{"a":'}, "call_x_0")
    assert second == {"index": 0, "function": {"arguments": " 1}"}}
    message = renderer.response(req, collector.choices, Usage()).choices[0].message
    assert message.reasoning_content == "hmm" and message.tool_calls[0]["function"]["arguments"] == '{"a": 1}'
