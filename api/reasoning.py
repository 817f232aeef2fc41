"""A reasoning model's thinking, split from its answer (vLLM's `--reasoning-parser`): the text
up to `</think>` is `reasoning_content`, the rest is `content`. A leading `<think>` is
dropped.

Two deployments differ only where no `</think>` has come (yet):
- "deepseek_r1": the chat template opens the thinking in the prompt, so the reply starts
  inside it, and a reply cut off before `</think>` is all reasoning;
- "qwen3": the reply thinks only if it begins with `<think>` (Qwen3 with enable_thinking
  off answers straight away), else it is all content.

gpt-oss ("gpt_oss") writes channels instead of tags: api.harmony reads those.
"""

from __future__ import annotations

from api.harmony import HarmonyReader
from api.text_readers import PairReader, partial_tag, read_piece

START = "<think>"
END = "</think>"


class ReasoningReader:
    """Splits a reply as it streams: `feed` returns (reasoning, content) that are safe to send,
    holding back what may be part of a tag."""

    def __init__(self, parser: str) -> None:
        self._starts_thinking = parser == "deepseek_r1"
        self._held = ""
        self._phase = "start"  # start (a <think> may still come) | thinking | answering
        self._gap = False  # right after </think>: whitespace is not content yet

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = ""
        if self._phase == "start":
            stripped = self._held.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                return "", ""  # it may still be <think>
            if stripped.startswith(START):
                self._held, self._phase = stripped[len(START):], "thinking"
            else:
                self._phase = "thinking" if self._starts_thinking else "answering"
        if self._phase == "thinking":
            end = self._held.find(END)
            if end < 0:
                keep = partial_tag(self._held, END)
                reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning, self._held = self._held[:end], self._held[end + len(END):]
            self._phase, self._gap = "answering", True
        if self._gap:  # the blank lines between the thinking and the answer are neither
            self._held = self._held.lstrip()
            self._gap = not self._held
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held when the reply ends: a tag cut short is text after all."""
        held, self._held = self._held, ""
        if self._phase == "thinking" or (self._phase == "start" and self._starts_thinking):
            return held, ""
        return "", held


def reader(parser: str) -> PairReader:
    """A reader that splits a streamed reply's (reasoning, content) for `parser`."""
    return HarmonyReader() if parser == "gpt_oss" else ReasoningReader(parser)


def split(text: str, parser: str) -> tuple[str | None, str]:
    """A whole reply's reasoning (None when it has none) and content."""
    reasoning, content = read_piece(reader(parser), text, last=True)
    return reasoning or None, content
