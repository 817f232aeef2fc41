"""gpt-oss replies in OpenAI's harmony format, read into reasoning, content and tool calls
(`--reasoning-parser gpt_oss`, vLLM's openai_gptoss).

The chat template ends the prompt with `<|start|>assistant`; the reply is a run of messages,
each a header and a body:

    <|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, with no call, `...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The
`analysis` channel is the reasoning; `final` is the content, and so is `commentary` addressed
to no one (a preamble the model says before calling tools); a message addressed to
`functions.NAME` is a call of NAME whose body is its arguments. The tags are special tokens,
so the API asks the worker for the text with them (`skip_special_tokens` off); the tokens that
end the reply (`<|return|>`, `<|call|>`) are stop tokens the worker leaves out.

Calls come out in the content as hermes blocks (`<tool_call>{"name": ..., "arguments":
...}</tool_call>`, api.parsers.tool_calls), so the tool-call reader that follows finds them as it finds
any other model's. A body that opens with `{` streams into its block as it comes; any other
body is held and goes in as JSON text, which stays content there, nothing lost. A reply
that does not open with a harmony tag (a template without harmony) is all content.

A guided reply (`response_format`, `guided_*`) thinks freely in the analysis channel; its
grammar holds from `<|channel|>final<|message|>` on (the worker's `guided_decoding` "after").
"""

from __future__ import annotations

import json

from api.parsers.text_readers import partial_tag

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # what closes a body (the last two when not left out)
TAG = "<|"
FINAL_CHANNEL = "<|channel|>final<|message|>"  # where the answer begins (a guided reply's grammar too)


class HarmonyReader:
    """Splits a harmony reply as it streams: `feed` returns (reasoning, content) that are safe
    to send, holding back a tag that may be cut, and a call's body until it closes."""

    def __init__(self) -> None:
        self._held = ""
        self._phase = "header"  # header (until <|message|>) | body | plain (not harmony)
        self._channel = ""
        self._recipient: str | None = None
        self._call_body = ""  # a call's arguments so far, until they show whether they stream
        self._streaming = False  # the call's body opened with `{` and goes out as it comes

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        while self._held:
            if self._phase == "plain":
                content, self._held = content + self._held, ""
            elif self._phase == "header":
                if not self._read_header():
                    break
                content += self._call_head()
            else:
                piece, closed = self._read_body()
                if self._recipient is not None:
                    content += self._call_piece(piece, closed)
                elif self._channel == "analysis":
                    reasoning += piece
                else:
                    content += piece
                if not closed:
                    break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held when the reply ends: a body cut short counts as its channel's; a call
        cut short is still a call (its arguments may not parse)."""
        held, self._held = self._held, ""
        if self._phase == "plain" or (self._phase == "header" and not held.lstrip().startswith(TAG)):
            return "", held
        if self._phase != "body":
            return "", ""  # a header cut short says nothing
        if self._recipient is not None:
            return "", self._call_piece(held, closed=True)
        return (held, "") if self._channel == "analysis" else ("", held)

    def _read_header(self) -> bool:
        """Take the header if it is whole; False when more text is needed."""
        start = self._held.lstrip()
        if not start.startswith(TAG[: len(start)]) or (len(start) >= len(TAG) and not start.startswith(TAG)):
            self._phase = "plain"  # not harmony: a reply in plain words
            return True
        end = self._held.find(MESSAGE)
        if end < 0:
            return False
        header, self._held = self._held[:end], self._held[end + len(MESSAGE):]
        self._channel = _field(header.partition(CHANNEL)[2])
        recipient = _field(header.partition("to=")[2]) if "to=" in header else ""
        self._recipient = recipient or None
        self._phase = "body"
        return True

    def _read_body(self) -> tuple[str, bool]:
        """The body text that is safe to give out, and whether the body closed."""
        found = [(i, tag) for tag in ENDS if (i := self._held.find(tag)) >= 0]
        if found:
            i, tag = min(found)
            piece, self._held = self._held[:i], self._held[i + len(tag):]
            self._phase = "header"
            return piece, True
        keep = max(partial_tag(self._held, tag) for tag in ENDS)
        piece, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return piece, False

    def _call_head(self) -> str:
        """A call's block up to its arguments, once its header is read."""
        if self._recipient is None:
            return ""
        self._call_body, self._streaming = "", False
        name = json.dumps(self._recipient.removeprefix("functions."), ensure_ascii=False)
        return f'<tool_call>{{"name": {name}, "arguments": '

    def _call_piece(self, piece: str, closed: bool) -> str:
        """What of a call's body goes out now: all it has once it opened with `{`; otherwise
        nothing until it closes, then the body as JSON text. Once closed, the block's end (a
        streamed body's own braces close its arguments, so no brace is added: a body cut short
        stays the call's arguments as they came)."""
        if not self._streaming:
            self._call_body += piece
            self._streaming = self._call_body.lstrip().startswith("{")
            piece = self._call_body.lstrip() if self._streaming else ""
        if not closed:
            return piece
        if self._streaming:
            return piece + "</tool_call>"
        body = self._call_body.strip()
        try:
            piece = json.dumps(json.loads(body), ensure_ascii=False)
        except json.JSONDecodeError:
            piece = json.dumps(body, ensure_ascii=False)  # left as text: kept as content
        return piece + "}</tool_call>"


def _field(text: str) -> str:
    """The first word of a header field: up to a space or the next tag."""
    return text.strip().split(TAG, 1)[0].split(" ", 1)[0].strip()

