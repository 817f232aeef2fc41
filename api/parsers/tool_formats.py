"""Tool calls as Llama 3, Mistral and Granite 3 models write them (GENQ_TOOL_CALL_PARSER
`llama3_json`, `mistral`, `granite`; vLLM's parsers of those names), read as they stream, each call's arguments going
out as they are written (api.parsers.call_stream). Both formats begin with a special token, so the
API asks the worker for the text with special tokens.

- llama3_json (Llama 3.1 to 3.3): a reply that opens with `<|python_tag|>` or `{` is calls,
  `{"name": ..., "parameters": {...}}`, several separated by `;`; any other reply is content.
  A reply that opens with `{` but is no call is content after all, sent when it ends.
- mistral: content, then `[TOOL_CALLS]` and the calls: a JSON array of `{"name", "arguments"}`
  objects (tokenizers up to v7), or from v11 (Mistral Small 3.2, Magistral) the name, `[ARGS]`
  and the arguments, each call after its own `[TOOL_CALLS]`.
- granite (Granite 3.x; vLLM's `granite`): the same array after `<|tool_call|>`.
"""

from __future__ import annotations

import json

from api.parsers.call_stream import CallDelta, CallStream
from api.parsers.text_readers import partial_tag

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class Llama3JsonReader:
    def __init__(self) -> None:
        self._held = ""
        self._calls: CallStream | None = None  # once the reply shows it is calls
        self._content = False  # once it shows it is not
        self._opening = ""  # what came before the calls' JSON: blanks, the python tag

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls if self._calls else 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._content:
            return text, []
        if self._calls is not None:
            return "", self._calls.feed(text)
        self._held += text
        start = self._held.lstrip()
        if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
            return "", []  # it may still open with the tag
        if not start.startswith((PYTHON_TAG, "{")):
            self._content, held, self._held = True, self._held, ""
            return held, []
        tag = PYTHON_TAG if start.startswith(PYTHON_TAG) else ""
        self._opening, self._held = self._held[: len(self._held) - len(start)] + tag, ""
        self._calls = CallStream(separator=";")
        return "", self._calls.feed(start.removeprefix(tag))

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._calls is None:
            held, self._held = self._held, ""
            return held, []
        rest = self._calls.close()
        if rest is None:  # JSON (or the tag) that holds no call: what the model said, as it said it
            return self._opening + self._calls.text, []
        return "", rest


class MistralReader:
    tag = TOOL_CALLS  # what opens the calls

    def __init__(self) -> None:
        self._held = ""
        self._phase = "content"  # content | calls (after [TOOL_CALLS]) | array | arguments
        self._stream: CallStream | None = None  # the calls being read
        self._done = 0  # calls of streams read to their end

    @property
    def num_calls(self) -> int:
        return self._done + (self._stream.num_calls if self._stream else 0)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._held += text
        content = ""
        deltas: list[CallDelta] = []
        while True:
            if self._phase != "content":
                if not self._step(deltas):
                    break
                continue
            at = self._held.find(self.tag)
            if at < 0:
                keep = partial_tag(self._held, self.tag)
                content, self._held = content + self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
                break
            content, self._held, self._phase = content + self._held[:at], self._held[at + len(self.tag):], "calls"
        return content, deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        held, self._held = self._held, ""
        if self._phase == "content":
            return held, []
        rest = self._stream.close() if self._stream is not None and self._phase == "array" else []
        return "", rest or []  # a call's arguments or name cut short end here

    def _step(self, deltas: list[CallDelta]) -> bool:
        """Read on after [TOOL_CALLS]; False when more text is needed."""
        text, self._held = self._held, ""
        if self._phase == "calls":
            start = text.lstrip()
            if start[:1] in ("[", "{"):  # a JSON array (or object) of calls, to the end of the reply
                self._phase, self._stream = "array", CallStream(self.num_calls)
                deltas += self._stream.feed(start)
                return False
            if ARGS not in text:
                self._held = text
                return False
            name, _, text = text.partition(ARGS)  # v11: the name, then the arguments
            self._phase, self._stream = "arguments", CallStream(self.num_calls)
            text = '{"name": ' + json.dumps(name.strip(), ensure_ascii=False) + ', "arguments": ' + text
        assert self._stream is not None
        deltas += self._stream.feed(text)
        if self._phase == "array" or self._stream.arguments_end is None:
            return False
        # the arguments closed: what follows is read as at the start (content, or the next call)
        self._held = self._stream.text[self._stream.arguments_end:]
        self._done, self._stream, self._phase = self.num_calls, None, "content"
        return True


class GraniteReader(MistralReader):
    """Granite 3's calls: content, then `<|tool_call|>` and a JSON array of calls."""

    tag = "<|tool_call|>"
