"""The JSON of tool calls read as it streams, so a call's arguments go out piece by piece as the
model writes them (as OpenAI and vLLM stream them), not whole once the call has closed.

The text is one call object or a list of them, each beginning `{"name": "...", "arguments": {`
(`parameters` may stand for `arguments`). Once a call's head is whole the call is given out
with its name; then its arguments' text as it comes, exactly as the model writes it, up to
the brace that closes them. Text that does not begin so (other keys first, arguments as JSON
text) is held and read whole when it ends, as before. A call once given out stays one: if
the model's arguments then break off (max_tokens), the call keeps what came. Plain Python; no
I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# a call's head, token by token: str stands for the name, a tuple for one of its words
_HEAD: tuple[Any, ...] = ("{", '"name"', ":", str, ",", ('"arguments"', '"parameters"'), ":", "{")
_WAIT = "wait"  # a head needs more text
_NOT_A_CALL = "not a call"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index` as it streams: its first piece has the name; each piece adds
    `arguments` text."""

    index: int
    name: str | None
    arguments: str


def parse_block(body: str) -> list[ToolCall] | None:
    """The calls in one block's JSON; None if it is not one call or a list of calls."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = _calls(value)
    return calls if calls and len(calls) == len(value if isinstance(value, list) else [value]) else None


def _calls(value: Any) -> list[ToolCall]:
    """The items of `value` (a call or a list of them) that are calls, up to the first not one."""
    calls: list[ToolCall] = []
    for item in value if isinstance(value, list) else [value]:
        call = _call(item)
        if call is None:
            break
        calls.append(call)
    return calls


def _call(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class CallStream:
    """Reads the JSON text of calls (one object or a list) fed piece by piece. `feed` returns
    the pieces of calls it can give out; `close` (when the text has ended) what is left, or
    None when the text turned out to hold no call at all."""

    def __init__(self, first_index: int = 0, separator: str | None = None) -> None:
        self.text = ""  # all that was fed
        self._separator = separator  # between calls written one after another, not in a list (";")
        self.arguments_end: int | None = None  # where in `text` the last call's arguments closed
        self._at = 0  # where reading resumes
        self._phase = "open"  # open | head | arguments | rest | next | end | whole
        self._in_list = False
        self._depth = 0  # of brackets, in arguments (from their brace) and the rest of an item
        self._in_string = False
        self._escaped = False
        self._given = 0  # characters of the current call's arguments given out
        self._arguments_start = 0
        self._first_index = first_index
        self.num_calls = 0  # calls given out

    @property
    def next_index(self) -> int:
        """The index the next call will have."""
        return self._first_index + self.num_calls

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas: list[CallDelta] = []
        while self._step(deltas):
            pass
        return merged(deltas)

    def close(self) -> list[CallDelta] | None:
        """The end of the text: calls held whole are read now; None when there is no call."""
        if self.num_calls == 0 and self._phase in ("open", "head", "whole"):
            calls = parse_block(self.text)  # all calls, or the text is none
            if calls is None and self._separator:  # calls one after another, not one JSON value
                calls = self._calls_from(0) or None
            return None if calls is None else [self._start(call.name, call.arguments) for call in calls]
        if self._phase == "whole":  # the calls after those streamed, from the item held
            return [self._start(call.name, call.arguments) for call in self._calls_from(self._at)]
        return []

    def cut(self) -> list[CallDelta] | None:
        """The text broke off before its block's end tag (max_tokens, a stop string): JSON
        read whole needs no tag, so this is `close`."""
        return self.close()

    def _calls_from(self, at: int) -> list[ToolCall]:
        """The calls written one after another from `at`, each read whole, up to the first
        that is not one."""
        decoder, calls = json.JSONDecoder(), []
        between = "," if self._in_list else self._separator
        while True:
            try:
                value, at = decoder.raw_decode(self.text, _skip_space(self.text, at))
            except json.JSONDecodeError:
                break
            call = _call(value)
            if call is None:
                break
            calls.append(call)
            at = _skip_space(self.text, at)
            if not self.text.startswith(between or "\0", at):
                break
            at += 1
        return calls

    def _step(self, deltas: list[CallDelta]) -> bool:
        """Read on from `_at`; False when more text is needed."""
        if self._phase in ("open", "next"):
            at = _skip_space(self.text, self._at)
            if at == len(self.text):
                return False
            if self._phase == "open":
                self._in_list = self.text[at] == "["
                self._phase, self._at = "head", at + self._in_list
            else:  # between a list's calls, or calls separated so
                between = "," if self._in_list else self._separator
                self._phase, self._at = ("head", at + 1) if self.text[at] == between else ("end", at)
            return True
        if self._phase == "head":
            return self._read_head(deltas)
        if self._phase == "arguments":
            return self._read_arguments(deltas)
        if self._phase == "rest":
            return self._read_rest()
        return False  # end, whole: the rest is read when the text closes

    def _read_head(self, deltas: list[CallDelta]) -> bool:
        head = _head(self.text, self._at)
        if head == _WAIT:
            return False
        if head == _NOT_A_CALL:  # `_at` stays where the item begins, to read it whole at the close
            self._phase = "whole"
            return False
        name, brace = head
        deltas.append(self._start(name, ""))
        self._phase, self._at, self._arguments_start, self._given = "arguments", brace, brace, 0
        return True

    def _start(self, name: str, arguments: str) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.next_index - 1, name, arguments)

    def _read_arguments(self, deltas: list[CallDelta]) -> bool:
        closed = self._scan()
        piece = self.text[self._arguments_start + self._given : self._at]
        self._given += len(piece)
        if piece:
            deltas.append(CallDelta(self.next_index - 1, None, piece))
        if closed:
            self._phase, self._depth = "rest", 1  # inside the call's object still
            self.arguments_end = self._at
        return closed

    def _read_rest(self) -> bool:
        """Skip what follows the arguments in the call's object (other keys) to its brace."""
        closed = self._scan()
        if closed:
            self._phase = "next" if self._in_list or self._separator else "end"
        return closed

    def _scan(self) -> bool:
        """Advance `_at` over brackets and strings until the depth is back to 0 (True, `_at`
        just past the closing bracket) or the text ends (False)."""
        text = self.text
        for at in range(self._at, len(text)):
            char = text[at]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 0:
                    self._at = at + 1
                    return True
        self._at = len(text)
        return False


def _head(text: str, at: int) -> Any:
    """A call's head read from `at`: (its name, where its arguments' brace is), or _WAIT when
    the text may still become one, or _NOT_A_CALL."""
    name = None
    for expected in _HEAD:
        at = _skip_space(text, at)
        if at == len(text):
            return _WAIT
        if text[at] == '"':
            end = _string_end(text, at)
            if end is None:
                return _WAIT
            token, next_at = text[at:end], end
        else:
            token, next_at = text[at], at + 1
        if expected is str:
            name = _loads(token) if token.startswith('"') else None
            if not isinstance(name, str):
                return _NOT_A_CALL
        elif token not in (expected if isinstance(expected, tuple) else (expected,)):
            return _NOT_A_CALL
        brace, at = at, next_at
    return name, brace


def _string_end(text: str, at: int) -> int | None:
    """Just past the string that opens at `at`; None if it has not closed yet."""
    escaped = False
    for i in range(at + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """One piece per call: a call's name and the arguments that came with it go out together."""
    pieces: list[CallDelta] = []
    for delta in deltas:
        if pieces and pieces[-1].index == delta.index:
            last = pieces[-1]
            pieces[-1] = CallDelta(last.index, last.name or delta.name, last.arguments + delta.arguments)
        else:
            pieces.append(delta)
    return pieces
