"""Tool calls in a model's own words, for `tool_choice: "auto"`: the model decides, and its text
is read for calls in the hermes format, which Qwen, Hermes and SmolLM2 write:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

A block may also hold a list of such objects, and `parameters` may stand for `arguments`.
Text outside the blocks is the message's content. A call streams as it is written: its name
once its head is whole, then its arguments piece by piece (api.parsers.call_stream). A block whose
JSON is not a call stays in the content as written, so nothing the model said is lost. Under
`tool_choice: "required"` with several tools the reply is instead guided into a JSON array of
calls. GLM's blocks hold key and value tags instead of JSON (api.parsers.glm_tool_calls); the blocks
are found alike. Plain functions and small stateful readers for streams; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from api.parsers.call_stream import CallDelta, CallStream, ToolCall, merged
from api.parsers.glm_tool_calls import GlmBlock, MiniMaxBlock, Qwen3CoderBlock, StringParameters
from api.parsers.pythonic_tool_calls import PythonicReader
from api.parsers.section_tool_calls import FORMATS as SECTION_FORMATS
from api.parsers.section_tool_calls import SectionReader
from api.parsers.text_readers import partial_tag, read_piece
from api.parsers.tool_formats import GraniteReader, Llama3JsonReader, MistralReader

START = "<tool_call>"
END = "</tool_call>"


class Block(Protocol):
    """What one block holds, read as it streams: JSON (CallStream) or GLM's tags (GlmBlock).
    `close` when its end tag came, `cut` when the reply ended inside it: the rest of its calls,
    or None when it holds none."""

    text: str  # all that was fed

    @property
    def next_index(self) -> int: ...

    def feed(self, text: str) -> list[CallDelta]: ...

    def close(self) -> list[CallDelta] | None: ...

    def cut(self) -> list[CallDelta] | None: ...


class ToolCallReader:
    """Reads a completion's text as it streams: `feed` returns the content that is safe to
    send and the pieces of calls so far. It holds back what may still turn out to be part of a
    call (a tag cut between two pieces, a block whose head is not whole yet) and trailing
    whitespace (the gap before a call is not content)."""

    def __init__(self, block: Callable[[int], Block] = CallStream, tags: tuple[str, str] = (START, END)) -> None:
        self._new_block = block  # a block's reader, from the index of its first call
        self._start, self._end = tags  # a block's opening and closing tags
        self._held = ""  # text not yet given out
        self._block: Block | None = None  # the open block's calls
        self._gap = ""  # whitespace before the open block: content only if it is no call
        self._num_closed = 0  # calls of the blocks closed so far
        self._content_started = False

    @property
    def num_calls(self) -> int:
        """Calls given out so far."""
        return self._block.next_index if self._block is not None else self._num_closed

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._held += text
        content: list[str] = []
        calls: list[CallDelta] = []
        while True:
            if self._block is not None:
                end = self._held.find(self._end)
                cut = end if end >= 0 else len(self._held) - partial_tag(self._held, self._end)
                calls += self._block.feed(self._held[:cut])
                self._held = self._held[cut:]
                if end < 0:
                    break
                self._held = self._held[len(self._end):]
                self._close(content, calls)
                continue
            start = self._held.find(self._start)
            if start < 0:
                stem = self._held[: len(self._held) - partial_tag(self._held, self._start)]
                stem = stem.rstrip()
                content.append(stem)
                self._held = self._held[len(stem):]
                break
            before = self._held[:start]
            content.append(before.rstrip())
            self._gap = before[len(before.rstrip()):]
            self._held, self._block = self._held[start + len(self._start):], self._new_block(self.num_calls)
        return self._content("".join(content)), merged(calls)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left when the completion ends. A block the model did not close is a call if
        enough of it came (`Block.cut`: whole JSON, a whole GLM name; a stop string may have
        cut `</tool_call>` off), else it is text."""
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[CallDelta] = []
        if self._block is not None:
            calls += self._block.feed(held)
            self._close(content, calls, closed=False)
        elif not (self.num_calls and not held.strip()):  # the gap after a call is not content
            content.append(held)
        return self._content("".join(content)), merged(calls)

    def _close(self, content: list[str], calls: list[CallDelta], closed: bool = True) -> None:
        assert self._block is not None
        block, self._block = self._block, None
        rest = block.close() if closed else block.cut()
        if rest is None:
            content.append(self._gap + self._start + block.text + (self._end if closed else ""))
            return
        calls += rest
        self._num_closed = block.next_index

    def _content(self, text: str) -> str:
        """Leading whitespace of the whole content is dropped, as a gap before a call."""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text


class CallArrayReader:
    """Reads the JSON array of calls that genq guides tool_choice "required" into (with
    several tools: `calls_schema`), streaming each call as it is written."""

    def __init__(self) -> None:
        self._calls = CallStream()

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        return "", self._calls.feed(text)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return "", self._calls.close() or []  # an array cut short (max_tokens) keeps its calls


def calls_schema(tools: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
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


Reader = ToolCallReader | CallArrayReader | Llama3JsonReader | MistralReader | PythonicReader | SectionReader
# blocks whose arguments are tagged pairs, read by the tools' declared string parameters, and
# the tags each block lies between
XML_BLOCKS: dict[str, tuple[Callable[[int, StringParameters], Block], tuple[str, str]]] = {
    "glm45": (GlmBlock, (START, END)),
    "qwen3_coder": (Qwen3CoderBlock, (START, END)),
    "seed_oss": (Qwen3CoderBlock, ("<seed:tool_call>", "</seed:tool_call>")),
    "minimax_m2": (MiniMaxBlock, ("<minimax:tool_call>", "</minimax:tool_call>")),
}
READERS: dict[str, Callable[[], Reader]] = {"hermes": ToolCallReader, "json": CallArrayReader,
                                    "llama3_json": Llama3JsonReader, "mistral": MistralReader, "granite": GraniteReader,
                                    "pythonic": PythonicReader}


def calls_reader(form: str, string_parameters: Iterable[tuple[str, str]] = ()) -> Reader:
    """A reader of calls written in `form` (READERS, XML_BLOCKS, or the section formats of
    api.parsers.section_tool_calls). The XML blocks' calls write the values of parameters declared
    strings ((tool, parameter)) as raw text, any other as JSON."""
    if form in SECTION_FORMATS:
        return SectionReader(SECTION_FORMATS[form])
    if form in XML_BLOCKS:
        strings, (block, tags) = frozenset(string_parameters), XML_BLOCKS[form]
        return ToolCallReader(lambda first_index: block(first_index, strings), tags)
    return READERS[form]()


def read_all(
    text: str, form: str = "hermes", string_parameters: Iterable[tuple[str, str]] = ()
) -> tuple[str | None, list[ToolCall]]:
    """A whole completion's content (None when it only called tools) and calls, as a stream
    would give them out."""
    content, deltas = read_piece(calls_reader(form, string_parameters), text, last=True)
    calls = joined(deltas)
    return (content or None) if calls else content, calls


def joined(deltas: list[CallDelta]) -> list[ToolCall]:
    """Whole calls from their pieces, in order."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return [ToolCall(names[k], arguments[k]) for k in sorted(names)]
