"""Reading hermes tool calls out of a reply, whole and as it streams in pieces of any size."""

from __future__ import annotations

import json
import random

import pytest

from api.tool_calls import CallArrayReader, ToolCall, ToolCallReader, read_all

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
TWO = '[{"name": "a", "arguments": {}}, {"name": "b", "parameters": "{\\"x\\": [1, \\"é\\"]}"}]'

CASES = [
    # (reply, content, calls as (name, arguments))
    ("Just an answer.", "Just an answer.", []),
    (f"<tool_call>\n{CALL}\n</tool_call>", None, [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Let me check.\n\n<tool_call>{CALL}</tool_call>\n", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (f"<tool_call>{TWO}</tool_call>", None, [("a", {}), ("b", {"x": [1, "é"]})]),
    (f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>", None,
     [("get_weather", {"city": "Paris", "days": 2})] * 2),
    (f"<tool_call>{CALL}</tool_call> Done, see above.", "Done, see above.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    # the stop string ate </tool_call>: whole JSON is still a call
    (f"<tool_call>{CALL}", None, [("get_weather", {"city": "Paris", "days": 2})]),
    # not calls: kept as the model wrote them
    ("a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b", []),
    ('x <tool_call>{"arguments": {}}</tool_call>', 'x <tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}', '<tool_call>{"name": "f", "arguments": [1]}', []),
    ("cut off <tool_call>{\"name\": \"f\", \"argu", "cut off <tool_call>{\"name\": \"f\", \"argu", []),
    ("a < b and <tool", "a < b and <tool", []),
    ("  spaced  ", "spaced  ", []),
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_a_whole_reply(reply: str, content: str | None, calls: list) -> None:
    got_content, got_calls = read_all(reply)
    assert (got_content, _calls(got_calls)) == (content, calls)


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_a_streamed_reply_gives_the_same_in_pieces_of_any_size(
    reply: str, content: str | None, calls: list
) -> None:
    rng = random.Random(reply)
    for _ in range(20):
        reader = ToolCallReader()
        got_content, got_calls, at = "", [], 0
        while at < len(reply):
            size = rng.choice([1, 1, 2, 3, 7, 40])
            piece_content, piece_calls = reader.feed(reply[at : at + size])
            got_content += piece_content
            got_calls += piece_calls
            at += size
        rest, more = reader.finish()
        assert (got_content + rest or None if got_calls + more else got_content + rest) == content
        assert _calls(got_calls + more) == calls
        assert reader.num_calls == len(calls)


def test_nothing_of_a_call_is_sent_as_content_before_it_is_whole() -> None:
    reader = ToolCallReader()
    assert reader.feed("Sure.\n<tool") == ("Sure.", [])
    assert reader.feed("_call>{\"name\": \"a\",") == ("", [])
    content, calls = reader.feed(' "arguments": {}}</tool_call>')
    assert (content, _calls(calls)) == ("", [("a", {})])


ARRAY = '[{"name": "a", "arguments": {"s": "}]\\\\\\"{["}}, {"name": "b", "arguments": {"l": [1, {}]}}]'


def test_a_guided_array_of_calls_gives_each_call_as_its_object_closes() -> None:
    assert json.loads(ARRAY)  # brackets and escaped quotes inside strings do not count
    expected = [("a", {"s": '}]\\"{['}), ("b", {"l": [1, {}]})]
    assert read_all(ARRAY, "json") == (None, [ToolCall(n, json.dumps(a)) for n, a in expected])
    reader = CallArrayReader()
    given = [_calls(reader.feed(char)[1]) for char in ARRAY]
    assert [at for at, calls in enumerate(given) if calls] == [ARRAY.index("}}") + 1, len(ARRAY) - 2]
    assert sum(given, []) == expected
    cut = CallArrayReader()  # max_tokens cut the array: the calls it completed stay
    assert _calls(cut.feed(ARRAY[:-20])[1] + cut.finish()[1]) == expected[:1]
