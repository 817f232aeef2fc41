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
...}</tool_call>`, api.tool_calls), so the tool-call reader that follows finds them as it finds
any other model's; a body that is not a JSON object stays content there, nothing lost. A reply
that does not open with a harmony tag (a template without harmony) is all content.

A guided reply (`response_format`, `guided_*`) thinks freely in the analysis channel; its
grammar holds from `<|channel|>final<|message|>` on (the worker's `guided_decoding` "after").
"""

from __future__ import annotations

import json

from api.text_readers import partial_tag

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
        self._call_body = ""  # a call's arguments so far

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        while self._held:
            if self._phase == "plain":
                content, self._held = content + self._held, ""
            elif self._phase == "header":
                if not self._read_header():
                    break
            else:
                piece, closed = self._read_body()
                if self._recipient is not None:
                    self._call_body += piece
                    if closed:
                        content += self._call()
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
            self._call_body += held
            return "", self._call()
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

    def _call(self) -> str:
        assert self._recipient is not None
        name = self._recipient.removeprefix("functions.")
        body, self._call_body = self._call_body.strip(), ""
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError:
            arguments = body  # left as text: the tool-call reader keeps the block as content
        block = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>{block}</tool_call>"


def _field(text: str) -> str:
    """The first word of a header field: up to a space or the next tag."""
    return text.strip().split(TAG, 1)[0].split(" ", 1)[0].strip()

