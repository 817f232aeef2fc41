"""A reasoning model's thinking, split from its answer (vLLM's `--reasoning-parser`): the text
up to the end tag (`</think>`) is `reasoning_content`, the rest is `content`. A leading start
tag (`<think>`) is dropped.

Deployments differ in their tags and in where no end tag has come (yet):
- "deepseek_r1", "minimax_m2" (MiniMax-M2): the chat template opens the thinking in the
  prompt, so the reply starts inside it, and a reply cut off before `</think>` is all reasoning;
- "qwen3", "glm45" (GLM-4.5 to 4.7): the reply thinks only if it begins with `<think>` (with
  thinking off the model answers straight away), else it is all content;
- "seed_oss" (`<seed:think>`), "mistral" (Magistral's `[THINK]`, special tokens), "granite"
  (Granite 3.2's "Here is my thought process:" and "Here is my response:"): as qwen3, with
  their tags;
- "deepseek_v3" (DeepSeek-V3.1 and on): deepseek_r1 when the request turns the template's
  thinking on (`chat_template_kwargs` `thinking`), else no reasoning (api.generate decides);
- "minimax_m2_append_think" (vLLM's, which MiniMax recommends): nothing is split off; the
  content is the whole reply after the `<think>` the template opened, so a client that sends
  back only the content keeps the model's earlier thinking in the conversation (M2 thinks
  between tool calls, and reads its own thinking back).

gpt-oss ("gpt_oss") writes channels instead of tags: api.parsers.harmony reads those.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.parsers.harmony import HarmonyReader
from api.parsers.text_readers import PairReader, partial_tag, read_piece

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class ThinkTags:
    start: str
    end: str
    opened: bool = False  # the chat template opens the thinking: the reply starts inside it
    special: bool = False  # the tags are special tokens: the reply must keep them to be read
    kept: bool = False  # not split off: the thinking stays in the content, its opening tag put back


TAGS = {
    "deepseek_r1": ThinkTags(START, END, opened=True),
    "qwen3": ThinkTags(START, END),
    "glm45": ThinkTags(START, END),
    "seed_oss": ThinkTags("<seed:think>", "</seed:think>", special=True),
    "minimax_m2": ThinkTags(START, END, opened=True),
    "minimax_m2_append_think": ThinkTags(START, END, opened=True, kept=True),
    "mistral": ThinkTags("[THINK]", "[/THINK]", special=True),
    "granite": ThinkTags("Here is my thought process:", "Here is my response:"),
}


class ReasoningReader:
    """Splits a reply as it streams: `feed` returns (reasoning, content) that are safe to send,
    holding back what may be part of a tag."""

    def __init__(self, parser: str) -> None:
        tags = TAGS[parser]
        self._start, self._end, self._starts_thinking = tags.start, tags.end, tags.opened
        self._held = ""
        self._phase = "start"  # start (a <think> may still come) | thinking | answering
        self._gap = False  # right after </think>: whitespace is not content yet
        self._opening = tags.start if tags.kept else None  # (kept: put before the reply's first piece)

    def feed(self, text: str) -> tuple[str, str]:
        if self._opening is not None:  # kept: all content
            text, self._opening = self._opening + text, ""
            return "", text
        self._held += text
        reasoning = ""
        if self._phase == "start":
            stripped = self._held.lstrip()
            if self._start.startswith(stripped) and len(stripped) < len(self._start):
                return "", ""  # it may still be <think>
            if stripped.startswith(self._start):
                self._held, self._phase = stripped[len(self._start):], "thinking"
            else:
                self._phase = "thinking" if self._starts_thinking else "answering"
        if self._phase == "thinking":
            end = self._held.find(self._end)
            if end < 0:
                keep = partial_tag(self._held, self._end)
                reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning, self._held = self._held[:end], self._held[end + len(self._end):]
            self._phase, self._gap = "answering", True
        if self._gap:  # the blank lines between the thinking and the answer are neither
            self._held = self._held.lstrip()
            self._gap = not self._held
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held when the reply ends: a tag cut short is text after all."""
        if self._opening is not None:  # kept: the opening tag, if no piece came
            return self.feed("")
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
