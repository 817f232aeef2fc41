"""Reading hermes tool calls out of a reply, whole and as it streams in pieces of any size:
the pieces of a call join to the call read whole, and its arguments go out as they come."""

from __future__ import annotations

import json
import random

import pytest

from api.call_stream import CallDelta, ToolCall
from api.tool_calls import CallArrayReader, ToolCallReader, joined, read_all

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
    # keys in another order, arguments as JSON text: read whole when the block closes
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    # more keys after the arguments, and a list whose second call is read whole
    ('<tool_call>{"name": "f", "arguments": {"a": "}"}, "id": "x"}</tool_call>', None, [("f", {"a": "}"})]),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"arguments": {}, "name": "g"}]</tool_call>', None,
     [("f", {}), ("g", {})]),
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


def _stream(reader: ToolCallReader | CallArrayReader, reply: str, sizes: list[int]) -> tuple[str, list[CallDelta]]:
    """The content and call pieces a reader gives out for `reply` fed in pieces of `sizes`."""
    content, deltas, at = "", [], 0
    for size in sizes:
        piece_content, piece_deltas = reader.feed(reply[at : at + size])
        content, deltas, at = content + piece_content, deltas + piece_deltas, at + size
    rest, more = reader.finish()
    return content + rest, deltas + more


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_a_streamed_reply_gives_the_same_in_pieces_of_any_size(
    reply: str, content: str | None, calls: list
) -> None:
    rng = random.Random(reply)
    whole = read_all(reply)[1]
    for _ in range(20):
        sizes = [rng.choice([1, 1, 2, 3, 7, 40]) for _ in reply]
        reader = ToolCallReader()
        got_content, deltas = _stream(reader, reply, sizes)
        assert (got_content or None if deltas else got_content) == content
        assert joined(deltas) == whole  # the pieces join to the very calls read whole
        assert [d.index for d in deltas if d.name] == list(range(len(calls)))  # each named once
        assert reader.num_calls == len(calls)


def test_a_calls_arguments_stream_as_the_model_writes_them() -> None:
    arguments = '{"path":"a.py","code":"def f():\\n    return {\\"x\\": [1]}\\n"}'
    reply = f'Writing it.<tool_call>\n{{"name": "write", "arguments": {arguments}}}\n</tool_call>'
    reader = ToolCallReader()
    given = [reader.feed(char) for char in reply] + [reader.finish()]
    deltas = [d for _, piece in given for d in piece]
    named = [at for at, (_, piece) in enumerate(given) if any(d.name for d in piece)]
    assert named == [reply.index("{", reply.index('"arguments"'))]  # once the head is whole
    assert sum(bool(d.arguments) for d in deltas) == len(arguments)  # a piece a character
    assert joined(deltas) == [ToolCall("write", arguments)]  # exactly as written, not re-spaced
    assert "".join(content for content, _ in given) == "Writing it."
    assert read_all(reply) == ("Writing it.", [ToolCall("write", arguments)])


def test_a_call_cut_short_keeps_what_came() -> None:
    """max_tokens in the middle of the arguments: the call was given out, and stays one."""
    content, calls = read_all('<tool_call>{"name": "f", "arguments": {"a": [1, 2')
    assert (content, calls) == (None, [ToolCall("f", '{"a": [1, 2')])


def test_nothing_of_a_call_is_sent_as_content_before_its_head_is_read() -> None:
    reader = ToolCallReader()
    assert reader.feed("Sure.\n<tool") == ("Sure.", [])
    assert reader.feed("_call>{\"name\": \"a\",") == ("", [])
    assert reader.feed(' "arguments": {') == ("", [CallDelta(0, "a", "{")])
    assert reader.feed('}}</tool_call>') == ("", [CallDelta(0, None, "}")])
    assert reader.finish() == ("", [])


ARRAY = '[{"name": "a", "arguments": {"s": "}]\\\\\\"{["}}, {"name": "b", "arguments": {"l": [1, {}]}}]'


def test_a_guided_array_of_calls_streams_each_call_as_it_is_written() -> None:
    assert json.loads(ARRAY)  # brackets and escaped quotes inside strings do not count
    expected = [("a", {"s": '}]\\"{['}), ("b", {"l": [1, {}]})]
    content, calls = read_all(ARRAY, "json")
    assert (content, _calls(calls)) == (None, expected)
    reader = CallArrayReader()
    given = [reader.feed(char)[1] for char in ARRAY]
    named = [at for at, piece in enumerate(given) if any(d.name for d in piece)]
    assert named == [ARRAY.index("{", ARRAY.index("arguments")), ARRAY.rindex("{", 0, ARRAY.rindex("[1"))]
    assert _calls(joined(sum(given, []))) == expected
    cut = CallArrayReader()  # max_tokens cut the array: the calls it began stay
    calls = joined(_stream(cut, ARRAY[:-6], [len(ARRAY)])[1])
    assert (_calls(calls[:1]), calls[1:], cut.num_calls) == (expected[:1], [ToolCall("b", '{"l": [1, ')], 2)


# -- Llama 3's and Mistral's formats (api.tool_formats) ---------------------------------------

WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
FORMAT_CASES = [
    # (form, reply, content, calls as (name, arguments))
    ("llama3_json", WEATHER, None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("llama3_json", f"<|python_tag|>{WEATHER}; {WEATHER}", None, [("get_weather", {"city": "Paris", "days": 2})] * 2),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # the second call's keys in another order: read whole at the end, after the first streamed
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"parameters": {"y": 2}, "name": "b"}', None,
     [("a", {"x": 1}), ("b", {"y": 2})]),
    ("llama3_json", '{"parameters": {"y": 2}, "name": "b"}; {"name": "a", "parameters": {"x": 1}}', None,
     [("b", {"y": 2}), ("a", {"x": 1})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call: content as written
    ("llama3_json", "<|python", "<|python", []),
    ("mistral", 'Let me look.[TOOL_CALLS][{"name": "a", "arguments": {"x": [1, "]"]}}, {"name": "b", "arguments": {}}]',
     "Let me look.", [("a", {"x": [1, "]"]}), ("b", {})]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": {"y": "}"}}[TOOL_CALLS]b[ARGS]{}', None, [("a", {"x": {"y": "}"}}), ("b", {})]),
    ("mistral", "No tools needed [TOOL", "No tools needed [TOOL", []),
]


@pytest.mark.parametrize(("form", "reply", "content", "calls"), FORMAT_CASES)
def test_llama3_and_mistral_formats_whole_and_streamed(form: str, reply: str, content: str | None, calls: list) -> None:
    from api.tool_calls import READERS

    got_content, got_calls = read_all(reply, form)
    assert (got_content, _calls(got_calls)) == (content, calls)
    rng = random.Random(reply)
    for _ in range(20):
        reader = READERS[form]()
        streamed, deltas = _stream(reader, reply, [rng.choice([1, 1, 2, 3, 7, 40]) for _ in reply])
        assert (streamed or None if deltas else streamed) == content
        assert joined(deltas) == got_calls
        assert reader.num_calls == len(calls)


def test_a_mistral_calls_arguments_stream_before_it_closes() -> None:
    from api.tool_formats import MistralReader

    reader = MistralReader()
    assert reader.feed("[TOOL_CALLS]get_weather[AR") == ("", [])
    assert reader.feed('GS]{"city": "Pa') == ("", [CallDelta(0, "get_weather", '{"city": "Pa')])
    assert reader.num_calls == 1
    assert reader.feed('ris"}') == ("", [CallDelta(0, None, 'ris"}')])
