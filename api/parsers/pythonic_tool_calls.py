"""Tool calls as Llama 3.2 and Llama 4 models write them (GENQ_TOOL_CALL_PARSER `pythonic`;
vLLM's `pythonic` and `llama4_pythonic`): the reply is a Python list of calls,
`[get_weather(city="Paris", days=2), get_time(zone="CET")]`, each with keyword arguments whose
values are Python literals (strings, numbers, True, False, None, lists, tuples and dicts),
between Llama 4's `<|python_start|>` and `<|python_end|>` or not. Any other reply is content.

Each call goes out whole once its closing parenthesis is read, its arguments as a JSON object.
A reply that opens like a list but holds no call (a list of numbers, a call with positional
arguments) is content, as the model wrote it, given out when that shows. A call that breaks
off (max_tokens) is dropped; the calls before it stand. Plain Python; no I/O.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from api.parsers.call_stream import CallDelta

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_CLOSING = ")]}"


class NotACall(ValueError):
    pass


class PythonicReader:
    def __init__(self) -> None:
        self._text = ""  # the reply so far, kept whole until it shows what it is
        self._phase = "start"  # start | calls | content | done (the list closed, or broke off after a call)
        self._pos = 0  # how far the calls' text is scanned
        self._depth = 0  # brackets open at _pos
        self._quote = ""  # the string literal _pos is in, if any
        self._call_start: int | None = None  # where the call being read begins
        self._calls = 0

    @property
    def num_calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._phase == "content":
            return text, []
        self._text += text
        if self._phase == "start":
            start = self._text.lstrip()
            body = start.removeprefix(PYTHON_START).lstrip()
            if not start or (PYTHON_START.startswith(start) and start != PYTHON_START) or (start != body and not body):
                return "", []  # it may still open with the tag, or a list after it
            if not body.startswith("["):
                return self._as_content()
            self._phase, self._pos = "calls", len(self._text) - len(body)
        if self._phase != "calls":
            return "", []
        deltas: list[CallDelta] = []
        try:
            self._scan(deltas)
        except NotACall:
            if not self._calls:
                return self._as_content()
            self._phase = "done"  # the calls read stand; what follows is not read
        return "", deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._phase == "content" or (self._phase != "done" and not self._calls):
            return self._as_content()
        return "", []

    def _as_content(self) -> tuple[str, list[CallDelta]]:
        self._phase, text, self._text = "content", self._text, ""
        return text, []

    def _scan(self, deltas: list[CallDelta]) -> None:
        """Read on from _pos (the list's bracket, at first): each call whose parenthesis
        closes goes out, into `deltas`; NotACall where the text shows it is no list of calls."""
        text = self._text
        while self._pos < len(text) and self._phase == "calls":
            ch = text[self._pos]
            if self._quote:
                if ch == "\\":
                    self._pos += 1  # the escaped character
                elif ch == self._quote:
                    self._quote = ""
            elif self._depth == 1 and self._call_start is None and ch not in "]," and not ch.isspace():
                if not ch.isidentifier():
                    raise NotACall  # an item that is no call: a number, a string, a list
                self._call_start = self._pos
            elif ch in "'\"":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in _CLOSING:
                self._close(ch, deltas)
            self._pos += 1

    def _close(self, ch: str, deltas: list[CallDelta]) -> None:
        """A closing bracket at _pos: the list's, a call's, or one within a call's arguments."""
        if self._depth == 1:  # the list closed
            if ch != "]" or self._call_start is not None or not self._calls:
                raise NotACall
            self._phase = "done"
            return
        self._depth -= 1
        if self._depth == 1:  # a call closed
            if ch != ")" or self._call_start is None:
                raise NotACall
            deltas.append(self._call(self._text[self._call_start : self._pos + 1]))
            self._call_start = None

    def _call(self, source: str) -> CallDelta:
        """One call's delta: its name and its keyword arguments as a JSON object."""
        try:
            node = ast.parse(source.strip(), mode="eval").body
        except SyntaxError as e:
            raise NotACall from e
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise NotACall
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise NotACall  # **kwargs
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError as e:
                raise NotACall from e
        try:
            body = json.dumps(arguments, ensure_ascii=False)
        except TypeError as e:  # a set, bytes, a complex number: no JSON for them
            raise NotACall from e
        self._calls += 1
        return CallDelta(self._calls - 1, node.func.id, body)
