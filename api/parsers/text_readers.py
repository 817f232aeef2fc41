"""What the readers that split a streamed reply share (api.parsers.tool_calls, api.parsers.reasoning): each has
`feed(piece)` and `finish()`, both returning a pair of what is safe to give out now."""

from __future__ import annotations

from typing import Any, Protocol


class PairReader(Protocol):
    def feed(self, text: str) -> tuple[Any, Any]: ...

    def finish(self) -> tuple[Any, Any]: ...


def read_piece(reader: PairReader, text: str, last: bool) -> tuple[Any, Any]:
    """What a piece of text gives out, and with the last piece what the reader still held."""
    first, second = reader.feed(text)
    if last:
        more_first, more_second = reader.finish()
        first, second = first + more_first, second + more_second
    return first, second


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`, still to come whole."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
