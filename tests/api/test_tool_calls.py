"""Reading tool calls out of a reply (hermes, Llama 3's, Mistral's and GLM's formats), whole and
as it streams in pieces of any size: the pieces of a call join to the call read whole, and its
arguments go out as they come."""

from __future__ import annotations

import json
import random

import pytest

from api.chat import chat_prompt
from api.cluster import Cluster
from api.deps import AppState
from api.generate import Collector, plan
from api.metrics import Metrics
from api.parsers.call_stream import CallDelta, ToolCall
from api.parsers.tool_calls import CallArrayReader, ToolCallReader, calls_reader, joined, read_all
from api.relay import Relay
from api.render import ChatRenderer, RelayedRequest
from api.request_bodies import ChatCompletionRequest
from api.response_bodies import Usage
from api.settings import Settings
from producer.async_client import AsyncClient
from producer.protocol import Event

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


# -- GLM-4.5 to 4.7's format (api.parsers.glm_tool_calls) -----------------------------------------------

GLM45 = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
GLM47 = GLM45.replace("\n", "")  # GLM-4.7 writes no newlines between the parts
PARIS = ("get_weather", {"city": "Paris", "days": 2})
# the parameters the request's tools declare strings: lookup's `limit` is declared an integer,
# `other` has no schema
STRINGS = (("get_weather", "city"), ("lookup", "code"), ("lookup", "quote"))


def _glm(name: str, *arguments: tuple[str, str]) -> str:
    """A GLM-4.7 block calling `name` with (key, value as written)."""
    written = "".join(f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>" for key, value in arguments)
    return f"<tool_call>{name}{written}</tool_call>"


def _qwen3_coder(name: str, *arguments: tuple[str, str]) -> str:
    """A Qwen3-Coder block calling `name` with (key, value as written)."""
    written = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments)
    return f"<tool_call>\n<function={name}>\n{written}</function>\n</tool_call>"


def _minimax(*calls: tuple[str, tuple[tuple[str, str], ...]]) -> str:
    """A MiniMax-M2 block calling each (name, ((key, value as written), ...))."""
    invokes = "".join(f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args)
                      + "</invoke>\n" for name, args in calls)
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


GLM_CASES = [
    # (reply, content, calls as (name, arguments))
    (GLM45, None, [PARIS]),
    (GLM47, None, [PARIS]),
    (f"{GLM45}\n{GLM47}\n", None, [PARIS, PARIS]),
    (f"Let me check.\n\n{GLM45}", "Let me check.", [PARIS]),
    (f"{GLM47} Done, see above.", "Done, see above.", [PARIS]),
    ("<tool_call>get_time</tool_call>", None, [("get_time", {})]),
    ("<tool_call>get_time\n</tool_call>", None, [("get_time", {})]),
    # a declared string keeps its text as written; any other value is JSON when it is JSON
    (_glm("lookup", ("code", "123"), ("quote", '"x" <b>')), None, [("lookup", {"code": "123", "quote": '"x" <b>'})]),
    (_glm("lookup", ("limit", "123")), None, [("lookup", {"limit": 123})]),
    (_glm("other", ("code", "123"), ("q", "Paris"), ("on", "true"), ("x", "NaN")), None,
     [("other", {"code": 123, "q": "Paris", "on": True, "x": "NaN"})]),
    (_glm("other", ("filter", '{"tags": ["é", 1]}'), ("text", "line 1\nline 2")), None,
     [("other", {"filter": {"tags": ["é", 1]}, "text": "line 1\nline 2"})]),
    # cut off (max_tokens, or a stop string ate </tool_call>): a call once its name is whole,
    # with the arguments whose values closed
    (GLM45.removesuffix("</tool_call>"), None, [PARIS]),
    (GLM47[: GLM47.rindex("</arg_value>")], None, [("get_weather", {"city": "Paris"})]),
    ("<tool_call>get_weather<arg_key>ci", None, [("get_weather", {})]),
    ("Hm, <tool_call>get_wea", "Hm, <tool_call>get_wea", []),  # the name may have gone on
    # not calls: kept as the model wrote them
    ("a <tool_call>\n<arg_key>x</arg_key><arg_value>1</arg_value></tool_call> b",
     "a <tool_call>\n<arg_key>x</arg_key><arg_value>1</arg_value></tool_call> b", []),
    ("<tool_call>not a name</tool_call>", "<tool_call>not a name</tool_call>", []),
    ("a < b and <tool_", "a < b and <tool_", []),
]


def test_a_glm_call_is_named_once_its_name_is_whole_and_streams_an_argument_at_a_time() -> None:
    reader = calls_reader("glm45", STRINGS)
    assert reader.feed("Sure.\n<tool") == ("Sure.", [])
    assert reader.feed("_call>get_wea") == ("", [])
    assert reader.feed("ther\n<arg_key>ci") == ("", [CallDelta(0, "get_weather", "")])
    assert reader.feed("ty</arg_key>\n<arg_value>Pa") == ("", [])
    assert reader.feed("ris</arg_value>\n") == ("", [CallDelta(0, None, '{"city": "Paris"')])
    assert reader.feed("<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>") == (
        "", [CallDelta(0, None, ', "days": 2}')])
    assert reader.finish() == ("", [])
    assert reader.num_calls == 1


# -- Llama 3's and Mistral's formats (api.parsers.tool_formats) ---------------------------------------

WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                 "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
KIMI_BEGIN, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, KIMI_END = (
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|tool_calls_section_end|>")


def _deepseek_v31(*calls: tuple[str, str]) -> str:
    return DS_BEGIN + "".join(f"{DS_CALL}{name}{DS_SEP}{arguments}{DS_CALL_END}" for name, arguments in calls) + DS_END


def _deepseek_v3(*calls: tuple[str, str]) -> str:
    return DS_BEGIN + "".join(f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"
                              for name, arguments in calls) + DS_END


def _kimi(*calls: tuple[str, str]) -> str:
    return KIMI_BEGIN + "".join(f"{KIMI_CALL}functions.{name}:{k}{KIMI_ARGS}{arguments}{KIMI_CALL_END}"
                                for k, (name, arguments) in enumerate(calls)) + KIMI_END


SECTION_WRITERS = {"deepseek_v31": _deepseek_v31, "deepseek_v3": _deepseek_v3, "kimi_k2": _kimi}
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
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', None, [PARIS]),
    ("granite", 'Checking.<|tool_call|>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]',
     "Checking.", [("a", {}), ("b", {"y": 2})]),
    ("granite", "Sunny, <|tool", "Sunny, <|tool", []),
    *[("glm45", *case) for case in GLM_CASES],
    # Qwen3-Coder's blocks (Qwen3.5, Qwen3-Next): a value on its own lines, typed as GLM's are
    *[("qwen3_coder", *case) for case in [
        (_qwen3_coder("get_weather", ("city", "Paris"), ("days", "2")), None, [PARIS]),
        (f"Let me check.\n\n{_qwen3_coder('get_time')}", "Let me check.", [("get_time", {})]),
        (_qwen3_coder("lookup", ("code", "123"), ("quote", "line 1\n</b> 2")) + _qwen3_coder("other", ("code", "123")),
         None, [("lookup", {"code": "123", "quote": "line 1\n</b> 2"}), ("other", {"code": 123})]),
        ("<tool_call>\nno function here\n</tool_call>", "<tool_call>\nno function here\n</tool_call>", []),
    ]],
    # Seed-OSS's: Qwen3-Coder's blocks between its own tags (a hermes tag is no call there)
    *[("seed_oss", *case) for case in [
        (_qwen3_coder("get_weather", ("city", "Paris"), ("days", "2")).replace("tool_call>", "seed:tool_call>"),
         None, [PARIS]),
        ("Sure. " + _qwen3_coder("get_time").replace("tool_call>", "seed:tool_call>"), "Sure.", [("get_time", {})]),
        ("<tool_call>x</tool_call>", "<tool_call>x</tool_call>", []),
    ]],
    # MiniMax-M2's: several invokes in a block, values typed as GLM's are
    *[("minimax_m2", *case) for case in [
        (_minimax(("get_weather", (("city", "Paris"), ("days", "2")))), None, [PARIS]),
        ("Let me look.\n" + _minimax(("lookup", (("code", "123"), ("quote", "a </b> b"))), ("get_time", ())),
         "Let me look.", [("lookup", {"code": "123", "quote": "a </b> b"}), ("get_time", {})]),
        (_minimax(("a", (("x", "[1, 2]"),))) + "\n" + _minimax(("b", (("y", "true"),))), None, [("a", {"x": [1, 2]}), ("b", {"y": True})]),
        # cut short: the calls named so far, with the arguments whose values closed
        ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="da',
         None, [("get_weather", {"city": "Paris"})]),
        ("<minimax:tool_call>\nno invoke here\n</minimax:tool_call>", "<minimax:tool_call>\nno invoke here\n</minimax:tool_call>", []),
        ("It is sunny <minimax:tool", "It is sunny <minimax:tool", []),
    ]],
    # Llama 3.2's and Llama 4's Python lists of calls: literals of every kind, brackets and
    # quotes inside strings, Llama 4's tags
    ("pythonic", '[get_weather(city="Paris", days=2)]', None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("pythonic", '<|python_start|>[a(x=[1, (2, 3)], y={"k": None}, z=True), b()]<|python_end|>', None,
     [("a", {"x": [1, [2, 3]], "y": {"k": None}, "z": True}), ("b", {})]),
    ("pythonic", """ [note(text='it\\'s ) ] "fine"', n=-1.5),\n note(text="[x(y=1)]")]""", None,
     [("note", {"text": 'it\'s ) ] "fine"', "n": -1.5}), ("note", {"text": "[x(y=1)]"})]),
    ("pythonic", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),  # a list, but of no calls
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),  # a positional argument: no call genq can name
    ("pythonic", "[f(x=y)]", "[f(x=y)]", []),  # a value that is no literal
    ("pythonic", "[a(x=1), b(y=2", None, [("a", {"x": 1})]),  # cut short: the whole calls stand
    ("pythonic", "[a(x=1), 7]", None, [("a", {"x": 1})]),
    ("pythonic", "<|python_st", "<|python_st", []),
    # DeepSeek's and Kimi K2's sections of special tokens: content before them, calls in them
    *[case for form, write in SECTION_WRITERS.items() for case in [
        (form, write(("get_weather", '{"city": "Paris", "days": 2}')), None, [PARIS]),
        (form, "Let me check both." + write(("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")),
         "Let me check both.", [PARIS, ("get_time", {})]),
        (form, "It is sunny in Paris.", "It is sunny in Paris.", []),
        (form, "It is sunny <|tool", "It is sunny <|tool", []),
    ]],
    # cut short: a call whose arguments were coming keeps what came of them
    ("deepseek_v31", f'{DS_BEGIN}{DS_CALL}a{DS_SEP}{{"x": 1}}{DS_CALL_END}{DS_CALL}b{DS_SEP}{{"y": 2}}', None,
     [("a", {"x": 1}), ("b", {"y": 2})]),
    ("kimi_k2", f"{KIMI_BEGIN}{KIMI_CALL}functions.lookup.v2:3{KIMI_ARGS}{{}}{KIMI_CALL_END}", None, [("lookup.v2", {})]),
]


@pytest.mark.parametrize(("form", "reply", "content", "calls"), FORMAT_CASES)
def test_other_formats_whole_and_streamed(form: str, reply: str, content: str | None, calls: list) -> None:
    got_content, got_calls = read_all(reply, form, STRINGS)
    assert (got_content, _calls(got_calls)) == (content, calls)
    rng = random.Random(reply)
    for _ in range(20):
        reader = calls_reader(form, STRINGS)
        streamed, deltas = _stream(reader, reply, [rng.choice([1, 1, 2, 3, 7, 40]) for _ in reply])
        assert (streamed or None if deltas else streamed) == content
        assert joined(deltas) == got_calls
        assert reader.num_calls == len(calls)


def test_a_pythonic_call_goes_out_once_its_parenthesis_closes() -> None:
    from api.parsers.pythonic_tool_calls import PythonicReader

    reader = PythonicReader()
    assert reader.feed("<|python_start|>[get_weather(city=") == ("", [])
    assert reader.feed('"Paris (FR)"), get_time(zone="CE') == ("", [CallDelta(0, "get_weather", '{"city": "Paris (FR)"}')])
    assert reader.num_calls == 1
    assert reader.feed('T")]<|python_end|>') == ("", [CallDelta(1, "get_time", '{"zone": "CET"}')])
    assert reader.finish() == ("", [])


@pytest.mark.parametrize("form", ["deepseek_v31", "kimi_k2"])
def test_a_section_calls_arguments_stream_as_written(form: str) -> None:
    reply = SECTION_WRITERS[form](("get_weather", '{"city": "Paris"}'))
    head = reply.index('{"city"')
    reader = calls_reader(form)
    assert reader.feed(reply[:head]) == ("", [CallDelta(0, "get_weather", "")])
    assert reader.feed(reply[head : head + 10]) == ("", [CallDelta(0, None, reply[head : head + 10])])
    assert reader.feed(reply[head + 10 :]) == ("", [CallDelta(0, None, reply[head + 10 : reply.index("}") + 1])])
    assert reader.finish() == ("", []) and reader.num_calls == 1


def test_a_mistral_calls_arguments_stream_before_it_closes() -> None:
    from api.parsers.tool_formats import MistralReader

    reader = MistralReader()
    assert reader.feed("[TOOL_CALLS]get_weather[AR") == ("", [])
    assert reader.feed('GS]{"city": "Pa') == ("", [CallDelta(0, "get_weather", '{"city": "Pa')])
    assert reader.num_calls == 1
    assert reader.feed('ris"}') == ("", [CallDelta(0, None, 'ris"}')])


def test_a_glm45_server_reads_calls_with_the_parameters_its_tools_declare_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    """GENQ_TOOL_CALL_PARSER=glm45 from the environment, a chat request with tools planned as
    the route plans it (no job is submitted), and its reply rendered whole and streamed."""
    monkeypatch.setenv("GENQ_TOOL_CALL_PARSER", "glm45")
    settings = Settings()
    client = AsyncClient(settings.redis_url, settings.prefix)  # connects on first use only: never here
    state = AppState(settings, client, Relay(client.redis, client.keys), Cluster(client.redis, client.keys), Metrics())
    properties = {"code": {"type": "string"}, "limit": {"type": "integer"}, "tag": {"type": ["string"]},
                  "note": {"type": ["string", "null"]}}
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Look up 123."}], "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": properties}}},
        {"type": "function", "function": {"name": "other"}}]})
    renderer = ChatRenderer()
    req = plan(state, body, [chat_prompt(body)], renderer, "x", "m").req
    assert (req.read_tool_calls, req.string_parameters) == ("glm45", (("lookup", "code"), ("lookup", "tag")))
    reply = _glm("lookup", ("code", "123"), ("limit", "123"), ("tag", "7"), ("note", "8")) + _glm("other", ("code", "123"))
    event = Event(seq=0, token_ids=[0], text=reply, finished=True, finish_reason="stop")
    collector = Collector(req)
    streamed = renderer.chunk(req, collector.add("x", event), event)["choices"][0]
    whole = renderer.response(req, collector.choices, Usage()).choices[0]
    expected = [("lookup", {"code": "123", "limit": 123, "tag": "7", "note": 8}), ("other", {"code": 123})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.message.tool_calls] == expected
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["delta"]["tool_calls"]] == expected
    assert (whole.finish_reason, streamed["finish_reason"]) == ("tool_calls", "tool_calls")


@pytest.mark.parametrize(("parser", "reply"), [
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=2)]<|python_end|>'),
    ("deepseek_v3", _deepseek_v3(("get_weather", '{"city": "Paris", "days": 2}'))),
    ("deepseek_v31", _deepseek_v31(("get_weather", '{"city": "Paris", "days": 2}'))),
    ("kimi_k2", _kimi(("get_weather", '{"city": "Paris", "days": 2}'))),
    ("minimax_m2", _minimax(("get_weather", (("city", "Paris"), ("days", "2"))))),
])
def test_a_server_whose_calls_are_special_tokens_asks_for_them(monkeypatch: pytest.MonkeyPatch, parser: str,
                                                              reply: str) -> None:
    """GENQ_TOOL_CALL_PARSER=pythonic (Llama 4), deepseek_v3, deepseek_v31, kimi_k2: the calls
    are wrapped in special tokens, so the job asks for the text with them; a reply of calls
    renders as tool_calls, whole and streamed."""
    monkeypatch.setenv("GENQ_TOOL_CALL_PARSER", parser)
    settings = Settings()
    client = AsyncClient(settings.redis_url, settings.prefix)  # connects on first use only: never here
    state = AppState(settings, client, Relay(client.redis, client.keys), Cluster(client.redis, client.keys), Metrics())
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    renderer = ChatRenderer()
    planned = plan(state, body, [chat_prompt(body)], renderer, "x", "m")
    assert planned.req.read_tool_calls == parser and planned.params.skip_special_tokens is False
    event = Event(seq=0, token_ids=[0], text=reply, finished=True, finish_reason="stop")
    collector = Collector(planned.req)
    streamed = renderer.chunk(planned.req, collector.add("x", event), event)["choices"][0]
    whole = renderer.response(planned.req, collector.choices, Usage()).choices[0]
    expected = [("get_weather", {"city": "Paris", "days": 2})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.message.tool_calls] == expected
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["delta"]["tool_calls"]] == expected
    assert whole.message.content is None and (whole.finish_reason, streamed["finish_reason"]) == ("tool_calls", "tool_calls")


STRICT_REPLIES = {  # a reply of two calls (the strict tool's, then the other's) in each format
    "hermes": ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
               '\n<tool_call>\n{"name": "note", "arguments": {"any": [1]}}\n</tool_call> Done.'),
    "deepseek_v31": "Let me look." + _deepseek_v31(("get_weather", '{"city": "Paris", "days": 2}'), ("note", '{"any": [1]}')),
    "deepseek_v3": "Let me look." + _deepseek_v3(("get_weather", '{"city": "Paris", "days": 2}'), ("note", '{"any": [1]}')),
    "granite": ('Let me look. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "note", "arguments": {"any": [1]}}]'),
}


@pytest.mark.parametrize("parser", list(STRICT_REPLIES))
def test_strict_tools_hold_the_calls_of_an_auto_reply(monkeypatch: pytest.MonkeyPatch, parser: str) -> None:
    """OpenAI's `strict` functions under tool_choice "auto": the reply may write text, and
    each call it opens is held to its tool in the server's format (a structural tag): a
    reply written so reads as those calls; a call whose arguments break the strict tool's
    schema, or that names no tool, is refused where it goes wrong."""
    import xgrammar as xgr

    from worker.guided.structured_output import structural_tag_json

    monkeypatch.setenv("GENQ_TOOL_CALL_PARSER", parser)
    settings = Settings()
    client = AsyncClient(settings.redis_url, settings.prefix)  # connects on first use only: never here
    state = AppState(settings, client, Relay(client.redis, client.keys), Cluster(client.redis, client.keys), Metrics())
    weather = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather, "strict": True}},
             {"type": "function", "function": {"name": "note"}}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}], "tools": tools})
    planned = plan(state, body, [chat_prompt(body)], ChatRenderer(), "x", "m")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_structural_tag(
        structural_tag_json(planned.params.guided_decoding["structural_tag"]))

    def taken(text: str) -> int:
        """The bytes of `text` the worker's grammar takes before it refuses one (all of them,
        where it may end there; -1 where it may not)."""
        matcher = xgr.GrammarMatcher(compiled)
        data = text.encode()
        for i in range(len(data)):
            if not matcher.accept_string(data[i : i + 1]):
                return i
        return len(data) if matcher.is_completed() else -1

    reply = STRICT_REPLIES[parser]
    assert taken(reply) == len(reply.encode())
    assert read_all(reply, planned.req.read_tool_calls)[1] == [
        ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("note", '{"any": [1]}')]
    bad_days = reply.replace('"days": 2', '"days": "2"', 1)
    assert taken(bad_days) == bad_days.encode().index(b'"2"')
    unknown = reply.replace("get_weather", "get_whether", 1)
    assert taken(unknown) == unknown.encode().index(b"whether") + 1  # at the h: no tool is named so
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}],
                                                  "tools": [{**tools[0], "function": {**tools[0]["function"], "strict": False}}]})
    assert plan(state, plain, [chat_prompt(plain)], ChatRenderer(), "x", "m").params.guided_decoding is None
    odd = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}  # (xgrammar holds it too)
    held = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": odd, "strict": True}}]})
    assert plan(state, held, [chat_prompt(held)], ChatRenderer(), "x", "m").params.guided_decoding is not None


def test_a_forced_calls_arguments_begin_at_their_brace() -> None:
    """The JSON a forced call is guided into may open with whitespace (the guide allows it, and
    a small model writes it): it is no part of the arguments, whole or streamed."""
    req = RelayedRequest(id="chatcmpl-x", job_ids=["j"], n=1, model="m", created=0, tool_call="f")
    events = [Event(seq=i, text=t, token_ids=[i]) for i, t in enumerate([" \n", "\n {", '"a": 1}'])]
    events[-1].finished, events[-1].finish_reason = True, "stop"
    collector, renderer = Collector(req), ChatRenderer()
    chunks = [renderer.chunk(req, collector.add("j", e), e) for e in events]
    assert chunks[0] is None  # (nothing to send yet)
    first, second = (chunk["choices"][0]["delta"]["tool_calls"][0] for chunk in chunks[1:] if chunk)
    assert first["function"] == {"name": "f", "arguments": "{"} and second["function"] == {"arguments": '"a": 1}'}
    message = renderer.response(req, collector.choices, Usage()).choices[0].message
    assert message.tool_calls[0]["function"]["arguments"] == '{"a": 1}'
