"""Tool calls as GLM-4.5, 4.6 and 4.7 write them (GENQ_TOOL_CALL_PARSER `glm45`; vLLM's glm45
and glm47 parsers): a `<tool_call>` block holds the function's name, then each argument as a
key and a value,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

and GLM-4.7 writes the same without the newlines; and as Qwen3-Coder and Qwen3.5 write them
(`qwen3_coder`; vLLM's qwen3_coder):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The blocks are found as hermes blocks are (api.parsers.tool_calls.ToolCallReader); `GlmBlock` and
`Qwen3CoderBlock` read what one holds. The chat templates write a string value as its raw
text and any other as JSON, so a value is read as JSON unless the request's tool declares
that parameter a string, and as text when it is no JSON. A call's arguments go out as the
JSON text of an object, an argument at a time as each value closes. Plain Python; no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

from api.parsers.call_stream import CallDelta

StringParameters = frozenset[tuple[str, str]]  # (tool, parameter): those the tools declare strings


class TaggedBlock:
    """What a block of tagged arguments keeps as its text streams in: the open call (its
    index, its name once given out, its arguments given out) and where reading goes on."""

    def __init__(self, first_index: int, string_parameters: StringParameters = frozenset()) -> None:
        self.text = ""  # all that was fed
        self._index = first_index  # the open call's, or the next one's
        self._strings = string_parameters
        self._name: str | None = None  # the open call's, once given out
        self._at = 0  # where reading goes on
        self._num_arguments = 0  # of the open call, given out

    @property
    def next_index(self) -> int:
        """The index the next call will have."""
        return self._index + (self._name is not None)


class GlmBlock(TaggedBlock):
    """Reads one block's text (between its tags) as it streams. The block is a call once its
    name is whole, at its first `<arg_key>` or at the block's end tag; a name that is empty or
    more than one word makes it no call."""

    key = "<arg_key>"  # where an argument begins
    value_end = "</arg_value>"
    # one argument, up to its value's closing tag: its key and its value
    argument = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*)", re.DOTALL)

    def __init__(self, first_index: int, string_parameters: StringParameters = frozenset()) -> None:
        super().__init__(first_index, string_parameters)
        self._not_a_call = False

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas: list[CallDelta] = []
        if self._name is None and not self._not_a_call and (key := self.text.find(self.key)) >= 0:
            deltas += self._named(self.text[:key])
            self._at = key
        while self._name is not None and (end := self.text.find(self.value_end, self._at)) >= 0:
            deltas += self._argument(self.text[self._at : end])
            self._at = end + len(self.value_end)
        return deltas

    def close(self) -> list[CallDelta] | None:
        """The block's end tag came: the rest of the call, or None when the block is none. An
        argument whose value did not close is dropped."""
        deltas = self._named(self.text) if self._name is None and not self._not_a_call else []
        if self._name is None:
            return None
        return [*deltas, CallDelta(self._index, None, "}" if self._num_arguments else "{}")]

    def cut(self) -> list[CallDelta] | None:
        """The reply ended inside the block (max_tokens, or a stop string ate the end tag): a
        call only if its name was whole, with the arguments whose values closed."""
        return None if self._name is None else self.close()

    def _name_in(self, text: str) -> str:
        """The function's name in the block's text before its first argument."""
        return text.strip()

    def _named(self, text: str) -> list[CallDelta]:
        name = self._name_in(text)
        if len(name.split()) != 1:  # empty, or words: no function's name
            self._not_a_call = True
            return []
        self._name = name
        return [CallDelta(self._index, name, "")]

    def _argument(self, text: str) -> list[CallDelta]:
        """One argument's text, as JSON to add to the arguments' object; none if the text is
        not a key and a value."""
        match = self.argument.fullmatch(text)
        if match is None:
            return []
        piece = argument_piece(self._name, match[1].strip(), self._value(match[2]), self._strings, self._num_arguments)
        self._num_arguments += 1
        return [CallDelta(self._index, None, piece)]


    def _value(self, text: str) -> str:
        return text


class Qwen3CoderBlock(GlmBlock):
    """Qwen3-Coder's block: the name in `<function=NAME>`, each argument a `<parameter=KEY>`
    whose value lies on the lines between it and `</parameter>` (one newline each side is
    the template's, not the value's)."""

    key = "<parameter="
    value_end = "</parameter>"
    argument = re.compile(r"\s*<parameter=([^>]*)>(.*)", re.DOTALL)

    def _name_in(self, text: str) -> str:
        match = re.fullmatch(r"\s*<function=([^>]*)>.*", text, re.DOTALL)
        return match[1].strip() if match else ""

    def _value(self, text: str) -> str:
        return text.removeprefix("\n").removesuffix("\n")


class MiniMaxBlock(TaggedBlock):
    """MiniMax-M2's block: one or more calls, each an `<invoke name="NAME">` whose arguments are
    `<parameter name="KEY">VALUE</parameter>`, up to `</invoke>`. A call is given out once its
    invoke tag is whole, an argument at a time as each value closes; a block without an invoke
    is none."""

    invoke = re.compile(r'<invoke name="([^"<>]*)">')
    parameter = re.compile(r'\s*<parameter name="([^"<>]*)">(.*)', re.DOTALL)

    def __init__(self, first_index: int, string_parameters: StringParameters = frozenset()) -> None:
        super().__init__(first_index, string_parameters)
        self._any = False  # a call was given out

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas: list[CallDelta] = []
        while True:
            if self._name is None:
                match = self.invoke.search(self.text, self._at)
                if match is None or not match[1].strip():
                    return deltas
                self._name, self._num_arguments, self._at, self._any = match[1].strip(), 0, match.end(), True
                deltas.append(CallDelta(self._index, self._name, ""))
            ends = [(i, tag) for tag in ("</parameter>", "</invoke>") if (i := self.text.find(tag, self._at)) >= 0]
            if not ends:
                return deltas
            end, tag = min(ends)
            if tag == "</invoke>":
                deltas += self._finish()
            else:
                deltas += self._argument(self.text[self._at : end])
            self._at = end + len(tag)

    def close(self) -> list[CallDelta] | None:
        """The block's end tag came: the open call's end, or None when the block held none."""
        deltas = self._finish() if self._name is not None else []
        return deltas if self._any else None

    def cut(self) -> list[CallDelta] | None:
        return self.close()

    def _finish(self) -> list[CallDelta]:
        delta = CallDelta(self._index, None, "}" if self._num_arguments else "{}")
        self._name, self._index = None, self._index + 1
        return [delta]

    def _argument(self, text: str) -> list[CallDelta]:
        match = self.parameter.fullmatch(text)
        if match is None:
            return []
        piece = argument_piece(self._name, match[1].strip(), match[2], self._strings, self._num_arguments)
        self._num_arguments += 1
        return [CallDelta(self._index, None, piece)]


def argument_piece(name: str | None, key: str, value: str, strings: StringParameters, num_before: int) -> str:
    """One argument as the next piece of the arguments' JSON object: a value the tool declares
    a string as its text, any other as JSON when it is JSON."""
    read = value if (name, key) in strings else _json_or_text(value)
    pair = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(read, ensure_ascii=False)
    return (", " if num_before else "{") + pair


def _json_or_text(value: str) -> Any:
    """A value the template wrote with `tojson`, or the text of a string the request's tool
    does not declare."""
    try:
        return json.loads(value, parse_constant=_not_json)
    except ValueError:
        return value


def _not_json(constant: str) -> Any:
    """Python's json reads NaN and Infinity, but they are no JSON for the client."""
    raise ValueError(f"{constant} is not JSON")
