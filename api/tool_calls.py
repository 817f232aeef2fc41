"""Tool calls in a model's own words, for `tool_choice: "auto"`: the model decides, and its text
is read for calls in the hermes format, which Qwen, Hermes and SmolLM2 write:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

A block may also hold a list of such objects, and `parameters` may stand for `arguments`.
Text outside the blocks is the message's content. A block whose JSON is not a call stays in
the content as written, so nothing the model said is lost. Under `tool_choice: "required"`
with several tools the reply is instead guided into a JSON array of calls. Plain functions
and small stateful readers for streams; no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api.text_readers import partial_tag, read_piece

START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


def parse_block(body: str) -> list[ToolCall] | None:
    """The calls in one block's JSON; None if it is not one call or a list of calls."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


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


class ToolCallReader:
    """Reads a completion's text as it streams: `feed` returns the content that is safe to
    send and the calls completed so far. It holds back what may still turn out to be part of a
    call (a tag cut between two pieces, a block not yet closed) and trailing whitespace (the
    gap before a call is not content)."""

    def __init__(self) -> None:
        self._held = ""  # text not yet given out
        self._in_block = False  # _held is the inside of an open block
        self._gap = ""  # whitespace before the open block: content only if it is no call
        self.num_calls = 0  # calls given out so far
        self._content_started = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_block:
                end = self._held.find(END)
                if end < 0:
                    break
                body, self._held = self._held[:end], self._held[end + len(END):]
                self._in_block = False
                self._take(body, content, calls)
                continue
            start = self._held.find(START)
            if start < 0:
                stem = self._held[: len(self._held) - partial_tag(self._held, START)]
                stem = stem.rstrip()
                content.append(stem)
                self._held = self._held[len(stem):]
                break
            before = self._held[:start]
            content.append(before.rstrip())
            self._gap = before[len(before.rstrip()):]
            self._held, self._in_block = self._held[start + len(START):], True
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left when the completion ends. A block the model did not close is a call if
        its JSON is whole (a stop string may have cut `</tool_call>` off), else it is text."""
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_block:
            self._in_block = False
            self._take(held, content, calls, closed=False)
        elif not (self.num_calls and not held.strip()):  # the gap after a call is not content
            content.append(held)
        return self._content("".join(content)), calls

    def _take(
        self, body: str, content: list[str], calls: list[ToolCall], closed: bool = True
    ) -> None:
        found = parse_block(body)
        if found is None:
            content.append(self._gap + START + body + (END if closed else ""))
            return
        calls.extend(found)
        self.num_calls += len(found)

    def _content(self, text: str) -> str:
        """Leading whitespace of the whole content is dropped, as a gap before a call."""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text


class CallArrayReader:
    """Reads the JSON array of calls that genq guides tool_choice "required" into (with
    several tools: `calls_schema`), giving out each call as soon as its object closes."""

    def __init__(self) -> None:
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item_start = 0
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        calls: list[ToolCall] = []
        for at in range(self._scanned, len(self._text)):
            char = self._text[at]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item_start = at
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1:
                    found = parse_block(self._text[self._item_start : at + 1])
                    calls += found or []
        self._scanned = len(self._text)
        self.num_calls += len(calls)
        return "", calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", []  # an array cut short (max_tokens) keeps the calls it completed


def calls_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a reply that calls one or more of `tools` ((name, parameters)):
    `[{"name": ..., "arguments": {...}}, ...]`, the name deciding which arguments follow."""
    return {
        "type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
        "items": {"anyOf": [
            {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"const": name}, "arguments": parameters or {"type": "object"}}}
            for name, parameters in tools
        ]},
    }


Reader = ToolCallReader | CallArrayReader
READERS: dict[str, type[Reader]] = {"hermes": ToolCallReader, "json": CallArrayReader}


def read_all(text: str, form: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """A whole completion's content (None when it only called tools) and calls, as a stream
    would give them out."""
    content, calls = read_piece(READERS[form](), text, last=True)
    return (content or None) if calls else content, calls
