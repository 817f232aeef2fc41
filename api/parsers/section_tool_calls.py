"""Tool calls in a section of special tokens, as DeepSeek's and Kimi's models write them
(GENQ_TOOL_CALL_PARSER `deepseek_v3`, `deepseek_v31`, `kimi_k2`; vLLM's parsers of those
names), read as they stream:

- deepseek_v31 (DeepSeek-V3.1, V3.2): `<｜tool▁calls▁begin｜>`, then per call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.
- deepseek_v3 (DeepSeek-V3, R1): the same tags, a call's head `function`, and after the
  separator the name on its own line and the arguments fenced as a JSON code block.
- kimi_k2 (Kimi K2): `<|tool_calls_section_begin|>`, per call
  `<|tool_call_begin|>functions.NAME:K<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`,
  `<|tool_calls_section_end|>`.

Text before the section (and after it) is content. A call is named once its head is whole
and its arguments go out as they are written (deepseek_v3's once its fence closes); a call
the reply cuts short keeps what came. The tags are special tokens, so the API asks the
worker for the text with special tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from api.parsers.call_stream import CallDelta, merged
from api.parsers.text_readers import partial_tag


@dataclass(frozen=True)
class SectionFormat:
    begin: str  # the section of calls opens
    call: str  # a call opens
    sep: str  # its head ends
    call_end: str
    end: str  # the section closes
    name: Callable[[str], str]  # a call's name from its head
    fenced: bool = False  # the name and the fenced arguments follow the separator (DeepSeek-V3)


def _kimi_name(head: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    return head.strip().rsplit(":", 1)[0].removeprefix("functions.")


def _deepseek(fenced: bool) -> SectionFormat:
    return SectionFormat("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                         "<｜tool▁calls▁end｜>", name=str.strip, fenced=fenced)


FORMATS = {
    "deepseek_v31": _deepseek(fenced=False),
    "deepseek_v3": _deepseek(fenced=True),
    "kimi_k2": SectionFormat("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                             "<|tool_call_end|>", "<|tool_calls_section_end|>", name=_kimi_name),
}


class SectionReader:
    """`feed` returns the content safe to send and the pieces of calls so far; it holds back
    what may be the start of a tag."""

    def __init__(self, form: SectionFormat) -> None:
        self.form = form
        self._held = ""
        self._phase = "content"  # content | section | head | arguments
        self.num_calls = 0  # calls named so far

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._held += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), merged(deltas)

    def finish(self) -> tuple[str, list[CallDelta]]:
        held, self._held = self._held, ""
        if self._phase == "content":
            return held, []
        if self._phase == "arguments" and not self.form.fenced:
            return "", [CallDelta(self.num_calls - 1, None, held)] if held else []
        if self._phase == "head" and self.form.fenced and self.form.sep in held:
            return "", self._fenced_call(held)  # its fence cut short: what came of it
        return "", []

    def _step(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Read on in the current phase; False when more text is needed."""
        form, held = self.form, self._held
        if self._phase == "content":
            at = held.find(form.begin)
            if at < 0:
                keep = partial_tag(held, form.begin)
                content.append(held[: len(held) - keep])
                self._held = held[len(held) - keep :]
                return False
            content.append(held[:at])
            self._held, self._phase = held[at + len(form.begin) :], "section"
            return True
        if self._phase == "section":
            start = held.lstrip()
            for tag, phase in ((form.call, "head"), (form.end, "content")):
                if start.startswith(tag):
                    self._held, self._phase = start[len(tag) :], phase
                    return True
            self._held = start
            return False  # a tag still to come whole (anything else is waited past)
        if self._phase == "head":
            return self._head(held, deltas)
        return self._arguments(held, deltas)

    def _head(self, held: str, deltas: list[CallDelta]) -> bool:
        form = self.form
        if form.fenced:  # DeepSeek-V3: the call whole, up to its end tag
            at = held.find(form.call_end)
            if at < 0:
                return False
            deltas += self._fenced_call(held[:at])
            self._held, self._phase = held[at + len(form.call_end) :], "section"
            return True
        at = held.find(form.sep)
        if at < 0:
            return False
        deltas.append(CallDelta(self.num_calls, form.name(held[:at]), ""))
        self.num_calls += 1
        self._held, self._phase = held[at + len(form.sep) :], "arguments"
        return True

    def _arguments(self, held: str, deltas: list[CallDelta]) -> bool:
        at = self.form.call_end
        end = held.find(at)
        cut = end if end >= 0 else len(held) - partial_tag(held, at)
        if held[:cut]:
            deltas.append(CallDelta(self.num_calls - 1, None, held[:cut]))
        if end < 0:
            self._held = held[cut:]
            return False
        self._held, self._phase = held[end + len(at) :], "section"
        return True

    def _fenced_call(self, call: str) -> list[CallDelta]:
        """`function<｜tool▁sep｜>NAME` and a ```json fence of the arguments."""
        _, _, rest = call.partition(self.form.sep)
        name, _, body = rest.partition("\n")
        arguments = body.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        self.num_calls += 1
        return [CallDelta(self.num_calls - 1, self.form.name(name), arguments)]
